-- peek_timer and list_timers: claimed true/false (backoff reads false),
-- the keyset cursor, the limit clamp, truncated / next_after, byte order.
BEGIN;
SELECT plan(27);

CREATE FUNCTION pg_temp.t0() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2030-01-01 00:00:00+00'::timestamptz $$;
CREATE FUNCTION pg_temp.op(p_key text, p_delay bigint DEFAULT 1000, p_queue text DEFAULT 'q')
RETURNS queen.timer_op LANGUAGE sql AS $$
    SELECT ROW('schedule', p_queue, p_key, p_delay, 'txn-' || p_key, '\x7b7d'::bytea, NULL, NULL, NULL, NULL)::queen.timer_op
$$;
SELECT lives_ok($$SELECT * FROM queen.schedule_timers('acme', ARRAY[pg_temp.op('c'), pg_temp.op('a'), pg_temp.op('B', 500), pg_temp.op('b'),
                                                                   pg_temp.op('x', 5000, 'other-queue')], 'svc', p_now => pg_temp.t0())$$,
                'setup: B, a, b, c on queue q');
SELECT lives_ok($$SELECT * FROM queen.schedule_timers('globex', ARRAY[pg_temp.op('a0')], p_now => pg_temp.t0())$$,
                'setup: another tenant''s timer on the same queue');

-- ---------------------------------------------------------------- peek
SELECT results_eq($$SELECT tenant, queue, timer_key, partition, deliver_at, txn, payload, payload_zstd, encrypted, producer_sub,
                           attempts, last_error, claimed, created_at
                      FROM queen.peek_timer('acme', 'q', 'a', pg_temp.t0())$$,
                  $$VALUES ('acme', 'q', 'a', 'Default', pg_temp.t0() + interval '1 second', 'txn-a', '\x7b7d'::bytea, false, false, 'svc',
                            0, NULL::text, false, pg_temp.t0())$$,
                  'peek shows the timer with its payload as stored, not claimed');
SELECT is((SELECT message_id FROM queen.peek_timer('acme', 'q', 'a')), (SELECT message_id FROM queen.timers WHERE tenant = 'acme' AND timer_key = 'a'),
          'peek shows the message id');
SELECT is((SELECT count(*) FROM queen.peek_timer('acme', 'q', 'nope')), 0::bigint, 'a miss is no row');
SELECT is((SELECT count(*) FROM queen.peek_timer('globex', 'q', 'a')), 0::bigint, 'another tenant''s timer is a miss');

CREATE TEMP TABLE cl AS SELECT * FROM queen.claim_timers('broker-1', 1, 5000, pg_temp.t0() + interval '2 seconds');
SELECT is((SELECT timer_key FROM cl), 'B', 'setup: B is claimed (first in expiry order)');
SELECT is((SELECT claimed FROM queen.peek_timer('acme', 'q', 'B', pg_temp.t0() + interval '2 seconds')), true, 'peek: claimed while the lease runs');
SELECT is((SELECT claimed FROM queen.peek_timer('acme', 'q', 'B', pg_temp.t0() + interval '8 seconds')), false, 'peek: not claimed once the lease expired');
SELECT is(queen.fail_timer('acme', 'q', 'B', (SELECT claim_id FROM cl), 'permanent', 'queue exploded', p_now => pg_temp.t0() + interval '3 seconds'),
          'backoff', 'setup: the fire of B failed');
SELECT results_eq($$SELECT claimed, attempts, last_error, deliver_at FROM queen.peek_timer('acme', 'q', 'B', pg_temp.t0() + interval '3 seconds')$$,
                  $$VALUES (false, 1, 'queue exploded', pg_temp.t0() + interval '4 seconds')$$,
                  'a row in backoff reads claimed = false, with attempts and last error');
SELECT is(queen.cancel_timer('acme', 'q', 'B', pg_temp.t0() + interval '3 seconds'), 'cancelled', 'a row in backoff is cancellable');
SELECT lives_ok($$SELECT * FROM queen.schedule_timers('acme', ARRAY[pg_temp.op('B')], p_now => pg_temp.t0())$$, 'setup: B again');

-- ---------------------------------------------------------------- list
SELECT results_eq($$SELECT timer_key, truncated, next_after FROM queen.list_timers('acme', 'q', NULL, 2)$$,
                  $$VALUES ('B', true, 'a'), ('a', true, 'a')$$,
                  'first page: byte order (B < a), truncated, next_after = last key');
SELECT results_eq($$SELECT timer_key, truncated, next_after FROM queen.list_timers('acme', 'q', 'a', 2)$$,
                  $$VALUES ('b', false, NULL::text), ('c', false, NULL)$$,
                  'the cursor is exclusive; the last page is not truncated');
SELECT is((SELECT count(*) FROM queen.list_timers('acme', 'q', 'c', 2)), 0::bigint, 'after the last key: empty');
SELECT results_eq($$SELECT timer_key FROM queen.list_timers('acme', 'q', 'A')$$, $$VALUES ('B'), ('a'), ('b'), ('c')$$,
                  'a cursor need not be an existing key');
SELECT results_eq($$SELECT timer_key FROM queen.list_timers('acme', 'q', 'Z')$$, $$VALUES ('a'), ('b'), ('c')$$,
                  'byte order: Z < a');
SELECT results_eq($$SELECT timer_key, truncated FROM queen.list_timers('acme', 'q', NULL, 0)$$, $$VALUES ('B', true)$$,
                  'limit 0 is clamped to 1');
SELECT results_eq($$SELECT timer_key, truncated FROM queen.list_timers('acme', 'q', NULL, -5)$$, $$VALUES ('B', true)$$,
                  'a negative limit is clamped to 1');
SELECT is((SELECT count(*) FROM queen.list_timers('acme', 'q')), 4::bigint, 'default limit: the whole (small) queue');
SELECT is((SELECT bool_or(truncated) FROM queen.list_timers('acme', 'q')), false, 'not truncated when all fit');
SELECT results_eq($$SELECT timer_key FROM queen.list_timers('acme', 'other-queue')$$, $$VALUES ('x')$$, 'list is per queue');
SELECT results_eq($$SELECT timer_key FROM queen.list_timers('globex', 'q')$$, $$VALUES ('a0')$$, 'list is per tenant');
SELECT results_eq($$SELECT txn, partition, attempts, claimed FROM queen.list_timers('acme', 'q', 'b', 1)$$, $$VALUES ('txn-c', 'Default', 0, false)$$,
                  'list rows carry the timer fields (without payload)');

-- the clamp at 1000: 1001 more rows (inserted directly; only the listing is under test)
INSERT INTO queen.timers (tenant, queue, timer_key, deliver_at, txn, message_id, payload)
SELECT 'acme', 'bulk', format('k%s', lpad(i::text, 5, '0')), pg_temp.t0(), 't' || i, gen_random_uuid(), '\x00'
  FROM generate_series(1, 1001) i;
SELECT results_eq($$SELECT count(*), bool_and(truncated), max(next_after) FROM queen.list_timers('acme', 'bulk', NULL, 5000)$$,
                  $$VALUES (1000::bigint, true, 'k01000')$$,
                  'limit 5000 is clamped to 1000, truncated, next_after the 1000th key');
SELECT results_eq($$SELECT timer_key, truncated FROM queen.list_timers('acme', 'bulk', 'k01000', 5000)$$,
                  $$VALUES ('k01001', false)$$, 'the next page holds the rest');

SELECT * FROM finish();
ROLLBACK;
