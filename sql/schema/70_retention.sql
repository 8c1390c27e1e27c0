-- =====================================================================
-- Part 70: log retention. queen.messages and queen.dead_letter_queue
-- would grow without bound; every broker's retention task calls
-- queen.apply_retention periodically, in bounded batches.
--
-- A queue opts in with Queen's options (configure stores them in
-- queen.queues): retentionEnabled, retentionSeconds (pending retention:
-- frames older than this go, consumed or not) and
-- completedRetentionSeconds (frames every consumer group of the
-- partition has consumed go once older than this); 0 switches a rule
-- off, as in Queen. Dead letters of such a queue go once failed_at is
-- older than queen.cell_settings.dlq_retention_seconds (0: kept).
--
-- Retention deletes the HEAD of a partition: walking the partition in
-- log order (xid, seq), it stops at the first frame no rule lets it
-- delete. Cursors are log positions and pop reads (xid, seq) > cursor,
-- so a cursor that points at a deleted frame (or before it) still moves
-- on to the next one that exists. The completed rule deletes only frames
-- at or behind the lowest cursor. created_at (the appending transaction's
-- start) follows the log order within a partition up to the length of an
-- append transaction, so the head is where the old frames are; a frame
-- that is older than a frame before it simply goes when that one does.
-- =====================================================================

-- Delete what retention allows, at most p_limit rows in all (frames and
-- dead letters), partition by partition in (tenant, queue, partition) order.
-- Safe to call from any number of sessions at once: a partition with
-- something to delete is worked on by one session at a time (a
-- transaction-level pg_try_advisory_xact_lock(7261005, hashtext(partition
-- id)); a session that finds it taken skips the partition and counts it in
-- partitions_skipped, it never waits). A partition with nothing to delete
-- costs two index probes and no lock; one call locks at most 1000
-- partitions (the lock table is finite), the next call goes on. It
-- takes no partition row lock, so appends (push, the fire) never wait on
-- it; dead letters a replay holds are skipped (SKIP LOCKED).
--   pending_deleted   frames deleted that some group had not consumed
--                     (or in a partition no group reads)
--   completed_deleted frames deleted that every group had consumed
--   dlq_deleted       dead letters deleted
-- A full batch (the three counts add up to p_limit, clamped to
-- 1..100000) means there may be more: call again.
CREATE FUNCTION queen.apply_retention(
    p_limit integer     DEFAULT 1000,
    p_now   timestamptz DEFAULT NULL)
RETURNS TABLE (pending_deleted bigint, completed_deleted bigint, dlq_deleted bigint, partitions_skipped integer)
LANGUAGE plpgsql AS $$
DECLARE
    v_now       timestamptz := queen.finite_now(p_now);
    v_room      bigint := least(greatest(coalesce(p_limit, 1000), 1), 100000);
    v_dlq_secs  integer := (queen.get_cell_settings()).dlq_retention_seconds;
    c           record;
    v_pend_cut  timestamptz;  -- pending rule: created_at before this
    v_done_cut  timestamptz;  -- completed rule: created_at before this
    v_min_xid   xid8;         -- the lowest cursor (xid, seq) of the partition's groups (NULL: no group)
    v_min_seq   bigint;
    v_upto_xid  xid8;         -- completed rule: (xid, seq) at or before this
    v_upto_seq  bigint;
    v_xid       xid8;
    v_seq       bigint;
    v_at        timestamptz;
    v_n         bigint;
    v_nc        bigint;
    v_pending   bigint := 0;
    v_completed bigint := 0;
    v_dlq       bigint := 0;
    v_skipped   integer := 0;
    v_locked    integer := 0;
    v_head_due  boolean;
    v_dlq_due   boolean;
BEGIN
    FOR c IN
        SELECT p.id, q.retention_seconds, q.completed_retention_seconds
          FROM queen.queues q
          JOIN queen.partitions p ON p.queue_id = q.id
         WHERE q.retention_enabled
           AND (q.retention_seconds > 0 OR q.completed_retention_seconds > 0 OR v_dlq_secs > 0)
         ORDER BY q.tenant, q.name, p.name
    LOOP
        EXIT WHEN v_room <= 0 OR v_locked >= 1000;
        v_pend_cut := CASE WHEN c.retention_seconds > 0
                           THEN v_now - make_interval(secs => c.retention_seconds) END;
        v_done_cut := CASE WHEN c.completed_retention_seconds > 0
                           THEN v_now - make_interval(secs => c.completed_retention_seconds) END;
        v_min_xid := NULL;
        v_min_seq := NULL;
        SELECT pc.last_consumed_xid, pc.last_consumed_seq INTO v_min_xid, v_min_seq
          FROM queen.partition_consumers pc WHERE pc.partition_id = c.id
         ORDER BY pc.last_consumed_xid, pc.last_consumed_seq LIMIT 1;
        v_upto_xid := CASE WHEN v_done_cut IS NOT NULL THEN v_min_xid END;
        v_upto_seq := CASE WHEN v_done_cut IS NOT NULL THEN v_min_seq END;

        -- index probes, before any lock: is the first frame deletable, is a dead letter old enough?
        -- (cursors only move forward, so the lowest cursor read now is safe to use after the lock)
        SELECT m.xid, m.seq, m.created_at INTO v_xid, v_seq, v_at
          FROM queen.messages m WHERE m.partition_id = c.id ORDER BY m.xid, m.seq LIMIT 1;
        v_head_due := FOUND AND (coalesce(v_at < v_pend_cut, false)
                                 OR coalesce((v_xid, v_seq) <= (v_upto_xid, v_upto_seq) AND v_at < v_done_cut, false));
        v_dlq_due := v_dlq_secs > 0 AND EXISTS (
            SELECT 1 FROM queen.dead_letter_queue d
             WHERE d.partition_id = c.id AND d.failed_at < v_now - make_interval(secs => v_dlq_secs));
        CONTINUE WHEN NOT (v_head_due OR v_dlq_due);
        IF NOT pg_try_advisory_xact_lock(7261005, hashtext(c.id::text)) THEN
            v_skipped := v_skipped + 1;
            CONTINUE;
        END IF;
        v_locked := v_locked + 1;

        IF v_head_due THEN
            WITH head AS (
                SELECT m.id, row_number() OVER (ORDER BY m.xid, m.seq) AS n,
                       (m.xid, m.seq) <= (v_min_xid, v_min_seq) AS consumed,
                       coalesce(m.created_at < v_pend_cut, false)
                       OR coalesce((m.xid, m.seq) <= (v_upto_xid, v_upto_seq) AND m.created_at < v_done_cut, false) AS ok
                  FROM queen.messages m
                 WHERE m.partition_id = c.id
                 ORDER BY m.xid, m.seq
                 LIMIT v_room
            ), stop AS (
                SELECT min(h.n) AS n FROM head h WHERE NOT h.ok
            ), del AS (
                DELETE FROM queen.messages m
                 USING head h
                 WHERE m.id = h.id
                   AND h.n < coalesce((SELECT s.n FROM stop s), 9223372036854775807)
                RETURNING h.consumed
            )
            SELECT count(*), count(*) FILTER (WHERE d.consumed) INTO v_n, v_nc FROM del d;
            v_completed := v_completed + v_nc;
            v_pending := v_pending + v_n - v_nc;
            v_room := v_room - v_n;
        END IF;

        IF v_dlq_due AND v_room > 0 THEN
            WITH old AS (
                SELECT d.id
                  FROM queen.dead_letter_queue d
                 WHERE d.partition_id = c.id
                   AND d.failed_at < v_now - make_interval(secs => v_dlq_secs)
                 ORDER BY d.failed_at
                 LIMIT v_room
                   FOR UPDATE SKIP LOCKED
            )
            DELETE FROM queen.dead_letter_queue d USING old o WHERE d.id = o.id;
            GET DIAGNOSTICS v_n = ROW_COUNT;
            v_dlq := v_dlq + v_n;
            v_room := v_room - v_n;
        END IF;
    END LOOP;
    RETURN QUERY SELECT v_pending, v_completed, v_dlq, v_skipped;
END
$$;
