-- The quota rung's count (queen.count_new_timers, migration 021): what a
-- batch would add to the tenant's pending timers, found by one descent of
-- the primary key per op. As a join it was planned once per session; a plan
-- made while the tenant had few rows read every row of the tenant at every
-- batch after. Which rows a call reads shows in this transaction's own
-- counters (pg_stat_get_xact_*): they must not grow with the tenant.
BEGIN;
SELECT plan(15);

CREATE FUNCTION pg_temp.t0() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2030-01-01 00:00:00+00'::timestamptz $$;
CREATE FUNCTION pg_temp.op(p_op text, p_key text)
RETURNS queen.timer_op LANGUAGE sql AS $$
    SELECT ROW(p_op, 'lq', p_key, 60000, 'txn-' || p_key, '\x6869'::bytea, NULL, NULL, NULL, NULL)::queen.timer_op
$$;
CREATE FUNCTION pg_temp.new(p_ops queen.timer_op[], p_tenant text DEFAULT 'ql') RETURNS bigint LANGUAGE sql AS $$
    SELECT queen.count_new_timers(p_tenant, p_ops, pg_temp.t0()) $$;
CREATE FUNCTION pg_temp.put(p_tenant text, p_key text, p_lease timestamptz DEFAULT NULL) RETURNS void LANGUAGE sql AS $$
    INSERT INTO queen.timers (tenant, queue, timer_key, deliver_at, txn, message_id, payload,
                              claim_id, lease_until, created_at, updated_at)
    VALUES (p_tenant, 'lq', p_key, pg_temp.t0(), 't', gen_random_uuid(), '\x00',
            CASE WHEN p_lease IS NOT NULL THEN gen_random_uuid() END, p_lease, pg_temp.t0(), pg_temp.t0()) $$;
-- the rows of queen.timers this transaction has read so far, by any scan
CREATE FUNCTION pg_temp.rows_read() RETURNS bigint LANGUAGE sql AS $$
    SELECT pg_stat_get_xact_tuples_returned('queen.timers'::regclass)
         + pg_stat_get_xact_tuples_fetched('queen.timers'::regclass) $$;

SELECT has_function('queen', 'count_new_timers', ARRAY['text', 'queen.timer_op[]', 'timestamp with time zone'],
                    'queen.count_new_timers(text, timer_op[], timestamptz) exists');
SELECT is((SELECT proconfig FROM pg_proc WHERE oid = 'queen.count_new_timers(text, queen.timer_op[], timestamptz)'::regprocedure),
          ARRAY['enable_seqscan=off'], 'it runs with enable_seqscan off');

-- ---------------------------------------------------------------- the count
SELECT pg_temp.put('ql', 'have');
SELECT pg_temp.put('ql', 'held', pg_temp.t0() + interval '30 s');     -- claimed: its lease runs
SELECT pg_temp.put('ql', 'dead', pg_temp.t0() - interval '1 s');      -- an expired lease: a dead claim
SELECT pg_temp.put('other', 'theirs');
SELECT is(pg_temp.new(ARRAY[pg_temp.op('schedule', 'a'), pg_temp.op('reschedule', 'b')]), 2::bigint,
          'a schedule and a reschedule of new keys add two');
SELECT is(pg_temp.new(ARRAY[pg_temp.op('schedule', 'have'), pg_temp.op('reschedule', 'held')]), 0::bigint,
          'keys that exist (claimed or not) add none');
SELECT is(pg_temp.new(ARRAY[pg_temp.op('cancel', 'have')]), -1::bigint, 'a cancel of an unclaimed timer frees one');
SELECT is(pg_temp.new(ARRAY[pg_temp.op('cancel', 'dead')]), -1::bigint, '... and of one whose lease expired');
SELECT is(pg_temp.new(ARRAY[pg_temp.op('cancel', 'held'), pg_temp.op('cancel', 'none')]), 0::bigint,
          'a cancel of a claimed timer or of no timer frees none');
SELECT is(pg_temp.new(ARRAY[pg_temp.op('schedule', 'theirs')]), 1::bigint, 'another tenant''s key is new to this one');
SELECT is(pg_temp.new(ARRAY[pg_temp.op('schedule', 'x'), pg_temp.op('cancel', 'have'), pg_temp.op('schedule', 'have')]),
          0::bigint, 'a swap nets out');

-- ---------------------------------------------------------------- the reads: one lookup per op
INSERT INTO queen.plans (plan, max_pending_timers) VALUES ('ql-plan', 1000000);
INSERT INTO queen.tenants (tenant, plan) VALUES ('ql', 'ql-plan');
-- the gate runs with plans made while the tenant has four rows (past the
-- five custom plans after which PL/pgSQL may keep a generic one) ...
-- (called here, not in lives_ok: a call in its subtransaction leaves the
-- read counters as they were)
SELECT is(count(*), 8::bigint, 'setup: eight gated batches while the tenant is small')
  FROM (SELECT queen.check_timer_gates('ql', ARRAY[pg_temp.op('schedule', 'n' || i)], NULL, true, pg_temp.t0())
          FROM generate_series(1, 8) i) g;
-- ... then the tenant grows to 20,004 rows
INSERT INTO queen.timers (tenant, queue, timer_key, deliver_at, txn, message_id, payload, created_at, updated_at)
SELECT 'ql', 'lq', 'bulk-' || i, pg_temp.t0(), 't', gen_random_uuid(), '\x00', pg_temp.t0(), pg_temp.t0()
  FROM generate_series(1, 20000) i;
CREATE TEMP TABLE reads AS SELECT pg_temp.rows_read() AS before;
SELECT is((queen.check_timer_gates('ql', ARRAY(SELECT pg_temp.op('schedule', 'g' || i) FROM generate_series(1, 10) i)
                                          || pg_temp.op('reschedule', 'bulk-7'), NULL, true, pg_temp.t0())).max_pending_timers,
          1000000::bigint, 'a gated batch of 11 ops on the grown tenant passes');
SELECT cmp_ok(pg_temp.rows_read() - (SELECT before FROM reads), '<=', 11::bigint,
              'it read at most one row of queen.timers per op, not the tenant''s 20,004');
SELECT is(pg_temp.new(ARRAY(SELECT pg_temp.op('schedule', 'bulk-' || i) FROM generate_series(1, 256) i)
                      || pg_temp.op('schedule', 'fresh')), 1::bigint,
          'on the grown tenant: 256 keys that exist and one new key add one');
UPDATE queen.plans SET max_pending_timers = 0 WHERE plan = 'ql-plan';
SELECT throws_ok($$SELECT queen.check_timer_gates('ql', ARRAY[pg_temp.op('schedule', 'over')], NULL, true, pg_temp.t0())$$,
                 'QTQUO', NULL, 'the rung still refuses a new timer past the quota');
SELECT lives_ok($$SELECT queen.check_timer_gates('ql', ARRAY[pg_temp.op('reschedule', 'bulk-9')], NULL, true, pg_temp.t0())$$,
                '... and passes a reschedule of one that exists');

SELECT * FROM finish();
ROLLBACK;
