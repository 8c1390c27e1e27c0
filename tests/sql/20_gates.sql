-- The refusals of schedule_timers: shape (QTBAD) and every rung of the
-- gate ladder, in order, each with its SQLSTATE; a refused batch writes nothing.
BEGIN;
SELECT plan(60);

CREATE FUNCTION pg_temp.t0() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2030-01-01 00:00:00+00'::timestamptz $$;
CREATE FUNCTION pg_temp.op(p_op text, p_queue text, p_key text, p_delay bigint DEFAULT 1000,
                           p_payload bytea DEFAULT '\x6869', p_zstd boolean DEFAULT NULL, p_raw integer DEFAULT NULL)
RETURNS queen.timer_op LANGUAGE sql AS $$
    SELECT ROW(p_op, p_queue, p_key, p_delay, 'txn-' || p_key, p_payload, NULL, p_zstd, NULL, p_raw)::queen.timer_op
$$;
-- tenancy and horizon are the broker's environment, passed as arguments
CREATE FUNCTION pg_temp.sched(p_ops queen.timer_op[], p_tenant text DEFAULT 'acme', p_tenancy boolean DEFAULT NULL,
                              p_horizon bigint DEFAULT NULL, p_at timestamptz DEFAULT NULL)
RETURNS SETOF queen.timer_verdict LANGUAGE sql AS $$
    SELECT * FROM queen.schedule_timers(p_tenant, p_ops, p_horizon_ms => p_horizon, p_tenancy => p_tenancy,
                                        p_now => coalesce(p_at, pg_temp.t0()))
$$;
-- the HINT or the DETAIL (p_field) of the error a statement raises
CREATE FUNCTION pg_temp.error_of(p_sql text, p_field text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE v_hint text; v_detail text;
BEGIN
    EXECUTE p_sql;
    RETURN 'no error';
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS v_hint = PG_EXCEPTION_HINT, v_detail = PG_EXCEPTION_DETAIL;
    RETURN CASE p_field WHEN 'hint' THEN v_hint WHEN 'detail' THEN v_detail END;
END $$;

-- ---------------------------------------------------------------- shape: QTBAD
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('delete', 'q', 'k')])$$, 'QTBAD', 'timers_bad_request', 'unknown op');
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op(NULL, 'q', 'k')])$$, 'QTBAD', 'timers_bad_request', 'missing op');
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', NULL, 'k')])$$, 'QTBAD', 'timers_bad_request', 'no queue');
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', '', 'k')])$$, 'QTBAD', 'timers_bad_request', 'empty queue');
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', NULL)])$$, 'QTBAD', 'timers_bad_request', 'no timerKey');
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('cancel', 'q', '')])$$, 'QTBAD', 'timers_bad_request', 'empty timerKey (cancel too)');
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'k', NULL)])$$, 'QTBAD', 'timers_bad_request', 'no delayMs');
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[ROW('schedule', 'q', 'k', 1, NULL, '\x00', NULL, NULL, NULL, NULL)::queen.timer_op])$$,
                 'QTBAD', 'timers_bad_request', 'schedule without txn');
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'k', 1, NULL)])$$, 'QTBAD', 'timers_bad_request', 'no payload');
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[ROW('schedule', 'q', 'k', 1, 't', '\x00', '', NULL, NULL, NULL)::queen.timer_op])$$,
                 'QTBAD', 'timers_bad_request', 'empty partition');
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'k'), pg_temp.op('cancel', 'q', 'k')])$$,
                 'QTBAD', 'timers_bad_request', 'a duplicated (queue, timerKey)');
SELECT lives_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q1', 'same'), pg_temp.op('schedule', 'q2', 'same')])$$,
                'the same key on two queues is no duplicate');
UPDATE queen.cell_settings SET max_ops = 2;
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'a'), pg_temp.op('schedule', 'q', 'b'), pg_temp.op('schedule', 'q', 'c')])$$,
                 'QTBAD', 'timers_bad_request', 'more operations than the cell''s max_ops');
UPDATE queen.cell_settings SET max_ops = 256;
SELECT throws_ok($$SELECT * FROM queen.schedule_timers('acme', ARRAY[pg_temp.op('schedule', 'q', 'a'), pg_temp.op('schedule', 'q', 'b')], p_max_ops => 1)$$,
                 'QTBAD', 'timers_bad_request', 'more operations than the broker''s p_max_ops');
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'k')], '')$$, 'QTBAD', 'timers_bad_request', 'no tenant');

-- ---------------------------------------------------------------- 1. paused: QTOFF
SELECT is(queen.pause_scheduling(), true, 'pause_scheduling answers the new state');
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'k')])$$, 'QTOFF', 'timers_disabled', 'paused scheduling refuses a batch');
SELECT is(pg_temp.error_of($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('cancel', 'q1', 'same')])$$, 'hint'), 'retry_after_seconds=30',
          'even a cancel-only batch; QTOFF carries a retry hint');
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'k')], 'nobody', true)$$, 'QTOFF', 'timers_disabled',
                 'the pause is the first rung (before feature_gated)');
SELECT throws_ok($$SELECT * FROM pg_temp.sched('{}')$$, 'QTOFF', 'timers_disabled', 'an empty batch passes the ladder too (migration 035)');
SELECT throws_ok($$SELECT * FROM queen.schedule_timers('acme', NULL)$$, 'QTOFF', 'timers_disabled', 'and so does no batch at all');
SELECT is(queen.cancel_timer('acme', 'q1', 'same', pg_temp.t0()), 'cancelled', 'cancel_timer (the DELETE route) passes a paused schedule');
SELECT is(queen.resume_scheduling(), true, 'resume_scheduling');
SELECT lives_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'after-resume')])$$, 'scheduling works again');

-- ---------------------------------------------------------------- 2. plan grant: QTGAT
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'k')], 'nobody', true)$$, 'QTGAT', 'feature_gated',
                 'tenancy on and no quota row');
INSERT INTO queen.plans (plan, timers_enabled) VALUES ('free', false);
INSERT INTO queen.plans (plan, max_pending_timers, max_payload_bytes, horizon_ms, rate_ops_per_second, rate_burst)
     VALUES ('pro', 3, 10, 60000, 2, 2);
INSERT INTO queen.tenants (tenant, plan) VALUES ('freeloader', 'free'), ('initech', 'pro');
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'k')], 'freeloader', true)$$, 'QTGAT', 'feature_gated',
                 'a plan without timers');
SELECT throws_ok($$SELECT * FROM pg_temp.sched('{}', 'nobody', true)$$, 'QTGAT', 'feature_gated',
                 'an empty batch of a tenant without a quota row under tenancy');
SELECT is_empty($$SELECT * FROM pg_temp.sched('{}', 'initech', true)$$, 'an empty batch that passes every rung returns no verdict');

-- ---------------------------------------------------------------- 3. produce block: QTBLK
UPDATE queen.tenants SET produce_blocked = true WHERE tenant = 'initech';
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'k')], 'initech', true)$$, 'QTBLK', 'produce_blocked',
                 'a tenant produce block');
SELECT throws_ok($$SELECT * FROM pg_temp.sched('{}', 'initech', true)$$, 'QTBLK', 'produce_blocked', 'an empty batch under a produce block');
UPDATE queen.tenants SET produce_blocked = false WHERE tenant = 'initech';
UPDATE queen.cell_settings SET produce_blocked = true;
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('cancel', 'q', 'after-resume')])$$, 'QTBLK', 'produce_blocked',
                 'a cell produce block refuses a POST batch, cancels included');
SELECT is(queen.cancel_timer('acme', 'q', 'after-resume', pg_temp.t0()), 'cancelled', 'cancel_timer passes a produce block');
UPDATE queen.cell_settings SET produce_blocked = false;

-- ---------------------------------------------------------------- 4. rate: QTRAT (pro: 2 ops/s, burst 2)
SELECT lives_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'r1'), pg_temp.op('cancel', 'q', 'r0')], 'initech', true)$$,
                'two operations use the burst');
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('cancel', 'q', 'r0')], 'initech', true)$$, 'QTRAT', 'rate_limited',
                 'the third operation in the same second is rate limited');
SELECT is(pg_temp.error_of($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('cancel', 'q', 'r0')], 'initech', true)$$, 'hint'),
          'retry_after_seconds=1', 'QTRAT carries HINT retry_after_seconds');
SELECT lives_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('cancel', 'q', 'r0'), pg_temp.op('cancel', 'q', 'r00')], 'initech', true, NULL, pg_temp.t0() + interval '1 second')$$,
                'a second later the bucket has refilled');
SELECT lives_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('cancel', 'q', 'a'), pg_temp.op('cancel', 'q', 'b'), pg_temp.op('cancel', 'q', 'c')], 'initech', true, NULL, pg_temp.t0() + interval '10 seconds')$$,
                'a batch larger than the burst passes on a full bucket');
SELECT is(pg_temp.error_of($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('cancel', 'q', 'a')], 'initech', true, NULL, pg_temp.t0() + interval '10 seconds')$$, 'hint'),
          'retry_after_seconds=1', '... and leaves it in debt');
SELECT is(pg_temp.error_of($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('cancel', 'q', 'a')], 'initech', true, NULL, pg_temp.t0() + interval '10 seconds')$$, 'detail'),
          'tenant initech asked for 1 operations; 0 available at 2 per second', '... which has 0 available (not -1)');
UPDATE queen.plans SET rate_ops_per_second = NULL WHERE plan = 'pro';

-- ---------------------------------------------------------------- 5. quota: QTQUO (pro: 3 pending)
SELECT lives_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'r2'), pg_temp.op('schedule', 'q', 'r3')], 'initech', true)$$,
                'up to the quota');
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'r4')], 'initech', true)$$, 'QTQUO', 'timers_quota_exceeded',
                 'one more pending timer than the quota');
SELECT is((SELECT status FROM pg_temp.sched(ARRAY[pg_temp.op('reschedule', 'q', 'r3')], 'initech', true)), 'rescheduled',
          'a reschedule of an existing timer needs no quota');
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'r4', 3600000000)], 'initech', true)$$, 'QTQUO', 'timers_quota_exceeded',
                 'the quota rung comes before the horizon rung');
SELECT is(queen.cancel_timer('initech', 'q', 'r1', pg_temp.t0()), 'cancelled', 'a cancel frees one');
SELECT is((SELECT status FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'r4')], 'initech', true)), 'scheduled', 'and it can be used again');
SELECT results_eq($$SELECT status FROM pg_temp.sched(ARRAY[pg_temp.op('cancel', 'q', 'r2'), pg_temp.op('schedule', 'q', 'r5')], 'initech', true) ORDER BY ordinal$$,
                  $$VALUES ('cancelled'), ('scheduled')$$, 'at the quota, a batch may swap one timer for another');
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('cancel', 'q', 'r3'), pg_temp.op('schedule', 'q', 'r6'), pg_temp.op('schedule', 'q', 'r7')], 'initech', true)$$,
                 'QTQUO', 'timers_quota_exceeded', '... but not grow past it');
UPDATE queen.plans SET max_pending_timers = NULL WHERE plan = 'pro';

-- ---------------------------------------------------------------- 6. horizon: QTHOR
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'h', 60001)], 'acme', NULL, 60000)$$, 'QTHOR', 'timer_horizon_exceeded',
                 'delayMs beyond the broker''s horizon');
SELECT lives_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'h', 60000)], 'acme', NULL, 60000)$$, 'delayMs at the horizon');
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'h', 7776000001)])$$, 'QTHOR', 'timer_horizon_exceeded',
                 'the cell''s default horizon is 90 days');
UPDATE queen.tenants SET horizon_ms = 10000 WHERE tenant = 'initech';
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'h', 20000)], 'initech', true, 3600000)$$, 'QTHOR', 'timer_horizon_exceeded',
                 'a tenant horizon narrows the cell''s');
UPDATE queen.tenants SET horizon_ms = 99999999999 WHERE tenant = 'initech';
UPDATE queen.plans SET horizon_ms = NULL WHERE plan = 'pro';
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'h', 3600001)], 'initech', true, 3600000)$$, 'QTHOR', 'timer_horizon_exceeded',
                 'and never widens it');

-- ---------------------------------------------------------------- 7. payload: QTBIG (pro: 10 bytes)
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'big', 1, '\x0102030405060708090a0b')], 'initech', true)$$,
                 'QTBIG', 'payload_too_large', 'payload over the plan''s max');
SELECT lives_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'big', 1, '\x0102030405060708090a')], 'initech', true)$$,
                'payload at the plan''s max');
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'z', 1, '\x0102', true, 11)], 'initech', true)$$,
                 'QTBIG', 'payload_too_large', 'a zstd payload whose decompressed size (raw_size) is over the ceiling');
UPDATE queen.plans SET max_payload_bytes = 5000000 WHERE plan = 'pro';
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'z', 1, '\x0102', true, 1048577)], 'initech', true)$$,
                 'QTBIG', 'payload_too_large', 'the ceiling is min(1 MiB, plan max)');
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'big', 1, convert_to(repeat('x', 1048577), 'UTF8'))])$$,
                 'QTBIG', 'payload_too_large', '1 MiB + 1 with tenancy off');

-- ---------------------------------------------------------------- a refused batch writes nothing
CREATE TEMP TABLE before_usage AS SELECT * FROM queen.tenant_usage;
CREATE TEMP TABLE before_timers AS SELECT * FROM queen.timers;
SELECT throws_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'q', 'good'), pg_temp.op('cancel', 'q', 'big'),
                                                     pg_temp.op('schedule', 'q', 'bad', 999999999999)], 'initech', true)$$,
                 'QTHOR', 'timer_horizon_exceeded', 'one bad operation refuses the whole batch');
SELECT set_eq('SELECT tenant, queue, timer_key, message_id FROM queen.timers',
              'SELECT tenant, queue, timer_key, message_id FROM before_timers', 'a refused batch wrote no row and cancelled nothing');
SELECT set_eq('SELECT tenant, pending_timers, billed_messages FROM queen.tenant_usage',
              'SELECT tenant, pending_timers, billed_messages FROM before_usage', 'a refused batch metered nothing');

SELECT * FROM finish();
ROLLBACK;
