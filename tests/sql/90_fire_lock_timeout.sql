-- The fire waits at most 50 ms on another transaction (migration 031): a frame can
-- wait only on a transaction of its own tenant, but a batch holds every tenant's
-- frames. The two-session behaviour (the waiting tenant left for the next cycle,
-- the others fired, nothing lost or fired twice) is in tests/py/test_fire_lock_wait.py;
-- here, the settings and the tenant-by-tenant fire on one session.
BEGIN;
SELECT plan(6);

SELECT ok('lock_timeout=50ms' = ANY (proconfig), 'fire_due_batch waits at most 50 ms for a lock')
  FROM pg_proc WHERE oid = 'queen.fire_due_batch(integer, timestamptz, integer, boolean)'::regprocedure;
SELECT ok('lock_timeout=50ms' = ANY (proconfig), 'fire_timers waits at most 50 ms for a lock')
  FROM pg_proc WHERE oid = 'queen.fire_timers(uuid, queen.fire_frame[], timestamptz)'::regprocedure;
SELECT function_returns('queen', 'fire_due_apart', ARRAY['integer', 'timestamp with time zone'],
                        'setof queen.fire_result', 'fire_due_apart answers fire results');

-- tenant by tenant, at most p_limit rows in all, answering as the redo does
SELECT queen.schedule_timers('acme', ARRAY[
    ROW('schedule', 'q', 'a1', -2000, 'txn-a1', decode('7b7d', 'hex'), NULL, false, false, NULL)::queen.timer_op,
    ROW('schedule', 'q', 'a2', -1500, 'txn-a2', decode('7b7d', 'hex'), NULL, false, false, NULL)::queen.timer_op]);
SELECT queen.schedule_timers('globex', ARRAY[
    ROW('schedule', 'q', 'g1', -1000, 'txn-g1', decode('7b7d', 'hex'), NULL, false, false, NULL)::queen.timer_op]);
SELECT is((SELECT array_agg(outcome || ':' || tenant || '/' || timer_key ORDER BY timer_key)
             FROM queen.fire_due_apart(2, now())),
          ARRAY['fired:acme/a1', 'fired:acme/a2'], 'at most p_limit rows in all, the tenant due first first');
SELECT is((SELECT array_agg(outcome || ':' || tenant || '/' || timer_key) FROM queen.fire_due_apart(10, now())),
          ARRAY['fired:globex/g1'], 'the rest on the next call');
SELECT is((SELECT count(*) FROM queen.timers), 0::bigint, 'every due row fired once');

SELECT * FROM finish();
ROLLBACK;
