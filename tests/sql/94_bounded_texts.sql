-- What a client stores beside a message does not size the answers that show it
-- (migration 041): a dead letter keeps the first 8,192 characters of its ack's
-- error, a DLQ page counts error texts against its byte bound, and a message's
-- detail lists at most 1,000 consumer groups (its counts cover every group).
BEGIN;
SELECT plan(9);

SELECT is((SELECT count(*) FROM queen.push_messages('acme', ARRAY[
              ROW('texts', NULL, 'm1', NULL, '\x01'::bytea, false)::queen.push_item,
              ROW('texts', NULL, 'm2', NULL, '\x02'::bytea, false)::queen.push_item])),
          2::bigint, 'setup: two frames');

SELECT results_eq($$SELECT r.success, r.dlq FROM queen.ack_messages('acme', ARRAY(
                      SELECT ROW(m.transaction_id, m.partition_id, 'dlq', repeat('é', 10000), NULL, 'g')::queen.ack_item
                        FROM queen.messages m WHERE m.transaction_id IN ('m1', 'm2') ORDER BY m.seq)) r
                    ORDER BY r.idx$$,
                  $$VALUES (true, true), (true, true)$$,
                  'two dlq acks whose errors hold 10,000 characters are dead-lettered');
SELECT results_eq($$SELECT DISTINCT length(error_message), error_message = repeat('é', 8192)
                      FROM queen.dead_letter_queue WHERE tenant = 'acme'$$,
                  $$VALUES (8192, true)$$, 'each keeps the first 8,192 characters of its error, whole');

-- each entry: 1 byte of payload and 16,384 bytes of error (8,192 two-byte characters)
SELECT is((SELECT count(*) FROM queen.list_dlq('acme', 'texts', NULL, 100, 0, 20000)), 1::bigint,
          'a page bounded at 20,000 bytes holds one entry: the error texts count');
SELECT is((SELECT count(*) FROM queen.list_dlq('acme', 'texts', NULL, 100, 0, 40000)), 2::bigint,
          'one bounded at 40,000 holds both');
SELECT is((SELECT count(*) FROM queen.list_dlq('acme', 'texts', NULL, 100, 0, 1)), 1::bigint,
          'the first entry comes whatever its size');

SELECT is((SELECT count(*) FROM queen.ack_messages('acme', ARRAY(
              SELECT ROW('m1', (SELECT partition_id FROM queen.messages WHERE transaction_id = 'm1'), 'retry',
                         NULL, NULL, format('grp-%s', lpad(i::text, 4, '0')))::queen.ack_item
                FROM generate_series(1, 1005) i)) r WHERE r.success),
          1005::bigint, 'setup: acks name 1,005 new groups');
SELECT results_eq($$SELECT jsonb_array_length(d.consumer_groups), d.consumer_groups->0->>'name',
                           d.consumer_groups->999->>'name'
                      FROM queen.get_message('acme', (SELECT partition_id FROM queen.messages
                                                       WHERE transaction_id = 'm1'), 'm1') d$$,
                  $$VALUES (1000, 'g', 'grp-0999')$$,
                  'a message''s detail lists its first 1,000 groups by name');
SELECT is((SELECT (d.mode->>'busGroupsCount')::int FROM queen.get_message('acme',
              (SELECT partition_id FROM queen.messages WHERE transaction_id = 'm1'), 'm1') d),
          1006, 'and its mode counts all 1,006');

SELECT * FROM finish();
ROLLBACK;
