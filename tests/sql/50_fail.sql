-- fail_timer: transient failures cost no attempt, permanent and config
-- spend one, backoff is exponential and capped, the DLQ after max
-- attempts; replay_dlq_entry refuses a timer's dead letter (QTRPL) and keeps a
-- replayed frame's transaction id within 255 bytes (migration 039).
BEGIN;
SELECT plan(38);

CREATE FUNCTION pg_temp.t0() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2030-01-01 00:00:00+00'::timestamptz $$;
CREATE FUNCTION pg_temp.at(p_seconds numeric) RETURNS timestamptz LANGUAGE sql AS $$ SELECT pg_temp.t0() + p_seconds * interval '1 second' $$;
CREATE FUNCTION pg_temp.pending() RETURNS bigint LANGUAGE sql AS $$
    SELECT queen.get_pending_timers('acme') $$;
-- claim the one due timer 'k' at p_at; its claim id
CREATE FUNCTION pg_temp.claim(p_at timestamptz) RETURNS uuid LANGUAGE sql AS $$
    SELECT claim_id FROM queen.claim_timers('b1', 10, 60000, p_at) WHERE timer_key = 'k' $$;
-- fail 'k' (backoff 1 s doubling, capped at 5 s, 3 attempts)
CREATE FUNCTION pg_temp.fail(p_claim uuid, p_class text, p_at timestamptz) RETURNS text LANGUAGE sql AS $$
    SELECT queen.fail_timer('acme', 'dq', 'k', p_claim, p_class, 'error ' || p_class, 3, 1000, 5000, p_at) $$;

SELECT lives_ok($$SELECT * FROM queen.schedule_timers('acme', ARRAY[ROW('schedule', 'dq', 'k', 0, 'txn-k', '\x6b6b', 'p1', NULL, NULL, NULL)::queen.timer_op],
                                                      'svc', p_now => pg_temp.t0())$$, 'setup: a due timer');
SELECT throws_ok($$SELECT pg_temp.fail(pg_temp.claim(pg_temp.t0()), 'flaky', pg_temp.t0())$$, 'QTBAD', 'timers_bad_request', 'an unknown failure class');
SELECT is(pg_temp.fail(gen_random_uuid(), 'permanent', pg_temp.t0()), 'lost', 'a failure reported without the claim answers lost');

-- transient: no attempt, backoff 1 s
SELECT is(pg_temp.fail(pg_temp.claim(pg_temp.at(0)), 'transient', pg_temp.at(0)), 'backoff', 'a transient failure backs off');
SELECT results_eq('SELECT attempts, failures, last_error, last_error_class, claim_id, lease_until, deliver_at FROM queen.timers',
                  $$VALUES (0, 1, 'error transient', 'transient', NULL::uuid, NULL::timestamptz, pg_temp.at(1))$$,
                  'transient: no attempt spent, claim dropped, due again after the base backoff');
SELECT is((SELECT claimed FROM queen.peek_timer('acme', 'dq', 'k', pg_temp.at(0))), false, 'in backoff the timer is not claimed');
SELECT is(pg_temp.claim(pg_temp.at(0.5)), NULL, 'and not due before its backoff ends');

-- permanent: one attempt, backoff doubles
SELECT is(pg_temp.fail(pg_temp.claim(pg_temp.at(1)), 'permanent', pg_temp.at(1)), 'backoff', 'a permanent failure backs off');
SELECT results_eq('SELECT attempts, failures, deliver_at FROM queen.timers', $$VALUES (1, 2, pg_temp.at(3))$$,
                  'permanent: one attempt spent, backoff doubled (2 s)');
SELECT is(pg_temp.fail(pg_temp.claim(pg_temp.at(3)), 'transient', pg_temp.at(3)), 'backoff', 'transient again');
SELECT results_eq('SELECT attempts, failures, deliver_at FROM queen.timers', $$VALUES (1, 3, pg_temp.at(7))$$,
                  'transient: still one attempt, backoff 4 s');
SELECT is(pg_temp.fail(pg_temp.claim(pg_temp.at(7)), 'transient', pg_temp.at(7)), 'backoff', 'transient again');
SELECT results_eq('SELECT attempts, failures, deliver_at FROM queen.timers', $$VALUES (1, 4, pg_temp.at(12))$$,
                  'the backoff is capped (5 s, not 8 s)');
UPDATE queen.timers SET failures = 1000;
SELECT is(pg_temp.fail(pg_temp.claim(pg_temp.at(12)), 'transient', pg_temp.at(12)), 'backoff', 'many transient failures never dead-letter');
SELECT is((SELECT deliver_at FROM queen.timers), pg_temp.at(17), 'and the backoff stays capped without overflowing');

-- config: spends an attempt (2 of 3)
SELECT is(pg_temp.fail(pg_temp.claim(pg_temp.at(17)), 'config', pg_temp.at(17)), 'backoff', 'a config failure backs off');
SELECT is((SELECT attempts FROM queen.timers), 2, 'config: one attempt spent');
SELECT is(pg_temp.pending(), 1::bigint, 'pending counter: still 1');

-- third spent attempt: the DLQ
SELECT is(pg_temp.fail(pg_temp.claim(pg_temp.at(30)), 'permanent', pg_temp.at(30)), 'dead_lettered', 'after max attempts the timer is dead-lettered');
SELECT is((SELECT count(*) FROM queen.timers), 0::bigint, 'the timer row is gone');
SELECT is(pg_temp.pending(), 0::bigint, 'pending counter: the DLQ move -1');
SELECT results_eq($$SELECT d.consumer_group, d.transaction_id, d.payload, d.producer_sub, d.error_message, d.retry_count, d.timer_tenant,
                           d.timer_key COLLATE "default", d.failed_at, d.original_created_at, p.name, q.name
                      FROM queen.dead_letter_queue d JOIN queen.partitions p ON p.id = d.partition_id JOIN queen.queues q ON q.id = p.queue_id$$,
                  $$VALUES ('__QUEEN_TIMERS__', 'txn-k', '\x6b6b'::bytea, 'svc', 'error permanent', 3, 'acme', 'k', pg_temp.at(30), pg_temp.t0(), 'p1', 'dq')$$,
                  'the DLQ row: synthetic group, txn, payload, error, attempts, the timer''s identity, its queue and partition');
SELECT is((SELECT count(*) FROM queen.messages), 0::bigint, 'no frame entered the log');

-- replay
SELECT throws_ok($$SELECT queen.replay_dlq_entry('acme', (SELECT id FROM queen.dead_letter_queue WHERE consumer_group = '__QUEEN_TIMERS__'))$$,
                 'QTRPL', 'dlq_replay_refused', 'replaying a timer''s dead letter is refused');
SELECT is((SELECT count(*) FROM queen.dead_letter_queue), 1::bigint, 'the refused replay kept the DLQ row');
SELECT throws_ok($$SELECT queen.replay_dlq_entry('acme', gen_random_uuid())$$, 'QTNFD', 'not_found', 'an unknown DLQ id');
INSERT INTO queen.dead_letter_queue (message_id, partition_id, consumer_group, transaction_id, payload, error_message, retry_count)
SELECT gen_random_uuid(), partition_id, 'workers', 'order-7', '\x6f37', 'consumer gave up', 3 FROM queen.dead_letter_queue;
CREATE TEMP TABLE replayed AS
SELECT queen.replay_dlq_entry('acme', (SELECT id FROM queen.dead_letter_queue WHERE consumer_group = 'workers')) AS id,
       (SELECT id FROM queen.dead_letter_queue WHERE consumer_group = 'workers') AS dlq_id;
SELECT isnt((SELECT id FROM replayed), NULL, 'an ordinary dead letter replays, answering the new message id');
SELECT results_eq($$SELECT m.transaction_id, m.payload, p.name FROM queen.messages m JOIN queen.partitions p ON p.id = m.partition_id
                     WHERE m.id = (SELECT id FROM replayed)$$,
                  $$SELECT 'order-7#replay-' || dlq_id, '\x6f37'::bytea, 'p1' FROM replayed$$,
                  'the replayed frame is in the partition with a derived transaction id');
SELECT is((SELECT count(*) FROM queen.dead_letter_queue WHERE consumer_group = 'workers'), 0::bigint, 'the replayed DLQ row is gone');

-- a replayed frame's transaction id stays within the log's 255 bytes (an ack refuses a longer one)
CREATE FUNCTION pg_temp.replay_of(p_txn text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE v_dlq uuid; v_msg uuid;
BEGIN
    INSERT INTO queen.dead_letter_queue (message_id, partition_id, consumer_group, transaction_id, payload, error_message, retry_count)
    SELECT gen_random_uuid(), partition_id, 'workers', p_txn, '\x6f37', 'consumer gave up', 3
      FROM queen.dead_letter_queue LIMIT 1
    RETURNING id INTO v_dlq;
    v_msg := queen.replay_dlq_entry('acme', v_dlq);
    RETURN (SELECT transaction_id FROM queen.messages WHERE id = v_msg);
END $$;
SELECT is(octet_length(pg_temp.replay_of(repeat('t', 255))), 255, 'an id of 255 bytes replays within 255 bytes');
SELECT matches(pg_temp.replay_of(repeat('t', 255)), '^t{211}#replay-[0-9a-f-]{36}$', '... cut to 211 bytes and the suffix');
SELECT ok(pg_temp.replay_of(repeat('é', 127)) ~ '^é{105}#replay-[0-9a-f-]{36}$',
          'a multibyte id is cut on a character boundary (105 x 2 bytes, not 211)');
SELECT matches(pg_temp.replay_of(pg_temp.replay_of(pg_temp.replay_of('order-8'))), '^order-8#replay-[0-9a-f-]{36}$',
               'a replay of a replay replaces the earlier suffix instead of adding one');
SELECT is((SELECT count(*) FROM queen.messages WHERE octet_length(transaction_id) > 255), 0::bigint,
          'no frame in the log has a transaction id past 255 bytes');

-- a DLQ with max attempts 1: the first permanent failure dead-letters (a zstd timer this time)
SELECT lives_ok($$SELECT * FROM queen.schedule_timers('acme', ARRAY[ROW('schedule', 'dq', 'k', 0, 'txn-k2', '\x00', NULL, true, NULL, NULL)::queen.timer_op],
                                                      p_now => pg_temp.at(40))$$, 'setup: k again, zstd');
SELECT is(queen.fail_timer('acme', 'dq', 'k', pg_temp.claim(pg_temp.at(40)), 'permanent', 'nope', 1, p_now => pg_temp.at(40)), 'dead_lettered',
          'p_max_attempts 1: the first spent attempt dead-letters');
SELECT results_eq($$SELECT transaction_id, payload_zstd FROM queen.list_dlq('acme', 'dq', '__QUEEN_TIMERS__') ORDER BY transaction_id$$,
                  $$VALUES ('txn-k', false), ('txn-k2', true)$$,
                  'a dead-lettered zstd payload is flagged as such (its bytes are stored compressed)');
SELECT is((SELECT payload FROM queen.dead_letter_queue WHERE transaction_id = 'txn-k2'), '\x00'::bytea, 'the payload is dead-lettered as stored');

SELECT * FROM finish();
ROLLBACK;
