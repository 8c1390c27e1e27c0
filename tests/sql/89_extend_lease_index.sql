-- queen.extend_lease finds the lease by an index (migration 029). It compared
-- pc.lease_id::text = lower(p_lease_id), which no index serves: every renew
-- read every cursor row, by the primary key with the statistics of an empty
-- table (about 650 pages of partition_consumers for one renew among 3,000
-- rows here, 1,550 for a failed one: it looked twice), by a seq scan once
-- analyzed (about 100). Now both lookups compare
-- pc.lease_id = queen.lease_uuid(p_lease_id) and read
-- partition_consumers_lease_idx (a bitmap scan: seq and plain index scans
-- are off), a few pages a renew whatever the statistics say. Which pages
-- and indexes a call visits shows in this transaction's own counters.
-- The answers are those of the text comparison: either case, and nothing
-- else (a malformed id, NULL), names the lease; another tenant's lease is not
-- found, an expired one is expired.
BEGIN;
SELECT plan(32);

CREATE FUNCTION pg_temp.t0() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2030-01-01 00:00:00+00'::timestamptz $$;
CREATE FUNCTION pg_temp.at(p_seconds numeric) RETURNS timestamptz LANGUAGE sql AS $$ SELECT pg_temp.t0() + p_seconds * interval '1 second' $$;
-- pages of partition_consumers, and scans of its lease index, since the last mark()
CREATE TEMP TABLE marks (pages bigint, idx bigint);
CREATE FUNCTION pg_temp.mark() RETURNS void LANGUAGE sql AS $$
    DELETE FROM marks;
    INSERT INTO marks VALUES (pg_stat_get_xact_blocks_fetched('queen.partition_consumers'::regclass),
                              pg_stat_get_xact_numscans('queen.partition_consumers_lease_idx'::regclass)) $$;
CREATE FUNCTION pg_temp.pages() RETURNS bigint LANGUAGE sql AS $$
    SELECT pg_stat_get_xact_blocks_fetched('queen.partition_consumers'::regclass) - pages FROM marks $$;
CREATE FUNCTION pg_temp.idx() RETURNS bigint LANGUAGE sql AS $$
    SELECT pg_stat_get_xact_numscans('queen.partition_consumers_lease_idx'::regclass) - idx FROM marks $$;
CREATE FUNCTION pg_temp.expiry(p_group text) RETURNS timestamptz LANGUAGE sql AS $$
    SELECT lease_expires_at FROM queen.partition_consumers WHERE consumer_group = p_group $$;

-- ---------------------------------------------------------------- the function
SELECT is((SELECT proconfig FROM pg_proc WHERE oid = 'queen.extend_lease(text, text, integer, timestamptz)'::regprocedure),
          ARRAY['enable_seqscan=off', 'enable_indexscan=off'],
          'extend_lease plans without seq scans or plain index scans (the lease index by a bitmap scan)');

-- ---------------------------------------------------------------- 3,000 cursor rows, statistics of an empty table
ANALYZE queen.partition_consumers;
SELECT is((SELECT reltuples > 0 FROM pg_class WHERE oid = 'queen.partition_consumers'::regclass), false,
          'setup: the statistics say partition_consumers holds no row');
SELECT lives_ok($$SELECT * FROM queen.configure_queue('acme', 'in', NULL, NULL, '{"leaseTime": 60}')$$, 'setup: acme''s queue in');
SELECT lives_ok($$SELECT * FROM queen.push_messages('acme', ARRAY[ROW('in', NULL, 'm1', NULL, '\x31'::bytea, false)::queen.push_item])$$,
                'setup: m1');
CREATE TEMP TABLE leased AS
SELECT g AS n, 'g' || g AS grp, m.partition_id, m.lease_id::text AS lease
  FROM generate_series(1, 3000) g, LATERAL queen.pop_messages('acme', 'in', NULL, 'g' || g, 1, p_now => pg_temp.t0()) m;
SELECT is((SELECT count(DISTINCT lease) FROM leased), 3000::bigint, 'setup: 3,000 consumer groups each hold a lease on m1 until t0 + 60 s');
CREATE FUNCTION pg_temp.lease(p_n integer) RETURNS text LANGUAGE sql AS $$ SELECT lease FROM leased WHERE n = p_n $$;

SELECT pg_temp.mark();
SELECT results_eq($$SELECT lease_id, success, error, expires_at, renewed FROM queen.extend_lease('acme', pg_temp.lease(1500), 600, pg_temp.at(10))$$,
                  $$VALUES (pg_temp.lease(1500), true, NULL::text, pg_temp.at(610), 1)$$,
                  'one renew among 3,000 leases: now + seconds, one partition');
SELECT cmp_ok(pg_temp.pages(), '<', 30::bigint, 'it visits a few pages of the cursors (about 11), not every row (about 650 before)');
SELECT cmp_ok(pg_temp.idx(), '>=', 1::bigint, 'it reads partition_consumers_lease_idx');
SELECT is(pg_temp.expiry('g1500'), pg_temp.at(610), 'g1500''s lease moved');
SELECT is((SELECT count(*) FROM queen.partition_consumers WHERE lease_expires_at <> pg_temp.at(60)), 1::bigint, 'and no other');

SELECT pg_temp.mark();
SELECT is((SELECT count(*) FROM leased, LATERAL queen.extend_lease('acme', upper(lease), 120, pg_temp.at(20)) x
            WHERE n % 30 = 0 AND x.success AND x.renewed = 1), 100::bigint,
          '100 renews, in upper case: each extended');
SELECT cmp_ok(pg_temp.pages(), '<', 3000::bigint, 'about 11 pages each (about 74,000 in all before)');

SELECT pg_temp.mark();
SELECT results_eq($$SELECT success, error, renewed FROM queen.extend_lease('acme', pg_temp.lease(7), 60, pg_temp.at(61))$$,
                  $$VALUES (false, 'Lease already expired', 0)$$, 'an expired lease: Lease already expired');
SELECT cmp_ok(pg_temp.pages(), '<', 30::bigint, 'both lookups of a failed renew by the index too (2 pages; about 1,550 before)');

-- ---------------------------------------------------------------- and with statistics that know the rows
ANALYZE queen.partition_consumers;
SELECT is((SELECT reltuples >= 3000 FROM pg_class WHERE oid = 'queen.partition_consumers'::regclass), true,
          'setup: analyzed, the statistics know the 3,000 rows');
SELECT pg_temp.mark();
SELECT results_eq($$SELECT success, expires_at, renewed FROM queen.extend_lease('acme', pg_temp.lease(2999), 300, pg_temp.at(30))$$,
                  $$VALUES (true, pg_temp.at(330), 1)$$, 'analyzed: a renew extends the lease');
SELECT cmp_ok(pg_temp.pages(), '<', 30::bigint, 'and visits a few pages (a seq scan, about 100, before)');
SELECT cmp_ok(pg_temp.idx(), '>=', 1::bigint, 'by partition_consumers_lease_idx');
SELECT pg_temp.mark();
SELECT results_eq($$SELECT success, error FROM queen.extend_lease('acme', pg_temp.lease(8), 60, pg_temp.at(61))$$,
                  $$VALUES (false, 'Lease already expired')$$, 'analyzed: an expired lease');
SELECT cmp_ok(pg_temp.pages(), '<', 30::bigint, 'found by the index (about 90 pages before)');

-- ---------------------------------------------------------------- the same answers as the text comparison
CREATE TEMP TABLE before AS SELECT md5(string_agg(format('%s %s', consumer_group, lease_expires_at), ',' ORDER BY consumer_group)) AS s
  FROM queen.partition_consumers;
SELECT results_eq($$SELECT lease_id, success, expires_at, renewed FROM queen.extend_lease('acme', upper(pg_temp.lease(1500)), 60, pg_temp.at(40))$$,
                  $$VALUES (upper(pg_temp.lease(1500)), true, pg_temp.at(610), 1)$$,
                  'upper case names the lease (echoed as sent), and a renew never shortens it');
SELECT results_eq($$SELECT success, renewed FROM queen.extend_lease('acme',
                        overlay(upper(pg_temp.lease(1500)) placing lower(substr(pg_temp.lease(1500), 1, 8)) from 1 for 8), 60, pg_temp.at(40))$$,
                  $$VALUES (true, 1)$$, 'so does mixed case');
SELECT results_eq($$SELECT lease_id, success, error, expires_at, renewed FROM queen.extend_lease('acme', 'not-a-lease', 60, pg_temp.at(40))$$,
                  $$VALUES ('not-a-lease', false, 'Lease not found', NULL::timestamptz, 0)$$, 'a malformed id is not found (it raises nothing)');
SELECT results_eq($$SELECT lease_id, success, error, renewed FROM queen.extend_lease('acme', NULL, 60, pg_temp.at(40))$$,
                  $$VALUES (NULL::text, false, 'Lease not found', 0)$$, 'nor is NULL');
SELECT results_eq($$SELECT x.error FROM unnest(ARRAY['{' || pg_temp.lease(1500) || '}', replace(pg_temp.lease(1500), '-', ''),
                                                     pg_temp.lease(1500) || ' ', pg_temp.lease(1500) || E'\n', ' ' || pg_temp.lease(1500), '']) l,
                         LATERAL queen.extend_lease('acme', l, 60, pg_temp.at(40)) x$$,
                  $$SELECT 'Lease not found' FROM generate_series(1, 6)$$,
                  'nor another spelling of a held lease (braces, no hyphens, spaces, a newline) or an empty id');
SELECT results_eq($$SELECT success, error, renewed FROM queen.extend_lease('globex', pg_temp.lease(1500), 600, pg_temp.at(40))$$,
                  $$VALUES (false, 'Lease not found', 0)$$, 'another tenant''s lease is not found');
SELECT results_eq($$SELECT success, error FROM queen.extend_lease('globex', upper(pg_temp.lease(9)), 600, pg_temp.at(61))$$,
                  $$VALUES (false, 'Lease not found')$$, 'not even when it expired (not: already expired)');
SELECT results_eq($$SELECT success, error FROM queen.extend_lease('acme', '00000000-0000-0000-0000-000000000001', 60, pg_temp.at(40))$$,
                  $$VALUES (false, 'Lease not found')$$, 'an unknown lease is not found');
SELECT is((SELECT md5(string_agg(format('%s %s', consumer_group, lease_expires_at), ',' ORDER BY consumer_group))
             FROM queen.partition_consumers), (SELECT s FROM before),
          'none of these changed an expiry (a renew never shortens one)');
SELECT results_eq($$SELECT success FROM queen.ack_messages('acme', ARRAY[ROW('m1', (SELECT partition_id FROM leased LIMIT 1), 'completed', NULL,
                                                                              pg_temp.lease(10), 'g10')::queen.ack_item], pg_temp.at(40))$$,
                  $$VALUES (true)$$, 'setup: g10 acks m1 under its lease');
SELECT results_eq($$SELECT success, error FROM queen.extend_lease('acme', pg_temp.lease(10), 60, pg_temp.at(41))$$,
                  $$VALUES (false, 'Lease not found')$$, 'a released lease is not found');
SELECT throws_ok($$SELECT * FROM queen.extend_lease('acme', pg_temp.lease(11), 86401)$$, 'QTBAD', 'timers_bad_request', 'seconds above 86400');

SELECT * FROM finish();
ROLLBACK;
