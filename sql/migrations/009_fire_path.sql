-- Migration 009: the leased path's claim bounded by bytes (issue 9).
-- queen.claim_timers gains p_max_bytes (NULL: no bound): rows are claimed
-- in expiry order while the stored payload bytes before them are under
-- it, so a broker's leased batch (QUEEN_SWEEPER_BATCH_BYTES) holds a
-- bounded amount of payload however large QUEEN_SWEEPER_BATCH is.
-- A new parameter is a new signature: the old function is dropped.
-- Function text equals sql/schema/40_fire.sql.

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
