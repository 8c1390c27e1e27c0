-- =====================================================================
-- Part 60: operations: what the sweeper asks before it sleeps, and the
-- status an operator (or a Prometheus scrape) reads
-- =====================================================================

-- The lease expiries of held claims, so "when does a dead broker's
-- claim become due again" is an index probe, not a scan. Partial: only
-- claimed rows (a handful of batches at any time) are in it.
CREATE INDEX timers_lease_until_idx ON queen.timers (lease_until) WHERE lease_until IS NOT NULL;

-- Milliseconds until the next timer a sweeper could claim: the soonest
-- deliver_at of an unclaimed row, or the soonest lease expiry of a held
-- claim (its broker may have died). 0 when something is due now; NULL
-- when there is nothing to wait for or the fire is paused. The sweeper
-- sleeps this long (clamped to its bounds), so PostgreSQL's clock alone
-- decides when it wakes.
CREATE FUNCTION queen.next_timer_due_ms(p_now timestamptz DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_now   timestamptz := coalesce(p_now, now());
    v_next  timestamptz;
    v_lease timestamptz;
BEGIN
    IF (queen.get_cell_settings()).fire_paused THEN
        RETURN NULL;
    END IF;
    SELECT t.deliver_at INTO v_next
      FROM queen.timers t
     WHERE NOT queen.timer_is_claimed(t.lease_until, v_now)
     ORDER BY t.deliver_at
     LIMIT 1;
    SELECT min(t.lease_until) INTO v_lease
      FROM queen.timers t
     WHERE t.lease_until IS NOT NULL AND t.lease_until > v_now;
    v_next := least(v_next, v_lease);  -- least() ignores NULLs
    IF v_next IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN greatest(0, ceil(extract(epoch FROM (v_next - v_now)) * 1000))::bigint;
END
$$;

-- The operator's view of the fire: the two switches and the number of
-- pending timers in the cell (from the per-tenant counters the timer
-- functions keep, so it is cheap enough for every Prometheus scrape).
CREATE FUNCTION queen.get_timer_status()
RETURNS TABLE (scheduling_paused boolean, fire_paused boolean, pending bigint)
LANGUAGE sql STABLE AS $$
    SELECT c.scheduling_paused, c.fire_paused,
           coalesce((SELECT sum(u.pending_timers) FROM queen.tenant_usage u), 0)::bigint
      FROM queen.cell_settings c
     WHERE c.id
$$;
