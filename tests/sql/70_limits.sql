-- Limits on names, in UTF-8 bytes (issue 8): queue 255, timerKey 1024,
-- txn 255, partition 255. Over a limit is QTBAD on every timer function
-- a DBA may call, and writes nothing; at the limit is accepted.
BEGIN;
SELECT plan(27);

CREATE FUNCTION pg_temp.op(p_op text, p_queue text, p_key text, p_txn text DEFAULT 't',
                           p_partition text DEFAULT NULL)
RETURNS queen.timer_op LANGUAGE sql AS $$
    SELECT queen.make_timer_op(p_op, p_queue, p_key,
                               CASE WHEN p_op = 'cancel' THEN NULL ELSE 60000 END,
                               CASE WHEN p_op = 'cancel' THEN NULL ELSE p_txn END,
                               CASE WHEN p_op = 'cancel' THEN NULL ELSE '\x7b7d'::bytea END,
                               p_partition)
$$;

-- ------------------------------------------------------------ schedule
SELECT throws_ok($$SELECT * FROM queen.schedule_timers('acme', ARRAY[pg_temp.op('schedule', repeat('q', 256), 'k')])$$,
                 'QTBAD', 'timers_bad_request', 'schedule: a queue of 256 bytes is QTBAD');
SELECT throws_ok($$SELECT * FROM queen.schedule_timers('acme', ARRAY[pg_temp.op('schedule', 'q', repeat('k', 1025))])$$,
                 'QTBAD', 'timers_bad_request', 'schedule: a timerKey of 1025 bytes is QTBAD');
SELECT throws_ok($$SELECT * FROM queen.schedule_timers('acme', ARRAY[pg_temp.op('schedule', 'q', repeat('k', 3000000))])$$,
                 'QTBAD', 'timers_bad_request', 'schedule: a timerKey of 3 MB is QTBAD, not "index row too large"');
SELECT throws_ok($$SELECT * FROM queen.schedule_timers('acme', ARRAY[pg_temp.op('schedule', 'q', repeat('€', 342))])$$,
                 'QTBAD', 'timers_bad_request', 'schedule: the limit is in bytes: 342 three-byte characters are 1026 bytes');
SELECT throws_ok($$SELECT * FROM queen.schedule_timers('acme', ARRAY[pg_temp.op('schedule', 'q', 'k', repeat('t', 256))])$$,
                 'QTBAD', 'timers_bad_request', 'schedule: a txn of 256 bytes is QTBAD');
SELECT throws_ok($$SELECT * FROM queen.schedule_timers('acme', ARRAY[pg_temp.op('schedule', 'q', 'k', 't', repeat('p', 256))])$$,
                 'QTBAD', 'timers_bad_request', 'schedule: a partition of 256 bytes is QTBAD');
SELECT throws_ok($$SELECT * FROM queen.schedule_timers('acme', ARRAY[pg_temp.op('reschedule', 'q', 'k', repeat('t', 256))])$$,
                 'QTBAD', 'timers_bad_request', 'reschedule: a txn of 256 bytes is QTBAD');
SELECT throws_ok($$SELECT * FROM queen.schedule_timers('acme', ARRAY[pg_temp.op('schedule', 'q', 'ok'),
                                                                     pg_temp.op('cancel', 'q', repeat('k', 1025))])$$,
                 'QTBAD', 'timers_bad_request', 'a batch with one cancel over the limit is refused whole');
SELECT is((SELECT count(*) FROM queen.timers), 0::bigint, 'nothing was written');

SELECT lives_ok($$SELECT * FROM queen.schedule_timers('acme', ARRAY[
                      pg_temp.op('schedule', repeat('q', 255), repeat('k', 1024), repeat('t', 255), repeat('p', 255)),
                      pg_temp.op('schedule', 'q', repeat('€', 341))])$$,
                'every name at its limit is accepted (341 three-byte characters are 1023 bytes)');
SELECT is((SELECT count(*) FROM queen.timers), 2::bigint, 'both timers are stored');

-- ------------------------------------------------------------ check_timer_ops (the shared shape check)
SELECT throws_ok($$SELECT queen.check_timer_ops(ARRAY[pg_temp.op('schedule', 'q', repeat('k', 1025))])$$,
                 'QTBAD', 'timers_bad_request', 'check_timer_ops refuses a timerKey over its limit');
SELECT is(queen.timer_name_problem('q', repeat('k', 1025)), 'timerKey is 1025 bytes; at most 1024 (UTF-8)',
          'timer_name_problem names the field, its size and the limit');
SELECT is(queen.timer_name_problem(repeat('q', 255), repeat('k', 1024), repeat('t', 255), repeat('p', 255)), NULL,
          'timer_name_problem: at the limits is no problem');
SELECT is(queen.timer_name_problem('q', NULL, NULL, repeat('é', 128)), 'partition is 256 bytes; at most 255 (UTF-8)',
          'timer_name_problem counts bytes');

-- ------------------------------------------------------------ cancel_timer (the DELETE route)
SELECT throws_ok($$SELECT queen.cancel_timer('acme', repeat('q', 256), 'k')$$,
                 'QTBAD', 'timers_bad_request', 'cancel_timer: a queue of 256 bytes is QTBAD');
SELECT throws_ok($$SELECT queen.cancel_timer('acme', 'q', repeat('k', 1025))$$,
                 'QTBAD', 'timers_bad_request', 'cancel_timer: a timerKey of 1025 bytes is QTBAD');
SELECT throws_ok($$SELECT queen.cancel_timer('acme', 'q', repeat('k', 3000000))$$,
                 'QTBAD', 'timers_bad_request', 'cancel_timer: a timerKey of 3 MB is QTBAD');
SELECT is(queen.cancel_timer('acme', repeat('q', 255), repeat('k', 1024)), 'cancelled',
          'cancel_timer: names at their limits cancel');

-- ------------------------------------------------------------ peek_timer, list_timers
SELECT throws_ok($$SELECT * FROM queen.peek_timer('acme', repeat('q', 256), 'k')$$,
                 'QTBAD', 'timers_bad_request', 'peek_timer: a queue of 256 bytes is QTBAD');
SELECT throws_ok($$SELECT * FROM queen.peek_timer('acme', 'q', repeat('k', 1025))$$,
                 'QTBAD', 'timers_bad_request', 'peek_timer: a timerKey of 1025 bytes is QTBAD');
SELECT is((SELECT octet_length(timer_key) FROM queen.peek_timer('acme', 'q', repeat('€', 341))), 1023,
          'peek_timer: a key under the limit is found');
SELECT is((SELECT count(*) FROM queen.peek_timer('acme', 'q', 'nope')), 0::bigint, 'peek_timer: a miss is still no row');
SELECT throws_ok($$SELECT * FROM queen.list_timers('acme', repeat('q', 256))$$,
                 'QTBAD', 'timers_bad_request', 'list_timers: a queue of 256 bytes is QTBAD');
SELECT throws_ok($$SELECT * FROM queen.list_timers('acme', 'q', repeat('a', 1025))$$,
                 'QTBAD', 'timers_bad_request', 'list_timers: an after cursor of 1025 bytes is QTBAD');
SELECT is((SELECT count(*) FROM queen.list_timers('acme', 'q', repeat('a', 1024))), 1::bigint,
          'list_timers: an after cursor at the limit pages');
SELECT is((SELECT array_agg(truncated) FROM queen.list_timers('acme', 'q', NULL, 1)), ARRAY[false],
          'list_timers (now PL/pgSQL) still answers its columns');

SELECT * FROM finish();
ROLLBACK;
