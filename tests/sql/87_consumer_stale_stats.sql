-- A pop and an ack read what they hand out or ack whatever the statistics
-- say (migration 027). With the statistics of an empty table (a large push
-- not yet committed when autovacuum analyzed queen.messages), a pop took
-- every frame after the cursor by a bitmap scan and sorted them, its check
-- for frames after a partition's cursor scanned the index from its start,
-- and an ack hashed every frame of the partition. Which pages a call visits
-- shows in this transaction's own counters.
BEGIN;
SELECT plan(10);

CREATE FUNCTION pg_temp.pages() RETURNS bigint LANGUAGE sql AS $$
    SELECT pg_stat_get_xact_blocks_fetched('queen.messages_partition_xid_seq_idx'::regclass)
         + pg_stat_get_xact_blocks_fetched('queen.messages_partition_transaction_unique'::regclass)
         + pg_stat_get_xact_blocks_fetched('queen.messages'::regclass) $$;
CREATE FUNCTION pg_temp.push(p_queue text, p_from integer, p_to integer) RETURNS bigint LANGUAGE sql AS $$
    SELECT count(*) FROM queen.push_messages('acme', ARRAY(
        SELECT ROW(p_queue, NULL, 'm' || i, NULL, convert_to('{"i":' || i || '}', 'UTF8'), false)::queen.push_item
          FROM generate_series(p_from, p_to) i)) $$;
CREATE TEMP TABLE reads (step text PRIMARY KEY, n bigint);
CREATE FUNCTION pg_temp.step(p_step text) RETURNS bigint LANGUAGE sql AS $$
    INSERT INTO reads VALUES (p_step, pg_temp.pages());
    SELECT (SELECT n FROM reads WHERE step = p_step) - max(n) FILTER (WHERE step <> p_step) FROM reads $$;

SELECT is((SELECT proconfig FROM pg_proc WHERE oid = 'queen.pop_messages(text, text, text, text, integer, boolean, timestamptz, bigint)'::regprocedure),
          ARRAY['enable_seqscan=off', 'enable_bitmapscan=off', 'enable_sort=off', 'jit=off'],
          'pop_messages plans without seq scans, bitmap scans or sorts it can avoid, and without JIT');
SELECT is((SELECT proconfig FROM pg_proc WHERE oid = 'queen.ack_messages(text, queen.ack_item[], timestamptz)'::regprocedure),
          ARRAY['enable_seqscan=off', 'enable_bitmapscan=off'],
          'ack_messages plans without seq scans or bitmap scans');

-- statistics of an empty table over hundreds of pages: analyzed with rows, emptied, analyzed again
SELECT pg_temp.push('gone', 1, 10000);
ANALYZE queen.messages;
DELETE FROM queen.messages;
ANALYZE queen.messages;
SELECT is((SELECT reltuples > 0 FROM pg_class WHERE oid = 'queen.messages'::regclass), false,
          'setup: the statistics say queen.messages holds no row');

-- then 10,000 frames arrive in one partition
SELECT pg_temp.push('q', 1, 10000);
SELECT pg_temp.step('start');

CREATE TEMP TABLE p1 AS SELECT * FROM queen.pop_messages('acme', 'q', p_batch => 10);
SELECT cmp_ok(pg_temp.step('pop 1'), '<', 30::bigint, 'a pop of 10 visits a few pages, not the 10,000 frames');
SELECT results_eq('SELECT transaction_id FROM p1 ORDER BY seq',
                  ARRAY['m1', 'm2', 'm3', 'm4', 'm5', 'm6', 'm7', 'm8', 'm9', 'm10'], 'it hands out the first ten, in order');

SELECT is((SELECT count(*) FILTER (WHERE success) FROM queen.ack_messages('acme', ARRAY(
              SELECT ROW(transaction_id, partition_id, 'completed', NULL, lease_id::text, NULL)::queen.ack_item FROM p1))),
          10::bigint, 'they are acked');
SELECT cmp_ok(pg_temp.step('ack'), '<', 60::bigint, 'the ack of 10 visits a few pages per item');

CREATE TEMP TABLE p2 AS SELECT * FROM queen.pop_messages('acme', 'q', p_batch => 10, p_auto_ack => true);
SELECT cmp_ok(pg_temp.step('pop 2'), '<', 30::bigint, 'the next pop a few too');
SELECT results_eq('SELECT transaction_id FROM p2 ORDER BY seq',
                  ARRAY['m11', 'm12', 'm13', 'm14', 'm15', 'm16', 'm17', 'm18', 'm19', 'm20'], 'and hands out the next ten');

-- an ack of a frame that is not there finds nothing (the lookup with LIMIT yields no row)
SELECT is((SELECT array_agg(error ORDER BY 1) FROM queen.ack_messages('acme', ARRAY[
              ROW('no-such-txn', (SELECT partition_id FROM p1 LIMIT 1), 'completed', NULL, NULL, NULL)::queen.ack_item])),
          ARRAY['Message not found'], 'an ack of a transaction id the partition does not hold: Message not found');

SELECT * FROM finish();
ROLLBACK;
