-- A pop reads the frames it hands out, not the rest of their transaction
-- (migration 026). A batch's bound (xid, seq) <= (its last frame) ends a
-- btree scan only past the last frame's xid: with every frame of a
-- partition in one transaction (one large push, or pushes in one
-- transaction, as here), each pop read all later frames of it. Which pages a
-- call visits shows in this transaction's own counters.
BEGIN;
SELECT plan(8);

-- pages of the log order's index a call visited (an entry the scan reads and
-- refuses is not counted as returned, but its page is fetched)
CREATE FUNCTION pg_temp.reads() RETURNS bigint LANGUAGE sql AS $$
    SELECT pg_stat_get_xact_blocks_fetched('queen.messages_partition_xid_seq_idx'::regclass) $$;
CREATE FUNCTION pg_temp.push(p_queue text, p_from integer, p_to integer) RETURNS bigint LANGUAGE sql AS $$
    SELECT count(*) FROM queen.push_messages('acme', ARRAY(
        SELECT ROW(p_queue, NULL, 'm' || i, NULL, convert_to('{"i":' || i || '}', 'UTF8'), false)::queen.push_item
          FROM generate_series(p_from, p_to) i)) $$;
CREATE TEMP TABLE reads (step text PRIMARY KEY, n bigint);
CREATE FUNCTION pg_temp.step(p_step text) RETURNS bigint LANGUAGE sql AS $$
    INSERT INTO reads VALUES (p_step, pg_temp.reads());
    SELECT (SELECT n FROM reads WHERE step = p_step) - max(n) FILTER (WHERE step <> p_step) FROM reads $$;

SELECT is(pg_temp.push('one-xid', 1, 5000) + pg_temp.push('one-xid', 5001, 10000), 10000::bigint,
          'setup: 10,000 frames in one partition, all of this one transaction');
-- statistics that know them (a pop walks the index in order then; without
-- any, a plan may take all frames after the cursor and sort them)
ANALYZE queen.messages;
SELECT pg_temp.step('start');

CREATE TEMP TABLE p1 AS SELECT * FROM queen.pop_messages('acme', 'one-xid', p_batch => 10);
SELECT cmp_ok(pg_temp.step('pop 1'), '<', 20::bigint,
              'a pop of 10 visits a few pages of the index, not the 10,000 entries of the transaction');
SELECT results_eq('SELECT transaction_id FROM p1 ORDER BY seq',
                  ARRAY['m1', 'm2', 'm3', 'm4', 'm5', 'm6', 'm7', 'm8', 'm9', 'm10'],
                  'it hands out the first ten, in order');

SELECT is((SELECT count(*) FILTER (WHERE success) FROM queen.ack_messages('acme', ARRAY(
              SELECT ROW(transaction_id, partition_id, 'completed', NULL, lease_id::text, NULL)::queen.ack_item FROM p1))),
          10::bigint, 'they are acked');
SELECT cmp_ok(pg_temp.step('ack'), '<', 20::bigint, 'the ack a few too');

-- the next pop starts inside the same transaction's frames, after the cursor
CREATE TEMP TABLE p2 AS SELECT * FROM queen.pop_messages('acme', 'one-xid', p_batch => 10, p_auto_ack => true);
SELECT cmp_ok(pg_temp.step('pop 2'), '<', 20::bigint, 'the next pop a few too');
SELECT results_eq('SELECT transaction_id FROM p2 ORDER BY seq',
                  ARRAY['m11', 'm12', 'm13', 'm14', 'm15', 'm16', 'm17', 'm18', 'm19', 'm20'],
                  'and hands out the next ten');
SELECT is((SELECT last_consumed_seq FROM queen.partition_consumers pc JOIN queen.partitions p ON p.id = pc.partition_id
            JOIN queen.queues q ON q.id = p.queue_id WHERE q.name = 'one-xid'),
          (SELECT max(seq) FROM p2), 'the cursor is at the last one handed out');

SELECT * FROM finish();
ROLLBACK;
