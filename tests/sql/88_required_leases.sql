-- queen.execute_transaction's p_required_leases is checked as a set, by an
-- index (migration 028). It compared pc.lease_id::text = lower(id) for each
-- element, a scan of every cursor row per element: 200,000 copies of one
-- lease against 3,000 cursor rows ran into the statement timeout. Now the
-- distinct ids are each one probe of partition_consumers_lease_idx
-- (queen.first_unheld_lease, seq and bitmap scans off), even with the
-- statistics of an empty table. Which pages a call visits shows in this
-- transaction's own counters; the work a join does in memory (a join
-- filter over a materialized scan, ids x rows) only in the time it takes,
-- bounded here at 2 s (before migration 028: 17 s and 3 s; now 20 and 80 ms),
-- and again with statistics that know the rows (15 s before).
BEGIN;
SELECT plan(30);

CREATE FUNCTION pg_temp.t0() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2030-01-01 00:00:00+00'::timestamptz $$;
CREATE FUNCTION pg_temp.at(p_seconds numeric) RETURNS timestamptz LANGUAGE sql AS $$ SELECT pg_temp.t0() + p_seconds * interval '1 second' $$;
CREATE FUNCTION pg_temp.pages() RETURNS bigint LANGUAGE sql AS $$
    SELECT pg_stat_get_xact_blocks_fetched('queen.partition_consumers'::regclass) $$;
CREATE TEMP TABLE reads (step text PRIMARY KEY, n bigint);
CREATE FUNCTION pg_temp.step(p_step text) RETURNS bigint LANGUAGE sql AS $$
    INSERT INTO reads VALUES (p_step, pg_temp.pages());
    SELECT (SELECT n FROM reads WHERE step = p_step) - max(n) FILTER (WHERE step <> p_step) FROM reads $$;
CREATE TEMP TABLE clock (t timestamptz);
CREATE FUNCTION pg_temp.tick() RETURNS void LANGUAGE sql AS $$ DELETE FROM clock; INSERT INTO clock VALUES (clock_timestamp()) $$;
CREATE FUNCTION pg_temp.ms() RETURNS numeric LANGUAGE sql AS $$ SELECT extract(epoch FROM clock_timestamp() - t) * 1000 FROM clock $$;
CREATE FUNCTION pg_temp.state() RETURNS text LANGUAGE sql AS $$
    SELECT format('%s messages, %s queues, cursors %s', (SELECT count(*) FROM queen.messages), (SELECT count(*) FROM queen.queues),
                  (SELECT md5(string_agg(format('%s %s %s %s', consumer_group, last_consumed_seq, lease_id, lease_expires_at), ',' ORDER BY consumer_group))
                     FROM queen.partition_consumers)) $$;

-- ---------------------------------------------------------------- the pieces
SELECT has_index('queen', 'partition_consumers', 'partition_consumers_lease_idx', ARRAY['lease_id'],
                 'partition_consumers has an index on lease_id');
SELECT is((SELECT proconfig FROM pg_proc WHERE oid = 'queen.first_unheld_lease(text, text[], timestamptz)'::regprocedure),
          ARRAY['enable_seqscan=off', 'enable_bitmapscan=off'],
          'first_unheld_lease plans without seq scans or bitmap scans');
SELECT is(queen.lease_uuid('6F9619FF-8B86-D011-B42D-00C04FC964FF'), '6f9619ff-8b86-d011-b42d-00c04fc964ff'::uuid,
          'lease_uuid: the canonical form, in either case');
SELECT is(ARRAY[queen.lease_uuid('not-a-lease'), queen.lease_uuid(''), queen.lease_uuid(NULL),
                queen.lease_uuid('{6f9619ff-8b86-d011-b42d-00c04fc964ff}'), queen.lease_uuid('6f9619ff8b86d011b42d00c04fc964ff'),
                queen.lease_uuid('6f9619ff-8b86-d011-b42d-00c04fc964ff ')],
          array_fill(NULL::uuid, ARRAY[6]),
          'lease_uuid: anything else (garbage, empty, NULL, braces, no hyphens, a trailing space) is no lease');

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
SELECT is((SELECT count(DISTINCT lease) FROM leased), 3000::bigint, 'setup: 3,000 consumer groups each hold a lease on m1');
CREATE FUNCTION pg_temp.lease(p_n integer) RETURNS text LANGUAGE sql AS $$ SELECT lease FROM leased WHERE n = p_n $$;
CREATE FUNCTION pg_temp.part() RETURNS uuid LANGUAGE sql AS $$ SELECT partition_id FROM leased LIMIT 1 $$;
SELECT pg_temp.step('start');
SELECT pg_temp.tick();

-- ---------------------------------------------------------------- duplicates count once
CREATE TEMP TABLE d1 AS
SELECT * FROM queen.execute_transaction('acme', ARRAY[queen.txn_push('out', '\x6f31', 'o1')],
                                        array_fill(pg_temp.lease(3000), ARRAY[10000]), p_now => pg_temp.at(1));
SELECT results_eq('SELECT success, error, failed_index FROM d1', $$VALUES (true, NULL::text, NULL::integer)$$,
                  '10,000 copies of one held lease: the transaction commits');
SELECT cmp_ok(pg_temp.step('10,000 copies'), '<', 10::bigint,
              'and the check visits a few pages of the cursors, once, not once per copy');
SELECT cmp_ok(pg_temp.ms(), '<', 2000::numeric, 'in well under 2 s');
SELECT pg_temp.tick();

-- ---------------------------------------------------------------- many distinct ids
CREATE TEMP TABLE d2 AS
SELECT * FROM queen.execute_transaction('acme', ARRAY[queen.txn_push('out', '\x6f32', 'o2')],
                                        ARRAY(SELECT upper(lease) FROM leased ORDER BY n DESC), p_now => pg_temp.at(1));
SELECT results_eq('SELECT success, error FROM d2', $$VALUES (true, NULL::text)$$,
                  'all 3,000 leases, in upper case: the transaction commits');
SELECT cmp_ok(pg_temp.step('3,000 leases'), '<', 6000::bigint,
              'one probe per lease (each one a heap page or two), not a scan of the 3,000 rows per lease');
SELECT cmp_ok(pg_temp.ms(), '<', 2000::numeric, 'in well under 2 s');

-- ---------------------------------------------------------------- and with statistics that know the rows
-- (as autovacuum leaves them: the per-element check then scanned every row per element, 15 s here)
ANALYZE queen.partition_consumers;
SELECT pg_temp.tick();
SELECT results_eq($$SELECT success FROM queen.execute_transaction('acme', ARRAY[queen.txn_push('out', '\x6f33', 'o3')],
                                                                array_fill(pg_temp.lease(3000), ARRAY[10000]), p_now => pg_temp.at(1))$$,
                  $$VALUES (true)$$, 'analyzed: 10,000 copies of one held lease, the transaction commits');
SELECT cmp_ok(pg_temp.ms(), '<', 2000::numeric, 'in well under 2 s');

-- ---------------------------------------------------------------- refusals write nothing
CREATE TEMP TABLE before AS SELECT pg_temp.state() AS s;
CREATE TEMP TABLE r1 AS
SELECT * FROM queen.execute_transaction('acme', ARRAY[queen.txn_push('out', '\x72', 'r1')],
                                        ARRAY(SELECT lease FROM leased) || '00000000-0000-0000-0000-000000000001'::text
                                            || 'not-a-lease'::text || ARRAY(SELECT lease FROM leased),
                                        p_now => pg_temp.at(1));
SELECT results_eq('SELECT success, error, failed_index, cardinality(results) FROM r1',
                  $$VALUES (false, 'Invalid or expired lease: 00000000-0000-0000-0000-000000000001', NULL::integer, 0)$$,
                  'an unknown lease among 6,000 held ones: refused, the first one not held named, failed_index NULL');
SELECT lives_ok($$CREATE TEMP TABLE r2 AS
                  SELECT * FROM queen.execute_transaction('acme', ARRAY[queen.txn_push('out', '\x72', 'r2')],
                                                          array_fill(pg_temp.lease(1), ARRAY[5000]) || 'not-a-lease'::text,
                                                          p_now => pg_temp.at(1))$$,
                'a malformed id raises nothing (it is not cast)');
SELECT results_eq('SELECT success, error, failed_index FROM r2', $$VALUES (false, 'Invalid or expired lease: not-a-lease', NULL::integer)$$,
                  'it is a lease nobody holds');
SELECT results_eq($$SELECT success, error FROM queen.execute_transaction('acme', ARRAY[queen.txn_push('out', '\x72', 'r3')],
                                                                       ARRAY[pg_temp.lease(1), NULL], p_now => pg_temp.at(1))$$,
                  $$VALUES (false, 'Invalid or expired lease: ')$$, 'so is NULL');
SELECT results_eq($$SELECT success, failed_index FROM queen.execute_transaction('globex', ARRAY[queen.txn_push('in', '\x67', 'g1')],
                                                                              array_fill(pg_temp.lease(7), ARRAY[10000]), p_now => pg_temp.at(1))$$,
                  $$VALUES (false, NULL::integer)$$, '10,000 copies of acme''s lease are not a lease globex holds');
SELECT results_eq($$SELECT success, error FROM queen.execute_transaction('acme', ARRAY[queen.txn_push('out', '\x72', 'r4')],
                                                                       array_fill(pg_temp.lease(7), ARRAY[10000]), p_now => pg_temp.at(61))$$,
                  $$SELECT false, 'Invalid or expired lease: ' || pg_temp.lease(7)$$, 'nor are copies of a lease that expired');
SELECT is(pg_temp.state(), (SELECT s FROM before), 'none of the refusals wrote anything');
SELECT is((SELECT count(*) FROM queen.queues WHERE tenant = 'globex'), 0::bigint, 'not even globex''s queue');
SELECT throws_ok($$SELECT * FROM queen.execute_transaction('acme', '{}', array_fill(pg_temp.lease(1), ARRAY[10000]))$$,
                 'QTBAD', 'timers_bad_request', 'a shape error is QTBAD whatever the leases');

-- ---------------------------------------------------------------- the lease an ack borrows
-- an ack without its own lease borrows the one distinct lease named, however often and in either case
SELECT results_eq($$SELECT success, error, failed_index FROM queen.execute_transaction('acme',
                        ARRAY[queen.txn_push('out', '\x62', 'b1'), queen.txn_ack('m1', pg_temp.part(), p_consumer_group => 'g5')],
                        ARRAY[pg_temp.lease(6), pg_temp.lease(6), upper(pg_temp.lease(6))], p_now => pg_temp.at(1))$$,
                  $$VALUES (false, 'ACK operation failed: Invalid or expired lease', 1)$$,
                  'copies of g6''s lease are lent to a bare ack for g5: it fails');
SELECT is(pg_temp.state(), (SELECT s FROM before), 'and writes nothing');
SELECT results_eq($$SELECT o.success, r.type, r.transaction_id, r.lease_released FROM queen.execute_transaction('acme',
                        ARRAY[queen.txn_ack('m1', pg_temp.part(), p_consumer_group => 'g5')],
                        ARRAY[pg_temp.lease(5), upper(pg_temp.lease(5)), pg_temp.lease(5)], p_now => pg_temp.at(1)) o,
                        unnest(o.results) r$$,
                  $$VALUES (true, 'ack', 'm1', true)$$,
                  'copies of g5''s own lease: the bare ack passes under it and releases it');
SELECT results_eq($$SELECT lease_id, last_consumed_seq > 0 FROM queen.partition_consumers WHERE consumer_group = 'g5'$$,
                  $$VALUES (NULL::uuid, true)$$, 'g5''s cursor moved past m1, its lease released');
SELECT results_eq($$SELECT success, error FROM queen.execute_transaction('acme',
                        ARRAY[queen.txn_ack('m1', pg_temp.part(), p_consumer_group => 'g8')],
                        ARRAY[pg_temp.lease(8), pg_temp.lease(9)], p_now => pg_temp.at(1))$$,
                  $$VALUES (true, NULL::text)$$,
                  'two distinct leases: none is lent (as before), the bare ack is not lease-checked');

SELECT * FROM finish();
ROLLBACK;
