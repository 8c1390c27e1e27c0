-- Migration 011: the sweeper's fire pays no subtransaction (issue 9).
-- Function texts equal sql/schema/40_fire.sql.
-- The fast statement of queen.fire_due_timers moves into
-- queen.fire_due_batch; fire_due_timers gains p_redo_duplicates (default
-- true: as before, the batch runs in a subtransaction and a duplicate txn
-- is redone as 'duplicate'). The sweeper passes false and calls again with
-- true when its call fails on a duplicate. A new parameter is a new
-- signature: the old function is dropped.

DROP FUNCTION queen.fire_due_timers(integer, timestamptz);

-- One batch of the fast path, as one statement, with no subtransaction:
-- the due rows (expiry order, SKIP LOCKED) deleted and their frames
-- appended, answered as fire results. A txn already in its partition
-- raises unique_violation (nothing of the batch stays). Internal to
-- queen.fire_due_timers.
CREATE FUNCTION queen.fire_due_batch(p_limit integer, p_now timestamptz)
RETURNS queen.fire_result[]
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
    v_out queen.fire_result[];
BEGIN
    WITH due AS (
        SELECT t.ctid AS row_id
          FROM queen.timers t
         WHERE t.deliver_at <= v_now
           AND NOT t.payload_zstd
           AND NOT queen.timer_is_claimed(t.lease_until, v_now)
         ORDER BY t.deliver_at
         LIMIT greatest(p_limit, 0)
           FOR UPDATE SKIP LOCKED
    ), gone AS (
        -- by the locked row's ctid: one TID fetch per row. A join on the key
        -- let the cached plan hash the whole table (a seq scan of every
        -- pending timer per batch: bench/RESULTS.md). A row another
        -- transaction updated after this statement's snapshot is not deleted
        -- (its new version is not the snapshot's): it stays for a later batch.
        DELETE FROM queen.timers t USING due d
         WHERE t.ctid = d.row_id
        RETURNING t.*
    ), parts AS (
        -- every destination partition (of the timer's tenant's queue), created
        -- on first use; no lock (see queen.messages)
        SELECT x.tenant, x.queue, x.partition,
               queen.ensure_partition(x.tenant, x.queue, x.partition) AS partition_id
          FROM (SELECT DISTINCT g.tenant, g.queue, g.partition FROM gone g ORDER BY 1, 2, 3) x
    ), src AS (
        SELECT g.*, p.partition_id
          FROM gone g JOIN parts p ON p.tenant = g.tenant AND p.queue = g.queue AND p.partition = g.partition
    ), ins AS (
        INSERT INTO queen.messages (id, transaction_id, partition_id, payload, is_encrypted, producer_sub)
        SELECT s.message_id, s.txn, s.partition_id, s.payload, s.encrypted, s.producer_sub
          FROM src s
         ORDER BY s.deliver_at, s.message_id
    )
    SELECT array_agg(ROW(s.tenant, s.queue, s.timer_key, 'fired', s.message_id, s.partition_id,
                         s.deliver_at, clock_timestamp())::queen.fire_result
                     ORDER BY s.deliver_at, s.message_id)
      INTO v_out
      FROM src s;
    RETURN v_out;
END
$$;

-- Claim and fire in one transaction: the row lock is the claim, so no
-- lease is needed and a broker dying mid-call loses nothing (the
-- transaction rolls back). Used for every due timer whose frame needs
-- nothing from the broker (no zstd to inflate). Expiry order, SKIP LOCKED.
-- The common case is one statement with a plain INSERT (no join back from
-- the log, no ON CONFLICT arbiter: together they halved the fire rate),
-- queen.fire_due_batch. A txn already in its partition raises
-- unique_violation there. With p_redo_duplicates (the default) the batch
-- runs in a subtransaction and is redone through append_timer_frames,
-- which answers 'duplicate'. The sweeper passes false: no subtransaction
-- on its common path; a duplicate fails its call (which rolls back whole)
-- and it calls again with true.
CREATE FUNCTION queen.fire_due_timers(
    p_limit integer     DEFAULT 100,
    p_now   timestamptz DEFAULT NULL,
    p_redo_duplicates boolean DEFAULT true)
RETURNS SETOF queen.fire_result
LANGUAGE plpgsql AS $$
DECLARE
    v_now  timestamptz := coalesce(p_now, now());
    v_out  queen.fire_result[];
    v_rows queen.timers[];
BEGIN
    IF (queen.get_cell_settings()).fire_paused THEN
        RETURN;
    END IF;
    IF NOT coalesce(p_redo_duplicates, true) THEN
        v_out := queen.fire_due_batch(p_limit, v_now);
    ELSE
        BEGIN
            v_out := queen.fire_due_batch(p_limit, v_now);
        EXCEPTION WHEN unique_violation THEN
            v_out := NULL;
            WITH due AS (
                SELECT t.tenant, t.queue, t.timer_key
                  FROM queen.timers t
                 WHERE t.deliver_at <= v_now
                   AND NOT t.payload_zstd
                   AND NOT queen.timer_is_claimed(t.lease_until, v_now)
                 ORDER BY t.deliver_at
                 LIMIT greatest(p_limit, 0)
                   FOR UPDATE SKIP LOCKED
            ), gone AS (
                DELETE FROM queen.timers t USING due d
                 WHERE (t.tenant, t.queue, t.timer_key) = (d.tenant, d.queue, d.timer_key)
                RETURNING t.*
            )
            SELECT array_agg(gone) INTO v_rows FROM gone;
            IF v_rows IS NOT NULL THEN
                RETURN QUERY SELECT * FROM queen.append_timer_frames(v_rows, NULL);
            END IF;
            RETURN;
        END;
    END IF;
    IF v_out IS NULL THEN
        RETURN;
    END IF;
    -- One decrement per tenant, appended: no fire waits on a counter row.
    INSERT INTO queen.tenant_usage_deltas (tenant, pending_delta)
    SELECT o.tenant, -count(*) FROM unnest(v_out) o GROUP BY o.tenant;
    RETURN QUERY SELECT * FROM unnest(v_out);
END
$$;
