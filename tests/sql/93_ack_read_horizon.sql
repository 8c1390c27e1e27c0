-- An ack cannot move a cursor to a frame at or past the read horizon
-- (migration 040). No pop hands such a frame out: a transaction older than it
-- still runs, and a cursor moved past that transaction's frames would skip them
-- when it commits. Here the frame 'late' gets an xid past every running
-- transaction's, as a frame of a transaction younger than a running one has
-- (tests/py/test_log_order.py drives the same with real concurrent sessions).
BEGIN;
SELECT plan(10);

SELECT is((SELECT count(*) FROM queen.push_messages('acme', ARRAY[
              ROW('horizon', NULL, 'early', NULL, '\x01'::bytea, false)::queen.push_item,
              ROW('horizon', NULL, 'late', NULL, '\x02'::bytea, false)::queen.push_item])),
          2::bigint, 'setup: two frames');
UPDATE queen.messages SET xid = (pg_current_xact_id()::text::bigint + 1000)::text::xid8
 WHERE transaction_id = 'late';
SELECT cmp_ok((SELECT xid FROM queen.messages WHERE transaction_id = 'late'), '>=', queen.log_read_horizon(),
              'setup: the late frame lies at or past the read horizon');

CREATE FUNCTION pg_temp.ack(p_txn text, p_status text, p_group text DEFAULT NULL)
RETURNS TABLE (success boolean, error text) LANGUAGE sql AS $$
    SELECT r.success, r.error FROM queen.ack_messages('acme', ARRAY[
        ROW(p_txn, (SELECT partition_id FROM queen.messages WHERE transaction_id = p_txn),
            p_status, NULL, NULL, p_group)::queen.ack_item]) r $$;
CREATE FUNCTION pg_temp.cursor(p_group text DEFAULT '__QUEUE_MODE__') RETURNS bigint LANGUAGE sql AS $$
    SELECT coalesce((SELECT pc.last_consumed_seq FROM queen.partition_consumers pc
                       JOIN queen.messages m ON m.partition_id = pc.partition_id AND m.transaction_id = 'early'
                      WHERE pc.consumer_group = p_group), 0) $$;

SELECT results_eq($$SELECT * FROM pg_temp.ack('late', 'completed')$$,
                  $$VALUES (false, 'Message not yet readable')$$,
                  'a completed ack of a frame past the horizon is refused');
SELECT is(pg_temp.cursor(), 0::bigint, 'and the cursor stays where it was');
SELECT results_eq($$SELECT * FROM pg_temp.ack('late', 'dlq')$$,
                  $$VALUES (false, 'Message not yet readable')$$,
                  'so is a dlq ack (it would move the cursor past it too)');
SELECT is((SELECT count(*) FROM queen.dead_letter_queue d JOIN queen.messages m ON m.id = d.message_id
            WHERE m.transaction_id = 'late'), 0::bigint, 'and nothing is dead-lettered');
SELECT results_eq($$SELECT * FROM pg_temp.ack('late', 'retry')$$, $$VALUES (true, NULL::text)$$,
                  'a retry, which only releases a lease, still succeeds');

SELECT results_eq($$SELECT r.success, r.error FROM queen.ack_messages('acme', ARRAY(
                      SELECT ROW(m.transaction_id, m.partition_id, 'completed', NULL, NULL, 'bus')::queen.ack_item
                        FROM queen.messages m WHERE m.transaction_id IN ('early', 'late') ORDER BY m.seq)) r
                    ORDER BY r.idx$$,
                  $$VALUES (true, NULL::text), (false, 'Message not yet readable')$$,
                  'in one call, the frame below the horizon is acked and the one past it refused');
SELECT is(pg_temp.cursor('bus'), (SELECT seq FROM queen.messages WHERE transaction_id = 'early'),
          'that group''s cursor is at the frame below the horizon');
SELECT is((SELECT count(*) FROM queen.pop_messages('acme', 'horizon', NULL, 'bus', 10, true)), 0::bigint,
          'and a pop hands out nothing past it either');

SELECT * FROM finish();
ROLLBACK;
