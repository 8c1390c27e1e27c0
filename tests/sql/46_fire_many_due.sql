-- More tenants with rows due than the fair share's window (4,096 places,
-- migration 022). queen.find_due_tenants takes its 64 candidates a call from
-- the 4,096 tenants with the oldest bound; a served tenant's bound is not
-- raised, so with more than 4,096 due at once the same ones held the window
-- and a tenant past them was never probed until they drained. With the
-- window full, the candidates are the next 64 of all of them in tenant order:
-- every tenant with rows due is probed once a lap. Last, a batch into 300
-- tenants' queues: the partitions that exist are found by ensure_partition's
-- one lookup, the others created, every frame in its own tenant's partition.
BEGIN;
SELECT plan(15);

CREATE FUNCTION pg_temp.t0() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2030-01-01 00:00:00+00'::timestamptz $$;
-- p_n tenants named p_prefix || n, each with one timer due at p_due and its counter row
CREATE FUNCTION pg_temp.due(p_prefix text, p_n integer, p_due timestamptz) RETURNS void LANGUAGE sql AS $$
    INSERT INTO queen.timers (tenant, queue, timer_key, deliver_at, txn, message_id, payload)
    SELECT p_prefix || lpad(i::text, 5, '0'), 'mq', 'k', p_due, 't', gen_random_uuid(), '\x7b7d'
      FROM generate_series(1, p_n) i;
    INSERT INTO queen.tenant_usage (tenant, pending_timers, next_due_at)
    SELECT p_prefix || lpad(i::text, 5, '0'), 1, p_due FROM generate_series(1, p_n) i;
$$;
-- p_calls calls of find_due_tenants at t0, as a sweeper's session makes them; the tenants each returned
CREATE TEMP TABLE got (call integer, tenant text);
CREATE FUNCTION pg_temp.calls(p_calls integer, p_except text[] DEFAULT NULL) RETURNS bigint LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM got;
    FOR i IN 1..p_calls LOOP
        INSERT INTO got SELECT i, t FROM unnest(queen.find_due_tenants(pg_temp.t0(), 256, p_except)) t;
    END LOOP;
    RETURN (SELECT count(*) FROM got);
END
$$;

-- 4,200 tenants due ten seconds ago, and the one whose timer came due last
SELECT lives_ok($$SELECT pg_temp.due('md-', 4200, pg_temp.t0() - interval '10 s'),
                         pg_temp.due('md-last-', 1, pg_temp.t0() - interval '5 s')$$,
                'setup: 4,201 tenants with a timer due, md-last-00001 the latest');
SELECT is(set_config('queen.fire_turn', '', false), '', 'setup: a session that has probed nobody yet');

-- ---------------------------------------------------------------- a lap probes every tenant once
SELECT is(pg_temp.calls(66), 4224::bigint, '66 calls return 64 candidates each');
SELECT is((SELECT count(DISTINCT tenant) FROM got), 4201::bigint,
          '... and between them every one of the 4,201 tenants with a timer due');
SELECT is((SELECT count(DISTINCT tenant) FROM got WHERE call <= 65), 4160::bigint,
          'none a second time before every one once (the first 65 calls: 4,160 different tenants)');
SELECT ok((SELECT min(call) FROM got WHERE tenant = 'md-last-00001') IS NOT NULL,
          'the tenant with the newest bound is probed within the lap (past the 4,096 oldest bounds)');
SELECT is(pg_temp.calls(66), 4224::bigint, 'the next 66 calls, wrapping past the end ...');
SELECT is((SELECT count(DISTINCT tenant) FROM got), 4201::bigint, '... return every tenant again');

-- ---------------------------------------------------------------- the tenants the fire already serves are left out
SELECT is(pg_temp.calls(66, ARRAY['md-last-00001', 'md-00007']), 4224::bigint, 'p_except: 66 calls ...');
SELECT is((SELECT count(DISTINCT tenant) FROM got), 4199::bigint, '... return the other 4,199');
SELECT is((SELECT count(*) FROM got WHERE tenant IN ('md-last-00001', 'md-00007')), 0::bigint,
          '... and never those');

-- ---------------------------------------------------------------- a batch into 300 tenants' queues
-- half of whose partitions exist (found by one lookup) and half not (created)
INSERT INTO queen.timers (tenant, queue, timer_key, deliver_at, txn, message_id, payload)
SELECT 'fp-' || i, 'fq', 'k', pg_temp.t0() - interval '20 s', 'fp-' || i, gen_random_uuid(), '\x7b7d'
  FROM generate_series(1, 300) i;
SELECT is((SELECT count(queen.ensure_partition('fp-' || i, 'fq', 'Default')) FROM generate_series(1, 300, 2) i),
          150::bigint, 'setup: 300 tenants with a timer due, the partitions of 150 created beforehand');
SELECT is((SELECT count(*) FROM queen.fire_due_timers(512, pg_temp.t0() - interval '15 s') WHERE outcome = 'fired'),
          300::bigint, 'one batch fires the 300');
SELECT is((SELECT count(*) FROM queen.messages m JOIN queen.partitions p ON p.id = m.partition_id
             JOIN queen.queues q ON q.id = p.queue_id
            WHERE m.transaction_id LIKE 'fp-%' AND q.tenant = m.transaction_id AND q.name = 'fq' AND p.name = 'Default'),
          300::bigint, 'each frame is in its own tenant''s queue and partition');
SELECT is((SELECT count(*) FROM queen.partitions p JOIN queen.queues q ON q.id = p.queue_id
            WHERE q.tenant LIKE 'fp-%' AND q.name = 'fq'), 300::bigint, 'one partition each: 150 found, 150 created');

SELECT * FROM finish();
ROLLBACK;
