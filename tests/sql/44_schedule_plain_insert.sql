-- A batch of schedule ops is first tried as a plain INSERT (migration 020),
-- in a subtransaction; a key that exists undoes it and the upsert does the
-- batch. Which path wrote a row shows in its xmin: the plain INSERT's rows
-- carry the subtransaction's xid, the upsert's the top transaction's. The
-- verdicts, rows and counters must be the same either way.
BEGIN;
SELECT plan(31);

CREATE FUNCTION pg_temp.t0() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2030-01-01 00:00:00+00'::timestamptz $$;
CREATE FUNCTION pg_temp.op(p_op text, p_key text, p_delay bigint DEFAULT 60000)
RETURNS queen.timer_op LANGUAGE sql AS $$
    SELECT ROW(p_op, 'pq', p_key, p_delay, 'txn-' || p_key, '\x6869'::bytea, NULL, NULL, NULL, NULL)::queen.timer_op
$$;
CREATE FUNCTION pg_temp.sched(p_ops queen.timer_op[])
RETURNS SETOF queen.timer_verdict LANGUAGE sql AS $$
    SELECT * FROM queen.schedule_timers('pi', p_ops, p_now => pg_temp.t0())
$$;
-- the statuses of a batch, in input order
CREATE FUNCTION pg_temp.statuses(p_ops queen.timer_op[]) RETURNS text[] LANGUAGE sql AS $$
    SELECT array_agg(status ORDER BY ordinal) FROM pg_temp.sched(p_ops) $$;
-- written by the top transaction (the upsert), not by a subtransaction (the plain INSERT)
CREATE FUNCTION pg_temp.by_top(p_key text) RETURNS boolean LANGUAGE sql AS $$
    SELECT t.xmin::text = (pg_current_xact_id()::text::bigint % 4294967296)::text
      FROM queen.timers t WHERE t.tenant = 'pi' AND t.queue = 'pq' AND t.timer_key = p_key $$;
CREATE FUNCTION pg_temp.pending() RETURNS bigint LANGUAGE sql AS $$ SELECT queen.get_pending_timers('pi') $$;
CREATE FUNCTION pg_temp.billed() RETURNS bigint LANGUAGE sql AS $$
    SELECT billed_messages FROM queen.tenant_usage WHERE tenant = 'pi' $$;
CREATE FUNCTION pg_temp.msg(p_key text) RETURNS uuid LANGUAGE sql AS $$
    SELECT message_id FROM queen.timers WHERE tenant = 'pi' AND queue = 'pq' AND timer_key = p_key $$;

SELECT has_function('queen', 'timer_key_ends_exist', ARRAY['text', 'queen.timer_op[]'],
                    'queen.timer_key_ends_exist(text, timer_op[]) exists');
SELECT ok(pg_current_xact_id() IS NOT NULL, 'setup: the test transaction has its xid');

-- ---------------------------------------------------------------- new keys: the plain INSERT
CREATE TEMP TABLE v1 AS SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('schedule', 'b'), pg_temp.op('schedule', 'a', 1000),
                                                         pg_temp.op('schedule', 'c', -5000)]);
SELECT is((SELECT array_agg(status ORDER BY ordinal) FROM v1), ARRAY['scheduled', 'scheduled', 'scheduled'],
          'three new keys: scheduled, in input order');
SELECT is((SELECT bool_and(ok) FROM v1), true, 'every verdict ok');
SELECT is((SELECT array_agg(txn ORDER BY ordinal) FROM v1), ARRAY['txn-b', 'txn-a', 'txn-c'], 'each carries its txn');
SELECT is((SELECT array_agg(deliver_at ORDER BY ordinal) FROM v1),
          ARRAY[pg_temp.t0() + interval '60 s', pg_temp.t0() + interval '1 s', pg_temp.t0() - interval '5 s'],
          'deliver_at = now + delayMs (a negative delay: due at once)');
SELECT is((SELECT count(*) FROM queen.timers t
             JOIN v1 ON v1.timer_key COLLATE "C" = t.timer_key AND v1.message_id = t.message_id
            WHERE t.tenant = 'pi'), 3::bigint,
          'the rows are stored with the message ids the verdicts return');
SELECT results_eq($$SELECT partition, payload, attempts, failures, claim_id IS NULL, created_at, updated_at
                      FROM queen.timers WHERE tenant = 'pi' AND timer_key = 'a'$$,
                  $$VALUES ('Default', '\x6869'::bytea, 0, 0, true, pg_temp.t0(), pg_temp.t0())$$,
                  'the row as the upsert would store it');
SELECT is(pg_temp.by_top('a') OR pg_temp.by_top('b') OR pg_temp.by_top('c'), false,
          'written by the plain INSERT''s subtransaction');
SELECT is(pg_temp.pending(), 3::bigint, 'the pending counter counts 3');
SELECT is(pg_temp.billed(), 3::bigint, 'three messages billed');
SELECT is((SELECT next_due_at FROM queen.tenant_usage WHERE tenant = 'pi'), pg_temp.t0() - interval '5 s',
          'the tenant''s bound is the earliest deliver_at');

-- ---------------------------------------------------------------- sent again: straight to the upsert
CREATE TEMP TABLE m1 AS SELECT timer_key, message_id FROM queen.timers WHERE tenant = 'pi';
SELECT is(pg_temp.statuses(ARRAY[pg_temp.op('schedule', 'b'), pg_temp.op('schedule', 'a', 1000), pg_temp.op('schedule', 'c', -5000)]),
          ARRAY['rescheduled', 'rescheduled', 'rescheduled'], 'the same batch again: rescheduled');
SELECT is(pg_temp.by_top('a') AND pg_temp.by_top('c'), true, 'by the upsert (its ends exist: no plain INSERT tried)');
SELECT is((SELECT count(*) FROM queen.timers t JOIN m1 ON m1.timer_key = t.timer_key WHERE t.message_id = m1.message_id), 0::bigint,
          'each with a new message id');
SELECT is(pg_temp.pending(), 3::bigint, 'still 3 pending');
SELECT is(pg_temp.billed(), 6::bigint, 'billed again: 6');

-- ---------------------------------------------------------------- a key in the middle exists: undone, then the upsert
SELECT is(pg_temp.statuses(ARRAY[pg_temp.op('schedule', 'a0'), pg_temp.op('schedule', 'b', 2000), pg_temp.op('schedule', 'z9')]),
          ARRAY['scheduled', 'rescheduled', 'scheduled'],
          'ends new, the middle key there: scheduled, rescheduled, scheduled');
SELECT is((SELECT count(*) FROM queen.timers WHERE tenant = 'pi' AND timer_key IN ('a0', 'b', 'z9')), 3::bigint,
          'each key once');
SELECT is(pg_temp.by_top('a0') AND pg_temp.by_top('z9'), true,
          'the new rows are the upsert''s: the plain INSERT of a0 was undone');
SELECT is((SELECT deliver_at FROM queen.timers WHERE tenant = 'pi' AND timer_key = 'b'), pg_temp.t0() + interval '2 s',
          'the existing key took the new deliver_at');
SELECT is(pg_temp.pending(), 5::bigint, 'two new timers counted: 5 pending');
SELECT is(pg_temp.billed(), 9::bigint, 'three billed: 9');

-- ---------------------------------------------------------------- a claimed key in the middle: too_late, as before
UPDATE queen.timers SET claim_id = gen_random_uuid(), claimed_by = 'b1', lease_until = pg_temp.t0() + interval '1 minute'
 WHERE tenant = 'pi' AND timer_key = 'c';
CREATE TEMP TABLE m2 AS SELECT message_id FROM queen.timers WHERE tenant = 'pi' AND timer_key = 'c';
SELECT is(pg_temp.statuses(ARRAY[pg_temp.op('schedule', 'a1'), pg_temp.op('schedule', 'c'), pg_temp.op('schedule', 'z8')]),
          ARRAY['scheduled', 'too_late', 'scheduled'], 'a claimed key in the middle answers too_late');
SELECT is(pg_temp.msg('c'), (SELECT message_id FROM m2), 'and is left as it was');
SELECT is(pg_temp.pending(), 7::bigint, 'the two new ones counted: 7');

-- ---------------------------------------------------------------- a reschedule: straight to the upsert
SELECT is(pg_temp.statuses(ARRAY[pg_temp.op('schedule', 'n1'), pg_temp.op('reschedule', 'n2')]),
          ARRAY['scheduled', 'scheduled'], 'a batch with a reschedule of new keys: scheduled');
SELECT is(pg_temp.by_top('n1') AND pg_temp.by_top('n2'), true, 'by the upsert');

-- ---------------------------------------------------------------- the ends, one descent each
SELECT is(queen.timer_key_ends_exist('pi', ARRAY[pg_temp.op('schedule', 'zz'), pg_temp.op('schedule', 'a')]), true,
          'the first key in key order exists');
SELECT is(queen.timer_key_ends_exist('pi', ARRAY[pg_temp.op('schedule', 'a00'), pg_temp.op('schedule', 'b'),
                                                 pg_temp.op('schedule', 'zzz')]), false,
          'only a middle key exists: false (the plain INSERT finds it)');
SELECT is(queen.timer_key_ends_exist('other', ARRAY[pg_temp.op('schedule', 'a')]), false,
          'another tenant''s key is not this tenant''s');

SELECT * FROM finish();
ROLLBACK;
