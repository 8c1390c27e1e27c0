-- The fast path behind a backlog: a full batch whose oldest row is late
-- also takes a share of the oldest due rows of each tenant it left out
-- (queen.find_due_tenants, queen.fire_due_batch), so one tenant's backlog
-- does not hold another tenant's timers until it is fired.
BEGIN;
SELECT plan(50);

CREATE FUNCTION pg_temp.t0() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2030-01-01 00:00:00+00'::timestamptz $$;
CREATE FUNCTION pg_temp.at(p_seconds numeric) RETURNS timestamptz LANGUAGE sql AS $$ SELECT pg_temp.t0() + p_seconds * interval '1 second' $$;
-- p_n timers of p_tenant, keys <prefix>01.., due p_first_ms, p_first_ms + 1, ... after t0
CREATE FUNCTION pg_temp.sched(p_tenant text, p_prefix text, p_n integer, p_first_ms bigint, p_zstd boolean DEFAULT NULL)
RETURNS bigint LANGUAGE sql AS $$
    SELECT count(*) FROM queen.schedule_timers(
        p_tenant,
        (SELECT array_agg(ROW('schedule', 'fq', p_prefix || lpad(g::text, 2, '0'), p_first_ms + g - 1, 'txn-' || p_prefix || g,
                              convert_to('payload ' || g, 'UTF8'), NULL, p_zstd, NULL, NULL)::queen.timer_op ORDER BY g)
           FROM generate_series(1, p_n) g),
        p_now => pg_temp.t0())
$$;
CREATE FUNCTION pg_temp.keys(p_fired text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE v text;
BEGIN
    EXECUTE format('SELECT string_agg(timer_key, %L ORDER BY deliver_at, timer_key) FROM %I', ',', p_fired) INTO v;
    RETURN v;
END $$;

SELECT has_index('queen', 'timers', 'timers_tenant_deliver_at_idx', ARRAY['tenant', 'deliver_at'],
                 'each tenant''s due rows are indexed in expiry order');

-- fa: 30 due 1..30 ms after t0; fb: one due 500 ms after t0; fc: one due a day later; fd: one zstd row, due
SELECT is(pg_temp.sched('fair-a', 'a', 30, 1), 30::bigint, 'setup: fair-a has 30 timers');
SELECT is(pg_temp.sched('fair-b', 'b', 1, 500), 1::bigint, 'setup: fair-b has one, due after all of fair-a''s');
SELECT is(pg_temp.sched('fair-c', 'c', 1, 86400000), 1::bigint, 'setup: fair-c has one, due tomorrow');
SELECT is(pg_temp.sched('fair-d', 'd', 1, 0, true), 1::bigint, 'setup: fair-d has one zstd timer, due');

-- ---------------------------------------------------------------- find_due_tenants
SELECT is(queen.find_due_tenants(pg_temp.at(10), 10), ARRAY['fair-a', 'fair-b'],
          'find_due_tenants: the tenants with due rows, the longest waiting first; none with only later or zstd rows');
SELECT is(queen.find_due_tenants(pg_temp.at(10), 1), ARRAY['fair-a'], 'at most p_limit tenants');
SELECT is(queen.find_due_tenants(pg_temp.at(10), 10, ARRAY['fair-a']), ARRAY['fair-b'], 'none of p_except');
SELECT is(queen.find_due_tenants(pg_temp.at(0.2), 10), ARRAY['fair-a'], 'fair-b is not due yet at t0 + 0.2 s');
SELECT is(queen.find_due_tenants(pg_temp.at(10), 0), NULL, 'p_limit 0: none');

-- ---------------------------------------------------------------- a duplicate txn in a share
-- (t0 - 200 s .. t0 - 140 s: none of the timers below is due yet) dup-b's txn-db1 fired once, then
-- scheduled again under the same key: the second fire finds it in its partition
SELECT is(pg_temp.sched('dup-b', 'db', 1, -200000), 1::bigint, 'setup: dup-b''s db01 (txn-db1)');
SELECT is((SELECT string_agg(outcome, ',') FROM queen.fire_due_timers(10, pg_temp.at(-195))), 'fired', 'fired once');
SELECT is(pg_temp.sched('dup-a', 'da', 5, -160000) + pg_temp.sched('dup-b', 'db', 1, -150000), 6::bigint,
          'setup: dup-a 5 due 160 s before t0; db01 again (txn-db1 again), 150 s before t0');
SELECT throws_ok($$SELECT * FROM queen.fire_due_timers(3, pg_temp.at(-140), p_redo_duplicates => false)$$, '23505', NULL,
                 'without the redo, the share''s duplicate txn fails the whole batch');
SELECT results_eq($$SELECT timer_key, outcome FROM queen.fire_due_timers(3, pg_temp.at(-140))$$,
                  $$VALUES ('da01', 'fired'), ('da02', 'fired'), ('da03', 'fired'), ('db01', 'duplicate')$$,
                  'the redo: the cell''s 3 oldest fired, and dup-b''s share answered duplicate');
SELECT is((SELECT count(*) FROM queen.fire_due_timers(100, pg_temp.at(-140))), 2::bigint, 'the rest of dup-a''s');
SELECT is(queen.get_pending_timers('dup-a') + queen.get_pending_timers('dup-b'), 0::bigint,
          'the counters agree: each decrement appended once');

-- ---------------------------------------------------------------- expiry order while the fire keeps up
-- (no savepoint: pgTAP's own records would roll back with it) ord-a's 20 and ord-b's one, due
-- 100 s before t0, fired at t0 - 90 s, when none of the others is due
SELECT is(pg_temp.sched('ord-a', 'oa', 20, -100000) + pg_temp.sched('ord-b', 'ob', 1, -99500), 21::bigint,
          'setup: ord-a 20 due 100 s before t0, ord-b one due 99.5 s before it');
CREATE TEMP TABLE f_off AS SELECT * FROM queen.fire_due_timers(5, pg_temp.at(-90), p_fair_after_ms => NULL);
SELECT is(pg_temp.keys('f_off'), 'oa01,oa02,oa03,oa04,oa05',
          'p_fair_after_ms NULL: the 5 oldest due rows of the cell, all ord-a''s');
CREATE TEMP TABLE f_gate AS SELECT * FROM queen.fire_due_timers(5, pg_temp.at(-90), p_fair_after_ms => 20000);
SELECT is(pg_temp.keys('f_gate'), 'oa06,oa07,oa08,oa09,oa10',
          'the oldest row due 10 s ago, under p_fair_after_ms 20 s: expiry order');
CREATE TEMP TABLE f_late AS SELECT * FROM queen.fire_due_timers(5, pg_temp.at(-90), p_fair_after_ms => 5000);
SELECT is(pg_temp.keys('f_late'), 'oa11,oa12,oa13,oa14,oa15,ob01', 'over p_fair_after_ms 5 s: ord-b''s share too');
SELECT is((SELECT count(*) FROM queen.fire_due_timers(100, pg_temp.at(-90))), 5::bigint, 'a batch that is not full: the rest');

-- ---------------------------------------------------------------- behind a backlog: shares
CREATE TEMP TABLE f1 AS SELECT * FROM queen.fire_due_timers(10, pg_temp.at(10));
SELECT is(pg_temp.keys('f1'), 'a01,a02,a03,a04,a05,a06,a07,a08,a09,a10,b01',
          'a full batch whose oldest row was due 10 s ago (over 100 ms): fair-b''s timer fires in it, beside fair-a''s 10 oldest');
SELECT results_eq('SELECT deliver_at FROM f1', 'SELECT deliver_at FROM f1 ORDER BY deliver_at, message_id',
                  'the answers come in expiry order');
SELECT is((SELECT string_agg(f1.timer_key, ',' ORDER BY m.xid, m.seq)
             FROM queen.messages m JOIN f1 ON f1.message_id = m.id WHERE f1.tenant = 'fair-a'),
          'a01,a02,a03,a04,a05,a06,a07,a08,a09,a10', 'fair-a''s frames are in its partition in expiry order');
SELECT is((SELECT count(*) FROM queen.timers WHERE tenant = 'fair-a'), 20::bigint, 'fair-a has 20 left');
SELECT is(queen.get_pending_timers('fair-b'), 0::bigint, 'fair-b''s counter is down to 0');

-- both with a backlog: half each
SELECT is(pg_temp.sched('fair-b', 'bb', 30, 600), 30::bigint, 'setup: fair-b has 30 more, due 600-629 ms after t0');
CREATE TEMP TABLE f2 AS SELECT * FROM queen.fire_due_timers(10, pg_temp.at(10));
SELECT results_eq('SELECT tenant, count(*) FROM f2 GROUP BY tenant ORDER BY tenant',
                  $$VALUES ('fair-a', 10::bigint), ('fair-b', 5::bigint)$$,
                  'two tenants with a backlog, a batch of 10: fair-a''s 10 (the oldest), and fair-b, left out, its share (10 / 2 tenants)');
SELECT is(pg_temp.keys('f2'), 'a11,a12,a13,a14,a15,a16,a17,a18,a19,a20,bb01,bb02,bb03,bb04,bb05', 'each tenant''s oldest, in order');

-- more tenants due than the batch: one each for the longest waiting
SELECT is(pg_temp.sched('fair-e', 'e', 3, 700), 3::bigint, 'setup: fair-e has 3, due 700-702 ms after t0');
CREATE TEMP TABLE f3 AS SELECT * FROM queen.fire_due_timers(2, pg_temp.at(10));
SELECT is(pg_temp.keys('f3'), 'a21,a22,bb06,e01', 'three tenants due, a batch of 2: each tenant left out gets at least one (2 * p_limit at most)');

-- p_limit 1: the cell's oldest
CREATE TEMP TABLE f4 AS SELECT * FROM queen.fire_due_timers(1, pg_temp.at(10));
SELECT is(pg_temp.keys('f4'), 'a23,bb07', 'a batch of 1: the cell''s oldest, and one of the tenant left out waiting longest (at most p_limit tenants)');

-- the zstd row is the leased path's
SELECT is((SELECT count(*) FROM queen.fire_due_timers(1000, pg_temp.at(10)) WHERE tenant = 'fair-d'), 0::bigint,
          'the zstd row is not fired by the fast path');
SELECT is((SELECT count(*) FROM queen.timers WHERE tenant LIKE 'fair-%' AND deliver_at <= pg_temp.at(10)), 1::bigint,
          'every other due row fired (the zstd row left)');
SELECT is((SELECT sum(queen.get_pending_timers(t)) FROM unnest(ARRAY['fair-a', 'fair-b', 'fair-c', 'fair-e']) t), 1::numeric,
          'the counters agree: fair-c''s one left');

-- ---------------------------------------------------------------- the leased path (zstd): the same shares
SELECT has_index('queen', 'timers', 'timers_tenant_zstd_deliver_at_idx', ARRAY['tenant', 'deliver_at'],
                 'each tenant''s zstd rows are indexed in expiry order');
SELECT is(pg_temp.sched('fz-a', 'za', 6, 1, true) + pg_temp.sched('fz-b', 'zb', 3, 500, true) + pg_temp.sched('fz-c', 'zc', 1, 600, true),
          10::bigint, 'setup: zstd timers: fz-a 6 due 1-6 ms after t0, fz-b 3 due 500-502 ms, fz-c one due 600 ms');
SELECT is(queen.find_due_tenants(pg_temp.at(10), 10, p_zstd => true), ARRAY['fair-d', 'fz-a', 'fz-b', 'fz-c'],
          'find_due_tenants(p_zstd): the tenants with due zstd rows, oldest first');
-- each claim's rows are let go by hand before the next (no savepoint: see above)
CREATE FUNCTION pg_temp.unclaim() RETURNS void LANGUAGE sql AS $$
    UPDATE queen.timers SET claim_id = NULL, claimed_by = NULL, lease_until = NULL WHERE claim_id IS NOT NULL $$;
CREATE TEMP TABLE c2 AS SELECT * FROM queen.claim_timers('b1', 3, 60000, pg_temp.at(10), p_zstd_only => true, p_fair_after_ms => NULL);
SELECT is(pg_temp.keys('c2'), 'd01,za01,za02', 'p_fair_after_ms NULL: expiry order only');
SELECT pg_temp.unclaim();
CREATE TEMP TABLE c3 AS SELECT * FROM queen.claim_timers('b1', 3, 60000, pg_temp.at(10), p_fair_after_ms => 100);
SELECT is(pg_temp.keys('c3'), 'd01,za01,za02', 'not p_zstd_only (a broker isolating a failed batch): expiry order only');
SELECT pg_temp.unclaim();
-- stored payloads of 9 bytes ('payload 1'); a bound of 12 bytes takes two rows (the bytes before the second: 9)
CREATE TEMP TABLE c4 AS SELECT * FROM queen.claim_timers('b1', 100, 60000, pg_temp.at(10), p_zstd_only => true, p_max_bytes => 12);
SELECT is(pg_temp.keys('c4'), 'd01,za01,zb01,zc01',
          'full by bytes: the cell''s oldest under the bound, then the shares under a second bound, every tenant''s oldest first (zc01 before zb02)');
SELECT pg_temp.unclaim();
CREATE TEMP TABLE c1 AS SELECT * FROM queen.claim_timers('b1', 3, 60000, pg_temp.at(10), p_zstd_only => true);
SELECT is(pg_temp.keys('c1'), 'd01,za01,za02,zb01,zc01',
          'a full claim whose oldest was due 10 s ago: the cell''s 3 oldest, and one each for fz-b and fz-c, left out (3 / 4 tenants, at least 1)');
SELECT is((SELECT count(DISTINCT claim_id) FROM c1), 1::bigint, 'under one claim');
SELECT results_eq($$SELECT outcome, count(*) FROM queen.fire_timers((SELECT claim_id FROM c1 LIMIT 1),
                      (SELECT array_agg(ROW(tenant, queue, timer_key, NULL)::queen.fire_frame) FROM c1)) GROUP BY 1$$,
                  $$VALUES ('fired', 5::bigint)$$, 'fire_timers fires all five under that claim');

-- ---------------------------------------------------------------- at most 64 candidates a call, in turn
SELECT is((SELECT sum(pg_temp.sched('rot-' || lpad(g::text, 3, '0'), 'r', 1, 1)) FROM generate_series(1, 70) g), 70::numeric,
          'setup: 70 tenants with one due timer each');
SELECT set_config('queen.fire_turn', 'rot-', false);  -- the session's turn: just before them
CREATE TEMP TABLE r1 AS SELECT unnest(queen.find_due_tenants(pg_temp.at(10), 1000)) AS tenant;
SELECT is((SELECT count(*) FROM r1), 64::bigint, 'a call probes at most 64 tenants: rot-001 to rot-064');
SELECT is(current_setting('queen.fire_turn'), 'rot-064', 'the session keeps the last one probed');
CREATE TEMP TABLE r2 AS SELECT unnest(queen.find_due_tenants(pg_temp.at(10), 1000)) AS tenant;
SELECT is((SELECT string_agg(tenant, ',' ORDER BY tenant) FROM r2 WHERE tenant > 'rot-064'), 'rot-065,rot-066,rot-067,rot-068,rot-069,rot-070',
          'the next call starts after it, then wraps round to the first ones');
SELECT is((SELECT count(*) FROM (SELECT tenant FROM r1 UNION SELECT tenant FROM r2) x), 70::bigint, 'two calls: every one of the 70');

SELECT * FROM finish();
ROLLBACK;
