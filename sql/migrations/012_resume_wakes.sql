-- Migration 012: resuming the fire wakes the sleeping sweepers (issue 9).
-- Function text equals sql/schema/40_fire.sql. queen.pause_fire(false)
-- sends NOTIFY queen_timers with the soonest deliver_at at its commit, as a
-- schedule does; a paused sweeper had slept up to QUEEN_SWEEPER_MAX_SLEEP_MS
-- after a resume, each broker waking at a different moment.
-- The same signature and return type: replaced in place.

CREATE OR REPLACE FUNCTION queen.pause_fire(p_paused boolean DEFAULT true)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_paused boolean;
    v_first  timestamptz;
BEGIN
    UPDATE queen.cell_settings SET fire_paused = p_paused, updated_at = now() WHERE id
    RETURNING fire_paused INTO v_paused;
    IF NOT v_paused THEN
        SELECT min(t.deliver_at) INTO v_first FROM queen.timers t;
        IF v_first IS NOT NULL THEN
            PERFORM pg_notify('queen_timers', extract(epoch FROM v_first)::text);
        END IF;
    END IF;
    RETURN v_paused;
END
$$;
