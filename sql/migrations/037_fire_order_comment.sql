-- Migration 037: queen.fire_due_rows' comment on the zstd rows a plain row waits for
-- says what migration 036 built: the leased path inflates such a row in place and a
-- later batch of this function fires it (036's text said the leased path fired it).
-- No behaviour changes; migrations are append-only, so the comment is a migration.

CREATE OR REPLACE FUNCTION queen.fire_due_rows(
    p_limit   integer,
    p_now     timestamptz,
    p_tenants text[]  DEFAULT NULL,
    p_share   integer DEFAULT NULL,
    p_redo    boolean DEFAULT false)
RETURNS queen.fire_result[]
LANGUAGE plpgsql SET enable_seqscan = off SET enable_bitmapscan = off SET enable_sort = off SET jit = off AS $$
DECLARE
    v_now  timestamptz := coalesce(p_now, now());
    v_ids  tid[];
    v_out  queen.fire_result[];
    v_rows queen.timers[];
    v_zstd boolean;
BEGIN
    -- A plain row waits while a zstd row of its partition that matured before it is
    -- still to be inflated (the leased path inflates it in place, queen.inflate_timers,
    -- and a later batch fires it with the rows after it): due rows of one queue and
    -- partition enter the log in expiry order, the contract's rule (Dec 7 audit: every
    -- plain row of a cycle went before its zstd ones). Looked for only while some zstd
    -- row is due (one descent of timers_zstd_deliver_at_idx a batch); each candidate
    -- then one descent of timers_zstd_partition_idx.
    v_zstd := EXISTS (SELECT 1 FROM queen.timers z WHERE z.payload_zstd AND z.deliver_at <= v_now);
    -- Two statements: the rows chosen and locked (one of two plain ones),
    -- then deleted by ctid and fired. One statement with both choices as a
    -- UNION ALL planned both at every call: +0.3 ms a batch, which the
    -- sweeper's small batches (a few timers due at a time) paid in fire lag.
    IF p_tenants IS NULL THEN
        SELECT array_agg(o.row_id) INTO v_ids
          FROM (SELECT t.ctid AS row_id
                  FROM queen.timers t
                 WHERE t.deliver_at <= v_now
                   AND NOT t.payload_zstd
                   AND NOT queen.timer_is_claimed(t.lease_until, v_now)
                   AND (NOT v_zstd OR NOT EXISTS (
                        SELECT 1 FROM queen.timers z
                         WHERE z.payload_zstd AND z.tenant = t.tenant AND z.queue = t.queue
                           AND z.partition = t.partition AND z.deliver_at < t.deliver_at))
                 ORDER BY t.deliver_at
                 LIMIT greatest(p_limit, 0)
                   FOR UPDATE SKIP LOCKED) o;
    ELSE
        SELECT array_agg(s.row_id) INTO v_ids
          FROM unnest(p_tenants) AS tn(tenant)
         CROSS JOIN LATERAL (
                SELECT t.ctid AS row_id
                  FROM queen.timers t
                 WHERE (t.tenant, t.deliver_at) >= (tn.tenant, '-infinity'::timestamptz)  -- see find_due_tenants
                   AND (t.tenant, t.deliver_at) <= (tn.tenant, v_now)
                   AND NOT t.payload_zstd
                   AND NOT queen.timer_is_claimed(t.lease_until, v_now)
                   AND (NOT v_zstd OR NOT EXISTS (
                        SELECT 1 FROM queen.timers z
                         WHERE z.payload_zstd AND z.tenant = t.tenant AND z.queue = t.queue
                           AND z.partition = t.partition AND z.deliver_at < t.deliver_at))
                 ORDER BY t.tenant, t.deliver_at
                 LIMIT greatest(p_share, 0)
                   FOR UPDATE SKIP LOCKED) s;
    END IF;
    IF v_ids IS NULL THEN
        RETURN NULL;
    END IF;
    IF p_redo THEN
        -- each frame through append_timer_frames (ON CONFLICT: a txn already
        -- in its partition answers 'duplicate'; it appends the counter
        -- decrements itself)
        WITH gone AS (
            DELETE FROM queen.timers t WHERE t.ctid = ANY (v_ids) RETURNING t.*
        )
        SELECT array_agg(gone) INTO v_rows FROM gone;
        IF v_rows IS NOT NULL THEN
            SELECT array_agg(r ORDER BY r.deliver_at, r.message_id) INTO v_out
              FROM queen.append_timer_frames(v_rows, NULL) r;
        END IF;
        RETURN v_out;
    END IF;
    WITH gone AS (
        -- by the locked rows' ctids: one TID fetch per row (a join on the key
        -- let a cached plan hash the whole table: bench/RESULTS.md). This
        -- statement's snapshot is newer than the lock, and the lock holds
        -- every row as it was locked (an update before the lock: its newest
        -- version, whose ctid the lock answered).
        DELETE FROM queen.timers t WHERE t.ctid = ANY (v_ids) RETURNING t.*
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
