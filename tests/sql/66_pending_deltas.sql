-- The delta-aggregated pending counter: decrements appended to
-- queen.tenant_usage_deltas, increments and billing on the base row,
-- queen.get_pending_timers (base + deltas), queen.fold_pending_deltas,
-- queen.get_timer_status reading both.
BEGIN;
SELECT plan(45);

CREATE FUNCTION pg_temp.t0() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2030-01-01 00:00:00+00'::timestamptz $$;
CREATE FUNCTION pg_temp.at(p_seconds numeric) RETURNS timestamptz LANGUAGE sql AS $$ SELECT pg_temp.t0() + p_seconds * interval '1 second' $$;
CREATE FUNCTION pg_temp.op(p_op text, p_key text, p_delay bigint DEFAULT 60000) RETURNS queen.timer_op LANGUAGE sql AS $$
    SELECT queen.make_timer_op(p_op, 'pq', p_key, p_delay, 'txn-' || p_key, '\x00'::bytea) $$;
CREATE FUNCTION pg_temp.sched(p_tenant text, VARIADIC p_ops queen.timer_op[]) RETURNS SETOF queen.timer_verdict LANGUAGE sql AS $$
    SELECT * FROM queen.schedule_timers(p_tenant, p_ops, p_now => pg_temp.t0()) $$;
CREATE FUNCTION pg_temp.base(p_tenant text) RETURNS bigint LANGUAGE sql AS $$
    SELECT pending_timers FROM queen.tenant_usage WHERE tenant = p_tenant $$;
CREATE FUNCTION pg_temp.deltas(p_tenant text) RETURNS bigint LANGUAGE sql AS $$
    SELECT count(*) FROM queen.tenant_usage_deltas WHERE tenant = p_tenant $$;
CREATE FUNCTION pg_temp.billed(p_tenant text) RETURNS bigint LANGUAGE sql AS $$
    SELECT billed_messages FROM queen.tenant_usage WHERE tenant = p_tenant $$;

-- ---------------------------------------------------------------- shape
SELECT has_table('queen', 'tenant_usage_deltas', 'the delta table exists');
SELECT is((SELECT count(*) FROM pg_indexes WHERE schemaname = 'queen' AND tablename = 'tenant_usage_deltas'), 0::bigint,
          'it has no index (an INSERT contends on nothing)');
SELECT is((SELECT l.lanname FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
            WHERE p.oid = 'queen.bump_tenant_usage(text, bigint, bigint, timestamptz)'::regprocedure), 'plpgsql',
          'bump_tenant_usage is PL/pgSQL (its plan is cached, not made again per call)');
SELECT throws_ok($$INSERT INTO queen.tenant_usage_deltas VALUES ('dx-a', 1)$$, '23514', NULL,
                 'an increment is refused by the delta table: increments go to the base row');
SELECT throws_ok($$INSERT INTO queen.tenant_usage_deltas VALUES ('dx-a', 0)$$, '23514',
                 'value for domain queen.pending_decrement violates check constraint "pending_delta_negative"',
                 'so is a zero, by the domain''s named constraint');
SELECT col_type_is('queen', 'tenant_usage_deltas', 'pending_delta', 'queen', 'pending_decrement',
                   'the delta column is the domain (migration 030): its check comes planned from the type cache');
SELECT is((SELECT count(*) FROM pg_constraint WHERE conrelid = 'queen.tenant_usage_deltas'::regclass AND contype = 'c'),
          0::bigint, 'the table has no CHECK of its own (re-read and planned again at every INSERT)');
INSERT INTO queen.tenant_usage_deltas VALUES ('dx-upd', -1);
SELECT throws_ok($$UPDATE queen.tenant_usage_deltas SET pending_delta = 5 WHERE tenant = 'dx-upd'$$, '23514', NULL,
                 'nor can a delta be turned positive');
DELETE FROM queen.tenant_usage_deltas WHERE tenant = 'dx-upd';
SELECT is(queen.get_pending_timers('nobody'), 0::bigint, 'a tenant with no counter row has 0 pending');

-- ---------------------------------------------------------------- schedule: increments and billing on the base row
SELECT is((SELECT count(*) FROM pg_temp.sched('dx-a', pg_temp.op('schedule', 'a1'), pg_temp.op('schedule', 'a2'),
                                              pg_temp.op('schedule', 'a3'), pg_temp.op('schedule', 'a4', -1000))),
          4::bigint, 'setup: four timers, one due');
SELECT is(pg_temp.base('dx-a'), 4::bigint, 'a schedule adds to the base row');
SELECT is(pg_temp.billed('dx-a'), 4::bigint, 'and bills one each');
SELECT is(pg_temp.deltas('dx-a'), 0::bigint, 'and writes no delta');

-- ---------------------------------------------------------------- cancel: a delta, the base row untouched
SELECT is(queen.cancel_timer('dx-a', 'pq', 'a1', pg_temp.t0()), 'cancelled', 'cancel a1');
SELECT is(pg_temp.base('dx-a'), 4::bigint, 'a cancel leaves the base row alone');
SELECT results_eq($$SELECT pending_delta::bigint FROM queen.tenant_usage_deltas WHERE tenant = 'dx-a'$$, ARRAY[-1::bigint],
                  'it appends one -1');
SELECT is(queen.get_pending_timers('dx-a'), 3::bigint, 'get_pending_timers reads base + deltas');
SELECT is(pg_temp.billed('dx-a'), 4::bigint, 'a cancel bills nothing');
SELECT is(queen.cancel_timer('dx-a', 'pq', 'a1', pg_temp.t0()), 'absent', 'an absent cancel');
SELECT is(pg_temp.deltas('dx-a'), 1::bigint, 'writes no delta');

-- ---------------------------------------------------------------- a cancel-only batch: a delta; a batch that bills: the base row
SELECT is((SELECT status FROM pg_temp.sched('dx-a', pg_temp.op('cancel', 'a2'))), 'cancelled', 'a batch cancelling a2');
SELECT is(pg_temp.deltas('dx-a'), 2::bigint, 'appends its decrement');
SELECT is((SELECT string_agg(status, ',' ORDER BY ordinal) FROM pg_temp.sched('dx-a', pg_temp.op('cancel', 'a3'), pg_temp.op('reschedule', 'a4', -1000))),
          'cancelled,rescheduled', 'a batch cancelling a3 and rescheduling a4 (due)');
SELECT is(pg_temp.base('dx-a'), 3::bigint, 'bills and counts on the base row, which it holds anyway');
SELECT is(queen.get_pending_timers('dx-a'), 1::bigint, 'one timer left (a4)');

-- ---------------------------------------------------------------- the fire: one delta per tenant and batch
SELECT is((SELECT count(*) FROM pg_temp.sched('dx-b', pg_temp.op('schedule', 'b1', -1000), pg_temp.op('schedule', 'b2', -1000))),
          2::bigint, 'setup: dx-b has two due timers');
SELECT is((SELECT count(*) FROM queen.fire_due_timers(100, pg_temp.at(1)) WHERE tenant IN ('dx-a', 'dx-b')), 3::bigint,
          'fire_due_timers fires a4, b1, b2');
SELECT results_eq($$SELECT pending_delta::bigint FROM queen.tenant_usage_deltas WHERE tenant = 'dx-b'$$, ARRAY[-2::bigint],
                  'one delta of -2 for dx-b');
SELECT is(pg_temp.base('dx-b'), 2::bigint, 'its base row untouched');
SELECT is((queen.get_timer_status()).pending, 0::bigint, 'get_timer_status sums base rows and deltas: 0 pending');

-- ---------------------------------------------------------------- fold
SELECT is(queen.fold_pending_deltas(2), 2::bigint, 'a fold takes at most p_limit deltas');
SELECT is(queen.get_pending_timers('dx-a') + queen.get_pending_timers('dx-b'), 0::bigint, 'the reads do not change');
SELECT is(queen.fold_pending_deltas(), 2::bigint, 'the next fold takes the rest');
SELECT is((SELECT count(*) FROM queen.tenant_usage_deltas WHERE tenant IN ('dx-a', 'dx-b')), 0::bigint, 'no delta left');
SELECT results_eq($$SELECT tenant, pending_timers FROM queen.tenant_usage WHERE tenant IN ('dx-a', 'dx-b') ORDER BY 1$$,
                  $$VALUES ('dx-a', 0::bigint), ('dx-b', 0::bigint)$$, 'the base rows now hold the counts');
SELECT is(queen.fold_pending_deltas(), 0::bigint, 'nothing to fold: 0');

-- ---------------------------------------------------------------- many tenants, past the plan cache's generic plan
SELECT is((SELECT proconfig FROM pg_proc WHERE oid = 'queen.fold_pending_deltas(integer)'::regprocedure),
          ARRAY['jit=off'], 'the fold runs without JIT (compiling cost more than the fold)');
INSERT INTO queen.tenant_usage (tenant, pending_timers) SELECT 'dx-m' || g, 100 FROM generate_series(1, 300) g;
CREATE FUNCTION pg_temp.fold_rounds() RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE v_n bigint := 0;
BEGIN
    FOR r IN 1..8 LOOP  -- more calls than the custom plans PL/pgSQL makes before a generic one
        INSERT INTO queen.tenant_usage_deltas (tenant, pending_delta)
        SELECT 'dx-m' || (1 + g % 300), -1 FROM generate_series(1, 600) g;
        v_n := v_n + queen.fold_pending_deltas(600);
    END LOOP;
    RETURN v_n;
END $$;
SELECT is(pg_temp.fold_rounds(), 4800::bigint, '8 folds of 600 deltas of 300 tenants fold them all');
SELECT results_eq($$SELECT count(*), min(pending_timers), max(pending_timers) FROM queen.tenant_usage WHERE tenant LIKE 'dx-m%'$$,
                  $$VALUES (300::bigint, 84::bigint, 84::bigint)$$, 'each tenant lost its 16');

-- ---------------------------------------------------------------- DLQ move: a delta
SELECT is((SELECT count(*) FROM pg_temp.sched('dx-c', pg_temp.op('schedule', 'c1', -1000))), 1::bigint, 'setup: dx-c has one due timer');
SELECT is(queen.fail_timer('dx-c', 'pq', 'c1',
                           (SELECT claim_id FROM queen.claim_timers('dx-broker', 10, 5000, pg_temp.at(1)) WHERE tenant = 'dx-c'),
                           'permanent', 'poison', 1, 1000, 5000, pg_temp.at(1)),
          'dead_lettered', 'a failure with no attempt left moves it to the DLQ');
SELECT is(queen.get_pending_timers('dx-c'), 0::bigint, 'through a delta: 0 pending');

-- ---------------------------------------------------------------- a tenant without a counter row
INSERT INTO queen.timers (tenant, queue, timer_key, deliver_at, txn, message_id, payload)
VALUES ('dx-e', 'pq', 'e1', pg_temp.at(60), 'txn-e1', gen_random_uuid(), '\x00');
SELECT is(queen.cancel_timer('dx-e', 'pq', 'e1', pg_temp.t0()), 'cancelled', 'a row whose tenant has no counter row: cancelled');
SELECT lives_ok($$SELECT queen.fold_pending_deltas()$$, 'a fold');
SELECT is((SELECT count(*) FROM queen.tenant_usage WHERE tenant = 'dx-e') + pg_temp.deltas('dx-e'), 0::bigint,
          'drops its delta and creates no counter row');

SELECT * FROM finish();
ROLLBACK;
