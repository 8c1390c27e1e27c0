-- schedule_timers(p_staged): a batch whose payloads were COPYed into
-- queen.staged_payloads gets the verdicts, rows, metering and refusals of
-- the same batch sent inline, and leaves no staged row behind.
BEGIN;
SELECT plan(17);

CREATE FUNCTION pg_temp.t0() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2030-01-01 00:00:00+00'::timestamptz $$;
CREATE FUNCTION pg_temp.op(p_op text, p_key text, p_payload bytea DEFAULT NULL, p_raw integer DEFAULT NULL)
RETURNS queen.timer_op LANGUAGE sql AS $$
    SELECT ROW(p_op, 'q', p_key, CASE WHEN p_op = 'cancel' THEN NULL ELSE 60000 END,
               CASE WHEN p_op = 'schedule' THEN 'txn-' || p_key END,
               p_payload, NULL, NULL, NULL, p_raw)::queen.timer_op
$$;
CREATE FUNCTION pg_temp.usage(p_tenant text) RETURNS text LANGUAGE sql AS $$
    SELECT format('billed=%s pending=%s',
                  coalesce((SELECT billed_messages FROM queen.tenant_usage WHERE tenant = p_tenant), 0),
                  queen.get_pending_timers(p_tenant)) $$;

-- the same three schedules, inline for tenant `inline`, staged for tenant `staged`
CREATE TEMP TABLE vi AS SELECT * FROM queen.schedule_timers('inline', ARRAY[
    pg_temp.op('schedule', 'a', '\x01'), pg_temp.op('schedule', 'b', decode(repeat('ab', 5000), 'hex')),
    pg_temp.op('schedule', 'c', '\x03')], p_now => pg_temp.t0());
INSERT INTO queen.staged_payloads (batch, n, payload) VALUES
    ('00000000-0000-0000-0000-000000000001', 1, '\x01'),
    ('00000000-0000-0000-0000-000000000001', 2, decode(repeat('ab', 5000), 'hex'));
-- op 3 is not staged: it keeps its own payload
CREATE TEMP TABLE vs AS SELECT * FROM queen.schedule_timers('staged', ARRAY[
    pg_temp.op('schedule', 'a', NULL), pg_temp.op('schedule', 'b', NULL), pg_temp.op('schedule', 'c', '\x03')],
    p_now => pg_temp.t0(), p_staged => '00000000-0000-0000-0000-000000000001');
SELECT results_eq('SELECT ordinal, op, ok, status, timer_key, txn, deliver_at FROM vs ORDER BY ordinal',
                  'SELECT ordinal, op, ok, status, timer_key, txn, deliver_at FROM vi ORDER BY ordinal',
                  'a staged batch answers the verdicts of the same batch inline');
SELECT results_eq($$SELECT timer_key, payload, deliver_at FROM queen.timers WHERE tenant = 'staged' ORDER BY 1$$,
                  $$SELECT timer_key, payload, deliver_at FROM queen.timers WHERE tenant = 'inline' ORDER BY 1$$,
                  'the staged bytes are stored as the inline ones');
SELECT is(pg_temp.usage('staged'), pg_temp.usage('inline'), 'and metered the same');
SELECT is((SELECT count(*) FROM queen.staged_payloads), 0::bigint, 'the staged rows are gone once the batch is done');

-- a batch with a cancel takes the op-by-op path: staged bytes there too
INSERT INTO queen.staged_payloads (batch, n, payload) VALUES ('00000000-0000-0000-0000-000000000002', 2, '\x0202');
CREATE TEMP TABLE vc AS SELECT * FROM queen.schedule_timers('staged', ARRAY[
    pg_temp.op('cancel', 'c'), pg_temp.op('schedule', 'd', NULL)],
    p_now => pg_temp.t0(), p_staged => '00000000-0000-0000-0000-000000000002');
SELECT results_eq('SELECT status FROM vc ORDER BY ordinal', ARRAY['cancelled', 'scheduled'],
                  'a staged batch with a cancel: one verdict each');
SELECT is((SELECT payload FROM queen.timers WHERE tenant = 'staged' AND timer_key = 'd'), '\x0202'::bytea,
          'the op-by-op path stores the staged bytes');
SELECT is((SELECT count(*) FROM queen.staged_payloads), 0::bigint, 'and leaves no staged row');

-- the checks see the staged bytes: none staged and none sent is "payload is required"
SELECT throws_ok($$SELECT * FROM queen.schedule_timers('staged', ARRAY[pg_temp.op('schedule', 'e', NULL)],
                   p_now => pg_temp.t0(), p_staged => '00000000-0000-0000-0000-000000000003')$$,
                 'QTBAD', 'timers_bad_request', 'an op with neither staged nor own bytes is refused');
-- the payload ceiling (1 MiB with tenancy off) applies to the staged size, and refuses the whole batch
INSERT INTO queen.staged_payloads (batch, n, payload) VALUES
    ('00000000-0000-0000-0000-000000000004', 1, '\x01'),
    ('00000000-0000-0000-0000-000000000004', 2, convert_to(repeat('x', 1048577), 'UTF8'));
SELECT throws_ok($$SELECT * FROM queen.schedule_timers('staged', ARRAY[pg_temp.op('schedule', 'f', NULL),
                   pg_temp.op('schedule', 'g', NULL)], p_now => pg_temp.t0(),
                   p_staged => '00000000-0000-0000-0000-000000000004')$$,
                 'QTBIG', 'payload_too_large', 'a staged payload over the ceiling is refused (QTBIG)');
SELECT is((SELECT count(*) FROM queen.timers WHERE timer_key IN ('f', 'g')), 0::bigint,
          'the refusal writes nothing of the batch');
SELECT ok((SELECT count(*) FROM queen.staged_payloads WHERE batch = '00000000-0000-0000-0000-000000000004') = 2,
          'a refused call leaves its staged rows to its transaction (the broker''s rolls back)');
-- a zstd raw_size larger than the staged bytes is still the size the ceiling checks
INSERT INTO queen.staged_payloads (batch, n, payload) VALUES ('00000000-0000-0000-0000-000000000005', 1, '\x28b52ffd');
SELECT throws_ok($$SELECT * FROM queen.schedule_timers('staged', ARRAY[pg_temp.op('schedule', 'h', NULL, 1048577)],
                   p_now => pg_temp.t0(), p_staged => '00000000-0000-0000-0000-000000000005')$$,
                 'QTBIG', 'payload_too_large', 'the larger of the staged size and raw_size meets the ceiling');

-- a claimed row answers too_late in a staged batch as inline, and keeps its bytes
UPDATE queen.timers SET claim_id = gen_random_uuid(), claimed_by = 'b', lease_until = pg_temp.t0() + interval '1 hour'
 WHERE tenant = 'staged' AND timer_key = 'a';
INSERT INTO queen.staged_payloads (batch, n, payload) VALUES
    ('00000000-0000-0000-0000-000000000006', 1, '\xff'), ('00000000-0000-0000-0000-000000000006', 2, '\xee');
CREATE TEMP TABLE vt AS SELECT * FROM queen.schedule_timers('staged', ARRAY[
    pg_temp.op('reschedule', 'a', NULL), pg_temp.op('reschedule', 'b', NULL)],
    p_now => pg_temp.t0(), p_staged => '00000000-0000-0000-0000-000000000006');
SELECT results_eq('SELECT status FROM vt ORDER BY ordinal', ARRAY['too_late', 'rescheduled'],
                  'too_late and rescheduled in one staged batch');
SELECT results_eq($$SELECT timer_key, payload FROM queen.timers WHERE tenant = 'staged' AND timer_key IN ('a', 'b') ORDER BY 1$$,
                  $$VALUES ('a' COLLATE "C", '\x01'::bytea), ('b', '\xee'::bytea)$$,
                  'the claimed row keeps its bytes, the other takes the staged ones');
SELECT is((SELECT count(*) FROM queen.staged_payloads WHERE batch = '00000000-0000-0000-0000-000000000006'), 0::bigint,
          'no staged row left');
-- without p_staged nothing staged is read
INSERT INTO queen.staged_payloads (batch, n, payload) VALUES ('00000000-0000-0000-0000-000000000007', 1, '\xdd');
SELECT is((SELECT status FROM queen.schedule_timers('staged', ARRAY[pg_temp.op('schedule', 'i', '\xaa')], p_now => pg_temp.t0())),
          'scheduled', 'an inline batch');
SELECT is((SELECT payload FROM queen.timers WHERE tenant = 'staged' AND timer_key = 'i'), '\xaa'::bytea,
          'keeps its own bytes even when a staged row has its ordinal');

SELECT * FROM finish();
ROLLBACK;
