-- What a DBA passes from psql that a function cannot use is refused with QTBAD
-- (or a check violation on the settings row), and changes nothing: not an
-- internal error, a silent no-op, or a value stored that breaks later calls
-- (migration 042).
BEGIN;
SELECT plan(22);

-- the settings row: a horizon a delay can be added to, a rate a bucket can divide by
SELECT throws_ok($$UPDATE queen.cell_settings SET horizon_ms = 9000000000000000000$$, '23514', NULL,
                 'a cell horizon past 100 years is refused (a delay overflowed the timestamp, 22008)');
SELECT lives_ok($$UPDATE queen.cell_settings SET horizon_ms = 3155760000000$$, '100 years is taken');
SELECT results_eq($$SELECT status FROM queen.schedule_timers('acme', ARRAY[
                      queen.make_timer_op('schedule', 'q', 'far', -9000000000000000000, 't-far', '\x00')])$$,
                  $$VALUES ('scheduled')$$, 'and a delay of any size is held within it');
SELECT throws_ok($$UPDATE queen.cell_settings SET rate_ops_per_second = 0$$, '23514', NULL,
                 'a cell rate of 0 is refused (the second batch divided by zero, 22012)');
SELECT throws_ok($$SELECT queen.take_rate_tokens('acme', 1, 0, NULL)$$, 'QTBAD', 'timers_bad_request',
                 'take_rate_tokens refuses a rate of 0');
SELECT is((SELECT count(*) FROM queen.rate_buckets WHERE tenant = 'acme'), 0::bigint, 'and keeps no bucket');

-- a clock that is not finite: refused wherever a function stores or deletes by it
SELECT lives_ok($$SELECT queen.schedule_timers('acme', ARRAY[
                    queen.make_timer_op('schedule', 'q', 'due', 0, 't-due', '\x01', p_payload_zstd => true)])$$,
                'setup: a due zstd timer');
CREATE TEMP TABLE cl AS SELECT * FROM queen.claim_timers('b', NULL, NULL, p_zstd_only => true);
SELECT results_eq($$SELECT timer_key, lease_until - now() FROM cl$$, $$VALUES ('due', interval '30 seconds')$$,
                  'claim_timers takes a NULL limit and lease as their defaults (100, 30 s)');
SELECT throws_ok($$SELECT queen.fail_timer('acme', 'q', 'due', (SELECT claim_id FROM cl), 'transient', 'boom',
                                          p_now => '-infinity')$$, 'QTBAD', 'timers_bad_request',
                 'fail_timer refuses -infinity (its deliver_at broke every sweeper''s next_timer_due_ms)');
SELECT throws_ok($$SELECT queen.fail_timer('acme', 'q', 'due', (SELECT claim_id FROM cl), 'transient', 'boom',
                                          p_backoff_ms => NULL, p_backoff_max_ms => NULL)$$,
                 'QTBAD', 'timers_bad_request', 'fail_timer refuses NULL backoffs (a NULL deliver_at, 23502)');
SELECT throws_ok($$SELECT queen.fail_timer('acme', 'q', 'due', (SELECT claim_id FROM cl), 'permanent', 'boom',
                                          p_max_attempts => NULL)$$,
                 'QTBAD', 'timers_bad_request', 'and NULL attempts (they never ran out)');
SELECT throws_ok($$SELECT * FROM queen.inflate_timers((SELECT claim_id FROM cl),
                      ARRAY[ROW('acme', 'q', 'due', '\x02')::queen.fire_frame], 'infinity')$$,
                 'QTBAD', 'timers_bad_request', 'inflate_timers refuses infinity');
SELECT throws_ok($$SELECT * FROM queen.fire_timers((SELECT claim_id FROM cl),
                      ARRAY[ROW('acme', 'q', 'due', '\x02')::queen.fire_frame], '-infinity')$$,
                 'QTBAD', 'timers_bad_request', 'fire_timers refuses -infinity');
SELECT throws_ok($$SELECT * FROM queen.fire_due_timers(10, 'infinity')$$, 'QTBAD', 'timers_bad_request',
                 'fire_due_timers refuses infinity');
SELECT results_eq($$SELECT claim_id = (SELECT claim_id FROM cl), attempts FROM queen.timers
                     WHERE timer_key = 'due'$$,
                  $$VALUES (true, 0)$$, 'and the claimed timer is as it was');
SELECT is((SELECT count(*) FROM queen.fire_due_timers(NULL) f WHERE f.timer_key = 'far'), 1::bigint,
          'fire_due_timers takes a NULL limit as its default: the due plain timer fires');

SELECT throws_ok($$SELECT * FROM queen.apply_retention(1000, 'infinity')$$, 'QTBAD', 'timers_bad_request',
                 'apply_retention refuses infinity (everything older than it would go)');
SELECT throws_ok($$SELECT * FROM queen.extend_lease('acme', gen_random_uuid()::text, 60, 'infinity')$$,
                 'QTBAD', 'timers_bad_request', 'extend_lease refuses infinity');

-- the log: a group its cursors' key can hold, a byte bound that hands out the first message
SELECT is((SELECT count(*) FROM queen.push_messages('acme', ARRAY[
              ROW('lq', NULL, 'm1', NULL, '\x7b7d'::bytea, false)::queen.push_item])), 1::bigint, 'setup: a frame');
SELECT throws_ok(format($$SELECT * FROM queen.pop_messages('acme', 'lq', p_consumer_group => %L)$$,
                        repeat('g', 256)),
                 'QTBAD', 'timers_bad_request', 'pop_messages refuses a group over 255 bytes (54000 before)');
SELECT throws_ok($$SELECT * FROM queen.pop_messages('acme', 'lq', p_max_bytes => 0)$$,
                 'QTBAD', 'timers_bad_request', 'and a byte bound below 1 (it handed out nothing)');
SELECT throws_ok(format($$SELECT * FROM queen.ack_messages('acme', ARRAY[ROW('m1',
                            (SELECT partition_id FROM queen.messages WHERE transaction_id = 'm1'), 'completed',
                            NULL, NULL, %L)::queen.ack_item])$$, repeat('g', 256)),
                 'QTBAD', 'timers_bad_request', 'ack_messages refuses such a group too');

SELECT * FROM finish();
ROLLBACK;
