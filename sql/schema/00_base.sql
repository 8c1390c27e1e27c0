-- =====================================================================
-- queen-timers canonical schema, part 00: schema, bookkeeping, helpers
--
-- The files in sql/schema/ are applied in name order and together are
-- the one canonical schema. sql/migrations/ holds the numbered,
-- append-only migrations; tests/py/test_migrations.py proves that a
-- database built from either is the same.
--
-- Domain errors use SQLSTATEs of class QT (see README, "Error codes"):
--   QTBAD shape          -> 400 timers_bad_request
--   QTOFF paused         -> 503 timers_disabled
--   QTGAT not on plan    -> 403 feature_gated
--   QTBLK produce block  -> 403 produce_blocked
--   QTRAT rate           -> 429 rate_limited
--   QTQUO pending quota  -> 403 timers_quota_exceeded
--   QTHOR horizon        -> 403 timer_horizon_exceeded
--   QTBIG payload        -> 413 payload_too_large
--   QTRPL DLQ replay     -> 409 dlq_replay_refused
--   QTNFD not found      -> 404 not_found
-- The MESSAGE of each is the error slug; DETAIL explains; for QTRAT and
-- QTOFF the HINT is 'retry_after_seconds=N'.
-- =====================================================================

CREATE SCHEMA IF NOT EXISTS queen;

-- ---------------------------------------------------------------------
-- Tables
-- ---------------------------------------------------------------------

-- checksum: sha256 of the migration file as applied by the runner (NULL
-- when the database was built from the canonical schema instead).
CREATE TABLE queen.schema_migrations (
    version     integer PRIMARY KEY,
    name        text NOT NULL,
    checksum    text,
    applied_at  timestamptz NOT NULL DEFAULT now()
);

-- One row: the cell's defaults and the operator switches. Brokers pass
-- their own environment (horizon, tenancy) as arguments; what is here
-- applies to a DBA calling the functions from psql.
CREATE TABLE queen.cell_settings (
    id                  boolean PRIMARY KEY DEFAULT true CONSTRAINT cell_settings_one_row CHECK (id),
    scheduling_paused   boolean NOT NULL DEFAULT false,  -- operator: POST /timers answers 503 timers_disabled
    fire_paused         boolean NOT NULL DEFAULT false,  -- operator: no sweeper claims anything
    produce_blocked     boolean NOT NULL DEFAULT false,  -- cell-wide produce block (e.g. over storage)
    tenancy             boolean NOT NULL DEFAULT false,  -- QUEEN_TENANCY: plans and quota rows are read
    -- 90 days; at most 100 years, as schedule_timers' p_horizon_ms: past it a delay overflowed
    -- the timestamp (22008) (migration 042)
    horizon_ms          bigint  NOT NULL DEFAULT 7776000000
                        CONSTRAINT horizon_in_range CHECK (horizon_ms BETWEEN 1 AND 3155760000000),
    max_ops             integer NOT NULL DEFAULT 256 CONSTRAINT max_ops_positive CHECK (max_ops > 0),
    max_payload_bytes   integer NOT NULL DEFAULT 1048576 CONSTRAINT max_payload_in_range CHECK (max_payload_bytes BETWEEN 0 AND 1048576),
    max_pending_timers  bigint,            -- NULL: no pending-timer quota when tenancy is off
    rate_ops_per_second numeric            -- NULL: no rate limit when tenancy is off; 0 divided (migration 042)
                        CONSTRAINT rate_positive CHECK (rate_ops_per_second > 0),
    rate_burst          numeric,
    updated_at          timestamptz NOT NULL DEFAULT now(),
    -- log retention (sql/schema/70_retention.sql): dead letters of a queue with
    -- retentionEnabled are deleted once failed_at is older than this; 0 keeps them
    dlq_retention_seconds integer NOT NULL DEFAULT 0 CONSTRAINT dlq_retention_non_negative CHECK (dlq_retention_seconds >= 0)
);
INSERT INTO queen.cell_settings DEFAULT VALUES;

-- ---------------------------------------------------------------------
-- Helpers
-- ---------------------------------------------------------------------

-- A time-ordered UUID (RFC 9562 version 7) from PostgreSQL's clock.
CREATE FUNCTION queen.uuid_v7(p_at timestamptz DEFAULT clock_timestamp())
RETURNS uuid
LANGUAGE sql VOLATILE AS $$
    SELECT encode(
        set_bit(set_bit(
            overlay(uuid_send(gen_random_uuid())
                    placing substring(int8send((extract(epoch FROM p_at) * 1000)::bigint) FROM 3)
                    FROM 1 FOR 6),
            52, 1), 53, 1),
        'hex')::uuid
$$;

-- A function's clock: p_now, or now() when NULL. An infinite instant raises QTBAD:
-- stored, it held a lease or a claim for ever, or put a timer's deliver_at where
-- every sweeper's next_timer_due_ms failed (migrations 038 and 042).
CREATE FUNCTION queen.finite_now(p_now timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF p_now IS NULL THEN
        RETURN now();
    END IF;
    IF NOT isfinite(p_now) THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('p_now must be a finite time, got %s', p_now);
    END IF;
    RETURN p_now;
END
$$;

-- The cell settings row, read by every gate.
CREATE FUNCTION queen.get_cell_settings()
RETURNS queen.cell_settings
LANGUAGE sql STABLE AS $$
    SELECT * FROM queen.cell_settings WHERE id
$$;
