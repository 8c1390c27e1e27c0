-- queen.execute_transaction (pushes and acks, all or nothing, tenant-scoped)
-- and queen.extend_lease (tenant-scoped, never shortens, unknown / expired).
-- A run of consecutive acks is one ack_messages call (migration 039).
BEGIN;
SELECT plan(36);

CREATE FUNCTION pg_temp.t0() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2030-01-01 00:00:00+00'::timestamptz $$;
CREATE FUNCTION pg_temp.at(p_seconds numeric) RETURNS timestamptz LANGUAGE sql AS $$ SELECT pg_temp.t0() + p_seconds * interval '1 second' $$;

SELECT lives_ok($$SELECT * FROM queen.configure_queue('acme', 'in', NULL, NULL, '{"leaseTime": 60}')$$, 'setup: acme''s queue in');
SELECT lives_ok($$SELECT * FROM queen.push_messages('acme', ARRAY[ROW('in', NULL, 'm1', NULL, '\x31'::bytea, false)::queen.push_item,
                                                                   ROW('in', NULL, 'm2', NULL, '\x32'::bytea, false)::queen.push_item])$$,
                'setup: m1, m2');
CREATE TEMP TABLE popped AS SELECT * FROM queen.pop_messages('acme', 'in', p_batch => 10, p_now => pg_temp.t0());
CREATE FUNCTION pg_temp.part() RETURNS uuid LANGUAGE sql AS $$ SELECT partition_id FROM popped LIMIT 1 $$;
CREATE FUNCTION pg_temp.lease() RETURNS text LANGUAGE sql AS $$ SELECT lease_id::text FROM popped LIMIT 1 $$;
CREATE FUNCTION pg_temp.cursor() RETURNS bigint LANGUAGE sql AS $$
    SELECT last_consumed_seq FROM queen.partition_consumers WHERE partition_id = pg_temp.part() $$;

-- ---------------------------------------------------------------- a failing ack undoes everything
CREATE TEMP TABLE f1 AS
SELECT * FROM queen.execute_transaction('acme', ARRAY[
    queen.txn_ack('m1', pg_temp.part(), p_lease_id => pg_temp.lease()),
    queen.txn_push('out', '\x6f31', 'o1'),
    queen.txn_ack('nope', pg_temp.part())], p_now => pg_temp.at(1));
SELECT results_eq('SELECT success, error, failed_index, cardinality(results) FROM f1',
                  $$VALUES (false, 'ACK operation failed: Message not found', 2, 0)$$,
                  'an ack of an unknown message fails the transaction at its index, with no results');
SELECT is(pg_temp.cursor(), 0::bigint, 'the ack before it is undone (cursor not moved)');
SELECT is((SELECT count(*) FROM queen.queues WHERE name = 'out'), 0::bigint, 'the push before it is undone (not even the queue is left)');
SELECT is((SELECT count(*) FROM queen.messages), 2::bigint, 'no message written');
CREATE TEMP TABLE f2 AS
SELECT * FROM queen.execute_transaction('acme', ARRAY[queen.txn_push('out', '\x6f31', 'o1'),
                                                      queen.txn_ack('m1', pg_temp.part(), p_lease_id => gen_random_uuid()::text)],
                                        p_now => pg_temp.at(1));
SELECT results_eq('SELECT success, error, failed_index FROM f2', $$VALUES (false, 'ACK operation failed: Invalid or expired lease', 1)$$,
                  'an ack under a lease that is not the partition''s fails it');
SELECT is((SELECT count(*) FROM queen.messages), 2::bigint, 'and nothing is written');

-- ---------------------------------------------------------------- tenant
CREATE TEMP TABLE f3 AS
SELECT * FROM queen.execute_transaction('globex', ARRAY[queen.txn_push('in', '\x67', 'g1'), queen.txn_ack('m1', pg_temp.part())],
                                        p_now => pg_temp.at(1));
SELECT results_eq('SELECT success, failed_index FROM f3', $$VALUES (false, 1)$$, 'globex cannot ack acme''s message in a transaction');
SELECT is((SELECT count(*) FROM queen.queues WHERE tenant = 'globex'), 0::bigint, 'and its push is undone');
SELECT results_eq($$SELECT success, failed_index FROM queen.execute_transaction('globex', ARRAY[queen.txn_push('in', '\x67', 'g1')],
                                                                              ARRAY[pg_temp.lease()], p_now => pg_temp.at(1))$$,
                  $$VALUES (false, NULL::integer)$$, 'acme''s lease is not a lease globex holds');

-- ---------------------------------------------------------------- success
CREATE TEMP TABLE ok1 AS
SELECT * FROM queen.execute_transaction('acme', ARRAY[
    queen.txn_ack('m1', pg_temp.part()),             -- borrows the one required lease
    queen.txn_push('out', '\x6f31', 'o1', p_partition => 'p'),
    queen.txn_push('out', '\x6f32')], ARRAY[pg_temp.lease()], 'svc', pg_temp.at(1));
SELECT results_eq('SELECT success, error, failed_index FROM ok1', $$VALUES (true, NULL::text, NULL::integer)$$, 'the transaction commits');
SELECT results_eq('SELECT r.idx, r.type, r.success, r.status, r.transaction_id, r.queue_name, r.partition_name, r.lease_released FROM ok1, unnest(ok1.results) r',
                  $$VALUES (0, 'ack', true, NULL, 'm1', 'in', 'Default', false),
                           (1, 'push', true, 'queued', 'o1', 'out', 'p', false),
                           (2, 'push', true, 'queued', (SELECT transaction_id FROM queen.messages WHERE payload = '\x6f32'), 'out', 'Default', false)$$,
                  'one result per operation, in order; a push without a transaction id gets one');
SELECT is(pg_temp.cursor(), (SELECT seq FROM popped WHERE transaction_id = 'm1'), 'the ack moved the cursor');
SELECT results_eq($$SELECT m.transaction_id, m.producer_sub, q.tenant FROM queen.messages m JOIN queen.partitions p ON p.id = m.partition_id
                    JOIN queen.queues q ON q.id = p.queue_id WHERE q.name = 'out' ORDER BY m.seq$$,
                  $$SELECT x.t, 'svc', 'acme' FROM (VALUES (1, 'o1'), (2, (SELECT transaction_id FROM queen.messages WHERE payload = '\x6f32'))) x(n, t) ORDER BY n$$,
                  'the pushes are in acme''s out, stamped with the producer');
SELECT results_eq($$SELECT r.status, r.message_id FROM queen.execute_transaction('acme', ARRAY[queen.txn_push('out', '\x00', 'o1', 'p')]) o, unnest(o.results) r$$,
                  $$SELECT 'duplicate', id FROM queen.messages WHERE transaction_id = 'o1'$$,
                  'a repeated push is duplicate with the existing id: a retried transaction is idempotent');

-- ---------------------------------------------------------------- shape
SELECT throws_ok($$SELECT * FROM queen.execute_transaction('acme', '{}')$$, 'QTBAD', 'timers_bad_request', 'no operations');
SELECT throws_ok($$SELECT * FROM queen.execute_transaction('acme', ARRAY[ROW('nack', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)::queen.txn_op])$$,
                 'QTBAD', 'timers_bad_request', 'an unknown operation type');
SELECT throws_ok($$SELECT * FROM queen.execute_transaction('acme', ARRAY[queen.txn_ack('m2', pg_temp.part(), 'maybe')])$$,
                 'QTBAD', 'timers_bad_request', 'an unknown ack status');
SELECT throws_ok($$SELECT * FROM queen.execute_transaction('acme', ARRAY[queen.txn_push('out', '\x00', repeat('t', 256))])$$,
                 'QTBAD', 'timers_bad_request', 'a transactionId over 255 bytes');
SELECT throws_ok($$SELECT * FROM queen.execute_transaction('acme', ARRAY[queen.txn_push(repeat('é', 128), '\x00')])$$,
                 'QTBAD', 'timers_bad_request', 'a queue name over 255 bytes');

-- ---------------------------------------------------------------- extend_lease
CREATE TEMP TABLE p2 AS SELECT * FROM queen.pop_messages('acme', 'in', p_batch => 10, p_now => pg_temp.at(100));
SELECT is((SELECT transaction_id FROM p2), 'm2', 'setup: m2 popped at t0+100 s, lease 60 s');
CREATE FUNCTION pg_temp.lease2() RETURNS text LANGUAGE sql AS $$ SELECT lease_id::text FROM p2 $$;
SELECT results_eq($$SELECT success, error, expires_at, renewed FROM queen.extend_lease('acme', pg_temp.lease2(), 600, pg_temp.at(110))$$,
                  $$VALUES (true, NULL::text, pg_temp.at(710), 1)$$, 'extend_lease: now + seconds');
SELECT results_eq($$SELECT success, expires_at FROM queen.extend_lease('acme', upper(pg_temp.lease2()), 60, pg_temp.at(120))$$,
                  $$VALUES (true, pg_temp.at(710))$$, 'never shortens a longer lease (and the id is case-insensitive)');
SELECT results_eq($$SELECT success, error, renewed FROM queen.extend_lease('globex', pg_temp.lease2(), 600, pg_temp.at(120))$$,
                  $$VALUES (false, 'Lease not found', 0)$$, 'another tenant''s lease is not found');
SELECT results_eq($$SELECT success, error FROM queen.extend_lease('acme', pg_temp.lease2(), 60, pg_temp.at(711))$$,
                  $$VALUES (false, 'Lease already expired')$$, 'an expired lease is not extended');
SELECT is((SELECT lease_expires_at FROM queen.partition_consumers WHERE partition_id = pg_temp.part()), pg_temp.at(710),
          'neither refusal changed the expiry');
SELECT results_eq($$SELECT success, error FROM queen.extend_lease('acme', 'not-a-lease')$$, $$VALUES (false, 'Lease not found')$$,
                  'an unknown lease is not found');
SELECT throws_ok($$SELECT * FROM queen.extend_lease('acme', pg_temp.lease2(), 0)$$, 'QTBAD', 'timers_bad_request', 'seconds below 1');

-- ---------------------------------------------------------------- a run of acks is one ack_messages call
SELECT lives_ok($$SELECT * FROM queen.push_messages('acme', ARRAY[ROW('nk', NULL, 'n1', NULL, '\x31'::bytea, false)::queen.push_item,
                                                                   ROW('nk', NULL, 'n2', NULL, '\x32'::bytea, false)::queen.push_item,
                                                                   ROW('nk', NULL, 'n3', NULL, '\x33'::bytea, false)::queen.push_item])$$,
                'setup: n1, n2, n3 in nk');
CREATE TEMP TABLE p3 AS SELECT * FROM queen.pop_messages('acme', 'nk', p_batch => 10, p_now => pg_temp.at(200));
CREATE FUNCTION pg_temp.nk(p_status text, VARIADIC p_ids text[]) RETURNS queen.txn_outcome LANGUAGE sql AS $$
    SELECT queen.execute_transaction('acme', ARRAY(
        SELECT queen.txn_ack(i, (SELECT partition_id FROM p3 LIMIT 1), p_status, p_lease_id => (SELECT lease_id::text FROM p3 LIMIT 1))
          FROM unnest(p_ids) WITH ORDINALITY AS u(i, n) ORDER BY n), p_now => pg_temp.at(201)) $$;
CREATE FUNCTION pg_temp.nk_consumer() RETURNS TABLE (seq bigint, retries integer, leased boolean) LANGUAGE sql AS $$
    SELECT last_consumed_seq, batch_retry_count, lease_id IS NOT NULL FROM queen.partition_consumers
     WHERE partition_id = (SELECT partition_id FROM p3 LIMIT 1) $$;
CREATE TEMP TABLE t1 AS SELECT * FROM pg_temp.nk('failed', 'n1', 'n2', 'n3');
SELECT results_eq('SELECT success, error, cardinality(results) FROM t1', $$VALUES (true, NULL::text, 3)$$,
                  'a batch nacked as a list (queen-mq''s transaction().ack(messages, ''failed'')) succeeds, each item');
SELECT results_eq('SELECT seq, retries, leased FROM pg_temp.nk_consumer()', $$VALUES (0::bigint, 1, false)$$,
                  '... the batch comes back whole: no cursor move, one retry spent, the lease released');
-- in a partition of its own, so that it does not hang on the nack's outcome
SELECT lives_ok($$SELECT * FROM queen.push_messages('acme', ARRAY[ROW('nk', 'b', 'n4', NULL, '\x34'::bytea, false)::queen.push_item,
                                                                   ROW('nk', 'b', 'n5', NULL, '\x35'::bytea, false)::queen.push_item,
                                                                   ROW('nk', 'b', 'n6', NULL, '\x36'::bytea, false)::queen.push_item])$$,
                'setup: n4, n5, n6 in nk/b, popped');
DELETE FROM p3;
INSERT INTO p3 SELECT * FROM queen.pop_messages('acme', 'nk', 'b', p_batch => 10, p_now => pg_temp.at(202));
CREATE TEMP TABLE t2 AS SELECT * FROM pg_temp.nk('completed', 'n6', 'n4', 'n5');
SELECT results_eq('SELECT success, error FROM t2', $$VALUES (true, NULL::text)$$,
                  'completed acks listed out of log order succeed (the last message''s ack no longer releases the lease first)');
SELECT results_eq($$SELECT r.idx, r.transaction_id FROM t2, unnest(t2.results) r$$, $$VALUES (0, 'n6'), (1, 'n4'), (2, 'n5')$$,
                  '... one result per operation, in the order given');
SELECT results_eq('SELECT seq, leased FROM pg_temp.nk_consumer()', $$SELECT max(seq), false FROM p3$$,
                  '... the cursor past the last of them, the lease released');

SELECT * FROM finish();
ROLLBACK;
