-- apply_retention with real concurrency (dblink sessions, which commit
-- to see each other, so this file removes what they committed): a
-- partition one session is trimming is skipped by another, never waited
-- for, and an append to that partition does not wait either.
BEGIN;
SELECT plan(7);
CREATE EXTENSION IF NOT EXISTS dblink;
SET LOCAL statement_timeout = '10s';

CREATE FUNCTION pg_temp.connstr() RETURNS text LANGUAGE sql AS $$
    SELECT format('host=127.0.0.1 port=%s dbname=%s user=%s', current_setting('port'), current_database(), current_user)
$$;
-- one apply_retention call in a session, as 'pending/completed/dlq/skipped'
CREATE FUNCTION pg_temp.ret(p_conn text, p_limit integer) RETURNS text LANGUAGE sql AS $$
    SELECT r FROM dblink(p_conn, format($q$SELECT format('%%s/%%s/%%s/%%s', pending_deleted, completed_deleted, dlq_deleted,
                                                          partitions_skipped)
                                             FROM queen.apply_retention(%s)$q$, p_limit)) AS t(r text)
$$;
CREATE FUNCTION pg_temp.frames() RETURNS bigint LANGUAGE sql AS $$
    SELECT count(*) FROM queen.messages m JOIN queen.partitions p ON p.id = m.partition_id
      JOIN queen.queues q ON q.id = p.queue_id WHERE q.tenant = 'default' AND q.name = 'r-race' $$;

SELECT dblink_connect('setup', pg_temp.connstr());
SELECT dblink_connect('one', pg_temp.connstr());
SELECT dblink_connect('two', pg_temp.connstr());
SELECT dblink_exec('setup', $q$SET statement_timeout = '5s'$q$);
SELECT dblink_exec('two', $q$SET statement_timeout = '5s'$q$);

-- 30 expired frames in the queue's one partition (Default), committed
SELECT dblink_exec('setup', $q$
    SELECT queen.configure_queue('default', 'r-race', NULL, NULL, '{"retentionEnabled": true, "retentionSeconds": 60}');
    SELECT count(*) FROM queen.push_messages('default', (SELECT array_agg(ROW('r-race', NULL, 'race-' || g, NULL, '\x00'::bytea, false)::queen.push_item)
                                                FROM generate_series(1, 30) g));
    UPDATE queen.messages m SET created_at = now() - interval '1 hour'
      FROM queen.partitions p JOIN queen.queues q ON q.id = p.queue_id
     WHERE m.partition_id = p.id AND q.tenant = 'default' AND q.name = 'r-race'$q$);
SELECT is(pg_temp.frames(), 30::bigint, 'setup: 30 expired frames, committed');

SELECT dblink_exec('one', 'BEGIN');
SELECT is(pg_temp.ret('one', 10), '10/0/0/0', 'session one deleted 10 frames, its transaction still open');
SELECT is(pg_temp.ret('two', 100), '0/0/0/1', 'session two skips the partition one is working on (no wait, no double work)');
SELECT is((SELECT status FROM dblink('setup', $q$SELECT status FROM queen.push_messages('default',
              ARRAY[ROW('r-race', NULL, 'race-new', NULL, '\x01'::bytea, false)::queen.push_item])$q$) AS t(status text)),
          'queued', 'an append to that partition does not wait for retention');
SELECT dblink_exec('one', 'COMMIT');
SELECT is(pg_temp.ret('two', 100), '20/0/0/0', 'once one commits, two deletes the rest of the expired head');
SELECT is(pg_temp.frames(), 1::bigint, 'only the fresh frame is left');
SELECT is(pg_temp.ret('one', 100), '0/0/0/0', 'nothing left to do');

-- what the sessions committed
SELECT dblink_exec('setup', $q$DELETE FROM queen.queues WHERE tenant = 'default' AND name = 'r-race'$q$);
SELECT dblink_disconnect('setup');
SELECT dblink_disconnect('one');
SELECT dblink_disconnect('two');

SELECT * FROM finish();
ROLLBACK;
