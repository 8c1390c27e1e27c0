-- Two sessions racing a cancel against a claim, with real concurrency:
-- dblink opens the other sessions (they must commit to see each other),
-- so this file cleans up what they committed instead of relying on the
-- ROLLBACK below. Tenant 'race-tap' keeps it away from every other file.
BEGIN;
SELECT plan(9);
CREATE EXTENSION IF NOT EXISTS dblink;

CREATE FUNCTION pg_temp.connstr() RETURNS text LANGUAGE sql AS $$
    SELECT format('host=127.0.0.1 port=%s dbname=%s user=%s', current_setting('port'), current_database(), current_user)
$$;
-- The backend pid behind a dblink connection (ask before it gets busy).
CREATE FUNCTION pg_temp.pid_of(p_name text) RETURNS int LANGUAGE sql AS $$
    SELECT pid FROM dblink(p_name, 'SELECT pg_backend_pid()') AS t(pid int)
$$;
-- Wait (bounded, 10 s) until backend v_pid waits on a lock.
CREATE FUNCTION pg_temp.waits_on_lock(v_pid int) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    FOR i IN 1..1000 LOOP
        IF EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = v_pid AND wait_event_type = 'Lock') THEN
            RETURN true;
        END IF;
        PERFORM pg_sleep(0.01);
    END LOOP;
    RETURN false;
END
$$;
CREATE FUNCTION pg_temp.schedule(p_key text) RETURNS text LANGUAGE sql AS $$
    SELECT status FROM dblink('setup', format(
        $q$SELECT status FROM queen.schedule_timers('race-tap', ARRAY[queen.make_timer_op('schedule', 'race-q', %L,
              p_delay_ms => -1000, p_txn => %L, p_payload => '\x00'::bytea)])$q$, p_key, 'txn-' || p_key))
        AS t(status text)
$$;

SELECT dblink_connect('setup', pg_temp.connstr());
SELECT dblink_connect('claimer', pg_temp.connstr());
SELECT dblink_connect('canceller', pg_temp.connstr());
CREATE TEMP TABLE canceller AS SELECT pg_temp.pid_of('canceller') AS pid;

-- ---------------------------------------------------------------- a claim in flight: the cancel waits, then is too_late
SELECT is(pg_temp.schedule('k1'), 'scheduled', 'setup: a due timer, committed');
SELECT dblink_exec('claimer', 'BEGIN');
SELECT is((SELECT key FROM dblink('claimer',
              $q$SELECT timer_key FROM queen.claim_timers('tap-broker', 10, 60000) WHERE tenant = 'race-tap'$q$) AS t(key text)),
          'k1', 'the claimer holds k1, its transaction still open');
SELECT dblink_send_query('canceller', $q$SELECT queen.cancel_timer('race-tap', 'race-q', 'k1')$q$);
SELECT ok(pg_temp.waits_on_lock((SELECT pid FROM canceller)), 'the cancel waits on the claim''s row lock');
SELECT dblink_exec('claimer', 'COMMIT');
SELECT is((SELECT status FROM dblink_get_result('canceller') AS t(status text)), 'too_late',
          'once the claim commits, the cancel answers too_late');
SELECT * FROM dblink_get_result('canceller') AS t(status text);  -- drain: ends the async query

-- ---------------------------------------------------------------- a cancel in flight: the claim skips the row
SELECT is(pg_temp.schedule('k2'), 'scheduled', 'setup: another due timer, committed');
SELECT dblink_exec('canceller', 'BEGIN');
SELECT is((SELECT status FROM dblink('canceller', $q$SELECT queen.cancel_timer('race-tap', 'race-q', 'k2')$q$) AS t(status text)),
          'cancelled', 'the canceller deleted k2, its transaction still open');
SELECT is((SELECT count(*) FROM dblink('claimer',
              $q$SELECT timer_key FROM queen.claim_timers('tap-broker-2', 10, 60000) WHERE tenant = 'race-tap'$q$) AS t(key text)),
          0::bigint, 'a concurrent claim skips the locked row (SKIP LOCKED) instead of waiting');
SELECT dblink_exec('canceller', 'COMMIT');
SELECT is((SELECT n FROM dblink('setup', $q$SELECT count(*) FROM queen.timers WHERE tenant = 'race-tap' AND timer_key = 'k2'$q$) AS t(n bigint)),
          0::bigint, 'k2 is gone: the cancel won');
SELECT is((SELECT n FROM dblink('setup', $q$SELECT count(*) FROM queen.timers WHERE tenant = 'race-tap' AND timer_key = 'k1' AND lease_until > now()$q$) AS t(n bigint)),
          1::bigint, 'k1 is still held by its claim');

-- ---------------------------------------------------------------- clean up what the other sessions committed
SELECT dblink_exec('setup', $q$DELETE FROM queen.timers WHERE tenant = 'race-tap'$q$);
SELECT dblink_exec('setup', $q$DELETE FROM queen.tenant_usage WHERE tenant = 'race-tap'$q$);
SELECT dblink_exec('setup', $q$DELETE FROM queen.tenant_usage_deltas WHERE tenant = 'race-tap'$q$);
SELECT dblink_disconnect('setup');
SELECT dblink_disconnect('claimer');
SELECT dblink_disconnect('canceller');

SELECT * FROM finish();
ROLLBACK;
