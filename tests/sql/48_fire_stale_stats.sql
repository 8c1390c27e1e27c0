-- The fire's claims walk the deliver_at indexes in order whatever the
-- planner's statistics say (migration 025). An autovacuum ANALYZE that ran
-- while a bulk load was not yet committed left queen.timers "empty" over
-- thousands of pages: every plan of the fire then took all due rows by a
-- bitmap scan and sorted them, at every batch (a backlog of 1,000,000 fired
-- at half speed and another tenant's timer waited 460-670 ms for the first
-- batches, until the next ANALYZE). Which rows a call reads shows in this
-- transaction's own counters (pg_stat_get_xact_*).
BEGIN;
SELECT plan(9);

CREATE FUNCTION pg_temp.t0() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2030-01-01 00:00:00+00'::timestamptz $$;
CREATE FUNCTION pg_temp.rows_read() RETURNS bigint LANGUAGE sql AS $$
    SELECT pg_stat_get_xact_tuples_returned('queen.timers'::regclass)
         + pg_stat_get_xact_tuples_fetched('queen.timers'::regclass) $$;
CREATE FUNCTION pg_temp.load(p_tenant text, p_n integer, p_at timestamptz, p_zstd boolean DEFAULT false) RETURNS void LANGUAGE sql AS $$
    INSERT INTO queen.timers (tenant, queue, timer_key, deliver_at, txn, message_id, payload, payload_zstd,
                              created_at, updated_at)
    SELECT p_tenant, 'sq', 'k-' || i, p_at, 'txn-' || i, gen_random_uuid(), '\x00', p_zstd, p_at, p_at
      FROM generate_series(1, p_n) i $$;

SELECT is((SELECT proconfig FROM pg_proc WHERE oid = 'queen.fire_due_rows(integer, timestamptz, text[], integer, boolean)'::regprocedure),
          ARRAY['enable_seqscan=off', 'enable_bitmapscan=off', 'enable_sort=off', 'jit=off'],
          'fire_due_rows plans without seq scans, bitmap scans or sorts it can avoid, and without JIT');
SELECT is((SELECT proconfig FROM pg_proc WHERE oid = 'queen.claim_due_rows(uuid, text, integer, integer, timestamptz, boolean, bigint, text[], integer)'::regprocedure),
          ARRAY['plan_cache_mode=force_custom_plan', 'enable_seqscan=off', 'enable_bitmapscan=off', 'enable_sort=off', 'jit=off'],
          'claim_due_rows too');
SELECT is((SELECT proconfig FROM pg_proc WHERE oid = 'queen.find_due_tenants(timestamptz, integer, text[], boolean)'::regprocedure),
          ARRAY['enable_seqscan=off', 'enable_bitmapscan=off', 'enable_sort=off', 'jit=off'],
          'find_due_tenants too');

-- statistics of an empty table over thousands of pages: analyzed with rows, emptied, analyzed again
SELECT pg_temp.load('st-gone', 20000, pg_temp.t0() + interval '1 day');
ANALYZE queen.timers;
DELETE FROM queen.timers WHERE tenant = 'st-gone';
ANALYZE queen.timers;
SELECT is((SELECT reltuples > 0 FROM pg_class WHERE oid = 'queen.timers'::regclass), false,
          'setup: the statistics say queen.timers holds no row');

-- then two tenants' backlogs fall due, plain and zstd
SELECT pg_temp.load('st-a', 5000, pg_temp.t0() - interval '1 minute');
SELECT pg_temp.load('st-b', 5000, pg_temp.t0() - interval '1 minute');
SELECT pg_temp.load('st-z', 5000, pg_temp.t0() - interval '1 minute', true);
INSERT INTO queen.tenant_usage (tenant, pending_timers, next_due_at)
VALUES ('st-a', 5000, pg_temp.t0() - interval '1 minute'), ('st-b', 5000, pg_temp.t0() - interval '1 minute'),
       ('st-z', 5000, pg_temp.t0() - interval '1 minute');

CREATE TEMP TABLE reads (step text PRIMARY KEY, n bigint);
INSERT INTO reads VALUES ('start', pg_temp.rows_read());
-- a batch of 20: the cell's oldest, then (a backlog: the oldest was due a minute ago) the shares
SELECT is((SELECT count(*) FROM queen.fire_due_timers(20, pg_temp.t0())), 30::bigint,
          'a batch of 20 fires its 20 and the other tenant''s share of 10');
INSERT INTO reads VALUES ('fire', pg_temp.rows_read());
SELECT cmp_ok((SELECT n FROM reads WHERE step = 'fire') - (SELECT n FROM reads WHERE step = 'start'), '<', 500::bigint,
              'it read a few rows of queen.timers, not the 15,000 due');
SELECT is((SELECT count(*) FROM queen.claim_timers('st-broker', 20, 30000, pg_temp.t0(), p_zstd_only => true)), 20::bigint,
          'a zstd claim of 20 claims 20');
INSERT INTO reads VALUES ('claim', pg_temp.rows_read());
SELECT cmp_ok((SELECT n FROM reads WHERE step = 'claim') - (SELECT n FROM reads WHERE step = 'fire'), '<', 500::bigint,
              'it read a few rows too');
SELECT is((SELECT count(*) FROM queen.timers WHERE tenant IN ('st-a', 'st-b', 'st-z')), 14970::bigint,
          'the rest stays (the claimed 20 leased)');

SELECT * FROM finish();
ROLLBACK;
