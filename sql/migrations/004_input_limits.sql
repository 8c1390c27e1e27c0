-- =====================================================================
-- Migration 004: documented limits on names (issue 8), in UTF-8 bytes:
-- queue 255, timerKey 1024, txn 255, partition 255. Over a limit is
-- QTBAD (400 timers_bad_request), no longer a btree "index row too
-- large" that the broker mapped to 503 (retry forever).
--
-- New:      queen.timer_name_problem
-- Replaced: queen.delete_unclaimed_timer (so queen.cancel_timer),
--           queen.check_timer_ops (so queen.schedule_timers),
--           queen.peek_timer and queen.list_timers (now PL/pgSQL, to raise)
-- Same text as sql/schema/30_timers.sql.
-- =====================================================================

CREATE FUNCTION queen.timer_name_problem(
    p_queue     text,
    p_timer_key text DEFAULT NULL,
    p_txn       text DEFAULT NULL,
    p_partition text DEFAULT NULL)
RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
             WHEN octet_length(p_queue) > 255
               THEN format('queue is %s bytes; at most 255 (UTF-8)', octet_length(p_queue))
             WHEN octet_length(p_timer_key) > 1024
               THEN format('timerKey is %s bytes; at most 1024 (UTF-8)', octet_length(p_timer_key))
             WHEN octet_length(p_txn) > 255
               THEN format('txn is %s bytes; at most 255 (UTF-8)', octet_length(p_txn))
             WHEN octet_length(p_partition) > 255
               THEN format('partition is %s bytes; at most 255 (UTF-8)', octet_length(p_partition))
           END
$$;

CREATE OR REPLACE FUNCTION queen.delete_unclaimed_timer(
    p_tenant    text,
    p_queue     text,
    p_timer_key text,
    p_now       timestamptz DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_now   timestamptz := coalesce(p_now, now());
    v_lease timestamptz;
BEGIN
    IF p_queue IS NULL OR p_queue = '' OR p_timer_key IS NULL OR p_timer_key = '' THEN
        RAISE EXCEPTION 'timers_bad_request'
            USING ERRCODE = 'QTBAD', DETAIL = 'queue and timerKey are required';
    END IF;
    IF octet_length(p_queue) > 255 OR octet_length(p_timer_key) > 1024 THEN
        RAISE EXCEPTION 'timers_bad_request'
            USING ERRCODE = 'QTBAD', DETAIL = queen.timer_name_problem(p_queue, p_timer_key);
    END IF;
    SELECT lease_until INTO v_lease
      FROM queen.timers
     WHERE tenant = p_tenant AND queue = p_queue AND timer_key = p_timer_key
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 'absent';
    END IF;
    IF queen.timer_is_claimed(v_lease, v_now) THEN
        RETURN 'too_late';
    END IF;
    DELETE FROM queen.timers
     WHERE tenant = p_tenant AND queue = p_queue AND timer_key = p_timer_key;
    RETURN 'cancelled';
END
$$;

CREATE OR REPLACE FUNCTION queen.check_timer_ops(p_ops queen.timer_op[], p_max_ops integer DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_max integer := coalesce(p_max_ops, (queen.get_cell_settings()).max_ops);
    v_msg text;
BEGIN
    IF cardinality(p_ops) > v_max THEN
        RAISE EXCEPTION 'timers_bad_request'
            USING ERRCODE = 'QTBAD', DETAIL = format('%s operations; at most %s per call', cardinality(p_ops), v_max);
    END IF;
    SELECT CASE
             WHEN o.op IS NULL OR o.op NOT IN ('schedule', 'reschedule', 'cancel')
               THEN format('operation %s: unknown op %L', n, o.op)
             WHEN o.queue IS NULL OR o.queue = ''
               THEN format('operation %s: queue is required', n)
             WHEN o.timer_key IS NULL OR o.timer_key = ''
               THEN format('operation %s: timerKey is required', n)
             WHEN o.op <> 'cancel' AND o.delay_ms IS NULL
               THEN format('operation %s: delayMs is required', n)
             WHEN o.op = 'schedule' AND (o.txn IS NULL OR o.txn = '')
               THEN format('operation %s: txn is required', n)
             WHEN o.op <> 'cancel' AND o.payload IS NULL
               THEN format('operation %s: payload is required', n)
             WHEN o.partition = ''
               THEN format('operation %s: partition may not be empty', n)
             WHEN queen.timer_name_problem(o.queue, o.timer_key, o.txn, o.partition) IS NOT NULL
               THEN format('operation %s: %s', n,
                           queen.timer_name_problem(o.queue, o.timer_key, o.txn, o.partition))
           END
      INTO v_msg
      FROM unnest(p_ops) WITH ORDINALITY AS o(op, queue, timer_key, delay_ms, txn, payload,
                                              partition, payload_zstd, encrypted, raw_size, n)
     WHERE o.op IS NULL OR o.op NOT IN ('schedule', 'reschedule', 'cancel')
        OR o.queue IS NULL OR o.queue = '' OR o.timer_key IS NULL OR o.timer_key = ''
        OR (o.op <> 'cancel' AND (o.delay_ms IS NULL OR o.payload IS NULL))
        OR (o.op = 'schedule' AND (o.txn IS NULL OR o.txn = ''))
        OR o.partition = ''
        OR queen.timer_name_problem(o.queue, o.timer_key, o.txn, o.partition) IS NOT NULL
     ORDER BY n LIMIT 1;
    IF v_msg IS NOT NULL THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = v_msg;
    END IF;
    SELECT format('(%s, %s) appears more than once in the batch', queue, timer_key) INTO v_msg
      FROM unnest(p_ops) GROUP BY queue, timer_key HAVING count(*) > 1 LIMIT 1;
    IF v_msg IS NOT NULL THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = v_msg;
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION queen.peek_timer(
    p_tenant    text,
    p_queue     text,
    p_timer_key text,
    p_now       timestamptz DEFAULT NULL)
RETURNS SETOF queen.timer_view
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_problem text := queen.timer_name_problem(p_queue, p_timer_key);
BEGIN
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = v_problem;
    END IF;
    RETURN QUERY
    SELECT t.tenant, t.queue, t.timer_key COLLATE "default", t.partition, t.deliver_at, t.txn, t.message_id,
           t.payload, t.payload_zstd, t.encrypted, t.producer_sub, t.attempts, t.last_error,
           queen.timer_is_claimed(t.lease_until, coalesce(p_now, now())), t.created_at, t.updated_at
      FROM queen.timers t
     WHERE t.tenant = p_tenant AND t.queue = p_queue AND t.timer_key = p_timer_key;
END
$$;

CREATE OR REPLACE FUNCTION queen.list_timers(
    p_tenant text,
    p_queue  text,
    p_after  text    DEFAULT NULL,
    p_limit  integer DEFAULT 100,
    p_now    timestamptz DEFAULT NULL)
RETURNS TABLE (
    timer_key    text,
    partition    text,
    deliver_at   timestamptz,
    txn          text,
    message_id   uuid,
    payload_zstd boolean,
    encrypted    boolean,
    producer_sub text,
    attempts     integer,
    last_error   text,
    claimed      boolean,
    created_at   timestamptz,
    updated_at   timestamptz,
    truncated    boolean,
    next_after   text)
LANGUAGE plpgsql STABLE AS $$
#variable_conflict use_column
DECLARE
    v_problem text := coalesce(
        queen.timer_name_problem(p_queue),
        CASE WHEN octet_length(p_after) > 1024
             THEN format('after is %s bytes; at most 1024, a timerKey (UTF-8)', octet_length(p_after)) END);
BEGIN
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = v_problem;
    END IF;
    RETURN QUERY
    WITH lim AS (
        SELECT least(greatest(coalesce(p_limit, 100), 1), 1000) AS n
    ), page AS (
        SELECT t.*, row_number() OVER (ORDER BY t.timer_key COLLATE "C") AS rn
          FROM queen.timers t
         WHERE t.tenant = p_tenant AND t.queue = p_queue
           AND (p_after IS NULL OR t.timer_key > p_after COLLATE "C")
         ORDER BY t.timer_key COLLATE "C"
         LIMIT (SELECT n + 1 FROM lim)
    ), flags AS (
        SELECT count(*) > (SELECT n FROM lim) AS truncated,
               max(timer_key) FILTER (WHERE rn = (SELECT n FROM lim)) AS last_key
          FROM page
    )
    SELECT p.timer_key COLLATE "default", p.partition, p.deliver_at, p.txn, p.message_id, p.payload_zstd, p.encrypted,
           p.producer_sub, p.attempts, p.last_error,
           queen.timer_is_claimed(p.lease_until, coalesce(p_now, now())), p.created_at, p.updated_at,
           f.truncated, CASE WHEN f.truncated THEN f.last_key END COLLATE "default"
      FROM page p, flags f
     WHERE p.rn <= (SELECT n FROM lim)
     ORDER BY p.timer_key COLLATE "C";
END
$$;
