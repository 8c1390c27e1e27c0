-- The payload ceiling of a timer the broker encrypted is on the client's bytes
-- (raw_size), not on the envelope stored (4/3 of them plus 77 bytes), and the
-- envelope's own length still bounds it; the consumer group timers' dead letters
-- are filed under is refused to consumers (migration 043).
BEGIN;
SELECT plan(14);

-- an envelope of n client bytes is 4 * ceil(n / 3) + 77 bytes (payloads.encrypt)
CREATE FUNCTION pg_temp.envelope(n integer) RETURNS bytea LANGUAGE sql AS
$$ SELECT convert_to(repeat('e', 4 * ((n + 2) / 3) + 77), 'UTF8') $$;
CREATE FUNCTION pg_temp.op(key text, payload bytea, raw integer, zstd boolean DEFAULT NULL,
                           encrypted boolean DEFAULT true) RETURNS queen.timer_op LANGUAGE sql AS
$$ SELECT queen.make_timer_op('schedule', 'enc', key, 60000, 't-' || key, payload,
                              p_payload_zstd => zstd, p_encrypted => encrypted, p_raw_size => raw) $$;

SELECT is(queen.timer_payload_size(pg_temp.op('a', pg_temp.envelope(800000), 800000)), 800000::bigint,
          'an encrypted op weighs its client bytes, not its 1,066,745-byte envelope');
SELECT is(queen.timer_payload_size(pg_temp.op('b', pg_temp.envelope(1048576), 1048576)), 1048576::bigint,
          'at the ceiling too');
SELECT is(queen.timer_payload_size(pg_temp.op('c', pg_temp.envelope(1048576), 10)), 1048576::bigint,
          'a raw_size below what the envelope says weighs what the envelope says');
SELECT is(queen.timer_payload_size(pg_temp.op('d', '\x0102', NULL)), 2::bigint,
          'encrypted without a raw_size (a client''s own envelope): its decoded bytes');
SELECT is(queen.timer_payload_size(pg_temp.op('e', '\x0102', 5000, zstd => true)), 5000::bigint,
          'a zstd op: the larger of its decoded and decompressed bytes, as before');

SELECT results_eq($$SELECT status FROM queen.schedule_timers('acme', ARRAY[
                      pg_temp.op('a', pg_temp.envelope(800000), 800000),
                      pg_temp.op('b', pg_temp.envelope(1048576), 1048576)])$$,
                  $$VALUES ('scheduled'), ('scheduled')$$,
                  'client payloads of 800,000 and 1,048,576 bytes are scheduled encrypted (813 KiB was 413)');
SELECT throws_ok($$SELECT * FROM queen.schedule_timers('acme', ARRAY[pg_temp.op('f', pg_temp.envelope(1048577), 1048577)])$$,
                 'QTBIG', 'payload_too_large', 'one byte past the ceiling is refused');
SELECT throws_ok($$SELECT * FROM queen.schedule_timers('acme', ARRAY[pg_temp.op('g', pg_temp.envelope(1400000), 800000)])$$,
                 'QTBIG', 'payload_too_large', 'a raw_size that understates its envelope lets nothing larger in');
SELECT throws_ok($$SELECT * FROM queen.schedule_timers('acme', ARRAY[
                       pg_temp.op('h', pg_temp.envelope(800000), NULL)])$$,
                 'QTBIG', 'payload_too_large', 'a client''s own envelope is its decoded payload: over the ceiling');

-- the staged path keeps the broker's raw_size for an encrypted op
INSERT INTO queen.staged_payloads VALUES ('00000000-0000-0000-0000-000000000043', 1, pg_temp.envelope(900000));
SELECT results_eq($$SELECT status FROM queen.schedule_timers('acme', ARRAY[pg_temp.op('s', '', 900000)],
                      p_staged => '00000000-0000-0000-0000-000000000043')$$,
                  $$VALUES ('scheduled')$$, 'a staged encrypted op of 900,000 client bytes is scheduled');
SELECT is((SELECT octet_length(payload) FROM queen.timers WHERE tenant = 'acme' AND timer_key = 's'),
          octet_length(pg_temp.envelope(900000)), 'with its staged envelope stored');

-- the group of timers' dead letters
SELECT throws_ok($$SELECT * FROM queen.pop_messages('acme', 'enc', NULL, '__QUEEN_TIMERS__')$$,
                 'QTBAD', 'timers_bad_request', 'no consumer pops in __QUEEN_TIMERS__');
SELECT throws_ok($$SELECT * FROM queen.ack_messages('acme', ARRAY[ROW('x', gen_random_uuid(), 'dlq', 'e', NULL,
                                                                      '__QUEEN_TIMERS__')::queen.ack_item])$$,
                 'QTBAD', 'timers_bad_request', 'nor acks in it (its dead letter could never be replayed)');
SELECT lives_ok($$SELECT * FROM queen.list_dlq('acme', NULL, '__QUEEN_TIMERS__')$$,
                'the DLQ is still listed by that group');

SELECT * FROM finish();
ROLLBACK;
