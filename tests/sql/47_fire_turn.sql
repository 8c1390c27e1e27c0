-- The fair share's turn carried by the caller (migration 023). find_due_tenants
-- starts its candidates after the session's setting queen.fire_turn; behind a
-- transaction pooler a sweeper's calls run on whichever server connection is
-- free, whose setting is another caller's. fire_due_timers and claim_timers
-- take p_turn, which wins over the session's, and the new turn is read back in
-- the same statement (what the sweeper's statements do).
BEGIN;
SELECT plan(9);

CREATE FUNCTION pg_temp.t0() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2030-01-01 00:00:00+00'::timestamptz $$;
-- 'big': a backlog of 5 plain and 5 zstd timers due 10 s ago; tu-001 .. tu-070: one plain
-- and one zstd timer each, due about 5 s ago (tu-001 first, 1 ms apart); every counter row
-- past its bound
INSERT INTO queen.timers (tenant, queue, timer_key, deliver_at, txn, message_id, payload, payload_zstd)
SELECT 'big', 'mq', z || i, pg_temp.t0() - interval '10 s', z || i, gen_random_uuid(), '\x7b7d', z = 'z'
  FROM generate_series(1, 5) i, unnest(ARRAY['p', 'z']) z;
INSERT INTO queen.timers (tenant, queue, timer_key, deliver_at, txn, message_id, payload, payload_zstd)
SELECT 'tu-' || lpad(i::text, 3, '0'), 'mq', z, pg_temp.t0() - interval '5 s' + i * interval '1 ms', z, gen_random_uuid(), '\x7b7d', z = 'z'
  FROM generate_series(1, 70) i, unnest(ARRAY['p', 'z']) z;
INSERT INTO queen.tenant_usage (tenant, pending_timers, next_due_at)
SELECT t, 2, pg_temp.t0() - interval '10 s'
  FROM (SELECT 'big' UNION ALL SELECT 'tu-' || lpad(i::text, 3, '0') FROM generate_series(1, 70) i) x(t);

-- ---------------------------------------------------------------- claim_timers (zstd, the leased path)
SELECT is(set_config('queen.fire_turn', 'tu-050', false), 'tu-050', 'setup: the session''s turn is another caller''s, tu-050');
SELECT is((SELECT count(*) FROM queen.claim_timers('b1', 5, 60000, pg_temp.t0(), p_zstd_only => true,
                                                   p_turn => 'tu-010')), 10::bigint,
          'a full claim of big''s 5 zstd timers due 10 s ago, and a share for 5 more tenants');
SELECT is(current_setting('queen.fire_turn'), 'tu-004',
          'p_turn tu-010 wins over the session''s tu-050: the 64 probed are tu-011 .. tu-070, then tu-001 .. tu-004');

-- ---------------------------------------------------------------- fire_due_timers (the fast path)
SELECT is(set_config('queen.fire_turn', 'tu-050', false), 'tu-050', 'setup: tu-050 again');
SELECT results_eq(
    $$SELECT count(*), current_setting('queen.fire_turn', true)
        FROM (SELECT * FROM queen.fire_due_timers(5, pg_temp.t0(), false, p_turn => 'tu-030') OFFSET 0) f$$,
    $$VALUES (10::bigint, 'tu-024')$$,
    'big''s 5 plain timers and 5 shares; the statement reads back the turn the call left: tu-031 .. tu-070, tu-001 .. tu-024');
SELECT is(set_config('queen.fire_turn', 'tu-050', false), 'tu-050', 'setup: tu-050 again');
SELECT results_eq(
    $$SELECT count(*), current_setting('queen.fire_turn', true)
        FROM (SELECT * FROM queen.fire_due_timers(5, pg_temp.t0(), false, p_turn => NULL) OFFSET 0) f$$,
    $$VALUES (10::bigint, 'tu-048')$$,
    'p_turn NULL: the session''s turn, as before: tu-051 .. tu-070, then big, tu-001 .. tu-005 and tu-011 .. tu-048 (tu-006 .. tu-010 in the batch)');
SELECT is((SELECT count(*) FROM queen.timers WHERE NOT payload_zstd), 55::bigint,
          'of 75 plain timers, 20 fired: none twice, none lost');
SELECT is((SELECT count(*) FROM queen.messages m JOIN queen.partitions p ON p.id = m.partition_id
            JOIN queen.queues q ON q.id = p.queue_id WHERE q.name = 'mq'), 20::bigint,
          '... and 20 frames in the log');

SELECT * FROM finish();
ROLLBACK;
