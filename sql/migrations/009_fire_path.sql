-- Migration 009: the fire path (issue 9). Function texts equal
-- sql/schema/40_fire.sql.
-- 1. queen.claim_timers gains p_max_bytes (NULL: no bound): rows are
--    claimed in expiry order while the stored payload bytes before them
--    are under it, so a broker's leased batch (QUEEN_SWEEPER_BATCH_BYTES)
--    holds a bounded amount of payload. A new parameter is a new
--    signature: the old function is dropped.
-- 2. queen.fire_due_timers deletes the locked due rows by ctid instead of
--    a join on the key, which the cached plan could turn into a hash of
--    the whole timers table per batch.

DROP FUNCTION queen.claim_timers(text, integer, integer, timestamptz, boolean);

-- Claim up to p_limit due timers for p_lease_ms, in expiry order (and
-- returned in it), skipping rows another session holds. A row whose
-- lease expired (its broker died) is due again. Nothing is claimed
-- while the fire is paused. p_zstd_only: only rows whose frame needs the
-- broker (zstd to inflate); fire_due_timers takes the rest, lease-free.
-- p_max_bytes (NULL: no bound) bounds the stored payload bytes claimed:
-- rows are taken in expiry order while the bytes before them are under
-- it, so the first row is always claimed, however large; the rows left
-- are not claimed (their row locks end with the statement).
CREATE FUNCTION queen.claim_timers(
    p_broker    text,
    p_limit     integer     DEFAULT 100,
    p_lease_ms  integer     DEFAULT 30000,
    p_now       timestamptz DEFAULT NULL,
    p_zstd_only boolean     DEFAULT false,
    p_max_bytes bigint      DEFAULT NULL)
RETURNS SETOF queen.claimed_timer
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    v_now   timestamptz := coalesce(p_now, now());
    v_claim uuid := gen_random_uuid();
BEGIN
    IF (queen.get_cell_settings()).fire_paused THEN
        RETURN;
    END IF;
    RETURN QUERY
    WITH due AS (
        -- octet_length of a stored bytea reads its TOAST header, not the bytes
        SELECT t.tenant, t.queue, t.timer_key, t.deliver_at, octet_length(t.payload) AS bytes
          FROM queen.timers t
         WHERE t.deliver_at <= v_now
           AND NOT queen.timer_is_claimed(t.lease_until, v_now)
           AND (t.payload_zstd OR NOT p_zstd_only)
         ORDER BY t.deliver_at
         LIMIT greatest(p_limit, 0)
           FOR UPDATE SKIP LOCKED
    ), fit AS (
        SELECT d.tenant, d.queue, d.timer_key
          FROM (SELECT d.*, coalesce(sum(d.bytes) OVER (ORDER BY d.deliver_at, d.tenant, d.queue, d.timer_key
                                                        ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS before
                  FROM due d) d
         WHERE p_max_bytes IS NULL OR d.before < greatest(p_max_bytes, 1)
    ), claimed AS (
        UPDATE queen.timers t
           SET claim_id = v_claim, claimed_by = p_broker,
               lease_until = v_now + greatest(p_lease_ms, 1) * interval '1 millisecond'
          FROM fit due
         WHERE (t.tenant, t.queue, t.timer_key) = (due.tenant, due.queue, due.timer_key)
        RETURNING t.tenant, t.queue, t.timer_key, t.partition, t.deliver_at, t.lease_until,
                  t.txn, t.message_id, t.payload, t.payload_zstd, t.encrypted, t.attempts
    )
    SELECT v_claim, c.tenant, c.queue, c.timer_key::text, c.partition, c.deliver_at, c.lease_until,
           c.txn, c.message_id, c.payload, c.payload_zstd, c.encrypted, c.attempts
      FROM claimed c
     ORDER BY c.deliver_at, c.message_id;
END
$$;

-- Claim and fire in one transaction: the row lock is the claim, so no
-- lease is needed and a broker dying mid-call loses nothing (the
-- transaction rolls back). Used for every due timer whose frame needs
-- nothing from the broker (no zstd to inflate). Expiry order, SKIP LOCKED.
-- The common case is one statement with a plain INSERT (no join back from
-- the log, no ON CONFLICT arbiter: together they halved the fire rate);
-- a txn already in its partition raises unique_violation, and the batch
-- is redone through append_timer_frames, which answers 'duplicate'. The
-- exception block's subtransaction costs nothing measurable per batch
-- (removing it: same rate); an ON CONFLICT arbiter on every row cost ~10 %.
CREATE OR REPLACE FUNCTION queen.fire_due_timers(
    p_limit integer     DEFAULT 100,
    p_now   timestamptz DEFAULT NULL)
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
    IF v_out IS NULL THEN
        RETURN;
    END IF;
    -- One decrement per tenant, appended: no fire waits on a counter row.
    INSERT INTO queen.tenant_usage_deltas (tenant, pending_delta)
    SELECT o.tenant, -count(*) FROM unnest(v_out) o GROUP BY o.tenant;
    RETURN QUERY SELECT * FROM unnest(v_out);
END
$$;
