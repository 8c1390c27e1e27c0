-- Hostile arguments from psql get QTBAD and change nothing (migration 034; the Dec 7 audit's
-- calls with NULLs, empty and oversized names and infinities; migration 038 for the clock of
-- take_rate_tokens, claim_timers and pop_messages).
BEGIN;
SELECT plan(18);

SELECT throws_ok($$SELECT queen.pause_scheduling(NULL)$$, 'QTBAD', 'timers_bad_request',
                 'pause_scheduling(NULL) is QTBAD, not the column''s 23502');
SELECT throws_ok($$SELECT queen.pause_fire(NULL)$$, 'QTBAD', 'timers_bad_request', 'pause_fire(NULL) too');
SELECT is((SELECT scheduling_paused OR fire_paused FROM queen.cell_settings WHERE id), false, 'nothing paused');
SELECT is(queen.pause_scheduling(), true, 'pause_scheduling() still pauses');
SELECT is(queen.resume_scheduling(), true, 'and resume_scheduling resumes');

SELECT throws_ok($$SELECT queen.ensure_queue('acme', '')$$, 'QTBAD', 'timers_bad_request', 'an empty queue');
SELECT throws_ok(format($$SELECT queen.ensure_queue('acme', %L)$$, repeat('q', 256)), 'QTBAD', 'timers_bad_request',
                 'a queue of 256 bytes');
SELECT throws_ok($$SELECT queen.ensure_partition('acme', 'q', '')$$, 'QTBAD', 'timers_bad_request',
                 'an empty partition (not the table''s 23514)');
SELECT throws_ok(
    $$SELECT * FROM queen.schedule_timers('acme', ARRAY[ROW('schedule', 'q', 'k', 1000, 't', '\x7b7d', NULL, false,
                                          false, NULL)::queen.timer_op], p_now => 'infinity')$$,
    'QTBAD', 'timers_bad_request', 'an infinite clock');
SELECT throws_ok(
    $$SELECT * FROM queen.schedule_timers('acme', ARRAY[ROW('schedule', 'q', 'k', -9223372036854775807, 't', '\x7b7d',
                                          NULL, false, false, NULL)::queen.timer_op], p_horizon_ms => 9223372036854775807)$$,
    'QTBAD', 'timers_bad_request', 'a horizon past 100 years (a negative delay overflowed: 22008)');
SELECT is((SELECT count(*) FROM queen.queues) + (SELECT count(*) FROM queen.timers), 0::bigint, 'nothing written');


-- an infinite clock stored nowhere (migration 038): a bucket, a claim, a consumer's lease
SELECT throws_ok($$SELECT queen.take_rate_tokens('acme', 1, 2, 2, 'infinity')$$, 'QTBAD', 'timers_bad_request',
                 'take_rate_tokens: an infinite clock (every later refill failed)');
SELECT throws_ok($$SELECT queen.take_rate_tokens('acme', 1, 2, 2, '-infinity')$$, 'QTBAD', 'timers_bad_request',
                 '... or minus infinity');
SELECT lives_ok($$SELECT queen.take_rate_tokens('acme', 1, 2, 2)$$, 'the database clock takes a token');
SELECT is((SELECT count(*) FROM queen.rate_buckets WHERE isfinite(refilled_at)), 1::bigint, 'one bucket, at a finite instant');
SELECT * FROM queen.schedule_timers('acme', ARRAY[ROW('schedule', 'q', 'due', -1000, 't', '\x7b7d', NULL, false,
                                    false, NULL)::queen.timer_op]);
SELECT throws_ok($$SELECT * FROM queen.claim_timers('b1', p_now => 'infinity')$$, 'QTBAD', 'timers_bad_request',
                 'claim_timers: an infinite clock (a claim held forever)');
SELECT is((SELECT lease_until IS NULL AND claim_id IS NULL FROM queen.timers WHERE timer_key = 'due'), true,
          '... claims nothing');
SELECT throws_ok($$SELECT * FROM queen.pop_messages('acme', 'q', p_now => 'infinity')$$, 'QTBAD', 'timers_bad_request',
                 'pop_messages: an infinite clock (a lease that never ends)');

SELECT * FROM finish();
ROLLBACK;
