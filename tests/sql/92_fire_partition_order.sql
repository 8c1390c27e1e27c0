-- Due timers of one queue and partition enter the log in expiry order when zstd
-- and plain payloads mix (migration 036): the fast path leaves a plain row while a
-- zstd row of its partition that matured before it is still to fire (the leased
-- path fires that one), and fires it after. Other partitions are not held.
BEGIN;
SELECT plan(21);

CREATE FUNCTION pg_temp.t0() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2030-01-01 00:00:00+00'::timestamptz $$;
CREATE FUNCTION pg_temp.at(p_seconds numeric) RETURNS timestamptz LANGUAGE sql AS $$ SELECT pg_temp.t0() + p_seconds * interval '1 second' $$;
CREATE FUNCTION pg_temp.op(p_key text, p_delay bigint, p_zstd boolean DEFAULT NULL, p_partition text DEFAULT NULL)
RETURNS queen.timer_op LANGUAGE sql AS $$
    SELECT ROW('schedule', 'oq', p_key, p_delay, 'txn-' || p_key, convert_to('payload of ' || p_key, 'UTF8'),
               p_partition, p_zstd, NULL, NULL)::queen.timer_op
$$;
-- the frames of a partition, in log order
CREATE FUNCTION pg_temp.log_order(p_partition text DEFAULT 'Default') RETURNS text[] LANGUAGE sql AS $$
    SELECT array_agg(m.transaction_id ORDER BY m.xid, m.seq)
      FROM queen.messages m JOIN queen.partitions p ON p.id = m.partition_id
      JOIN queen.queues q ON q.id = p.queue_id
     WHERE q.tenant = 'acme' AND q.name = 'oq' AND p.name = p_partition
$$;

SELECT lives_ok($$SELECT * FROM queen.schedule_timers('acme', ARRAY[
                    pg_temp.op('z-early', 1000, true), pg_temp.op('plain-later', 2000),
                    pg_temp.op('plain-first', 500), pg_temp.op('elsewhere', 3000, NULL, 'other')], p_now => pg_temp.t0())$$,
                'setup: a zstd timer due between two plain ones of its partition, and a plain one elsewhere');

SELECT set_eq($$SELECT timer_key FROM queen.fire_due_timers(10, pg_temp.at(5))$$, ARRAY['plain-first', 'elsewhere'],
              'the fast path fires what matured before the zstd timer, and the other partition; plain-later waits');
SELECT is((SELECT count(*) FROM queen.timers WHERE timer_key = 'plain-later'), 1::bigint, 'plain-later is still a timer');
SELECT is(queen.next_timer_due_ms(pg_temp.at(5)), 0::bigint, 'and it is due: the sweeper comes straight back');

-- the leased path: claim the zstd row and fire its (inflated) frame
CREATE TEMP TABLE c AS SELECT * FROM queen.claim_timers('b1', 10, 30000, pg_temp.at(5), p_zstd_only => true);
SELECT is((SELECT array_agg(timer_key) FROM c), ARRAY['z-early'], 'the claim takes the zstd row');
SELECT set_eq($$SELECT timer_key FROM queen.fire_due_timers(10, pg_temp.at(5))$$, ARRAY[]::text[],
              'a claimed zstd row still holds the plain rows after it');
SELECT is((SELECT array_agg(outcome) FROM queen.fire_timers((SELECT claim_id FROM c LIMIT 1),
                ARRAY[ROW('acme', 'oq', 'z-early', convert_to('inflated', 'UTF8'))::queen.fire_frame], pg_temp.at(5))),
          ARRAY['fired'], 'the leased path fires it');
SELECT set_eq($$SELECT timer_key FROM queen.fire_due_timers(10, pg_temp.at(5))$$, ARRAY['plain-later'],
              'then the plain row after it fires');
SELECT is(pg_temp.log_order(), ARRAY['txn-plain-first', 'txn-z-early', 'txn-plain-later'],
          'the partition''s frames are in expiry order');

-- two zstd rows around a plain one: the leased path inflates both in place
-- (queen.inflate_timers), and the fast path fires all three in one transaction, in order
SELECT lives_ok($$SELECT * FROM queen.schedule_timers('acme', ARRAY[
                    pg_temp.op('z1', 10000, true), pg_temp.op('p2', 11000), pg_temp.op('z3', 12000, true)],
                    p_now => pg_temp.t0())$$, 'setup: zstd, plain, zstd in one partition');
SELECT is((SELECT count(*) FROM queen.fire_due_timers(10, pg_temp.at(20))), 0::bigint, 'the plain one waits for z1');
CREATE TEMP TABLE c2 AS SELECT * FROM queen.claim_timers('b1', 10, 30000, pg_temp.at(20), p_zstd_only => true);
SELECT is((SELECT array_agg(timer_key ORDER BY deliver_at) FROM c2), ARRAY['z1', 'z3'], 'the claim takes both zstd rows');
SELECT results_eq($$SELECT timer_key, outcome FROM queen.inflate_timers((SELECT claim_id FROM c2 LIMIT 1),
                      ARRAY[ROW('acme', 'oq', 'z1', convert_to('one', 'UTF8'))::queen.fire_frame,
                            ROW('acme', 'oq', 'z3', convert_to('three', 'UTF8'))::queen.fire_frame,
                            ROW('acme', 'oq', 'p2', convert_to('not held', 'UTF8'))::queen.fire_frame], pg_temp.at(20))
                     ORDER BY timer_key$$,
                  $$VALUES ('p2', 'lost'), ('z1', 'inflated'), ('z3', 'inflated')$$,
                  'inflate_timers turns the held zstd rows into rows to fire; a row it does not hold is lost');
SELECT results_eq($$SELECT payload, payload_zstd, claimed FROM queen.peek_timer('acme', 'oq', 'z1', pg_temp.at(20))$$,
                  $$VALUES (convert_to('payload of z1', 'UTF8'), true, false)$$,
                  'peek still shows the timer as scheduled, and unclaimed (a cancel would still take it)');
SELECT results_eq($$SELECT timer_key, outcome FROM queen.fire_due_timers(10, pg_temp.at(20)) ORDER BY deliver_at$$,
                  $$VALUES ('z1', 'fired'), ('p2', 'fired'), ('z3', 'fired')$$,
                  'the fast path fires the three together');
SELECT is(pg_temp.log_order(), ARRAY['txn-plain-first', 'txn-z-early', 'txn-plain-later', 'txn-z1', 'txn-p2', 'txn-z3'],
          'in expiry order');
SELECT is((SELECT convert_from(m.payload, 'UTF8') FROM queen.messages m WHERE m.transaction_id = 'txn-z3'), 'three',
          'with the inflated bytes');

-- a reschedule of an inflated row is a new timer: the bytes as sent, nothing of the inflation
SELECT lives_ok($$SELECT * FROM queen.schedule_timers('acme', ARRAY[pg_temp.op('z4', 10000, true)], p_now => pg_temp.t0())$$,
                'setup: z4');
SELECT lives_ok($$SELECT queen.inflate_timers(c.claim_id, ARRAY[ROW('acme', 'oq', 'z4', '\x01')::queen.fire_frame], pg_temp.at(20))
                    FROM queen.claim_timers('b1', 10, 30000, pg_temp.at(20), p_zstd_only => true) c$$, 'setup: z4 inflated');
SELECT lives_ok($$SELECT * FROM queen.schedule_timers('acme', ARRAY[pg_temp.op('z4', 60000, true)], p_now => pg_temp.at(20))$$,
                'z4 rescheduled');
SELECT results_eq($$SELECT payload, payload_zstd, zstd_payload FROM queen.timers WHERE timer_key = 'z4'$$,
                  $$VALUES (convert_to('payload of z4', 'UTF8'), true, NULL::bytea)$$, 'the row is as the reschedule sent it');

SELECT * FROM finish();
ROLLBACK;
