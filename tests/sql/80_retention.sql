-- apply_retention: disabled queues keep everything; pending retention
-- deletes old frames consumed or not; completed retention deletes old
-- frames every group consumed; the DLQ rule; cursors stay valid; every
-- call is bounded by p_limit. The clock is pinned (p_now).
BEGIN;
SELECT plan(42);

CREATE FUNCTION pg_temp.t0() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2030-01-01 00:00:00+00'::timestamptz $$;
CREATE FUNCTION pg_temp.at(p_seconds numeric) RETURNS timestamptz LANGUAGE sql AS $$ SELECT pg_temp.t0() + p_seconds * interval '1 second' $$;
-- a queue configured through queen.configure_queue (Queen's option names)
CREATE FUNCTION pg_temp.conf(p_queue text, p_options jsonb, p_tenant text DEFAULT 'default') RETURNS void LANGUAGE sql AS $$
    SELECT NULL::void FROM queen.configure_queue(p_tenant, p_queue, NULL, NULL, p_options) $$;
-- push frames <part>-1 .. <part>-n into a partition; frame g was appended at t0 + (g - 1) s
CREATE FUNCTION pg_temp.fill(p_queue text, p_part text, p_n integer, p_tenant text DEFAULT 'default') RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM * FROM queen.push_messages(p_tenant, (SELECT array_agg(ROW(p_queue, p_part, p_part || '-' || g, NULL, '\x00'::bytea, false)::queen.push_item ORDER BY g)
                                          FROM generate_series(1, p_n) g));
    UPDATE queen.messages m SET created_at = pg_temp.at(split_part(m.transaction_id, '-', 2)::integer - 1)
      FROM queen.partitions p JOIN queen.queues q ON q.id = p.queue_id
     WHERE m.partition_id = p.id AND q.tenant = p_tenant AND q.name = p_queue AND p.name = p_part;
END
$$;
-- the frames left in a partition, as '4,5,6'
CREATE FUNCTION pg_temp.left_in(p_queue text, p_part text, p_tenant text DEFAULT 'default') RETURNS text LANGUAGE sql AS $$
    SELECT coalesce(string_agg(split_part(m.transaction_id, '-', 2), ',' ORDER BY m.seq), '')
      FROM queen.messages m JOIN queen.partitions p ON p.id = m.partition_id JOIN queen.queues q ON q.id = p.queue_id
     WHERE q.tenant = p_tenant AND q.name = p_queue AND p.name = p_part $$;
-- one call, as 'pending/completed/dlq/skipped'
CREATE FUNCTION pg_temp.ret(p_limit integer, p_at timestamptz) RETURNS text LANGUAGE sql AS $$
    SELECT format('%s/%s/%s/%s', pending_deleted, completed_deleted, dlq_deleted, partitions_skipped)
      FROM queen.apply_retention(p_limit, p_at) $$;
-- pop with auto-ack (moves the group's cursor), the frames it got as '1,2'
CREATE FUNCTION pg_temp.take(p_queue text, p_part text, p_group text, p_n integer) RETURNS text LANGUAGE sql AS $$
    SELECT coalesce(string_agg(split_part(transaction_id, '-', 2), ',' ORDER BY seq), '')
      FROM queen.pop_messages('default', p_queue, p_part, p_group, p_n, true, pg_temp.t0()) $$;
CREATE FUNCTION pg_temp.done(p_queue text, p_tenant text DEFAULT 'default') RETURNS void LANGUAGE sql AS $$
    UPDATE queen.queues SET retention_enabled = false WHERE tenant = p_tenant AND name = p_queue $$;
CREATE FUNCTION pg_temp.dead(p_queue text, p_part text, p_failed_at timestamptz) RETURNS void LANGUAGE sql AS $$
    INSERT INTO queen.dead_letter_queue (message_id, partition_id, consumer_group, transaction_id, payload, failed_at)
    SELECT gen_random_uuid(), p.id, 'workers', 'dead-' || p_failed_at, '\x00', p_failed_at
      FROM queen.partitions p JOIN queen.queues q ON q.id = p.queue_id
     WHERE q.tenant = 'default' AND q.name = p_queue AND p.name = p_part $$;
CREATE FUNCTION pg_temp.dlq_left(p_queue text) RETURNS bigint LANGUAGE sql AS $$
    SELECT count(*) FROM queen.dead_letter_queue d JOIN queen.partitions p ON p.id = d.partition_id
      JOIN queen.queues q ON q.id = p.queue_id WHERE q.tenant = 'default' AND q.name = p_queue $$;

-- ---------------------------------------------------------------- configure stores and echoes the options
SELECT is((SELECT options - ARRAY['leaseTime', 'retryLimit', 'retryDelay', 'maxSize', 'ttl', 'priority', 'delayedProcessing',
                                  'windowBuffer', 'encryptionEnabled', 'deadLetterQueue', 'dlqAfterMaxRetries', 'maxWaitTimeSeconds']
             FROM queen.configure_queue('default', 'r-echo', NULL, NULL, '{"retentionEnabled": true, "retentionSeconds": 60, "completedRetentionSeconds": 5}')),
          '{"retentionEnabled": true, "retentionSeconds": 60, "completedRetentionSeconds": 5}'::jsonb,
          'configure stores and echoes retentionEnabled, retentionSeconds, completedRetentionSeconds');
SELECT pg_temp.done('r-echo');

-- ---------------------------------------------------------------- disabled: nothing goes
SELECT pg_temp.conf('r-off', '{"retentionSeconds": 5, "completedRetentionSeconds": 5}');
SELECT pg_temp.fill('r-off', 'p', 10);
SELECT pg_temp.conf('r-zero', '{"retentionEnabled": true}');
SELECT pg_temp.fill('r-zero', 'p', 3);
SELECT is(pg_temp.ret(1000, pg_temp.at(1000)), '0/0/0/0', 'retentionEnabled false (or every window 0): nothing is deleted');
SELECT is(pg_temp.left_in('r-off', 'p'), '1,2,3,4,5,6,7,8,9,10', 'a disabled queue keeps every frame');
SELECT is(pg_temp.left_in('r-zero', 'p'), '1,2,3', 'an enabled queue whose windows are 0 keeps every frame');

-- ---------------------------------------------------------------- pending retention
SELECT pg_temp.conf('r-pend', '{"retentionEnabled": true, "retentionSeconds": 5}');
SELECT pg_temp.fill('r-pend', 'p', 10);
SELECT is(pg_temp.take('r-pend', 'p', 'h', 3), '1,2,3', 'group h consumed 1..3 (its cursor is at frame 3)');
SELECT is(pg_temp.ret(1000, pg_temp.at(10)), '2/3/0/0',
          'pending retention: frames older than 5 s go, consumed or not (1..3 every group consumed, 4..5 not)');
SELECT is(pg_temp.left_in('r-pend', 'p'), '6,7,8,9,10', 'frames 6..10 are younger than the window');
SELECT is(pg_temp.ret(1000, pg_temp.at(10)), '0/0/0/0', 'a second call at the same instant finds nothing');
SELECT is(pg_temp.take('r-pend', 'p', 'h', 10), '6,7,8,9,10', 'a cursor on a deleted frame moves on to the next frame that exists');
SELECT is(pg_temp.take('r-pend', 'p', 'fresh', 2), '6,7', 'a new group starts at the first frame left');
SELECT is(pg_temp.ret(1000, pg_temp.at(12)), '0/2/0/0', 'two seconds later 6 and 7 expire; both groups had read them, so they count as completed');
SELECT pg_temp.done('r-pend');

-- ---------------------------------------------------------------- one queue name, two tenants
SELECT pg_temp.conf('r-ten', '{"retentionEnabled": true, "retentionSeconds": 5}', 'acme');
SELECT pg_temp.conf('r-ten', '{"retentionSeconds": 5}', 'globex');
SELECT pg_temp.fill('r-ten', 'p', 4, 'acme');
SELECT pg_temp.fill('r-ten', 'p', 4, 'globex');
SELECT is(pg_temp.ret(1000, pg_temp.at(100)), '4/0/0/0', 'retention works on every tenant''s queues, each by its own options');
SELECT is(pg_temp.left_in('r-ten', 'p', 'acme'), '', 'acme''s r-ten (retentionEnabled) lost its expired frames');
SELECT is(pg_temp.left_in('r-ten', 'p', 'globex'), '1,2,3,4', 'globex''s queue of the same name (retention off) keeps every frame');
SELECT pg_temp.done('r-ten', 'acme');

-- ---------------------------------------------------------------- completed retention
SELECT pg_temp.conf('r-done', '{"retentionEnabled": true, "completedRetentionSeconds": 5}');
SELECT pg_temp.fill('r-done', 'p1', 10);
SELECT pg_temp.fill('r-done', 'p2', 4);
SELECT is(pg_temp.take('r-done', 'p1', 'g1', 7) || ' ' || pg_temp.take('r-done', 'p1', 'g2', 3), '1,2,3,4,5,6,7 1,2,3',
          'group g1 consumed 1..7 of p1, group g2 1..3; nobody reads p2');
SELECT is(pg_temp.ret(1000, pg_temp.at(100)), '0/3/0/0', 'completed retention: only what every group consumed (1..3) goes');
SELECT is(pg_temp.left_in('r-done', 'p1'), '4,5,6,7,8,9,10', 'p1 keeps what g2 has not consumed');
SELECT is(pg_temp.left_in('r-done', 'p2'), '1,2,3,4', 'a partition no group reads keeps everything (nothing is completed)');
SELECT is(pg_temp.take('r-done', 'p1', 'g2', 6), '4,5,6,7,8,9', 'g2 moves on from its deleted cursor: 4..9');
SELECT is(pg_temp.ret(1000, pg_temp.at(11)), '0/3/0/0', 'completed but younger than 5 s is kept: at t0+11 only 4..6 are old enough');
SELECT is(pg_temp.left_in('r-done', 'p1'), '7,8,9,10', 'p1 after the window');
SELECT is(pg_temp.ret(1000, pg_temp.at(100)), '0/1/0/0', 'later, 7 (the lowest cursor, g1) goes; 8, 9 are behind g2 only');
SELECT pg_temp.done('r-done');

-- ---------------------------------------------------------------- both rules on one queue
SELECT pg_temp.conf('r-both', '{"retentionEnabled": true, "retentionSeconds": 50, "completedRetentionSeconds": 1}');
SELECT pg_temp.fill('r-both', 'p', 10);
SELECT is(pg_temp.take('r-both', 'p', '__QUEUE_MODE__', 2), '1,2', 'the queue-mode group consumed 1..2');
SELECT is(pg_temp.ret(1000, pg_temp.at(55)), '3/2/0/0', 'both rules: 1..2 completed, 3..5 older than 50 s');
SELECT is(pg_temp.left_in('r-both', 'p'), '6,7,8,9,10', 'the head went, in seq order');
SELECT pg_temp.done('r-both');

-- ---------------------------------------------------------------- dead letters (cell setting)
SELECT pg_temp.conf('r-dlq', '{"retentionEnabled": true}');
SELECT pg_temp.fill('r-dlq', 'p', 3);
SELECT pg_temp.dead('r-dlq', 'p', pg_temp.at(0));
SELECT pg_temp.dead('r-dlq', 'p', pg_temp.at(30));
SELECT pg_temp.dead('r-dlq', 'p', pg_temp.at(100));
SELECT pg_temp.dead('r-off', 'p', pg_temp.at(0));
SELECT is(pg_temp.ret(1000, pg_temp.at(1000)), '0/0/0/0', 'dlq_retention_seconds 0 (the default) keeps dead letters');
UPDATE queen.cell_settings SET dlq_retention_seconds = 60;
SELECT is(pg_temp.ret(1000, pg_temp.at(120)), '0/0/2/0', 'dead letters that failed more than 60 s ago go');
SELECT is(pg_temp.dlq_left('r-dlq'), 1::bigint, 'the younger dead letter stays');
SELECT is(pg_temp.dlq_left('r-off'), 1::bigint, 'a queue without retentionEnabled keeps its dead letters');
SELECT is(pg_temp.left_in('r-dlq', 'p'), '1,2,3', 'the DLQ rule deletes no frame');
SELECT throws_ok($$UPDATE queen.cell_settings SET dlq_retention_seconds = -1$$, '23514', NULL, 'a negative DLQ retention is refused');
SELECT pg_temp.done('r-dlq');

-- ---------------------------------------------------------------- bounded batches
SELECT pg_temp.conf('r-batch', '{"retentionEnabled": true, "retentionSeconds": 1}');
SELECT pg_temp.fill('r-batch', 'a', 15);
SELECT pg_temp.fill('r-batch', 'b', 10);
SELECT pg_temp.dead('r-batch', 'b', pg_temp.at(0));
SELECT pg_temp.dead('r-batch', 'b', pg_temp.at(1));
SELECT pg_temp.dead('r-batch', 'b', pg_temp.at(2));
SELECT is(pg_temp.ret(10, pg_temp.at(100)), '10/0/0/0', 'p_limit bounds a call: 10 rows');
SELECT is(pg_temp.left_in('r-batch', 'a') || ' ' || pg_temp.left_in('r-batch', 'b'), '11,12,13,14,15 1,2,3,4,5,6,7,8,9,10',
          'the head of partition a went first');
SELECT is(pg_temp.ret(10, pg_temp.at(100)), '10/0/0/0', 'the next call: the rest of a, then b');
SELECT is(pg_temp.ret(10, pg_temp.at(100)) || ' ' || pg_temp.ret(10, pg_temp.at(100)), '5/0/3/0 0/0/0/0',
          'dead letters count in the bound; then nothing is left');
SELECT is(pg_temp.ret(NULL, pg_temp.at(100)), '0/0/0/0', 'p_limit NULL is the default (1000)');

-- ---------------------------------------------------------------- after a delete: lease, ack, dedupe
SELECT pg_temp.conf('r-lease', '{"retentionEnabled": true, "retentionSeconds": 5, "leaseTime": 3600}');
SELECT pg_temp.fill('r-lease', 'p', 3);
CREATE TEMP TABLE leased AS SELECT * FROM queen.pop_messages('default', 'r-lease', 'p', 'w', 10, false, pg_temp.at(1));
SELECT is((SELECT count(*) FROM leased), 3::bigint, 'group w leased frames 1..3');
SELECT is(pg_temp.ret(1000, pg_temp.at(100)), '3/0/0/0', 'pending retention deletes frames inside a live lease too');
SELECT results_eq($$SELECT success, error FROM queen.ack_messages('default', ARRAY[ROW('p-1', (SELECT partition_id FROM leased LIMIT 1),
                                                                            'completed', NULL, (SELECT lease_id::text FROM leased LIMIT 1), 'w')::queen.ack_item],
                                                                  pg_temp.at(2))$$,
                  $$VALUES (false, 'Message not found')$$, 'an ack of a deleted frame answers Message not found');
SELECT is((SELECT status FROM queen.push_messages('default', ARRAY[ROW('r-lease', 'p', 'p-1', NULL, '\x01'::bytea, false)::queen.push_item])),
          'queued', 'a deleted frame''s transactionId is no longer a duplicate: the dedupe window is the retention window');
SELECT pg_temp.done('r-lease');

-- ---------------------------------------------------------------- one call locks at most 1000 partitions
SELECT pg_temp.conf('r-wide', '{"retentionEnabled": true, "retentionSeconds": 1}');
SELECT count(*) FROM queen.push_messages('default', (SELECT array_agg(ROW('r-wide', 'x' || g, 'x' || g || '-1', NULL, '\x00'::bytea, false)::queen.push_item)
                                            FROM generate_series(1, 1001) g));
UPDATE queen.messages m SET created_at = pg_temp.t0() FROM queen.partitions p JOIN queen.queues q ON q.id = p.queue_id
 WHERE m.partition_id = p.id AND q.tenant = 'default' AND q.name = 'r-wide';
SELECT is(pg_temp.ret(5000, pg_temp.at(100)), '1000/0/0/0', '1001 partitions with an expired frame each: one call works on 1000');
SELECT is(pg_temp.ret(5000, pg_temp.at(100)), '1/0/0/0', 'the next call finds the last one (the others have nothing left: no lock)');
SELECT pg_temp.done('r-wide');

SELECT * FROM finish();
ROLLBACK;
