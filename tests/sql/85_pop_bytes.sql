-- pop_messages(p_max_bytes): a pop's batch ends at the message whose
-- predecessors' stored bytes reach the bound; the first is always handed
-- out; the cursor and the lease cover exactly what was handed out.
BEGIN;
SELECT plan(7);

CREATE FUNCTION pg_temp.item(p_txn text, p_size integer) RETURNS queen.push_item
LANGUAGE sql AS $$ SELECT ROW('big', NULL, p_txn, NULL, convert_to(repeat('x', p_size), 'UTF8'), false)::queen.push_item $$;

SELECT is((SELECT count(*) FROM queen.push_messages('acme', ARRAY[
    pg_temp.item('m1', 100), pg_temp.item('m2', 100), pg_temp.item('m3', 100),
    pg_temp.item('m4', 100), pg_temp.item('m5', 5000)], 'svc')), 5::bigint, 'five messages pushed');

CREATE TEMP TABLE p1 AS SELECT * FROM queen.pop_messages('acme', 'big', p_batch => 10, p_max_bytes => 250);
SELECT results_eq('SELECT transaction_id FROM p1 ORDER BY seq', ARRAY['m1', 'm2', 'm3'],
                  'the batch ends at the message whose predecessors reach 250 bytes (0, 100, 200 before it)');
SELECT is((SELECT batch_size FROM queen.partition_consumers WHERE consumer_group = '__QUEUE_MODE__'), 3,
          'the lease covers the three handed out');
SELECT is((SELECT count(*) FILTER (WHERE success) FROM queen.ack_messages('acme', ARRAY(
              SELECT ROW(transaction_id, partition_id, 'completed', NULL, lease_id::text, NULL)::queen.ack_item FROM p1))),
          3::bigint, 'they are acked');

CREATE TEMP TABLE p2 AS SELECT * FROM queen.pop_messages('acme', 'big', p_batch => 10, p_max_bytes => 1);
SELECT results_eq('SELECT transaction_id FROM p2', ARRAY['m4'], 'a bound below the first message still hands it out');
SELECT is((SELECT count(*) FROM queen.pop_messages('acme', 'big', p_batch => 10, p_max_bytes => 1)), 0::bigint,
          'the partition is leased meanwhile');

-- without a bound, the whole batch as before
UPDATE queen.partition_consumers SET lease_expires_at = now() - interval '1 second';
SELECT results_eq($$SELECT transaction_id FROM queen.pop_messages('acme', 'big', p_batch => 10) ORDER BY seq$$,
                  ARRAY['m4', 'm5'], 'no bound: every message up to p_batch');

SELECT * FROM finish();
ROLLBACK;
