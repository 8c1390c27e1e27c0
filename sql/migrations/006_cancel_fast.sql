-- Migration 006: cancel at the cost of a bare delete (issue 12).
-- queen.cancel_timer deletes the unclaimed row first; the locking
-- look-up (delete_unclaimed_timer) runs only when that finds nothing, and
-- the counter is a plain UPDATE instead of bump_tenant_usage's upsert (a
-- SQL function, planned again on every call).
-- Same signature and verdicts; the text equals sql/schema/30_timers.sql.

-- Cancel one timer (DELETE /api/v1/timers/:queue/*timerKey): passes no
-- rung of the gate ladder. Returns cancelled | absent | too_late;
-- absent also for another tenant's key. Keeps the pending counter; a
-- cancel bills nothing and never creates the counter row (none reads 0).
-- The common case is two statements: the DELETE of the unclaimed row
-- (it takes the row lock delete_unclaimed_timer would take, so a cancel
-- racing a claim waits for it and a claim skips a row being cancelled)
-- and the counter row's UPDATE, last, as every writer of it does. Only
-- when the DELETE finds nothing does delete_unclaimed_timer check the
-- input and tell absent from too_late under the row lock; bad input
-- always gets there, since it cannot match a row (the key columns are
-- NOT NULL and non-empty). A claim that ended in between is cancelled
-- there. Plain PL/pgSQL statements only: their plans are cached per
-- session (a SQL function's body would be planned again on every call).
CREATE OR REPLACE FUNCTION queen.cancel_timer(
    p_tenant    text,
    p_queue     text,
    p_timer_key text,
    p_now       timestamptz DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_status text;
BEGIN
    DELETE FROM queen.timers
     WHERE tenant = p_tenant AND queue = p_queue AND timer_key = p_timer_key
       AND NOT queen.timer_is_claimed(lease_until, p_now);
    IF NOT FOUND THEN
        v_status := queen.delete_unclaimed_timer(p_tenant, p_queue, p_timer_key, p_now);
        IF v_status <> 'cancelled' THEN
            RETURN v_status;
        END IF;
    END IF;
    UPDATE queen.tenant_usage
       SET pending_timers = greatest(0, pending_timers - 1), updated_at = now()
     WHERE tenant = p_tenant;
    RETURN 'cancelled';
END
$$;
