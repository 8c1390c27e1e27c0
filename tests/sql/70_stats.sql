-- get_timer_stats: per-queue aggregates of one tenant's timers (pending,
-- due, claimed, retrying, next deliver_at) and the histogram of what comes
-- due, a page of queues at a time; get_timer_totals: the same over every
-- queue; never another tenant's rows; read-only; QTBAD on bad bucket sizes.
BEGIN;
SELECT plan(28);

CREATE FUNCTION pg_temp.t0() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2030-01-01 00:00:00+00'::timestamptz $$;
CREATE FUNCTION pg_temp.at(p_seconds numeric) RETURNS timestamptz LANGUAGE sql AS $$ SELECT pg_temp.t0() + p_seconds * interval '1 second' $$;
CREATE FUNCTION pg_temp.op(p_queue text, p_key text, p_delay bigint)
RETURNS queen.timer_op LANGUAGE sql AS $$
    SELECT ROW('schedule', p_queue, p_key, p_delay, 'txn-' || p_key, '\x7b7d'::bytea, NULL, NULL, NULL, NULL)::queen.timer_op
$$;
-- the whole histogram as a text, trailing zeros cut: '{2,2}' for {2,2,0,0,...}
CREATE FUNCTION pg_temp.hist(p_counts bigint[]) RETURNS text LANGUAGE sql AS $$
    SELECT '{' || coalesce((SELECT string_agg(c::text, ',' ORDER BY n) FROM unnest(p_counts) WITH ORDINALITY u(c, n)
                              WHERE n <= (SELECT max(n2) FROM unnest(p_counts) WITH ORDINALITY u2(c2, n2) WHERE c2 > 0)), '') || '}'
$$;

SELECT lives_ok($$SELECT * FROM queen.schedule_timers('acme', ARRAY[
                    pg_temp.op('alpha', 'a1', 30000), pg_temp.op('alpha', 'a2', 90000), pg_temp.op('alpha', 'a3', 90500),
                    pg_temp.op('alpha', 'a4', -5000), pg_temp.op('alpha', 'a5', 7200000), pg_temp.op('alpha', 'a6', 10000),
                    pg_temp.op('beta', 'b1', 0)], p_now => pg_temp.t0())$$,
                'setup: seven timers of acme in two queues');
SELECT lives_ok($$SELECT * FROM queen.schedule_timers('globex', ARRAY[pg_temp.op('alpha', 'g1', 30000), pg_temp.op('gamma', 'g2', 1000)],
                                                      p_now => pg_temp.t0())$$,
                'setup: another tenant''s timers, one on the same queue');

-- ---------------------------------------------------------------- at t0
SELECT results_eq($$SELECT queue, pending, due, claimed, retrying, next_deliver_at, array_length(due_by_bucket, 1)
                      FROM queen.get_timer_stats('acme', p_now => pg_temp.t0())$$,
                  $$VALUES ('alpha', 6::bigint, 1::bigint, 0::bigint, 0::bigint, pg_temp.at(-5), 60),
                           ('beta', 1::bigint, 1::bigint, 0::bigint, 0::bigint, pg_temp.at(0), 60)$$,
                  'one row per queue of the tenant, in queue order; 60 buckets by default');
SELECT is((SELECT pg_temp.hist(due_by_bucket) FROM queen.get_timer_stats('acme', p_now => pg_temp.t0()) WHERE queue = 'alpha'),
          '{2,2}', 'minute 1: a6 (10 s) and a1 (30 s); minute 2: a2 and a3; a5 (2 h) is past the histogram, a4 is due');
SELECT is((SELECT pg_temp.hist(due_by_bucket) FROM queen.get_timer_stats('acme', p_now => pg_temp.t0()) WHERE queue = 'beta'),
          '{}', 'a timer due now is counted as due, not in the histogram');
SELECT results_eq($$SELECT due_by_bucket FROM queen.get_timer_stats('acme', 3, 30, pg_temp.t0()) WHERE queue = 'alpha'$$,
                  $$VALUES ('{1,1,0}'::bigint[])$$,
                  'buckets of 30 s: a6 in the first, a1 (exactly 30 s) in the second, a2 (90 s) past the third');
SELECT is((SELECT sum(pending) FROM queen.get_timer_stats('acme')), (SELECT queen.get_pending_timers('acme')::numeric),
          'the pending counts add up to the tenant''s pending counter');
SELECT results_eq($$SELECT queue, pending FROM queen.get_timer_stats('globex', p_now => pg_temp.t0())$$,
                  $$VALUES ('alpha', 1::bigint), ('gamma', 1::bigint)$$,
                  'another tenant sees only its own timers, on the same queue name too');
SELECT is((SELECT count(*) FROM queen.get_timer_stats('initech')), 0::bigint, 'a tenant with no timers: no rows');

-- ---------------------------------------------------------------- pages, totals
SELECT results_eq($$SELECT queue, pending FROM queen.get_timer_stats('acme', p_now => pg_temp.t0(), p_limit => 1)$$,
                  $$VALUES ('alpha', 6::bigint)$$, 'p_limit: the first queues only');
SELECT results_eq($$SELECT queue, pending, due_by_bucket = (SELECT s.due_by_bucket FROM queen.get_timer_stats('acme', p_now => pg_temp.t0()) s
                                                                 WHERE s.queue = 'beta')
                      FROM queen.get_timer_stats('acme', p_now => pg_temp.t0(), p_after => 'alpha', p_limit => 5)$$,
                  $$VALUES ('beta', 1::bigint, true)$$, 'p_after: the queues after it, with the same counts and histogram');
SELECT is((SELECT count(*) FROM queen.get_timer_stats('acme', p_after => 'beta')), 0::bigint, 'nothing after the last queue');
SELECT results_eq($$SELECT queues, pending, due, claimed, retrying, next_deliver_at, pg_temp.hist(due_by_bucket)
                      FROM queen.get_timer_totals('acme', p_now => pg_temp.t0())$$,
                  $$VALUES (2::bigint, 7::bigint, 2::bigint, 0::bigint, 0::bigint, pg_temp.at(-5), '{2,2}')$$,
                  'get_timer_totals: one row over every queue of the tenant');
SELECT results_eq($$SELECT queues, pending, array_length(due_by_bucket, 1), pg_temp.hist(due_by_bucket)
                      FROM queen.get_timer_totals('initech', 3, 30)$$,
                  $$VALUES (0::bigint, 0::bigint, 3, '{}')$$, 'a tenant with no timers: one row of zeros');
SELECT throws_ok($$SELECT * FROM queen.get_timer_stats('acme', p_limit => 0)$$, 'QTBAD', 'timers_bad_request', 'a page of no queue');
SELECT throws_ok($$SELECT * FROM queen.get_timer_totals('acme', 1441)$$, 'QTBAD', 'timers_bad_request', 'totals: more than a day of minutes');
SELECT is((SELECT provolatile::text FROM pg_proc WHERE oid = 'queen.get_timer_totals'::regproc), 's',
          'get_timer_totals is STABLE too');

-- ---------------------------------------------------------------- claimed, backoff
CREATE TEMP TABLE cl AS SELECT * FROM queen.claim_timers('broker-1', 10, 5000, pg_temp.at(15));
SELECT results_eq($$SELECT timer_key FROM cl WHERE tenant = 'acme' ORDER BY 1$$, $$VALUES ('a4'), ('a6'), ('b1')$$,
                  'setup: a4, a6 and b1 claimed at t0 + 15 s (lease 5 s)');
SELECT is(queen.fail_timer('acme', 'alpha', 'a6', (SELECT claim_id FROM cl WHERE timer_key = 'a6'), 'permanent', 'boom',
                           p_backoff_ms => 1000, p_now => pg_temp.at(15)),
          'backoff', 'setup: the fire of a6 failed, due again at t0 + 16 s');
SELECT results_eq($$SELECT queue, pending, due, claimed, retrying, next_deliver_at
                      FROM queen.get_timer_stats('acme', p_now => pg_temp.at(15))$$,
                  $$VALUES ('alpha', 6::bigint, 0::bigint, 1::bigint, 1::bigint, pg_temp.at(16)),
                           ('beta', 1::bigint, 0::bigint, 1::bigint, 0::bigint, NULL::timestamptz)$$,
                  'claimed timers are pending but not due; the one in backoff is retrying; next deliver_at skips claimed rows');
SELECT is((SELECT pg_temp.hist(due_by_bucket) FROM queen.get_timer_stats('acme', p_now => pg_temp.at(15)) WHERE queue = 'alpha'),
          '{2,2}', 'the buckets start at now: a6 (1 s) and a1 (15 s), then a2 (75 s) and a3 (75.5 s)');
SELECT results_eq($$SELECT queue, due, claimed, retrying FROM queen.get_timer_stats('acme', p_now => pg_temp.at(25))$$,
                  $$VALUES ('alpha', 2::bigint, 0::bigint, 1::bigint), ('beta', 1::bigint, 0::bigint, 0::bigint)$$,
                  'once the leases expired the claimed timers are due again (with a6 out of its backoff)');

-- ---------------------------------------------------------------- bad input, read-only
SELECT throws_ok($$SELECT * FROM queen.get_timer_stats('acme', 0)$$, 'QTBAD', 'timers_bad_request', 'zero buckets');
SELECT throws_ok($$SELECT * FROM queen.get_timer_stats('acme', 1441)$$, 'QTBAD', 'timers_bad_request', 'more than a day of minutes');
SELECT throws_ok($$SELECT * FROM queen.get_timer_stats('acme', 60, 0)$$, 'QTBAD', 'timers_bad_request', 'a bucket of 0 s');
SELECT throws_ok($$SELECT * FROM queen.get_timer_stats(NULL)$$, 'QTBAD', 'timers_bad_request', 'no tenant');
SELECT is((SELECT provolatile::text FROM pg_proc WHERE oid = 'queen.get_timer_stats'::regproc), 's',
          'STABLE: PostgreSQL refuses any write inside it');
SELECT is((SELECT count(*) FROM queen.timers), 9::bigint, 'reading the stats changed no timer');

SELECT * FROM finish();
ROLLBACK;
