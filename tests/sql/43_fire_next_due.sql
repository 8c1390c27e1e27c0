-- The fair share's candidates (migration 019): queen.tenant_usage.next_due_at
-- is a lower bound of the deliver_at of each tenant's timers. A schedule
-- lowers it; queen.find_due_tenants looks only at tenants whose bound has
-- passed and raises the bound of a tenant it found with nothing due, so
-- tenants whose timers are all in the future cost the fire nothing.
BEGIN;
SELECT plan(26);

CREATE FUNCTION pg_temp.t0() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2030-01-01 00:00:00+00'::timestamptz $$;
CREATE FUNCTION pg_temp.at(p_seconds numeric) RETURNS timestamptz LANGUAGE sql AS $$ SELECT pg_temp.t0() + p_seconds * interval '1 second' $$;
-- one timer of p_tenant under p_key, due p_ms after t0 (p_zstd: stored zstd)
CREATE FUNCTION pg_temp.sched1(p_tenant text, p_key text, p_ms bigint, p_zstd boolean DEFAULT NULL)
RETURNS text LANGUAGE sql AS $$
    SELECT status FROM queen.schedule_timers(
        p_tenant, ARRAY[ROW('schedule', 'nq', p_key, p_ms, 'txn-' || p_key, '\x7b7d'::bytea, NULL, p_zstd, NULL, NULL)::queen.timer_op],
        p_now => pg_temp.t0())
$$;
CREATE FUNCTION pg_temp.bound(p_tenant text) RETURNS timestamptz LANGUAGE sql AS $$
    SELECT next_due_at FROM queen.tenant_usage WHERE tenant = p_tenant $$;

SELECT has_column('queen', 'tenant_usage', 'next_due_at', 'tenant_usage has next_due_at');
INSERT INTO queen.tenant_usage (tenant) VALUES ('nd-default');
SELECT is(pg_temp.bound('nd-default'), '-infinity'::timestamptz, 'a row nobody bounded may have due timers: -infinity');
SELECT has_index('queen', 'tenant_usage', 'tenant_usage_next_due_at_idx', ARRAY['next_due_at'],
                 'the candidates are found by their bound');

-- ---------------------------------------------------------------- schedules lower it
SELECT is(pg_temp.sched1('nd-a', 'k1', 60000), 'scheduled', 'setup: nd-a, one timer due a minute after t0');
SELECT is(pg_temp.bound('nd-a'), pg_temp.at(60), 'a new tenant''s bound is its timer''s deliver_at');
SELECT is(pg_temp.sched1('nd-a', 'k2', 120000), 'scheduled', 'setup: a second one, due later');
SELECT is(pg_temp.bound('nd-a'), pg_temp.at(60), 'a later timer leaves the bound');
SELECT is(pg_temp.sched1('nd-a', 'k2', 30000), 'rescheduled', 'setup: the second rescheduled earlier');
SELECT is(pg_temp.bound('nd-a'), pg_temp.at(30), 'an earlier one (a reschedule too) lowers it');
SELECT is((SELECT status FROM queen.schedule_timers('nd-a',
              ARRAY[ROW('cancel', 'nq', 'k1', NULL, NULL, NULL, NULL, NULL, NULL, NULL)::queen.timer_op,
                    ROW('schedule', 'nq', 'k3', 10000, 'txn-k3', '\x7b7d'::bytea, NULL, NULL, NULL, NULL)::queen.timer_op],
              p_now => pg_temp.t0()) WHERE timer_key = 'k3'), 'scheduled', 'setup: a batch with a cancel (the per-op loop)');
SELECT is(pg_temp.bound('nd-a'), pg_temp.at(10), 'the loop''s upserts lower it too');
SELECT lives_ok($$SELECT queen.bump_tenant_usage('nd-a', 0, 1)$$, 'a bump that says nothing of when');
SELECT is(pg_temp.bound('nd-a'), '-infinity'::timestamptz, 'leaves the tenant possibly due');

-- ---------------------------------------------------------------- find_due_tenants raises the bound of an idle candidate
SELECT is(queen.find_due_tenants(pg_temp.at(5), 10), NULL, 'nd-a has nothing due at t0 + 5 s');
SELECT is(pg_temp.bound('nd-a'), pg_temp.at(10), 'probed and idle: its bound is now its earliest timer');
SELECT is(queen.find_due_tenants(pg_temp.at(11), 10), ARRAY['nd-a'], 'at t0 + 11 s it is due, and found');
SELECT is(pg_temp.bound('nd-a'), pg_temp.at(10), 'a due tenant''s bound is left');

-- a zstd row is due: the fast path's probe finds nothing of its kind, the bound stays at the due row
SELECT is(pg_temp.sched1('nd-z', 'z1', 1000, true) || pg_temp.sched1('nd-z', 'p1', 90000), 'scheduledscheduled',
          'setup: nd-z, a zstd timer due at t0 + 1 s and a plain one at t0 + 90 s');
UPDATE queen.tenant_usage SET next_due_at = '-infinity' WHERE tenant = 'nd-z';
SELECT is(queen.find_due_tenants(pg_temp.at(5), 10, ARRAY['nd-a']), NULL, 'no plain row of nd-z is due');
SELECT is(pg_temp.bound('nd-z'), pg_temp.at(1), 'its bound is its earliest row of either kind (the due zstd one)');
SELECT is(queen.find_due_tenants(pg_temp.at(5), 10, ARRAY['nd-a'], p_zstd => true), ARRAY['nd-z'],
          'so the leased path still finds it');

-- a count that says pending, no rows: no bound at all
SELECT lives_ok($$SELECT queen.bump_tenant_usage('nd-empty', 1, 0)$$, 'setup: nd-empty counts one pending timer and has none');
SELECT is(queen.find_due_tenants(pg_temp.at(5), 10, ARRAY['nd-a', 'nd-z']), NULL, 'nd-empty has nothing due');
SELECT is(pg_temp.bound('nd-empty'), 'infinity'::timestamptz, 'no timer: its bound is infinity until a schedule lowers it');

-- ---------------------------------------------------------------- idle tenants are not candidates
-- 200 tenants with one timer each, due a day after t0; one more, last by name, with one due at t0
SELECT is((SELECT count(*) FROM generate_series(1, 200) g
            WHERE pg_temp.sched1('nd-idle-' || lpad(g::text, 3, '0'), 'i', 86400000) = 'scheduled')
          + (SELECT count(*) FROM (SELECT pg_temp.sched1('nd-zz-due', 'd', 0)) x), 201::bigint,
          'setup: 200 idle tenants (due tomorrow) and nd-zz-due, due now');
SELECT set_config('queen.fire_turn', '', false);
SELECT is(queen.find_due_tenants(pg_temp.at(5), 10, ARRAY['nd-a', 'nd-z']), ARRAY['nd-zz-due'],
          'the first call finds nd-zz-due: the 200 tenants due tomorrow are not probed (before 019: the fourth call)');

SELECT * FROM finish();
ROLLBACK;
