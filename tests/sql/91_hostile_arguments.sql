-- Hostile arguments from psql get QTBAD and change nothing (migration 034; the Dec 7 audit's
-- calls with NULLs, empty and oversized names and infinities).
BEGIN;
SELECT plan(11);

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

SELECT * FROM finish();
ROLLBACK;
