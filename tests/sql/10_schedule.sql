-- schedule_timers / cancel_timer: every verdict, the upsert's resets,
-- deliver_at from PostgreSQL's clock, metering and the pending counter.
BEGIN;
SELECT plan(65);

-- Helpers (pg_temp, gone with the transaction). The clock is pinned at T0.
CREATE FUNCTION pg_temp.t0() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2030-01-01 00:00:00+00'::timestamptz $$;
CREATE FUNCTION pg_temp.op(p_op text, p_queue text, p_key text, p_delay bigint DEFAULT 1000,
                           p_txn text DEFAULT NULL, p_payload bytea DEFAULT '\x6869')
RETURNS queen.timer_op LANGUAGE sql AS $$
    SELECT ROW(p_op, p_queue, p_key, p_delay,
               CASE WHEN p_op = 'schedule' THEN coalesce(p_txn, 'txn-' || p_key) ELSE p_txn END,
               CASE WHEN p_op = 'cancel' THEN NULL ELSE p_payload END,
               NULL, NULL, NULL, NULL)::queen.timer_op
$$;
CREATE FUNCTION pg_temp.sched(p_ops queen.timer_op[], p_tenant text DEFAULT 'acme', p_at timestamptz DEFAULT NULL)
RETURNS SETOF queen.timer_verdict LANGUAGE sql AS $$
    SELECT * FROM queen.schedule_timers(p_tenant, p_ops, p_producer_sub => 'svc-a', p_now => coalesce(p_at, pg_temp.t0()))
$$;
CREATE FUNCTION pg_temp.billed(p_tenant text DEFAULT 'acme') RETURNS bigint LANGUAGE sql AS $$
    SELECT coalesce((SELECT billed_messages FROM queen.tenant_usage WHERE tenant = p_tenant), 0) $$;
CREATE FUNCTION pg_temp.pending(p_tenant text DEFAULT 'acme') RETURNS bigint LANGUAGE sql AS $$
    SELECT queen.get_pending_timers(p_tenant) $$;

-- ---------------------------------------------------------------- scheduled
CREATE TEMP TABLE v1 AS SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'reminders', 'trial:acme:day7', 604800000, 'trial-acme-day7-v1')]);
SELECT is((SELECT status FROM v1), 'scheduled', 'a new key answers scheduled');
SELECT is((SELECT ok FROM v1), true, 'scheduled is ok');
SELECT is((SELECT txn FROM v1), 'trial-acme-day7-v1', 'the verdict carries the txn supplied');
SELECT is((SELECT deliver_at FROM v1), pg_temp.t0() + interval '7 days', 'deliver_at = now() + delayMs');
SELECT is((SELECT message_id FROM v1), (SELECT message_id FROM queen.timers WHERE timer_key = 'trial:acme:day7'),
          'the verdict returns the message id minted at schedule');
SELECT results_eq($$SELECT tenant, queue, partition, deliver_at, txn, payload, producer_sub, attempts, created_at
                      FROM queen.timers WHERE timer_key = 'trial:acme:day7'$$,
                  $$VALUES ('acme', 'reminders', 'Default', pg_temp.t0() + interval '7 days', 'trial-acme-day7-v1',
                            '\x6869'::bytea, 'svc-a', 0, pg_temp.t0())$$,
                  'the row is stored as sent, partition Default, producerSub from the caller');
SELECT is(pg_temp.pending(), 1::bigint, 'pending counter: 1 after one schedule');
SELECT is(pg_temp.billed(), 1::bigint, 'metering: a schedule bills one message');

-- ---------------------------------------------------------------- input order
CREATE TEMP TABLE v2 AS SELECT * FROM pg_temp.sched(ARRAY[
    pg_temp.op('schedule', 'q2', 'zeta'), pg_temp.op('schedule', 'q1', 'alpha'),
    pg_temp.op('cancel', 'q1', 'nothing-here', p_txn => 'echo-me'), pg_temp.op('schedule', 'q1', 'mid')]);
SELECT results_eq('SELECT ordinal, op, status, queue, timer_key, ok FROM v2',
                  $$VALUES (1, 'schedule', 'scheduled', 'q2', 'zeta', true), (2, 'schedule', 'scheduled', 'q1', 'alpha', true),
                           (3, 'cancel', 'absent', 'q1', 'nothing-here', false), (4, 'schedule', 'scheduled', 'q1', 'mid', true)$$,
                  'one verdict per operation, in input order (rows are touched in key order)');
SELECT is((SELECT txn FROM v2 WHERE ordinal = 3), 'echo-me', 'absent echoes the txn supplied');
SELECT is(pg_temp.billed(), 4::bigint, 'metering: three more schedules, the absent cancel bills nothing');
SELECT is(pg_temp.pending(), 4::bigint, 'pending counter: 4');

-- ---------------------------------------------------------------- negative delay
CREATE TEMP TABLE v3 AS SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q1', 'past', -5000)]);
SELECT is((SELECT deliver_at FROM v3), pg_temp.t0() - interval '5 seconds', 'a negative delayMs is legal: deliver_at in the past');
SELECT ok((SELECT deliver_at <= pg_temp.t0() FROM queen.timers WHERE timer_key = 'past'), 'a negative delay is due at once');
SELECT is((SELECT deliver_at FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q1', 'far-past', -9000000000000000)])),
          pg_temp.t0() - interval '90 days', 'an absurd negative delay is clamped to the horizon instead of overflowing');

-- ---------------------------------------------------------------- rescheduled
UPDATE queen.timers SET attempts = 3, failures = 4, last_error = 'boom', last_error_class = 'permanent'
 WHERE timer_key = 'alpha';
CREATE TEMP TABLE old_alpha AS SELECT * FROM queen.timers WHERE timer_key = 'alpha';
CREATE TEMP TABLE v4 AS SELECT * FROM pg_temp.sched(
    ARRAY[ROW('reschedule', 'q1', 'alpha', 30000, NULL, '\x6e6577'::bytea, 'p7', NULL, NULL, NULL)::queen.timer_op],
    p_at => pg_temp.t0() + interval '1 minute');
SELECT is((SELECT status FROM v4), 'rescheduled', 'reschedule of an existing key answers rescheduled');
SELECT is((SELECT ok FROM v4), true, 'rescheduled is ok');
SELECT isnt((SELECT message_id FROM v4), (SELECT message_id FROM old_alpha), 'a reschedule mints a new message id');
SELECT ok((SELECT txn IS NOT NULL AND txn <> (SELECT txn FROM old_alpha) FROM v4), 'a reschedule without txn gets a fresh txn');
SELECT results_eq($$SELECT attempts, failures, last_error, last_error_class, payload, partition, deliver_at, txn, message_id
                      FROM queen.timers WHERE timer_key = 'alpha'$$,
                  $$SELECT 0, 0, NULL::text, NULL::text, '\x6e6577'::bytea, 'p7', pg_temp.t0() + interval '90 seconds', txn, message_id FROM v4$$,
                  'reschedule resets attempts, clears last_error, replaces payload, partition and deliver_at');
SELECT is((SELECT created_at FROM queen.timers WHERE timer_key = 'alpha'), pg_temp.t0(), 'created_at is kept');
SELECT is((SELECT updated_at FROM queen.timers WHERE timer_key = 'alpha'), pg_temp.t0() + interval '1 minute', 'updated_at moves');
SELECT is((SELECT status FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q1', 'alpha', 1000, 'alpha-v3')])),
          'rescheduled', 'schedule of an existing key is the same upsert: rescheduled');
SELECT is((SELECT status FROM pg_temp.sched(ARRAY[pg_temp.op('reschedule', 'q1', 'brand-new')])),
          'scheduled', 'reschedule of a missing key is the same upsert: scheduled');
SELECT is(pg_temp.billed(), 9::bigint, 'metering: every schedule and reschedule bills one (9 so far)');
SELECT is(pg_temp.pending(), 7::bigint, 'pending counter: reschedules of existing rows add nothing (7)');

-- ---------------------------------------------------------------- cancelled / absent
CREATE TEMP TABLE v5 AS SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('cancel', 'q2', 'zeta')]);
SELECT is((SELECT status FROM v5), 'cancelled', 'cancel of an unclaimed timer answers cancelled');
SELECT is((SELECT ok FROM v5), true, 'cancelled is ok');
SELECT is((SELECT count(*) FROM queen.timers WHERE timer_key = 'zeta'), 0::bigint, 'the cancelled row is gone');
SELECT is(pg_temp.billed(), 9::bigint, 'metering: cancel bills nothing');
SELECT is(pg_temp.pending(), 6::bigint, 'pending counter: cancel in a batch -1 (6)');
SELECT is(queen.cancel_timer('acme', 'q1', 'mid', pg_temp.t0()), 'cancelled', 'cancel_timer: cancelled');
SELECT is(pg_temp.pending(), 5::bigint, 'pending counter: cancel_timer -1 (5)');
SELECT is(queen.cancel_timer('acme', 'q1', 'mid', pg_temp.t0()), 'absent', 'cancel_timer again: absent');
SELECT is(pg_temp.pending(), 5::bigint, 'pending counter: absent changes nothing');

SELECT is(queen.cancel_timer('globex', 'reminders', 'trial:acme:day7', pg_temp.t0()), 'absent',
          'cancel of another tenant''s key answers absent');
SELECT is((SELECT status FROM pg_temp.sched(ARRAY[pg_temp.op('cancel', 'reminders', 'trial:acme:day7')], 'globex')),
          'absent', 'cancel in a batch of another tenant''s key answers absent');
SELECT is((SELECT count(*) FROM queen.timers WHERE timer_key = 'trial:acme:day7' AND tenant = 'acme'), 1::bigint,
          'another tenant''s cancel left the row alone');
SELECT is((SELECT status FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'reminders', 'trial:acme:day7')], 'globex')),
          'scheduled', 'the same key under another tenant is another timer');
SELECT is((SELECT count(*) FROM queen.timers WHERE timer_key = 'trial:acme:day7'), 2::bigint, 'two tenants, two rows');

-- ---------------------------------------------------------------- too_late
-- 'past' is due at T0; a broker claims it.
SELECT is((SELECT count(*) FROM queen.claim_timers('broker-1', 10, 30000, pg_temp.t0()) WHERE timer_key IN ('past', 'far-past')),
          2::bigint, 'the due timers are claimed');
CREATE TEMP TABLE claimed_past AS SELECT * FROM queen.timers WHERE timer_key = 'past';
SELECT is(queen.cancel_timer('acme', 'q1', 'past', pg_temp.t0() + interval '1 second'), 'too_late',
          'cancel of a claimed timer answers too_late');
CREATE TEMP TABLE v6 AS SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('cancel', 'q1', 'past')], p_at => pg_temp.t0() + interval '1 second');
SELECT is((SELECT status FROM v6), 'too_late', 'cancel in a batch of a claimed timer answers too_late');
SELECT is((SELECT ok FROM v6), false, 'too_late is not ok');
CREATE TEMP TABLE v7 AS SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('reschedule', 'q1', 'past', 1000, 'replaced')],
                                                    p_at => pg_temp.t0() + interval '1 second');
SELECT is((SELECT status FROM v7), 'too_late', 'reschedule of a claimed timer answers too_late');
SELECT is((SELECT ok FROM v7), false, 'too_late reschedule is not ok');
SELECT is((SELECT message_id FROM v7), NULL, 'a too_late verdict mints nothing');
SELECT results_eq('SELECT txn, message_id, payload, claim_id, deliver_at FROM queen.timers WHERE timer_key = ''past''',
                  'SELECT txn, message_id, payload, claim_id, deliver_at FROM claimed_past',
                  'too_late changed nothing: the claim and the old payload stand');
SELECT is(pg_temp.billed(), 9::bigint, 'metering: too_late bills nothing');
SELECT is(pg_temp.pending(), 5::bigint, 'pending counter: too_late changes nothing');

-- ---------------------------------------------------------------- fire counts zero
SELECT is((SELECT outcome FROM queen.fire_timers((SELECT claim_id FROM claimed_past),
                                                 ARRAY[ROW('acme', 'q1', 'past', NULL)::queen.fire_frame],
                                                 pg_temp.t0() + interval '2 seconds')),
          'fired', 'the claimed timer fires');
SELECT is(pg_temp.billed(), 9::bigint, 'metering: the fire bills nothing');
SELECT is(pg_temp.pending(), 4::bigint, 'pending counter: fire -1 (4)');
SELECT is(queen.cancel_timer('acme', 'q1', 'past', pg_temp.t0() + interval '3 seconds'), 'absent',
          'cancel after delivery answers absent (no tombstone)');

-- ---------------------------------------------------------------- empty batch
SELECT is((SELECT count(*) FROM pg_temp.sched('{}')), 0::bigint, 'an empty batch answers nothing');

-- ---------------------------------------------------------------- make_timer_op (psql convenience)
SELECT is(queen.make_timer_op('schedule', 'q', 'k', p_delay_ms => 5, p_txn => 't', p_payload => '\x01', p_partition => 'p'),
          ROW('schedule', 'q', 'k', 5, 't', '\x01'::bytea, 'p', NULL, NULL, NULL)::queen.timer_op,
          'make_timer_op builds a timer_op with named arguments');

-- ---------------------------------------------------------------- one statement for a batch without cancels
-- scheduled, rescheduled and too_late in one batch, input order not key order:
-- the set-based path must answer each op with its own verdict.
SELECT is((SELECT status FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q3', 'held', -1000)])), 'scheduled',
          'setup: a due timer in q3');
SELECT is((SELECT count(*) FROM queen.claim_timers('broker-2', 10, 30000, pg_temp.t0()) WHERE timer_key = 'held'),
          1::bigint, 'setup: a broker claims it');
CREATE TEMP TABLE before_v8 AS SELECT pg_temp.billed() AS billed, pg_temp.pending() AS pending;
CREATE TEMP TABLE v8 AS SELECT * FROM pg_temp.sched(ARRAY[
    pg_temp.op('schedule', 'q3', 'zz-new', 2000, 'txn-zz'), pg_temp.op('reschedule', 'q3', 'held', 1000, 'no'),
    pg_temp.op('schedule', 'q1', 'alpha', 3000, 'txn-alpha-2'), pg_temp.op('reschedule', 'q3', 'aa-new', 4000)],
    p_at => pg_temp.t0() + interval '1 second');
SELECT results_eq('SELECT ordinal, op, status, ok, queue, timer_key, message_id IS NOT NULL, deliver_at FROM v8 ORDER BY ordinal',
                  $$VALUES (1, 'schedule', 'scheduled', true, 'q3', 'zz-new', true, pg_temp.t0() + interval '3 seconds'),
                           (2, 'reschedule', 'too_late', false, 'q3', 'held', false, NULL::timestamptz),
                           (3, 'schedule', 'rescheduled', true, 'q1', 'alpha', true, pg_temp.t0() + interval '4 seconds'),
                           (4, 'reschedule', 'scheduled', true, 'q3', 'aa-new', true, pg_temp.t0() + interval '5 seconds')$$,
                  'a batch of upserts: one verdict per op, in input order, each with its own status and deliver_at');
SELECT results_eq($$SELECT v.txn, v.message_id FROM v8 v WHERE v.ok ORDER BY v.ordinal$$,
                  $$SELECT t.txn, t.message_id FROM v8 v JOIN queen.timers t
                      ON t.tenant = 'acme' AND t.queue = v.queue AND t.timer_key = v.timer_key
                     WHERE v.ok ORDER BY v.ordinal$$,
                  'each accepted verdict carries the txn and message id stored in its own row');
SELECT is((SELECT txn FROM v8 WHERE ordinal = 2), 'no', 'too_late echoes the txn supplied');
SELECT ok((SELECT txn FROM v8 WHERE ordinal = 4) ~ '^[0-9a-f-]{36}$', 'a reschedule without txn gets a minted one');
SELECT is((SELECT (pg_temp.billed() - billed, pg_temp.pending() - pending)::text FROM before_v8), '(3,2)',
          'metering: three accepted upserts billed, two new rows pending, the too_late one neither');
-- rows written by one statement share its command id (cmin); op by op, each has its own
SELECT is((SELECT count(DISTINCT cmin::text) FROM queen.timers
            WHERE tenant = 'acme' AND (queue, timer_key) IN (('q3', 'zz-new'), ('q1', 'alpha'), ('q3', 'aa-new'))),
          1::bigint, 'a batch without cancels is written by one statement');
CREATE TEMP TABLE v9 AS SELECT * FROM pg_temp.sched(ARRAY[
    pg_temp.op('schedule', 'q4', 'x1'), pg_temp.op('cancel', 'q4', 'nothing'), pg_temp.op('schedule', 'q4', 'x2')]);
SELECT is((SELECT count(DISTINCT cmin::text) FROM queen.timers WHERE tenant = 'acme' AND queue = 'q4'),
          2::bigint, 'a batch with a cancel goes op by op');

SELECT * FROM finish();
ROLLBACK;
