-- cancel_timer, the DELETE route's function: every verdict and the
-- pending counter on each path (the common path is one DELETE and one
-- UPDATE of the counter; absent / too_late / bad input take the locking
-- look-up). Metering: a cancel bills nothing. Tenants cx-* only.
BEGIN;
SELECT plan(37);

CREATE FUNCTION pg_temp.t0() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2030-01-01 00:00:00+00'::timestamptz $$;
CREATE FUNCTION pg_temp.at(p_seconds numeric) RETURNS timestamptz LANGUAGE sql AS $$
    SELECT pg_temp.t0() + p_seconds * interval '1 second' $$;
-- schedule one timer for p_tenant, due p_delay_ms after T0
CREATE FUNCTION pg_temp.schedule(p_tenant text, p_key text, p_delay_ms bigint DEFAULT 60000) RETURNS text LANGUAGE sql AS $$
    SELECT status FROM queen.schedule_timers(p_tenant, ARRAY[queen.make_timer_op('schedule', 'cq', p_key,
               p_delay_ms => p_delay_ms, p_txn => 'txn-' || p_key, p_payload => '\x6869'::bytea)], p_now => pg_temp.t0()) $$;
CREATE FUNCTION pg_temp.pending(p_tenant text) RETURNS bigint LANGUAGE sql AS $$
    SELECT queen.get_pending_timers(p_tenant) $$;
CREATE FUNCTION pg_temp.billed(p_tenant text) RETURNS bigint LANGUAGE sql AS $$
    SELECT coalesce((SELECT billed_messages FROM queen.tenant_usage WHERE tenant = p_tenant), 0) $$;
CREATE FUNCTION pg_temp.has(p_tenant text, p_key text) RETURNS boolean LANGUAGE sql AS $$
    SELECT EXISTS (SELECT 1 FROM queen.timers WHERE tenant = p_tenant AND queue = 'cq' AND timer_key = p_key) $$;

SELECT is(pg_temp.schedule('cx-a', 'a1'), 'scheduled', 'setup: cx-a a1');
SELECT is(pg_temp.schedule('cx-a', 'a2'), 'scheduled', 'setup: cx-a a2');
SELECT is(pg_temp.schedule('cx-a', 'a3'), 'scheduled', 'setup: cx-a a3');
SELECT is(pg_temp.schedule('cx-b', 'b1'), 'scheduled', 'setup: cx-b b1');

-- ---------------------------------------------------------------- cancelled: the row goes, the counter -1, nothing billed
SELECT is(queen.cancel_timer('cx-a', 'cq', 'a1', pg_temp.t0()), 'cancelled', 'an unclaimed timer: cancelled');
SELECT is(pg_temp.has('cx-a', 'a1'), false, 'its row is gone');
SELECT is(pg_temp.pending('cx-a'), 2::bigint, 'pending counter 3 -> 2');
SELECT is(pg_temp.billed('cx-a'), 3::bigint, 'metering: the cancel billed nothing (3 schedules)');
SELECT is(queen.cancel_timer('cx-a', 'cq', 'a1', pg_temp.t0()), 'absent', 'the same key again: absent');
SELECT is(pg_temp.pending('cx-a'), 2::bigint, 'absent leaves the counter alone');

-- ---------------------------------------------------------------- another tenant's key: absent, nothing changes
SELECT is(queen.cancel_timer('cx-b', 'cq', 'a2', pg_temp.t0()), 'absent', 'another tenant''s key answers absent');
SELECT is(pg_temp.has('cx-a', 'a2'), true, 'and the row is still there');
SELECT is(pg_temp.pending('cx-a'), 2::bigint, 'the owner''s counter is unchanged');
SELECT is(pg_temp.pending('cx-b'), 1::bigint, 'the caller''s counter is unchanged');
SELECT is(queen.cancel_timer('cx-a', 'other-q', 'a2', pg_temp.t0()), 'absent', 'the same key in another queue: absent');

-- ---------------------------------------------------------------- claimed: too_late, nothing changes; an expired lease is a dead claim
SELECT is(pg_temp.schedule('cx-c', 'c1', 0), 'scheduled', 'setup: cx-c c1, due at T0');
SELECT is((SELECT count(*) FROM queen.claim_timers('cx-broker', 10, 5000, pg_temp.t0()) WHERE tenant = 'cx-c'), 1::bigint,
          'setup: c1 claimed at T0 with a 5 s lease');
SELECT is(queen.cancel_timer('cx-c', 'cq', 'c1', pg_temp.at(1)), 'too_late', 'a claimed timer: too_late');
SELECT is(pg_temp.has('cx-c', 'c1'), true, 'the claimed row stays');
SELECT is(pg_temp.pending('cx-c'), 1::bigint, 'too_late leaves the counter alone');
SELECT is(queen.cancel_timer('cx-c', 'cq', 'c1', pg_temp.at(6)), 'cancelled', 'after the lease ran out: cancelled');
SELECT is(pg_temp.pending('cx-c'), 0::bigint, 'pending counter 1 -> 0');

-- ---------------------------------------------------------------- backoff: a failed fire dropped the claim; cancellable
SELECT is(pg_temp.schedule('cx-d', 'd1', 0), 'scheduled', 'setup: cx-d d1, due at T0');
SELECT is(queen.fail_timer('cx-d', 'cq', 'd1',
                           (SELECT claim_id FROM queen.claim_timers('cx-broker', 10, 5000, pg_temp.t0()) WHERE tenant = 'cx-d'),
                           'transient', 'broker says no', 5, 1000, 5000, pg_temp.t0()),
          'backoff', 'setup: d1 claimed, failed, in backoff');
SELECT is(pg_temp.pending('cx-d'), 1::bigint, 'a timer in backoff is still pending');
SELECT is(queen.cancel_timer('cx-d', 'cq', 'd1', pg_temp.at(0.5)), 'cancelled', 'a timer in backoff: cancelled');
SELECT is(pg_temp.has('cx-d', 'd1'), false, 'its row is gone');
SELECT is(pg_temp.pending('cx-d'), 0::bigint, 'pending counter of the backoff row 1 -> 0');

-- ---------------------------------------------------------------- the counter row: never created by a cancel, never below 0
INSERT INTO queen.timers (tenant, queue, timer_key, deliver_at, txn, message_id, payload)
VALUES ('cx-e', 'cq', 'e1', pg_temp.at(60), 'txn-e1', gen_random_uuid(), '\x00');
SELECT is(queen.cancel_timer('cx-e', 'cq', 'e1', pg_temp.t0()), 'cancelled', 'a row whose tenant has no counter row: cancelled');
SELECT is((SELECT count(*) FROM queen.tenant_usage WHERE tenant = 'cx-e'), 0::bigint, 'and no counter row was created');
SELECT queen.fold_pending_deltas();  -- the earlier cancels' deltas into the row, then zero it
UPDATE queen.tenant_usage SET pending_timers = 0 WHERE tenant = 'cx-b';
SELECT is(queen.cancel_timer('cx-b', 'cq', 'b1', pg_temp.t0()), 'cancelled', 'a row counted as 0 pending: cancelled');
SELECT is(pg_temp.pending('cx-b'), 0::bigint, 'the counter stays at 0');

-- ---------------------------------------------------------------- bad input: QTBAD, nothing changes
SELECT throws_ok($$SELECT queen.cancel_timer('cx-a', '', 'a2')$$, 'QTBAD', 'timers_bad_request', 'an empty queue');
SELECT throws_ok($$SELECT queen.cancel_timer('cx-a', 'cq', '')$$, 'QTBAD', 'timers_bad_request', 'an empty timerKey');
SELECT throws_ok($$SELECT queen.cancel_timer('cx-a', 'cq', NULL)$$, 'QTBAD', 'timers_bad_request', 'a NULL timerKey');
SELECT results_eq($$SELECT timer_key COLLATE "default" FROM queen.timers WHERE tenant = 'cx-a' ORDER BY 1$$,
                  ARRAY['a2', 'a3'], 'after all of it cx-a holds a2 and a3');
SELECT is(pg_temp.pending('cx-a'), 2::bigint, 'and its counter says 2');
SELECT * FROM finish();
ROLLBACK;
