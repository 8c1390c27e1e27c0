-- claim_timers / fire_timers / fire_due_timers: expiry order, leases,
-- pause, lost claims, payload override (zstd), duplicates, what
-- fire_due_timers leaves to the leased path.
BEGIN;
SELECT plan(59);

CREATE FUNCTION pg_temp.t0() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2030-01-01 00:00:00+00'::timestamptz $$;
CREATE FUNCTION pg_temp.at(p_seconds numeric) RETURNS timestamptz LANGUAGE sql AS $$ SELECT pg_temp.t0() + p_seconds * interval '1 second' $$;
CREATE FUNCTION pg_temp.op(p_key text, p_delay bigint, p_txn text DEFAULT NULL, p_zstd boolean DEFAULT NULL,
                           p_queue text DEFAULT 'fq', p_partition text DEFAULT NULL)
RETURNS queen.timer_op LANGUAGE sql AS $$
    SELECT ROW('schedule', p_queue, p_key, p_delay, coalesce(p_txn, 'txn-' || p_key), convert_to('payload of ' || p_key, 'UTF8'),
               p_partition, p_zstd, NULL, NULL)::queen.timer_op
$$;
CREATE FUNCTION pg_temp.sched(p_ops queen.timer_op[]) RETURNS SETOF queen.timer_verdict LANGUAGE sql AS $$
    SELECT * FROM queen.schedule_timers('acme', p_ops, 'svc-a', p_now => pg_temp.t0())
$$;
CREATE FUNCTION pg_temp.frame(p_key text, p_payload bytea DEFAULT NULL, p_queue text DEFAULT 'fq') RETURNS queen.fire_frame
LANGUAGE sql AS $$ SELECT ROW('acme', p_queue, p_key, p_payload)::queen.fire_frame $$;
CREATE FUNCTION pg_temp.pending() RETURNS bigint LANGUAGE sql AS $$
    SELECT queen.get_pending_timers('acme') $$;

SELECT lives_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('third', 3000), pg_temp.op('first', 1000), pg_temp.op('second', 2000),
                                                     pg_temp.op('later', 60000)])$$, 'setup: four timers');

-- ---------------------------------------------------------------- pause
SELECT is(queen.pause_fire(), true, 'pause_fire');
SELECT is((SELECT count(*) FROM queen.claim_timers('b1', 10, 1000, pg_temp.at(5))), 0::bigint, 'nothing is claimed while the fire is paused');
SELECT is((SELECT count(*) FROM queen.fire_due_timers(10, pg_temp.at(5))), 0::bigint, 'fire_due_timers fires nothing while paused');
SELECT is(queen.resume_fire(), true, 'resume_fire');

-- ---------------------------------------------------------------- claim
CREATE TEMP TABLE c1 AS SELECT * FROM queen.claim_timers('b1', 2, 1000, pg_temp.at(5));
SELECT results_eq('SELECT timer_key, deliver_at, lease_until, attempts FROM c1',
                  $$VALUES ('first', pg_temp.at(1), pg_temp.at(6), 0), ('second', pg_temp.at(2), pg_temp.at(6), 0)$$,
                  'claim takes the limit, in expiry order, with lease = now + lease_ms');
SELECT is((SELECT count(DISTINCT claim_id) FROM c1), 1::bigint, 'one claim id for the batch');
SELECT results_eq($$SELECT claimed_by, claim_id FROM queen.timers WHERE timer_key = 'first'$$, $$SELECT 'b1', claim_id FROM c1 LIMIT 1$$,
                  'the row records the claim and the broker');
CREATE TEMP TABLE c2 AS SELECT * FROM queen.claim_timers('b2', 10, 1000, pg_temp.at(5));
SELECT results_eq('SELECT timer_key FROM c2', $$VALUES ('third')$$, 'a second claim passes over claimed rows and future rows');
SELECT is((SELECT count(*) FROM queen.claim_timers('b3', 10, 1000, pg_temp.at(5))), 0::bigint, 'nothing left to claim');

-- ---------------------------------------------------------------- fire
CREATE TEMP TABLE f1 AS SELECT * FROM queen.fire_timers((SELECT claim_id FROM c1 LIMIT 1),
                                                         ARRAY[pg_temp.frame('second'), pg_temp.frame('first')], pg_temp.at(5.5));
SELECT results_eq('SELECT timer_key, outcome, deliver_at FROM f1', $$VALUES ('first', 'fired', pg_temp.at(1)), ('second', 'fired', pg_temp.at(2))$$,
                  'fire_timers fires what the claim holds, in expiry order');
SELECT is((SELECT count(*) FROM queen.timers WHERE timer_key IN ('first', 'second')), 0::bigint, 'fired rows are deleted');
SELECT results_eq($$SELECT m.id, m.transaction_id, m.payload, m.is_encrypted, m.producer_sub, p.name, q.name
                      FROM queen.messages m JOIN queen.partitions p ON p.id = m.partition_id JOIN queen.queues q ON q.id = p.queue_id
                     ORDER BY m.seq$$,
                  $$SELECT c.message_id, c.txn, convert_to('payload of ' || c.timer_key, 'UTF8'), false, 'svc-a', 'Default', 'fq' FROM c1 c ORDER BY c.deliver_at$$,
                  'the frames are in the log, in expiry order, with the message id minted at schedule, txn, producerSub');
SELECT is((SELECT message_id FROM f1 WHERE timer_key = 'first'), (SELECT message_id FROM c1 WHERE timer_key = 'first'), 'the result carries the message id');
SELECT is(pg_temp.pending(), 2::bigint, 'pending counter: -2 after the fire');
SELECT results_eq($$SELECT outcome FROM queen.fire_timers((SELECT claim_id FROM c1 LIMIT 1), ARRAY[pg_temp.frame('first')], pg_temp.at(5.5))$$,
                  $$VALUES ('lost')$$, 'firing again answers lost');
SELECT results_eq($$SELECT outcome FROM queen.fire_timers((SELECT claim_id FROM c1 LIMIT 1), ARRAY[pg_temp.frame('third')], pg_temp.at(5.5))$$,
                  $$VALUES ('lost')$$, 'a claim cannot fire a row another claim holds');

-- ---------------------------------------------------------------- lease expiry
SELECT is((SELECT count(*) FROM queen.claim_timers('b3', 10, 1000, pg_temp.at(5.9))), 0::bigint, 'no takeover while the lease runs');
CREATE TEMP TABLE c3 AS SELECT * FROM queen.claim_timers('b3', 10, 1000, pg_temp.at(6.5));
SELECT results_eq('SELECT timer_key FROM c3', $$VALUES ('third')$$, 'the lease expired: the row is due again and claimed anew');
SELECT isnt((SELECT claim_id FROM c3), (SELECT claim_id FROM c2), 'with a new claim id');
SELECT results_eq($$SELECT outcome FROM queen.fire_timers((SELECT claim_id FROM c2), ARRAY[pg_temp.frame('third')], pg_temp.at(6.5))$$,
                  $$VALUES ('lost')$$, 'the old claim''s fire answers lost');
SELECT results_eq($$SELECT outcome FROM queen.fire_timers((SELECT claim_id FROM c3), ARRAY[pg_temp.frame('third')], pg_temp.at(7.5))$$,
                  $$VALUES ('lost')$$, 'a fire after its own lease expired answers lost even without a takeover');
SELECT is((SELECT count(*) FROM queen.timers WHERE timer_key = 'third'), 1::bigint, 'and the row is still there');
SELECT results_eq($$SELECT status FROM queen.schedule_timers('acme', ARRAY[pg_temp.op('third', 1000, 'third-v2')], p_now => pg_temp.at(7.5))$$,
                  $$VALUES ('rescheduled')$$, 'a reschedule takes over an expired claim');
SELECT results_eq($$SELECT claim_id, lease_until FROM queen.timers WHERE timer_key = 'third'$$, $$VALUES (NULL::uuid, NULL::timestamptz)$$,
                  'the takeover clears the claim');
SELECT results_eq($$SELECT outcome FROM queen.fire_timers((SELECT claim_id FROM c3), ARRAY[pg_temp.frame('third')], pg_temp.at(7.5))$$,
                  $$VALUES ('lost')$$, 'the old claim cannot fire the rescheduled timer');

-- ---------------------------------------------------------------- zstd: payload override
SELECT lives_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('zipped', 0, p_zstd => true)])$$, 'setup: a zstd timer');
CREATE TEMP TABLE c4 AS SELECT * FROM queen.claim_timers('b4', 10, 1000, pg_temp.at(20)) WHERE timer_key = 'zipped';
SELECT is((SELECT payload_zstd FROM c4), true, 'the claim hands the broker the zstd flag');
SELECT results_eq($$SELECT outcome FROM queen.fire_timers((SELECT claim_id FROM c4), ARRAY[pg_temp.frame('zipped', '\x696e666c61746564')], pg_temp.at(20))$$,
                  $$VALUES ('fired')$$, 'fire with a payload override');
SELECT is((SELECT payload FROM queen.messages WHERE transaction_id = 'txn-zipped'), '\x696e666c61746564'::bytea,
          'the frame carries the bytes the broker handed back (inflated), not the stored ones');

-- ---------------------------------------------------------------- duplicate txn in the partition
SELECT lives_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('dup', 0, 'txn-first', p_queue => 'fq')])$$, 'setup: a timer reusing a txn already delivered');
CREATE TEMP TABLE p5 AS SELECT pg_temp.pending() AS n;
SELECT throws_ok($$SELECT * FROM queen.fire_due_timers(100, pg_temp.at(30), p_redo_duplicates => false)$$, '23505', NULL,
                 'without the redo (the sweeper''s call, no subtransaction) a duplicate txn raises unique_violation');
SELECT is((SELECT count(*) FROM queen.timers WHERE timer_key IN ('dup', 'third')), 2::bigint, '... and the failed call deleted no timer');
SELECT is((SELECT count(*) FROM queen.messages WHERE transaction_id IN ('txn-first', 'txn-third')), 1::bigint, '... appended no frame');
SELECT is(pg_temp.pending(), (SELECT n FROM p5), '... and left the pending counter as it was');
CREATE TEMP TABLE f5 AS SELECT * FROM queen.fire_due_timers(100, pg_temp.at(30));
SELECT results_eq($$SELECT timer_key, outcome FROM f5 ORDER BY timer_key$$, $$VALUES ('dup', 'duplicate'), ('third', 'fired')$$,
                  'a txn already in the partition answers duplicate');
SELECT is((SELECT count(*) FROM queen.messages WHERE transaction_id = 'txn-first'), 1::bigint, 'no second frame');
SELECT is((SELECT count(*) FROM queen.timers WHERE timer_key IN ('dup', 'third')), 0::bigint, 'the duplicate row is deleted too');
SELECT is(pg_temp.pending(), (SELECT n - 2 FROM p5), 'the pending counter drops by both rows, the duplicate''s too');
SELECT is((SELECT count(*) FROM queen.messages m JOIN f5 ON f5.message_id = m.id WHERE f5.outcome = 'duplicate'), 0::bigint,
          'the duplicate''s own message id never entered the log');
SELECT lives_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('nodup', 0)])$$, 'setup: a timer with a fresh txn');
SELECT results_eq($$SELECT timer_key, outcome FROM queen.fire_due_timers(100, pg_temp.at(30), p_redo_duplicates => false)$$,
                  $$VALUES ('nodup', 'fired')$$, 'without the redo, a batch with no duplicate fires as usual');
SELECT is(pg_temp.pending(), (SELECT n - 2 FROM p5), 'the pending counter drops by the timer fired without the redo');

-- ---------------------------------------------------------------- fire_due_timers leaves zstd and claimed rows alone
SELECT lives_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('plain', 0), pg_temp.op('z2', 0, p_zstd => true), pg_temp.op('held', -1000),
                                                     pg_temp.op('p2', 0, p_partition => 'eu')])$$, 'setup: plain, zstd, claimed');
SELECT is((SELECT timer_key FROM queen.claim_timers('b5', 1, 60000, pg_temp.at(40))), 'held', 'setup: held is claimed');
SELECT results_eq($$SELECT timer_key, outcome FROM queen.fire_due_timers(100, pg_temp.at(40)) ORDER BY timer_key$$,
                  $$VALUES ('p2', 'fired'), ('plain', 'fired')$$,
                  'fire_due_timers fires neither the zstd row nor the claimed row');
SELECT is((SELECT p.name FROM queen.messages m JOIN queen.partitions p ON p.id = m.partition_id WHERE m.transaction_id = 'txn-p2'), 'eu',
          'the frame lands in the timer''s partition (created on first use)');
SELECT results_eq('SELECT timer_key COLLATE "default" FROM queen.timers ORDER BY timer_key', $$VALUES ('held'), ('later'), ('z2')$$, 'left for the leased path');

-- ---------------------------------------------------------------- the sweeper's leased path claims only what needs it
SELECT lives_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('plain3', 0)])$$, 'setup: a due plain timer beside the due zstd one');
SELECT results_eq($$SELECT timer_key COLLATE "default" FROM queen.claim_timers('b6', 10, 60000, pg_temp.at(40), p_zstd_only => true)$$,
                  $$VALUES ('z2')$$, 'p_zstd_only claims the zstd row and leaves the plain one');
SELECT is((SELECT claimed FROM queen.peek_timer('acme', 'fq', 'plain3', pg_temp.at(40))), false, 'the plain row stays for fire_due_timers');

-- ---------------------------------------------------------------- the leased claim bounded by bytes
-- each payload is 'payload of bzN': 14 bytes
SELECT lives_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('bz1', 41000, p_zstd => true), pg_temp.op('bz2', 42000, p_zstd => true),
                                                     pg_temp.op('bz3', 43000, p_zstd => true)])$$, 'setup: three zstd timers of 14 bytes');
SELECT results_eq($$SELECT timer_key COLLATE "default" FROM queen.claim_timers('b7', 10, 60000, pg_temp.at(50), p_zstd_only => true, p_max_bytes => 20)$$,
                  $$VALUES ('bz1'), ('bz2')$$, 'p_max_bytes: rows are claimed in expiry order while the bytes before them are under the bound');
SELECT is((SELECT claim_id FROM queen.timers WHERE timer_key = 'bz3'), NULL, 'the row past the bound is left unclaimed');
SELECT results_eq($$SELECT timer_key COLLATE "default" FROM queen.claim_timers('b7', 10, 60000, pg_temp.at(50), p_zstd_only => true, p_max_bytes => 1)$$,
                  $$VALUES ('bz3')$$, 'the first row is claimed however large it is');

-- ---------------------------------------------------------------- two timers of one txn in one batch
-- (in a partition of their own: the zstd rows claimed above, due before them, would hold them in
-- Default until fired, tests/sql/92_fire_partition_order.sql)
SELECT lives_ok($$SELECT * FROM pg_temp.sched(ARRAY[pg_temp.op('twin-b', 52000, 'txn-twin', p_partition => 'twins'),
                                                     pg_temp.op('twin-a', 51000, 'txn-twin', p_partition => 'twins')])$$,
                'setup: two timers with one txn');
CREATE TEMP TABLE p6 AS SELECT pg_temp.pending() AS n;
CREATE TEMP TABLE f6 AS SELECT * FROM queen.fire_due_timers(100, pg_temp.at(55));
SELECT results_eq($$SELECT timer_key COLLATE "default", outcome FROM f6 ORDER BY deliver_at$$,
                  $$VALUES ('plain3', 'fired'), ('twin-a', 'fired'), ('twin-b', 'duplicate')$$,
                  'one txn twice in one batch: the earlier timer fires, the later one is a duplicate');
SELECT is((SELECT count(*) FROM queen.messages WHERE transaction_id = 'txn-twin'), 1::bigint, 'one frame for the txn');
SELECT is(pg_temp.pending(), (SELECT n - 3 FROM p6), 'the pending counter drops by every row fired or duplicate');

SELECT * FROM finish();
ROLLBACK;
