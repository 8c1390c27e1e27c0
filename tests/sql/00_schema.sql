BEGIN;
SELECT plan(9);
SELECT has_schema('queen');
SELECT has_table('queen', 'timers', 'timers table exists');
SELECT results_eq('SELECT version FROM queen.schema_migrations ORDER BY 1', ARRAY[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43], 'every migration is recorded');
-- a large batch's payloads are staged by COPY, not carried in the ops (migration 013)
SELECT has_table('queen', 'staged_payloads', 'staged payloads table exists');
SELECT has_function('queen', 'schedule_timers', ARRAY['text', 'queen.timer_op[]', 'text', 'bigint', 'boolean', 'timestamp with time zone', 'integer', 'uuid'], 'schedule_timers takes p_staged');
-- the log order is (xid, seq) and no writer locks a partition (migration 008)
SELECT has_function('queen', 'ensure_partition', ARRAY['text', 'text', 'text'], 'partitions are looked up / created without a lock');
SELECT hasnt_function('queen', 'lock_partition', 'no partition lock serialises the appends');
SELECT has_index('queen', 'messages', 'messages_partition_xid_seq_idx', ARRAY['partition_id', 'xid', 'seq'], 'the log is indexed in (xid, seq) order');
SELECT col_type_is('queen', 'partition_consumers', 'last_consumed_xid', 'xid8', 'the cursor carries the xid of its position');
SELECT * FROM finish();
ROLLBACK;
