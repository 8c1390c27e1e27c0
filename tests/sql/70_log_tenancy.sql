-- The log functions take the tenant first: a queue name is unique per
-- tenant, another tenant's queue is invisible; timers fire (and
-- dead-letter) into the queue of the timer's tenant; names over 255
-- bytes raise QTBAD.
BEGIN;
SELECT plan(48);

CREATE FUNCTION pg_temp.item(p_queue text, p_txn text, p_partition text DEFAULT NULL) RETURNS queen.push_item
LANGUAGE sql AS $$ SELECT ROW(p_queue, p_partition, p_txn, NULL, convert_to(p_txn, 'UTF8'), false)::queen.push_item $$;
CREATE FUNCTION pg_temp.ack(p_txn text, p_partition uuid, p_status text DEFAULT NULL) RETURNS queen.ack_item
LANGUAGE sql AS $$ SELECT ROW(p_txn, p_partition, p_status, NULL, NULL, NULL)::queen.ack_item $$;

-- ---------------------------------------------------------------- configure
SELECT is((SELECT options->>'leaseTime' FROM queen.configure_queue('acme', 'leakq', NULL, NULL, '{"leaseTime": 30}')), '30',
          'configure_queue: acme''s leakq');
SELECT is((SELECT options->>'leaseTime' FROM queen.configure_queue('globex', 'leakq', NULL, NULL, '{"leaseTime": 90}')), '90',
          'configure_queue: globex''s leakq, the same name');
SELECT results_eq($$SELECT tenant, lease_time FROM queen.queues WHERE name = 'leakq' ORDER BY tenant$$,
                  $$VALUES ('acme', 30), ('globex', 90)$$, 'two queues: the name is unique per tenant, not per cell');
SELECT throws_ok($$SELECT * FROM queen.configure_queue('', 'leakq')$$, 'QTBAD', 'timers_bad_request', 'configure_queue needs a tenant');
SELECT throws_ok($$INSERT INTO queen.queues (tenant, name) VALUES ('acme', 'leakq')$$, '23505', NULL,
                 'unique (tenant, name)');

-- ---------------------------------------------------------------- push, encrypted_queues
CREATE TEMP TABLE pa AS SELECT * FROM queen.push_messages('acme', ARRAY[pg_temp.item('leakq', 'leak-1')], 'svc-a');
CREATE TEMP TABLE pb AS SELECT * FROM queen.push_messages('globex', ARRAY[pg_temp.item('leakq', 'leak-1')], 'svc-b');
SELECT results_eq('SELECT status FROM pa UNION ALL SELECT status FROM pb', ARRAY['queued', 'queued'],
                  'push_messages: the same txn in each tenant''s leakq is queued twice, not a duplicate');
SELECT isnt((SELECT partition_id FROM pa), (SELECT partition_id FROM pb), 'into different partitions');
SELECT is((SELECT q.tenant FROM queen.partitions p JOIN queen.queues q ON q.id = p.queue_id WHERE p.id = (SELECT partition_id FROM pa)),
          'acme', 'acme''s push went into acme''s queue');
UPDATE queen.queues SET encryption_enabled = true WHERE tenant = 'acme' AND name = 'leakq';
SELECT results_eq($$SELECT * FROM queen.encrypted_queues('acme', ARRAY['leakq'])$$, ARRAY['leakq'], 'encrypted_queues: acme''s leakq encrypts');
SELECT is_empty($$SELECT * FROM queen.encrypted_queues('globex', ARRAY['leakq'])$$, 'globex''s leakq does not');

-- ---------------------------------------------------------------- pop
SELECT is_empty($$SELECT * FROM queen.pop_messages('initech', 'leakq')$$, 'pop_messages: a tenant without the queue pops nothing');
SELECT is((SELECT count(*) FROM queen.queues WHERE tenant = 'initech'), 0::bigint, 'and creates no queue');
CREATE TEMP TABLE popa AS SELECT * FROM queen.pop_messages('acme', 'leakq', p_batch => 10);
SELECT results_eq('SELECT transaction_id, partition_id FROM popa', 'SELECT transaction_id, partition_id FROM pa',
                  'acme pops acme''s message');
CREATE TEMP TABLE popb AS SELECT * FROM queen.pop_messages('globex', 'leakq', p_batch => 10);
SELECT results_eq('SELECT transaction_id, partition_id FROM popb', 'SELECT transaction_id, partition_id FROM pb',
                  'globex pops globex''s, although acme''s partition is leased');

-- ---------------------------------------------------------------- ack
SELECT results_eq($$SELECT success, error FROM queen.ack_messages('globex', ARRAY[pg_temp.ack('leak-1', (SELECT partition_id FROM pa))])$$,
                  $$VALUES (false, 'Message not found')$$, 'ack_messages: globex cannot ack acme''s message');
SELECT results_eq($$SELECT last_consumed_seq, lease_id FROM queen.partition_consumers WHERE partition_id = (SELECT partition_id FROM pa)$$,
                  $$SELECT 0::bigint, lease_id FROM popa$$, 'acme''s cursor and lease are untouched');
SELECT is_empty($$SELECT * FROM queen.partition_consumers pc JOIN queen.partitions p ON p.id = pc.partition_id
                   JOIN queen.queues q ON q.id = p.queue_id WHERE q.tenant = 'globex' AND pc.consumer_group <> '__QUEUE_MODE__'$$,
                'and no consumer row was made for globex');

-- ---------------------------------------------------------------- get_message
SELECT is((SELECT count(*) FROM queen.get_message('acme', (SELECT partition_id FROM pa), 'leak-1')), 1::bigint, 'get_message: acme finds it');
SELECT is((SELECT count(*) FROM queen.get_message('globex', (SELECT partition_id FROM pa), 'leak-1')), 0::bigint, 'globex does not');

-- ---------------------------------------------------------------- DLQ: list, count, replay
SELECT results_eq($$SELECT dlq FROM queen.ack_messages('acme', ARRAY[pg_temp.ack('leak-1', (SELECT partition_id FROM pa), 'dlq')])$$,
                  ARRAY[true], 'acme dead-letters its message');
SELECT is((SELECT count(*) FROM queen.list_dlq('acme')), 1::bigint, 'list_dlq: acme sees it');
SELECT is((SELECT count(*) FROM queen.list_dlq('globex', 'leakq')), 0::bigint, 'globex does not');
SELECT results_eq($$SELECT queen.count_dlq('acme'), queen.count_dlq('globex'), queen.count_dlq('globex', 'leakq')$$,
                  $$VALUES (1::bigint, 0::bigint, 0::bigint)$$, 'count_dlq per tenant');
SELECT throws_ok($$SELECT queen.replay_dlq_entry('globex', (SELECT id FROM queen.dead_letter_queue))$$, 'QTNFD', 'not_found',
                 'replay_dlq_entry: another tenant''s entry is not found');
SELECT isnt(queen.replay_dlq_entry('acme', (SELECT id FROM queen.dead_letter_queue)), NULL, 'the owner replays it');

-- ---------------------------------------------------------------- timers fire into their tenant's queue
SELECT lives_ok($$SELECT * FROM queen.schedule_timers('globex', ARRAY[ROW('schedule', 'tq', 'k', -1000, 'txn-g', '\x67', NULL, NULL, NULL, NULL)::queen.timer_op])$$,
                'setup: a due timer of globex into tq');
SELECT lives_ok($$SELECT * FROM queen.schedule_timers('acme', ARRAY[ROW('schedule', 'tq', 'k', -1000, 'txn-a', '\x61', NULL, NULL, NULL, NULL)::queen.timer_op])$$,
                'setup: a due timer of acme into tq, same key');
SELECT results_eq($$SELECT tenant, outcome FROM queen.fire_due_timers(10) ORDER BY tenant$$,
                  $$VALUES ('acme', 'fired'), ('globex', 'fired')$$, 'fire_due_timers fires both');
SELECT results_eq($$SELECT q.tenant, m.transaction_id FROM queen.messages m JOIN queen.partitions p ON p.id = m.partition_id
                    JOIN queen.queues q ON q.id = p.queue_id WHERE q.name = 'tq' ORDER BY q.tenant$$,
                  $$VALUES ('acme', 'txn-a'), ('globex', 'txn-g')$$, 'each frame is in its timer''s tenant''s queue');
SELECT lives_ok($$SELECT * FROM queen.schedule_timers('globex', ARRAY[ROW('schedule', 'tq2', 'z', -1000, 'txn-z', '\x7a', NULL, true, NULL, NULL)::queen.timer_op])$$,
                'setup: a due zstd timer of globex (the leased path)');
SELECT is(queen.fail_timer('globex', 'tq2', 'z', (SELECT claim_id FROM queen.claim_timers('b1', 10, 30000, p_zstd_only => true) LIMIT 1),
                           'permanent', 'bad zstd', 1), 'dead_lettered', 'fail_timer dead-letters it');
SELECT results_eq($$SELECT q.tenant, q.name FROM queen.dead_letter_queue d JOIN queen.partitions p ON p.id = d.partition_id
                    JOIN queen.queues q ON q.id = p.queue_id WHERE d.transaction_id = 'txn-z'$$,
                  $$VALUES ('globex', 'tq2')$$, 'into the DLQ of globex''s queue');

-- ---------------------------------------------------------------- byte limits (UTF-8 octets)
SELECT throws_ok($$SELECT * FROM queen.configure_queue('acme', repeat('é', 128))$$, 'QTBAD', 'timers_bad_request',
                 'configure_queue: a queue name of 256 bytes (128 characters)');
SELECT throws_ok($$SELECT * FROM queen.push_messages('acme', ARRAY[pg_temp.item('ok', 't'), pg_temp.item(repeat('q', 256), 't')])$$,
                 'QTBAD', 'timers_bad_request', 'push_messages: queue over 255 bytes');
SELECT throws_ok($$SELECT * FROM queen.push_messages('acme', ARRAY[pg_temp.item('ok', 't', repeat('p', 256))])$$,
                 'QTBAD', 'timers_bad_request', 'push_messages: partition over 255 bytes');
SELECT throws_ok($$SELECT * FROM queen.push_messages('acme', ARRAY[pg_temp.item('ok', repeat('é', 127) || 'tt')])$$,
                 'QTBAD', 'timers_bad_request', 'push_messages: transactionId of 256 bytes');
SELECT is((SELECT count(*) FROM queen.queues WHERE name = 'ok'), 0::bigint, 'a refused push wrote nothing');
SELECT lives_ok($$SELECT * FROM queen.push_messages('acme', ARRAY[pg_temp.item(repeat('q', 255), repeat('é', 127) || 't', repeat('p', 255))])$$,
                'exactly 255 bytes each is accepted');
SELECT throws_ok($$SELECT * FROM queen.pop_messages('acme', repeat('q', 256))$$, 'QTBAD', 'timers_bad_request',
                 'pop_messages: queue over 255 bytes');
SELECT throws_ok($$SELECT * FROM queen.ack_messages('acme', ARRAY[pg_temp.ack(repeat('t', 256), gen_random_uuid())])$$,
                 'QTBAD', 'timers_bad_request', 'ack_messages: transactionId over 255 bytes');
SELECT throws_ok($$SELECT * FROM queen.get_message('acme', gen_random_uuid(), repeat('t', 256))$$, 'QTBAD', 'timers_bad_request',
                 'get_message: transactionId over 255 bytes');
SELECT throws_ok($$SELECT * FROM queen.list_dlq('acme', repeat('q', 256))$$, 'QTBAD', 'timers_bad_request',
                 'list_dlq: queue over 255 bytes');

-- ---------------------------------------------------------------- a DLQ page's bytes bound
CREATE TEMP TABLE pc AS SELECT * FROM queen.push_messages('initech', ARRAY[pg_temp.item('dlqb', 'b-1'), pg_temp.item('dlqb', 'b-2'),
                                                                         pg_temp.item('dlqb', 'b-3')], NULL);
SELECT results_eq($$SELECT count(*) FILTER (WHERE dlq) FROM queen.ack_messages('initech',
                    (SELECT array_agg(pg_temp.ack(m.transaction_id, m.partition_id, 'dlq'))
                       FROM queen.pop_messages('initech', 'dlqb', p_batch => 10) AS m))$$,
                  ARRAY[3::bigint], 'setup: three dead letters of 3 bytes each');
-- each entry weighs its 3-byte payload and its error text, 'Retries exhausted' (17 bytes; migration 041)
SELECT is((SELECT count(*) FROM queen.list_dlq('initech', 'dlqb', p_max_bytes => 40)), 2::bigint,
          'list_dlq: p_max_bytes 40 holds two entries of 20 bytes');
SELECT is((SELECT count(*) FROM queen.list_dlq('initech', 'dlqb', p_max_bytes => 39)), 1::bigint,
          'and 39 one');
SELECT is((SELECT count(*) FROM queen.list_dlq('initech', 'dlqb', p_max_bytes => 1)), 1::bigint,
          'the first entry comes whatever its size');
SELECT is((SELECT count(*) FROM queen.list_dlq('initech', 'dlqb')), 3::bigint, 'NULL: no bound');
SELECT throws_ok($$SELECT * FROM queen.list_dlq('initech', 'dlqb', p_max_bytes => 0)$$, 'QTBAD', 'timers_bad_request',
                 'list_dlq: p_max_bytes below 1');

SELECT * FROM finish();
ROLLBACK;
