-- Migration 031: the fire waits at most 50 ms on another transaction.
-- A frame can wait only on a transaction of its own tenant (the queue or
-- partition it is creating, a message of the same txn it is pushing), but a
-- batch holds many tenants' frames: one tenant's pushes of 10,000 items that
-- created the queue of its due timer held every tenant's fire for 1-2 s at a
-- time (Dec 7 audit). fire_due_batch and fire_timers get lock_timeout 50ms;
-- fire_due_timers (p_redo_duplicates) answers lock_not_available by firing
-- the due rows tenant by tenant (fire_due_apart), leaving a tenant that still
-- waits for the next cycle.

ALTER FUNCTION queen.fire_due_batch(integer, timestamptz, integer, boolean) SET lock_timeout = '50ms';
ALTER FUNCTION queen.fire_timers(uuid, queen.fire_frame[], timestamptz) SET lock_timeout = '50ms';

-- The fire's waits on other transactions are bounded: a frame can only wait
-- on a transaction of its own tenant (a queue or partition it is creating, a
-- message of the same txn it is pushing), since names are per tenant, but one
-- batch holds many tenants' frames. A push of 10,000 items that created the
-- queue a due timer fires into held every tenant's fire for 1-2 s at a time
-- (Dec 7 audit). So the fire functions wait at most 50 ms for a lock
-- (lock_not_available, 55P03), and queen.fire_due_timers then fires the due
-- rows tenant by tenant, each in a subtransaction: a tenant that still
-- waits is left for the next cycle, its rows untouched; the others fire.
-- At most p_limit rows in all, from the tenants queen.find_due_tenants gives
-- (in turn), answering 'duplicate' as the redo does. Internal to
-- queen.fire_due_timers.
CREATE FUNCTION queen.fire_due_apart(p_limit integer, p_now timestamptz)
RETURNS SETOF queen.fire_result
LANGUAGE plpgsql SET lock_timeout = '50ms' AS $$
DECLARE
    v_left   integer := greatest(p_limit, 0);
    v_tenant text;
    v_got    queen.fire_result[];
BEGIN
    FOREACH v_tenant IN ARRAY coalesce(queen.find_due_tenants(p_now, greatest(p_limit, 1)), '{}') LOOP
        EXIT WHEN v_left <= 0;
        BEGIN
            v_got := queen.fire_due_rows(v_left, p_now, ARRAY[v_tenant], v_left, p_redo => true);
        EXCEPTION WHEN lock_not_available THEN
            CONTINUE;  -- its own transaction holds what its frames need: the next cycle tries again
        END;
        IF v_got IS NOT NULL THEN
            v_left := v_left - cardinality(v_got);
            RETURN QUERY SELECT * FROM unnest(v_got);
        END IF;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION queen.fire_due_timers(
    p_limit integer     DEFAULT 100,
    p_now   timestamptz DEFAULT NULL,
    p_redo_duplicates boolean DEFAULT true,
    p_fair_after_ms integer DEFAULT 100,
    p_turn  text        DEFAULT NULL)
RETURNS SETOF queen.fire_result
LANGUAGE plpgsql AS $$
DECLARE
    v_now  timestamptz := coalesce(p_now, now());
    v_out  queen.fire_result[];
BEGIN
    IF p_turn IS NOT NULL THEN  -- the caller's turn, not this session's (find_due_tenants)
        PERFORM set_config('queen.fire_turn', p_turn, false);
    END IF;
    IF (queen.get_cell_settings()).fire_paused THEN
        RETURN;
    END IF;
    IF NOT coalesce(p_redo_duplicates, true) THEN
        v_out := queen.fire_due_batch(p_limit, v_now, p_fair_after_ms);
    ELSE
        BEGIN
            v_out := queen.fire_due_batch(p_limit, v_now, p_fair_after_ms);
        EXCEPTION
            WHEN unique_violation THEN
                -- the batch again (shares included), with the 'duplicate' answers
                BEGIN
                    v_out := queen.fire_due_batch(p_limit, v_now, p_fair_after_ms, p_redo => true);
                EXCEPTION WHEN lock_not_available THEN
                    RETURN QUERY SELECT * FROM queen.fire_due_apart(p_limit, v_now);
                    RETURN;
                END;
                RETURN QUERY SELECT * FROM unnest(v_out);
                RETURN;
            WHEN lock_not_available THEN
                -- a frame waited past 50 ms on its own tenant's transaction: tenant by tenant
                RETURN QUERY SELECT * FROM queen.fire_due_apart(p_limit, v_now);
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
