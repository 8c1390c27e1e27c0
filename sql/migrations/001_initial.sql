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
    horizon_ms          bigint  NOT NULL DEFAULT 7776000000 CONSTRAINT horizon_positive CHECK (horizon_ms > 0), -- 90 days
    max_ops             integer NOT NULL DEFAULT 256 CONSTRAINT max_ops_positive CHECK (max_ops > 0),
    max_payload_bytes   integer NOT NULL DEFAULT 1048576 CONSTRAINT max_payload_in_range CHECK (max_payload_bytes BETWEEN 0 AND 1048576),
    max_pending_timers  bigint,            -- NULL: no pending-timer quota when tenancy is off
    rate_ops_per_second numeric,           -- NULL: no rate limit when tenancy is off
    rate_burst          numeric,
    updated_at          timestamptz NOT NULL DEFAULT now()
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

-- The cell settings row, read by every gate.
CREATE FUNCTION queen.get_cell_settings()
RETURNS queen.cell_settings
LANGUAGE sql STABLE AS $$
    SELECT * FROM queen.cell_settings WHERE id
$$;
-- =====================================================================
-- Part 10: plans, tenants, quota rows, metering and the gate ladder
-- =====================================================================

-- ---------------------------------------------------------------------
-- Tables
-- ---------------------------------------------------------------------

CREATE TABLE queen.plans (
    plan                text PRIMARY KEY,
    timers_enabled      boolean NOT NULL DEFAULT true,
    max_pending_timers  bigint,                 -- NULL: unlimited
    max_payload_bytes   integer,                -- NULL: the cell's; the ceiling is min(1 MiB, this)
    horizon_ms          bigint,                 -- NULL: the cell's; narrows it, never widens it
    rate_ops_per_second numeric,                -- NULL: unlimited
    rate_burst          numeric,                -- NULL: one second of rate
    CONSTRAINT plan_limits_non_negative CHECK (
        coalesce(max_pending_timers, 0) >= 0 AND coalesce(max_payload_bytes, 0) >= 0
        AND coalesce(horizon_ms, 1) > 0 AND coalesce(rate_ops_per_second, 1) > 0)
);

-- The quota row of a tenant. With tenancy on, a tenant without one is
-- refused with feature_gated.
CREATE TABLE queen.tenants (
    tenant              text PRIMARY KEY,
    plan                text NOT NULL REFERENCES queen.plans (plan),
    max_pending_timers  bigint,                 -- NULL: the plan's
    horizon_ms          bigint,                 -- NULL: the plan's; narrows, never widens
    produce_blocked     boolean NOT NULL DEFAULT false,  -- over storage / over quota
    created_at          timestamptz NOT NULL DEFAULT now()
);

-- Per-tenant counters. pending_timers is kept by the timer functions
-- (schedule +1 per new row, cancel/fire/DLQ -1); billed_messages counts
-- every accepted schedule and reschedule (cancel and fire count zero).
CREATE TABLE queen.tenant_usage (
    tenant              text PRIMARY KEY,
    pending_timers      bigint NOT NULL DEFAULT 0,
    billed_messages     bigint NOT NULL DEFAULT 0,
    updated_at          timestamptz NOT NULL DEFAULT now()
);

-- Token buckets for the rate rung; one row per tenant, refilled lazily.
CREATE TABLE queen.rate_buckets (
    tenant              text PRIMARY KEY,
    tokens              numeric NOT NULL,
    refilled_at         timestamptz NOT NULL
);

-- ---------------------------------------------------------------------
-- Functions
-- ---------------------------------------------------------------------

-- The limits in force for one tenant, resolved from the cell, the plan
-- and the tenant row. p_horizon_ms / p_tenancy are the broker's
-- environment; NULL takes the cell settings.
CREATE TYPE queen.tenant_limits AS (
    tenant              text,
    tenancy             boolean,
    has_quota_row       boolean,
    timers_enabled      boolean,
    produce_blocked     boolean,
    max_pending_timers  bigint,
    horizon_ms          bigint,
    max_payload_bytes   integer,
    rate_ops_per_second numeric,
    rate_burst          numeric
);

CREATE FUNCTION queen.get_tenant_limits(
    p_tenant     text,
    p_horizon_ms bigint  DEFAULT NULL,
    p_tenancy    boolean DEFAULT NULL)
RETURNS queen.tenant_limits
LANGUAGE plpgsql STABLE AS $$
DECLARE
    c  queen.cell_settings := queen.get_cell_settings();
    t  queen.tenants;
    p  queen.plans;
    r  queen.tenant_limits;
    v_cell_horizon bigint := coalesce(p_horizon_ms, c.horizon_ms);
BEGIN
    r.tenant  := p_tenant;
    r.tenancy := coalesce(p_tenancy, c.tenancy);
    IF NOT r.tenancy THEN
        r.has_quota_row       := true;
        r.timers_enabled      := true;
        r.produce_blocked     := c.produce_blocked;
        r.max_pending_timers  := c.max_pending_timers;
        r.horizon_ms          := v_cell_horizon;
        r.max_payload_bytes   := least(1048576, c.max_payload_bytes);
        r.rate_ops_per_second := c.rate_ops_per_second;
        r.rate_burst          := coalesce(c.rate_burst, c.rate_ops_per_second);
        RETURN r;
    END IF;

    SELECT * INTO t FROM queen.tenants WHERE tenant = p_tenant;
    r.has_quota_row := FOUND;
    IF NOT FOUND THEN
        r.timers_enabled := false;
        RETURN r;
    END IF;
    SELECT * INTO p FROM queen.plans WHERE plan = t.plan;
    r.timers_enabled      := p.timers_enabled;
    r.produce_blocked     := c.produce_blocked OR t.produce_blocked;
    r.max_pending_timers  := coalesce(t.max_pending_timers, p.max_pending_timers);
    -- least() ignores NULLs: a tenant or plan horizon narrows, never widens.
    r.horizon_ms          := least(v_cell_horizon, p.horizon_ms, t.horizon_ms);
    r.max_payload_bytes   := least(1048576, c.max_payload_bytes, p.max_payload_bytes);
    r.rate_ops_per_second := p.rate_ops_per_second;
    r.rate_burst          := coalesce(p.rate_burst, p.rate_ops_per_second);
    RETURN r;
END
$$;

-- Take p_ops tokens from the tenant's bucket or raise QTRAT with the
-- seconds until enough have refilled. A batch larger than the burst
-- passes on a full bucket and leaves it in debt (else it could never
-- pass). Runs inside the caller's transaction: a batch refused by a
-- later rung gives its tokens back.
CREATE FUNCTION queen.take_rate_tokens(
    p_tenant text,
    p_ops    integer,
    p_rate   numeric,
    p_burst  numeric,
    p_now    timestamptz DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_now    timestamptz := coalesce(p_now, now());
    v_burst  numeric := greatest(coalesce(p_burst, p_rate), 1);
    v_tokens numeric;
    v_wait   numeric;
BEGIN
    IF p_rate IS NULL OR p_ops <= 0 THEN
        RETURN;
    END IF;
    INSERT INTO queen.rate_buckets AS b (tenant, tokens, refilled_at)
    VALUES (p_tenant, v_burst, v_now)
    ON CONFLICT (tenant) DO UPDATE
        SET tokens = least(v_burst, b.tokens
                       + p_rate * greatest(0, extract(epoch FROM v_now - b.refilled_at))),
            refilled_at = greatest(b.refilled_at, v_now)
    RETURNING tokens INTO v_tokens;

    IF v_tokens < least(p_ops, v_burst) THEN
        v_wait := ceil((least(p_ops, v_burst) - v_tokens) / p_rate);
        RAISE EXCEPTION 'rate_limited'
            USING ERRCODE = 'QTRAT',
                  DETAIL  = format('tenant %s asked for %s operations; %s available at %s per second',
                                   p_tenant, p_ops, floor(v_tokens), p_rate),
                  HINT    = format('retry_after_seconds=%s', greatest(1, v_wait));
    END IF;
    UPDATE queen.rate_buckets SET tokens = tokens - p_ops WHERE tenant = p_tenant;
END
$$;

-- Adjust a tenant's counters (one row write per call, not per op).
CREATE FUNCTION queen.bump_tenant_usage(
    p_tenant  text,
    p_pending bigint,
    p_billed  bigint)
RETURNS void
LANGUAGE sql AS $$
    INSERT INTO queen.tenant_usage AS u (tenant, pending_timers, billed_messages)
    VALUES (p_tenant, greatest(p_pending, 0), p_billed)
    ON CONFLICT (tenant) DO UPDATE
        SET pending_timers  = greatest(0, u.pending_timers + p_pending),
            billed_messages = u.billed_messages + p_billed,
            updated_at      = now()
$$;
-- =====================================================================
-- Part 20: the minimal Queen-compatible log a timer fires into
-- =====================================================================

-- ---------------------------------------------------------------------
-- Tables
-- ---------------------------------------------------------------------

CREATE TABLE queen.queues (
    id                           uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    name                         text NOT NULL CONSTRAINT queues_name_unique UNIQUE,
    namespace                    text,
    task                         text,
    lease_time                   integer NOT NULL DEFAULT 300,    -- seconds
    retry_limit                  integer NOT NULL DEFAULT 3,
    retry_delay                  integer NOT NULL DEFAULT 1000,   -- ms, stored and echoed (as Queen)
    max_size                     integer NOT NULL DEFAULT 0,
    ttl                          integer NOT NULL DEFAULT 3600,
    priority                     integer NOT NULL DEFAULT 0,
    delayed_processing           integer NOT NULL DEFAULT 0,
    window_buffer                integer NOT NULL DEFAULT 0,
    retention_seconds            integer NOT NULL DEFAULT 0,
    completed_retention_seconds  integer NOT NULL DEFAULT 0,
    retention_enabled            boolean NOT NULL DEFAULT false,
    encryption_enabled           boolean NOT NULL DEFAULT false,
    dead_letter_queue            boolean NOT NULL DEFAULT false,
    dlq_after_max_retries        boolean NOT NULL DEFAULT false,
    max_wait_time_seconds        integer NOT NULL DEFAULT 0,
    created_at                   timestamptz NOT NULL DEFAULT now(),
    updated_at                   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT queue_name_not_empty CHECK (name <> '')
);

CREATE TABLE queen.partitions (
    id          uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    queue_id    uuid NOT NULL REFERENCES queen.queues (id) ON DELETE CASCADE,
    name        text NOT NULL DEFAULT 'Default',
    created_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT partitions_queue_name_unique UNIQUE (queue_id, name),
    CONSTRAINT partition_name_not_empty CHECK (name <> '')
);

-- Frames. seq is the log order inside a partition: every writer takes
-- the partition row lock (queen.lock_partition) before appending, so seq
-- order is commit order and a consumer cursor never skips a late commit.
CREATE TABLE queen.messages (
    id              uuid PRIMARY KEY,
    seq             bigint GENERATED ALWAYS AS IDENTITY,
    transaction_id  text NOT NULL,
    trace_id        uuid,
    partition_id    uuid NOT NULL REFERENCES queen.partitions (id) ON DELETE CASCADE,
    payload         bytea NOT NULL,
    is_encrypted    boolean NOT NULL DEFAULT false,
    producer_sub    text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT messages_partition_transaction_unique UNIQUE (partition_id, transaction_id)
);
CREATE INDEX messages_partition_seq_idx ON queen.messages (partition_id, seq);

-- A consumer group's cursor and lease on one partition (Queen's
-- partition_consumers). '__QUEUE_MODE__' is the competing-consumers group.
CREATE TABLE queen.partition_consumers (
    partition_id        uuid NOT NULL REFERENCES queen.partitions (id) ON DELETE CASCADE,
    consumer_group      text NOT NULL,
    last_consumed_seq   bigint NOT NULL DEFAULT 0,
    lease_id            uuid,
    lease_expires_at    timestamptz,
    batch_size          integer NOT NULL DEFAULT 0,
    acked_count         integer NOT NULL DEFAULT 0,
    batch_retry_count   integer NOT NULL DEFAULT 0,
    batch_last_seq      bigint,
    updated_at          timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (partition_id, consumer_group)
);

-- Dead letters, per queue (through the partition) and consumer group.
-- A timer that exhausted its attempts lands here under the synthetic
-- group '__QUEEN_TIMERS__'; its frame never entered the log, so the row
-- carries the payload itself and message_id is not a foreign key.
CREATE TABLE queen.dead_letter_queue (
    id                   uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    message_id           uuid NOT NULL,
    partition_id         uuid NOT NULL REFERENCES queen.partitions (id) ON DELETE CASCADE,
    consumer_group       text NOT NULL,
    transaction_id       text NOT NULL,
    payload              bytea NOT NULL,
    is_encrypted         boolean NOT NULL DEFAULT false,
    payload_zstd         boolean NOT NULL DEFAULT false,  -- a timer's zstd payload, dead-lettered as stored
    producer_sub         text,
    error_message        text,
    retry_count          integer NOT NULL DEFAULT 0,
    original_created_at  timestamptz,
    failed_at            timestamptz NOT NULL DEFAULT now(),
    timer_tenant         text,            -- set for timer dead letters
    timer_key            text COLLATE "C" -- set for timer dead letters
);
CREATE INDEX dead_letter_queue_partition_idx ON queen.dead_letter_queue (partition_id, failed_at DESC);

-- ---------------------------------------------------------------------
-- Functions
-- ---------------------------------------------------------------------

-- The queue's id, creating it with defaults when it does not exist yet
-- (queues and partitions are created on first use, as in Queen).
CREATE FUNCTION queen.ensure_queue(p_queue text)
RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid;
BEGIN
    SELECT id INTO v_id FROM queen.queues WHERE name = p_queue;
    IF FOUND THEN
        RETURN v_id;
    END IF;
    INSERT INTO queen.queues (name, namespace, task)
    VALUES (p_queue, nullif(split_part(p_queue, '.', 1), p_queue), nullif(split_part(p_queue, '.', 2), ''))
    ON CONFLICT (name) DO NOTHING
    RETURNING id INTO v_id;
    IF v_id IS NULL THEN
        SELECT id INTO v_id FROM queen.queues WHERE name = p_queue;
    END IF;
    RETURN v_id;
END
$$;

-- The partition's id, created on first use, locked for appending until
-- the caller's transaction ends (see queen.messages.seq).
CREATE FUNCTION queen.lock_partition(p_queue text, p_partition text DEFAULT 'Default')
RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_queue_id uuid := queen.ensure_queue(p_queue);
    v_id uuid;
BEGIN
    SELECT id INTO v_id FROM queen.partitions
     WHERE queue_id = v_queue_id AND name = coalesce(p_partition, 'Default')
       FOR NO KEY UPDATE;
    IF FOUND THEN
        RETURN v_id;
    END IF;
    INSERT INTO queen.partitions (queue_id, name)
    VALUES (v_queue_id, coalesce(p_partition, 'Default'))
    ON CONFLICT (queue_id, name) DO NOTHING
    RETURNING id INTO v_id;
    IF v_id IS NULL THEN
        SELECT id INTO v_id FROM queen.partitions
         WHERE queue_id = v_queue_id AND name = coalesce(p_partition, 'Default')
           FOR NO KEY UPDATE;
    END IF;
    RETURN v_id;
END
$$;
-- =====================================================================
-- Part 30: timers: schedule / reschedule / cancel, peek and list
--
-- State of a row (there is no status column; it is derived):
--   pending    deliver_at in the future, or due and not claimed
--   claimed    lease_until > now(): a broker holds it and is about to
--              fire; cancel and reschedule answer too_late
--   backoff    a failed fire moved deliver_at forward and dropped the
--              claim: claimed = false, cancellable
--   (gone)     fired or dead-lettered: the row is deleted, no tombstone
-- =====================================================================

-- ---------------------------------------------------------------------
-- Tables
-- ---------------------------------------------------------------------

CREATE TABLE queen.timers (
    tenant           text NOT NULL,
    queue            text NOT NULL,
    timer_key        text COLLATE "C" NOT NULL,  -- byte order: a keyset cursor is stable across machines
    partition        text NOT NULL DEFAULT 'Default',
    deliver_at       timestamptz NOT NULL,
    txn              text NOT NULL,
    message_id       uuid NOT NULL,
    payload          bytea NOT NULL,             -- as sent (or the encryption envelope)
    payload_zstd     boolean NOT NULL DEFAULT false,
    encrypted        boolean NOT NULL DEFAULT false,
    producer_sub     text,
    attempts         integer NOT NULL DEFAULT 0, -- budget spent: permanent and config failures only
    failures         integer NOT NULL DEFAULT 0, -- every failure; drives the backoff exponent
    last_error       text,
    last_error_class text,
    claim_id         uuid,
    claimed_by       text,
    lease_until      timestamptz,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, queue, timer_key),
    CONSTRAINT timer_key_not_empty CHECK (timer_key <> ''),
    CONSTRAINT queue_not_empty CHECK (queue <> ''),
    CONSTRAINT txn_not_empty CHECK (txn <> ''),
    CONSTRAINT claim_has_lease CHECK ((claim_id IS NULL) = (lease_until IS NULL))
);
-- The sweeper's scan: due rows in expiry order.
CREATE INDEX timers_deliver_at_idx ON queen.timers (deliver_at);
-- The leased path's scan (claim_timers p_zstd_only): a backlog of plain
-- due rows must not be walked to find the few zstd ones.
CREATE INDEX timers_zstd_deliver_at_idx ON queen.timers (deliver_at) WHERE payload_zstd;

-- ---------------------------------------------------------------------
-- Types
-- ---------------------------------------------------------------------

-- One operation of a POST /api/v1/timers batch.
CREATE TYPE queen.timer_op AS (
    op            text,     -- schedule | reschedule | cancel
    queue         text,
    timer_key     text,
    delay_ms      bigint,   -- from PostgreSQL's now(); negative is legal (due at once)
    txn           text,     -- required for schedule; minted when a reschedule omits it
    payload       bytea,
    partition     text,     -- NULL: 'Default'
    payload_zstd  boolean,
    encrypted     boolean,
    raw_size      integer   -- decompressed size when payload_zstd (checked against the ceiling)
);

-- One verdict per operation, in input order.
CREATE TYPE queen.timer_verdict AS (
    ordinal     integer,
    op          text,
    ok          boolean,
    status      text,       -- scheduled | rescheduled | cancelled | absent | too_late
    queue       text,
    timer_key   text,
    txn         text,
    message_id  uuid,
    deliver_at  timestamptz
);

-- What peek shows of a timer (payload as stored, never decrypted).
CREATE TYPE queen.timer_view AS (
    tenant        text,
    queue         text,
    timer_key     text,
    partition     text,
    deliver_at    timestamptz,
    txn           text,
    message_id    uuid,
    payload       bytea,
    payload_zstd  boolean,
    encrypted     boolean,
    producer_sub  text,
    attempts      integer,
    last_error    text,
    claimed       boolean,
    created_at    timestamptz,
    updated_at    timestamptz
);

-- ---------------------------------------------------------------------
-- Functions
-- ---------------------------------------------------------------------

-- One queen.timer_op with named arguments, so a batch is writable by
-- hand in psql: queen.make_timer_op('cancel', 'reminders', 'k').
CREATE FUNCTION queen.make_timer_op(
    p_op           text,
    p_queue        text,
    p_timer_key    text,
    p_delay_ms     bigint  DEFAULT NULL,
    p_txn          text    DEFAULT NULL,
    p_payload      bytea   DEFAULT NULL,
    p_partition    text    DEFAULT NULL,
    p_payload_zstd boolean DEFAULT NULL,
    p_encrypted    boolean DEFAULT NULL,
    p_raw_size     integer DEFAULT NULL)
RETURNS queen.timer_op
LANGUAGE sql IMMUTABLE AS $$
    SELECT ROW(p_op, p_queue, p_timer_key, p_delay_ms, p_txn, p_payload, p_partition,
               p_payload_zstd, p_encrypted, p_raw_size)::queen.timer_op
$$;

-- The single definition of "in somebody's hands".
-- STABLE, not IMMUTABLE: with p_now NULL it reads now(), which must
-- never be folded into a cached plan.
CREATE FUNCTION queen.timer_is_claimed(p_lease_until timestamptz, p_now timestamptz DEFAULT NULL)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT p_lease_until IS NOT NULL AND p_lease_until > coalesce(p_now, now())
$$;

-- Internal: delete one timer unless a broker holds it, without touching
-- the tenant's counters (schedule_timers meters a whole batch at once,
-- after its row locks, so two batches cannot deadlock on the counter row).
-- Takes the row lock first, so a cancel racing a claim waits for the
-- claim and then answers too_late, and a claim (SKIP LOCKED) passes over
-- a row being cancelled. Returns cancelled | absent | too_late.
CREATE FUNCTION queen.delete_unclaimed_timer(
    p_tenant    text,
    p_queue     text,
    p_timer_key text,
    p_now       timestamptz DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_now   timestamptz := coalesce(p_now, now());
    v_lease timestamptz;
BEGIN
    IF p_queue IS NULL OR p_queue = '' OR p_timer_key IS NULL OR p_timer_key = '' THEN
        RAISE EXCEPTION 'timers_bad_request'
            USING ERRCODE = 'QTBAD', DETAIL = 'queue and timerKey are required';
    END IF;
    SELECT lease_until INTO v_lease
      FROM queen.timers
     WHERE tenant = p_tenant AND queue = p_queue AND timer_key = p_timer_key
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 'absent';
    END IF;
    IF queen.timer_is_claimed(v_lease, v_now) THEN
        RETURN 'too_late';
    END IF;
    DELETE FROM queen.timers
     WHERE tenant = p_tenant AND queue = p_queue AND timer_key = p_timer_key;
    RETURN 'cancelled';
END
$$;

-- Cancel one timer (DELETE /api/v1/timers/:queue/*timerKey): passes no
-- rung of the gate ladder. Returns cancelled | absent | too_late;
-- absent also for another tenant's key. Keeps the pending counter.
CREATE FUNCTION queen.cancel_timer(
    p_tenant    text,
    p_queue     text,
    p_timer_key text,
    p_now       timestamptz DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_status text := queen.delete_unclaimed_timer(p_tenant, p_queue, p_timer_key, p_now);
BEGIN
    IF v_status = 'cancelled' THEN
        PERFORM queen.bump_tenant_usage(p_tenant, -1, 0);
    END IF;
    RETURN v_status;
END
$$;

-- The gate ladder of POST /api/v1/timers, in order, before any write.
-- Refuses the whole batch by raising; passing it has no visible effect
-- besides the rate tokens taken (undone if the caller's batch fails).
CREATE FUNCTION queen.check_timer_gates(
    p_tenant     text,
    p_ops        queen.timer_op[],
    p_horizon_ms bigint      DEFAULT NULL,
    p_tenancy    boolean     DEFAULT NULL,
    p_now        timestamptz DEFAULT NULL)
RETURNS queen.tenant_limits
LANGUAGE plpgsql AS $$
DECLARE
    v_now     timestamptz := coalesce(p_now, now());
    c         queen.cell_settings := queen.get_cell_settings();
    l         queen.tenant_limits := queen.get_tenant_limits(p_tenant, p_horizon_ms, p_tenancy);
    v_pending bigint;
    v_new     bigint;
    v_bad     queen.timer_op;
BEGIN
    -- 1. operator pause of scheduling: 503
    IF c.scheduling_paused THEN
        RAISE EXCEPTION 'timers_disabled'
            USING ERRCODE = 'QTOFF', DETAIL = 'an operator paused scheduling (queen.pause_scheduling)',
                  HINT = 'retry_after_seconds=30';
    END IF;
    -- 2. plan grant, or tenancy without a quota row
    IF NOT l.has_quota_row THEN
        RAISE EXCEPTION 'feature_gated'
            USING ERRCODE = 'QTGAT', DETAIL = format('tenancy is on and tenant %s has no quota row', p_tenant);
    END IF;
    IF NOT l.timers_enabled THEN
        RAISE EXCEPTION 'feature_gated'
            USING ERRCODE = 'QTGAT', DETAIL = format('timers are not on the plan of tenant %s', p_tenant);
    END IF;
    -- 3. cluster or tenant produce block
    IF l.produce_blocked THEN
        RAISE EXCEPTION 'produce_blocked'
            USING ERRCODE = 'QTBLK', DETAIL = format('producing is blocked for tenant %s', p_tenant);
    END IF;
    -- 4. rate, one token per operation
    PERFORM queen.take_rate_tokens(p_tenant, cardinality(p_ops), l.rate_ops_per_second, l.rate_burst, v_now);
    -- 5. pending-timer quota: rows this batch would create, net of the
    --    unclaimed rows its own cancels free (at the quota, swapping one
    --    timer for another in one batch is allowed)
    IF l.max_pending_timers IS NOT NULL THEN
        SELECT count(*) FILTER (WHERE o.op IN ('schedule', 'reschedule') AND t.timer_key IS NULL)
             - count(*) FILTER (WHERE o.op = 'cancel' AND t.timer_key IS NOT NULL
                                  AND NOT queen.timer_is_claimed(t.lease_until, v_now))
          INTO v_new
          FROM unnest(p_ops) o
          LEFT JOIN queen.timers t
                 ON t.tenant = p_tenant AND t.queue = o.queue AND t.timer_key = o.timer_key;
        SELECT coalesce((SELECT pending_timers FROM queen.tenant_usage WHERE tenant = p_tenant), 0)
          INTO v_pending;
        IF v_new > 0 AND v_pending + v_new > l.max_pending_timers THEN
            RAISE EXCEPTION 'timers_quota_exceeded'
                USING ERRCODE = 'QTQUO',
                      DETAIL = format('tenant %s has %s pending timers of %s; this batch adds %s',
                                      p_tenant, v_pending, l.max_pending_timers, v_new);
        END IF;
    END IF;
    -- 6. horizon
    SELECT * INTO v_bad FROM unnest(p_ops) o
     WHERE o.op IN ('schedule', 'reschedule') AND o.delay_ms > l.horizon_ms LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'timer_horizon_exceeded'
            USING ERRCODE = 'QTHOR',
                  DETAIL = format('delayMs %s for %s/%s is beyond the horizon of %s ms',
                                  v_bad.delay_ms, v_bad.queue, v_bad.timer_key, l.horizon_ms);
    END IF;
    -- 7. payload ceiling, on the decoded and on the decompressed bytes
    SELECT * INTO v_bad FROM unnest(p_ops) o
     WHERE o.op IN ('schedule', 'reschedule')
       AND greatest(octet_length(o.payload), coalesce(o.raw_size, 0)) > l.max_payload_bytes LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'payload_too_large'
            USING ERRCODE = 'QTBIG',
                  DETAIL = format('payload of %s/%s is %s bytes; the ceiling is %s',
                                  v_bad.queue, v_bad.timer_key,
                                  greatest(octet_length(v_bad.payload), coalesce(v_bad.raw_size, 0)),
                                  l.max_payload_bytes);
    END IF;
    RETURN l;
END
$$;

-- Shape checks shared by every caller (HTTP validates first; this is
-- for psql users, so a DBA's batch gets the same 400 the wire gets).
CREATE FUNCTION queen.check_timer_ops(p_ops queen.timer_op[], p_max_ops integer DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_max integer := coalesce(p_max_ops, (queen.get_cell_settings()).max_ops);
    v_msg text;
BEGIN
    IF cardinality(p_ops) > v_max THEN
        RAISE EXCEPTION 'timers_bad_request'
            USING ERRCODE = 'QTBAD', DETAIL = format('%s operations; at most %s per call', cardinality(p_ops), v_max);
    END IF;
    SELECT CASE
             WHEN o.op IS NULL OR o.op NOT IN ('schedule', 'reschedule', 'cancel')
               THEN format('operation %s: unknown op %L', n, o.op)
             WHEN o.queue IS NULL OR o.queue = ''
               THEN format('operation %s: queue is required', n)
             WHEN o.timer_key IS NULL OR o.timer_key = ''
               THEN format('operation %s: timerKey is required', n)
             WHEN o.op <> 'cancel' AND o.delay_ms IS NULL
               THEN format('operation %s: delayMs is required', n)
             WHEN o.op = 'schedule' AND (o.txn IS NULL OR o.txn = '')
               THEN format('operation %s: txn is required', n)
             WHEN o.op <> 'cancel' AND o.payload IS NULL
               THEN format('operation %s: payload is required', n)
             WHEN o.partition = ''
               THEN format('operation %s: partition may not be empty', n)
           END
      INTO v_msg
      FROM unnest(p_ops) WITH ORDINALITY AS o(op, queue, timer_key, delay_ms, txn, payload,
                                              partition, payload_zstd, encrypted, raw_size, n)
     WHERE o.op IS NULL OR o.op NOT IN ('schedule', 'reschedule', 'cancel')
        OR o.queue IS NULL OR o.queue = '' OR o.timer_key IS NULL OR o.timer_key = ''
        OR (o.op <> 'cancel' AND (o.delay_ms IS NULL OR o.payload IS NULL))
        OR (o.op = 'schedule' AND (o.txn IS NULL OR o.txn = ''))
        OR o.partition = ''
     ORDER BY n LIMIT 1;
    IF v_msg IS NOT NULL THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = v_msg;
    END IF;
    SELECT format('(%s, %s) appears more than once in the batch', queue, timer_key) INTO v_msg
      FROM unnest(p_ops) GROUP BY queue, timer_key HAVING count(*) > 1 LIMIT 1;
    IF v_msg IS NOT NULL THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = v_msg;
    END IF;
END
$$;

-- The batch behind POST /api/v1/timers: shape checks, the gate ladder,
-- then every operation, one verdict each, in input order. schedule and
-- reschedule are the same upsert on (tenant, queue, timer_key); an
-- upsert of a claimed row answers too_late and changes nothing. Each
-- accepted upsert mints a new message id, resets attempts, clears the
-- last error and is billed one message; cancels bill nothing.
-- Rows are touched in (queue, timer_key) order and the counter row last,
-- so that concurrent batches cannot deadlock each other. p_max_ops is
-- the broker's QUEEN_TIMERS_MAX_OPS (NULL: the cell's).
CREATE FUNCTION queen.schedule_timers(
    p_tenant       text,
    p_ops          queen.timer_op[],
    p_producer_sub text        DEFAULT NULL,
    p_horizon_ms   bigint      DEFAULT NULL,
    p_tenancy      boolean     DEFAULT NULL,
    p_now          timestamptz DEFAULT NULL,
    p_max_ops      integer     DEFAULT NULL)
RETURNS SETOF queen.timer_verdict
LANGUAGE plpgsql AS $$
DECLARE
    v_now      timestamptz := coalesce(p_now, now());
    l          queen.tenant_limits;
    v_at       timestamptz;
    v_count    bigint;
    v_out      queen.timer_verdict[] := '{}';
    v          queen.timer_verdict;
    o          record;
    v_inserted boolean;
    v_msg_id   uuid;
    v_txn      text;
    v_status   text;
    v_pending  bigint := 0;
    v_billed   bigint := 0;
BEGIN
    IF p_tenant IS NULL OR p_tenant = '' THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = 'tenant is required';
    END IF;
    IF p_ops IS NULL OR cardinality(p_ops) = 0 THEN
        RETURN;
    END IF;
    PERFORM queen.check_timer_ops(p_ops, p_max_ops);
    l := queen.check_timer_gates(p_tenant, p_ops, p_horizon_ms, p_tenancy, v_now);

    FOR o IN
        SELECT x.*, x.n::integer AS ordinal
          FROM unnest(p_ops) WITH ORDINALITY AS x(op, queue, timer_key, delay_ms, txn, payload,
                                                  partition, payload_zstd, encrypted, raw_size, n)
         ORDER BY x.queue, x.timer_key COLLATE "C"
    LOOP
        v := ROW(o.ordinal, o.op, false, NULL, o.queue, o.timer_key, o.txn, NULL, NULL);
        IF o.op = 'cancel' THEN
            v_status := queen.delete_unclaimed_timer(p_tenant, o.queue, o.timer_key, v_now);
            v.status := v_status;
            v.ok := v_status = 'cancelled';
            IF v.ok THEN
                v_pending := v_pending - 1;
            END IF;
        ELSE
            v_msg_id := queen.uuid_v7();
            v_txn := coalesce(nullif(o.txn, ''), queen.uuid_v7()::text);
            -- a delay in the past is due at once; clamped so that no
            -- negative delayMs can overflow the timestamp
            v_at := v_now + greatest(o.delay_ms, -l.horizon_ms) * interval '1 millisecond';
            INSERT INTO queen.timers AS t
                   (tenant, queue, timer_key, partition, deliver_at, txn, message_id, payload,
                    payload_zstd, encrypted, producer_sub, created_at, updated_at)
            VALUES (p_tenant, o.queue, o.timer_key, coalesce(o.partition, 'Default'),
                    v_at, v_txn, v_msg_id, o.payload,
                    coalesce(o.payload_zstd, false), coalesce(o.encrypted, false), p_producer_sub,
                    v_now, v_now)
            ON CONFLICT (tenant, queue, timer_key) DO UPDATE
               SET partition = EXCLUDED.partition, deliver_at = EXCLUDED.deliver_at,
                   txn = EXCLUDED.txn, message_id = EXCLUDED.message_id,
                   payload = EXCLUDED.payload, payload_zstd = EXCLUDED.payload_zstd,
                   encrypted = EXCLUDED.encrypted, producer_sub = EXCLUDED.producer_sub,
                   attempts = 0, failures = 0, last_error = NULL, last_error_class = NULL,
                   claim_id = NULL, claimed_by = NULL, lease_until = NULL,
                   updated_at = v_now
             -- an expired lease is a dead claim: the upsert takes the row over
             WHERE NOT queen.timer_is_claimed(t.lease_until, v_now)
            RETURNING (xmax = 0) INTO v_inserted;
            IF NOT FOUND THEN
                v.status := 'too_late';
            ELSE
                v.ok := true;
                v.status := CASE WHEN v_inserted THEN 'scheduled' ELSE 'rescheduled' END;
                v.txn := v_txn;
                v.message_id := v_msg_id;
                v.deliver_at := v_at;
                v_billed := v_billed + 1;
                IF v_inserted THEN
                    v_pending := v_pending + 1;
                END IF;
            END IF;
        END IF;
        v_out := v_out || v;
    END LOOP;

    IF v_pending <> 0 OR v_billed <> 0 THEN
        PERFORM queen.bump_tenant_usage(p_tenant, v_pending, v_billed);
    END IF;
    -- The quota rung read the counter without a lock; re-check it under
    -- the counter row's lock so that concurrent batches cannot overshoot.
    IF l.max_pending_timers IS NOT NULL AND v_pending > 0 THEN
        SELECT pending_timers INTO v_count FROM queen.tenant_usage WHERE tenant = p_tenant;
        IF v_count > l.max_pending_timers THEN
            RAISE EXCEPTION 'timers_quota_exceeded'
                USING ERRCODE = 'QTQUO',
                      DETAIL = format('tenant %s would have %s pending timers of %s',
                                      p_tenant, v_count, l.max_pending_timers);
        END IF;
    END IF;
    -- Wake sweepers whose next planned wake-up is later than this.
    PERFORM pg_notify('queen_timers', extract(epoch FROM min(x.deliver_at))::text)
       FROM unnest(v_out) x WHERE x.deliver_at IS NOT NULL HAVING min(x.deliver_at) IS NOT NULL;

    RETURN QUERY SELECT * FROM unnest(v_out) ORDER BY ordinal;
END
$$;

-- One timer as peek shows it; no row when there is none (for this tenant).
-- Key columns are handed out with the declared (default) collation: an
-- inlined SQL function would otherwise leak the column's "C" collation.
CREATE FUNCTION queen.peek_timer(
    p_tenant    text,
    p_queue     text,
    p_timer_key text,
    p_now       timestamptz DEFAULT NULL)
RETURNS SETOF queen.timer_view
LANGUAGE sql STABLE AS $$
    SELECT tenant, queue, timer_key COLLATE "default", partition, deliver_at, txn, message_id, payload, payload_zstd,
           encrypted, producer_sub, attempts, last_error,
           queen.timer_is_claimed(lease_until, coalesce(p_now, now())), created_at, updated_at
      FROM queen.timers
     WHERE tenant = p_tenant AND queue = p_queue AND timer_key = p_timer_key
$$;

-- A keyset page of one queue's pending timers, without payloads.
-- p_after is exclusive; p_limit is clamped to 1..1000 (default 100).
-- truncated and next_after repeat on every row of the page (an empty
-- page is never truncated).
CREATE FUNCTION queen.list_timers(
    p_tenant text,
    p_queue  text,
    p_after  text    DEFAULT NULL,
    p_limit  integer DEFAULT 100,
    p_now    timestamptz DEFAULT NULL)
RETURNS TABLE (
    timer_key    text,
    partition    text,
    deliver_at   timestamptz,
    txn          text,
    message_id   uuid,
    payload_zstd boolean,
    encrypted    boolean,
    producer_sub text,
    attempts     integer,
    last_error   text,
    claimed      boolean,
    created_at   timestamptz,
    updated_at   timestamptz,
    truncated    boolean,
    next_after   text)
LANGUAGE sql STABLE AS $$
    WITH lim AS (
        SELECT least(greatest(coalesce(p_limit, 100), 1), 1000) AS n
    ), page AS (
        SELECT t.*, row_number() OVER (ORDER BY t.timer_key COLLATE "C") AS rn
          FROM queen.timers t
         WHERE t.tenant = p_tenant AND t.queue = p_queue
           AND (p_after IS NULL OR t.timer_key > p_after COLLATE "C")
         ORDER BY t.timer_key COLLATE "C"
         LIMIT (SELECT n + 1 FROM lim)
    ), flags AS (
        SELECT count(*) > (SELECT n FROM lim) AS truncated,
               max(timer_key) FILTER (WHERE rn = (SELECT n FROM lim)) AS last_key
          FROM page
    )
    SELECT p.timer_key COLLATE "default", p.partition, p.deliver_at, p.txn, p.message_id, p.payload_zstd, p.encrypted,
           p.producer_sub, p.attempts, p.last_error,
           queen.timer_is_claimed(p.lease_until, coalesce(p_now, now())), p.created_at, p.updated_at,
           f.truncated, CASE WHEN f.truncated THEN f.last_key END COLLATE "default"
      FROM page p, flags f
     WHERE p.rn <= (SELECT n FROM lim)
     ORDER BY p.timer_key COLLATE "C"
$$;
-- =====================================================================
-- Part 40: the fire: claim, fire, fail (backoff / DLQ), operator controls
-- =====================================================================

-- ---------------------------------------------------------------------
-- Types
-- ---------------------------------------------------------------------

-- A timer a broker claimed: what it needs to build the frame.
CREATE TYPE queen.claimed_timer AS (
    claim_id      uuid,
    tenant        text,
    queue         text,
    timer_key     text,
    partition     text,
    deliver_at    timestamptz,
    lease_until   timestamptz,
    txn           text,
    message_id    uuid,
    payload       bytea,
    payload_zstd  boolean,
    encrypted     boolean,
    attempts      integer
);

-- A frame to fire for a claimed timer; payload NULL means "the stored
-- bytes" (only a zstd payload needs the broker to hand back new bytes).
CREATE TYPE queen.fire_frame AS (
    tenant     text,
    queue      text,
    timer_key  text,
    payload    bytea
);

-- The outcome of firing one timer.
CREATE TYPE queen.fire_result AS (
    tenant        text,
    queue         text,
    timer_key     text,
    outcome       text,        -- fired | duplicate (txn already in the partition) | lost (claim no longer held)
    message_id    uuid,
    partition_id  uuid,
    deliver_at    timestamptz,
    fired_at      timestamptz
);

-- ---------------------------------------------------------------------
-- Operator controls
-- ---------------------------------------------------------------------

-- Pause or resume scheduling: POST /api/v1/timers answers 503
-- timers_disabled; DELETE, peek, list and the fire go on.
CREATE FUNCTION queen.pause_scheduling(p_paused boolean DEFAULT true)
RETURNS boolean
LANGUAGE sql AS $$
    UPDATE queen.cell_settings SET scheduling_paused = p_paused, updated_at = now() WHERE id
    RETURNING scheduling_paused
$$;

CREATE FUNCTION queen.resume_scheduling()
RETURNS boolean
LANGUAGE sql AS $$
    SELECT NOT queen.pause_scheduling(false)
$$;

-- Pause or resume the fire in every broker of the cell. This is the only
-- switch that stops the fire; no automatic rung ever does.
CREATE FUNCTION queen.pause_fire(p_paused boolean DEFAULT true)
RETURNS boolean
LANGUAGE sql AS $$
    UPDATE queen.cell_settings SET fire_paused = p_paused, updated_at = now() WHERE id
    RETURNING fire_paused
$$;

CREATE FUNCTION queen.resume_fire()
RETURNS boolean
LANGUAGE sql AS $$
    SELECT NOT queen.pause_fire(false)
$$;

-- ---------------------------------------------------------------------
-- Claim and fire
-- ---------------------------------------------------------------------
-- plan_cache_mode = force_custom_plan on the functions that join a batch
-- array: after five calls PL/pgSQL switches to a generic plan that guesses
-- unnest(array) at 10 rows and joins the batch by nested loop, quadratic
-- in the batch (bench/RESULTS.md: fire_timers of 1024 frames 45 ms ->
-- 400 ms). fire_due_timers joins no array and keeps its cached plan.

-- Append the frames of deleted timer rows to the log, in expiry order,
-- and keep the tenants' pending counters. Internal to the fire.
CREATE FUNCTION queen.append_timer_frames(p_rows queen.timers[], p_frames queen.fire_frame[] DEFAULT NULL)
RETURNS SETOF queen.fire_result
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    v_fired_at timestamptz := clock_timestamp();
BEGIN
    -- Lock every destination partition, in a fixed order, before appending.
    PERFORM queen.lock_partition(d.queue, d.partition)
       FROM (SELECT DISTINCT r.queue, r.partition FROM unnest(p_rows) r ORDER BY 1, 2) d;

    -- Counter rows in tenant order: two fires never wait on each other crosswise.
    PERFORM queen.bump_tenant_usage(g.tenant, -g.n, 0)
       FROM (SELECT r.tenant, count(*) AS n FROM unnest(p_rows) r GROUP BY r.tenant ORDER BY r.tenant) g;

    RETURN QUERY
    WITH src AS (
        SELECT r.*, coalesce(f.payload, r.payload) AS frame_payload, p.id AS partition_id
          FROM unnest(p_rows) r
          JOIN queen.queues q ON q.name = r.queue
          JOIN queen.partitions p ON p.queue_id = q.id AND p.name = r.partition
          LEFT JOIN (SELECT DISTINCT ON (x.tenant, x.queue, x.timer_key) x.*
                       FROM unnest(p_frames) x) f
                 ON f.tenant = r.tenant AND f.queue = r.queue AND f.timer_key = r.timer_key
    ), ins AS (
        INSERT INTO queen.messages (id, transaction_id, partition_id, payload, is_encrypted, producer_sub)
        SELECT s.message_id, s.txn, s.partition_id, s.frame_payload, s.encrypted, s.producer_sub
          FROM src s
         ORDER BY s.deliver_at, s.message_id
        ON CONFLICT (partition_id, transaction_id) DO NOTHING
        RETURNING id
    )
    SELECT s.tenant, s.queue, s.timer_key,
           CASE WHEN i.id IS NULL THEN 'duplicate' ELSE 'fired' END,
           s.message_id, s.partition_id, s.deliver_at, v_fired_at
      FROM src s LEFT JOIN ins i ON i.id = s.message_id
     ORDER BY s.deliver_at, s.message_id;
END
$$;

-- Claim up to p_limit due timers for p_lease_ms, in expiry order (and
-- returned in it), skipping rows another session holds. A row whose
-- lease expired (its broker died) is due again. Nothing is claimed
-- while the fire is paused. p_zstd_only: only rows whose frame needs the
-- broker (zstd to inflate); fire_due_timers takes the rest, lease-free.
CREATE FUNCTION queen.claim_timers(
    p_broker   text,
    p_limit    integer     DEFAULT 100,
    p_lease_ms  integer     DEFAULT 30000,
    p_now       timestamptz DEFAULT NULL,
    p_zstd_only boolean     DEFAULT false)
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
        SELECT t.tenant, t.queue, t.timer_key
          FROM queen.timers t
         WHERE t.deliver_at <= v_now
           AND NOT queen.timer_is_claimed(t.lease_until, v_now)
           AND (t.payload_zstd OR NOT p_zstd_only)
         ORDER BY t.deliver_at
         LIMIT greatest(p_limit, 0)
           FOR UPDATE SKIP LOCKED
    ), claimed AS (
        UPDATE queen.timers t
           SET claim_id = v_claim, claimed_by = p_broker,
               lease_until = v_now + greatest(p_lease_ms, 1) * interval '1 millisecond'
          FROM due
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

-- Fire claimed timers: in one transaction, delete each row still held by
-- p_claim_id and append its frame to the log. A row whose claim was lost
-- (lease expired and taken over, rescheduled, or cancelled after expiry)
-- answers 'lost' and is left alone. p_frames names the timers to fire;
-- its payload, when not NULL, replaces the stored bytes (zstd inflated).
CREATE FUNCTION queen.fire_timers(
    p_claim_id uuid,
    p_frames   queen.fire_frame[],
    p_now      timestamptz DEFAULT NULL)
RETURNS SETOF queen.fire_result
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    v_now  timestamptz := coalesce(p_now, now());
    v_rows queen.timers[];
BEGIN
    WITH held AS (
        SELECT t.tenant, t.queue, t.timer_key
          FROM queen.timers t
          JOIN unnest(p_frames) f USING (tenant, queue, timer_key)
         WHERE t.claim_id = p_claim_id AND queen.timer_is_claimed(t.lease_until, v_now)
         ORDER BY t.tenant, t.queue, t.timer_key
           FOR UPDATE OF t
    ), gone AS (
        DELETE FROM queen.timers t USING held h
         WHERE (t.tenant, t.queue, t.timer_key) = (h.tenant, h.queue, h.timer_key)
        RETURNING t.*
    )
    SELECT array_agg(gone) INTO v_rows FROM gone;

    IF v_rows IS NOT NULL THEN
        RETURN QUERY SELECT * FROM queen.append_timer_frames(v_rows, p_frames);
    END IF;
    RETURN QUERY
    SELECT f.tenant, f.queue, f.timer_key, 'lost'::text, NULL::uuid, NULL::uuid, NULL::timestamptz, NULL::timestamptz
      FROM unnest(p_frames) f
     WHERE v_rows IS NULL
        OR NOT EXISTS (SELECT 1 FROM unnest(v_rows) r
                        WHERE (r.tenant, r.queue, r.timer_key) = (f.tenant, f.queue, f.timer_key));
END
$$;

-- Claim and fire in one transaction: the row lock is the claim, so no
-- lease is needed and a broker dying mid-call loses nothing (the
-- transaction rolls back). Used for every due timer whose frame needs
-- nothing from the broker (no zstd to inflate). Expiry order, SKIP LOCKED.
-- The common case is one statement with a plain INSERT (no join back from
-- the log, no ON CONFLICT arbiter: together they halved the fire rate);
-- a txn already in its partition raises unique_violation, and the batch
-- is redone through append_timer_frames, which answers 'duplicate'.
CREATE FUNCTION queen.fire_due_timers(
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
             WHERE t.tenant = d.tenant AND t.queue = d.queue AND t.timer_key = d.timer_key
            RETURNING t.*
        ), parts AS (
            -- every destination partition locked, in a fixed order, before a row
            -- joined to it can be appended (see queen.messages.seq)
            SELECT x.queue, x.partition, queen.lock_partition(x.queue, x.partition) AS partition_id
              FROM (SELECT DISTINCT g.queue, g.partition FROM gone g ORDER BY 1, 2) x
        ), src AS (
            SELECT g.*, p.partition_id
              FROM gone g JOIN parts p ON p.queue = g.queue AND p.partition = g.partition
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
    -- Counter rows in tenant order: two fires never wait on each other crosswise.
    PERFORM queen.bump_tenant_usage(g.tenant, -g.n, 0)
       FROM (SELECT o.tenant, count(*) AS n FROM unnest(v_out) o GROUP BY o.tenant ORDER BY o.tenant) g;
    RETURN QUERY SELECT * FROM unnest(v_out);
END
$$;

-- A failed fire of a claimed timer. The claim is dropped; the timer
-- backs off exponentially (p_backoff_ms * 2^(failures-1), at most
-- p_backoff_max_ms). Only 'permanent' and 'config' failures spend the
-- attempt budget; 'transient' ones cost nothing. When attempts reach
-- p_max_attempts the timer moves to its queue's DLQ under the group
-- '__QUEEN_TIMERS__'. Returns backoff | dead_lettered | lost.
CREATE FUNCTION queen.fail_timer(
    p_tenant         text,
    p_queue          text,
    p_timer_key      text,
    p_claim_id       uuid,
    p_error_class    text,
    p_error          text,
    p_max_attempts   integer     DEFAULT 5,
    p_backoff_ms     integer     DEFAULT 1000,
    p_backoff_max_ms integer     DEFAULT 300000,
    p_now            timestamptz DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_now   timestamptz := coalesce(p_now, now());
    r       queen.timers;
    v_spend boolean;
    v_part  uuid;
BEGIN
    IF p_error_class IS NULL OR p_error_class NOT IN ('transient', 'permanent', 'config') THEN
        RAISE EXCEPTION 'timers_bad_request'
            USING ERRCODE = 'QTBAD', DETAIL = format('unknown failure class %L', p_error_class);
    END IF;
    v_spend := p_error_class IN ('permanent', 'config');

    SELECT * INTO r FROM queen.timers
     WHERE tenant = p_tenant AND queue = p_queue AND timer_key = p_timer_key
       AND claim_id = p_claim_id AND queen.timer_is_claimed(lease_until, v_now)
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 'lost';
    END IF;

    IF v_spend AND r.attempts + 1 >= p_max_attempts THEN
        DELETE FROM queen.timers
         WHERE tenant = p_tenant AND queue = p_queue AND timer_key = p_timer_key;
        v_part := queen.lock_partition(r.queue, r.partition);
        INSERT INTO queen.dead_letter_queue
               (message_id, partition_id, consumer_group, transaction_id, payload, is_encrypted,
                payload_zstd, producer_sub, error_message, retry_count, original_created_at, failed_at,
                timer_tenant, timer_key)
        VALUES (r.message_id, v_part, '__QUEEN_TIMERS__', r.txn, r.payload, r.encrypted,
                r.payload_zstd, r.producer_sub, p_error, r.attempts + 1, r.created_at, v_now,
                r.tenant, r.timer_key);
        PERFORM queen.bump_tenant_usage(r.tenant, -1, 0);
        RETURN 'dead_lettered';
    END IF;

    UPDATE queen.timers
       SET attempts = attempts + CASE WHEN v_spend THEN 1 ELSE 0 END,
           failures = failures + 1,
           last_error = p_error,
           last_error_class = p_error_class,
           claim_id = NULL, claimed_by = NULL, lease_until = NULL,
           deliver_at = v_now + least(p_backoff_max_ms::numeric,
                                      p_backoff_ms::numeric * power(2::numeric, least(r.failures, 30)))
                                * interval '1 millisecond',
           updated_at = v_now
     WHERE tenant = p_tenant AND queue = p_queue AND timer_key = p_timer_key;
    RETURN 'backoff';
END
$$;

-- Replay a DLQ row into its partition as a new frame (new message id,
-- transaction id '<original>#replay-<dlq id>'), deleting the DLQ row.
-- A timer's dead letter is refused with QTRPL: its frame never had a
-- consumer group, and republishing it into a phantom group has no
-- defined meaning.
CREATE FUNCTION queen.replay_dlq_entry(p_dlq_id uuid)
RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    d      queen.dead_letter_queue;
    v_id   uuid := queen.uuid_v7();
BEGIN
    SELECT * INTO d FROM queen.dead_letter_queue WHERE id = p_dlq_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'not_found' USING ERRCODE = 'QTNFD', DETAIL = format('no DLQ entry %s', p_dlq_id);
    END IF;
    IF d.consumer_group = '__QUEEN_TIMERS__' THEN
        RAISE EXCEPTION 'dlq_replay_refused'
            USING ERRCODE = 'QTRPL',
                  DETAIL = 'a timer''s dead letter never had a consumer group and its offset is not a position; schedule a new timer instead';
    END IF;
    PERFORM 1 FROM queen.partitions WHERE id = d.partition_id FOR NO KEY UPDATE;
    INSERT INTO queen.messages (id, transaction_id, partition_id, payload, is_encrypted, producer_sub)
    VALUES (v_id, d.transaction_id || '#replay-' || d.id, d.partition_id, d.payload, d.is_encrypted, d.producer_sub);
    DELETE FROM queen.dead_letter_queue WHERE id = p_dlq_id;
    RETURN v_id;
END
$$;
-- =====================================================================
-- Part 50: the log API behind Queen's routes (configure, push, pop,
-- ack, message detail, DLQ list). Shapes follow Queen MQ; the cursor is
-- messages.seq (append order inside a partition, see 20_log.sql).
--
-- Consumer state per (partition, consumer group) lives in
-- queen.partition_consumers: last_consumed_seq is the cursor, and
-- lease_id / lease_expires_at a partition-level lease taken by pop and
-- released when the batch is acked, failed, retried or expires.
-- =====================================================================

-- ---------------------------------------------------------------------
-- Types
-- ---------------------------------------------------------------------

-- One item of POST /api/v1/push. payload is the bytes to store (the
-- compact JSON of the item's payload, or its encryption envelope).
CREATE TYPE queen.push_item AS (
    queue           text,
    partition       text,       -- NULL: 'Default'
    transaction_id  text,       -- NULL or '': a random UUID is generated
    trace_id        uuid,
    payload         bytea,
    is_encrypted    boolean
);

-- One verdict per pushed item, in input order.
CREATE TYPE queen.push_result AS (
    idx             integer,    -- 0-based input position
    transaction_id  text,
    status          text,       -- queued | duplicate
    message_id      uuid,       -- the new row, or the existing one for a duplicate
    partition_id    uuid,
    trace_id        uuid,
    queue_name      text
);

-- One message handed out by pop.
CREATE TYPE queen.popped_message AS (
    message_id        uuid,
    seq               bigint,
    transaction_id    text,
    trace_id          uuid,
    payload           bytea,
    is_encrypted      boolean,
    producer_sub      text,
    created_at        timestamptz,
    queue             text,
    partition_id      uuid,
    partition         text,
    lease_id          uuid,       -- NULL with auto-ack
    consumer_group    text,
    lease_expires_at  timestamptz
);

-- One acknowledgement of POST /api/v1/ack and /api/v1/ack/batch.
CREATE TYPE queen.ack_item AS (
    transaction_id  text,
    partition_id    uuid,
    status          text,       -- completed (default) | success | failed | dlq | retry
    error           text,
    lease_id        text,       -- checked only when non-empty
    consumer_group  text        -- NULL or '': '__QUEUE_MODE__'
);

-- One verdict per acknowledgement, in input order.
CREATE TYPE queen.ack_result AS (
    idx             integer,    -- 0-based input position
    transaction_id  text,
    success         boolean,
    error           text,       -- NULL | 'Message not found' | 'Invalid or expired lease'
    queue_name      text,
    partition_name  text,
    lease_released  boolean,
    dlq             boolean
);

-- A message as GET /api/v1/messages/:partitionId/:transactionId shows it.
CREATE TYPE queen.message_detail AS (
    message_id        uuid,
    transaction_id    text,
    partition_id      uuid,
    queue             text,
    partition         text,
    namespace         text,
    task              text,
    status            text,     -- dead_letter | completed | processing | pending
    payload           bytea,
    is_encrypted      boolean,
    trace_id          uuid,
    producer_sub      text,
    created_at        timestamptz,
    error_message     text,
    retry_count       integer,
    lease_expires_at  timestamptz,
    queue_config      jsonb,    -- {leaseTime, retryLimit, retryDelay, ttl, priority}
    mode              jsonb,    -- {hasQueueMode, busGroupsCount, consumedByGroups, type}
    consumer_groups   jsonb     -- [{name, consumed, processing, lastConsumedSeq, leaseExpiresAt}]
);

-- One dead letter as GET /api/v1/dlq lists it.
CREATE TYPE queen.dlq_entry AS (
    dlq_id          uuid,
    message_id      uuid,
    transaction_id  text,
    partition_id    uuid,
    queue           text,
    partition       text,
    consumer_group  text,
    error_message   text,
    retry_count     integer,
    payload         bytea,
    is_encrypted    boolean,
    payload_zstd    boolean,
    producer_sub    text,
    created_at      timestamptz,
    failed_at       timestamptz
);

-- ---------------------------------------------------------------------
-- Functions
-- ---------------------------------------------------------------------

-- A queue's 15 effective options, camelCase, as configure echoes them.
CREATE FUNCTION queen.queue_options(q queen.queues)
RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_build_object(
        'leaseTime', q.lease_time, 'retryLimit', q.retry_limit, 'retryDelay', q.retry_delay,
        'maxSize', q.max_size, 'ttl', q.ttl, 'priority', q.priority,
        'delayedProcessing', q.delayed_processing, 'windowBuffer', q.window_buffer,
        'retentionSeconds', q.retention_seconds, 'completedRetentionSeconds', q.completed_retention_seconds,
        'retentionEnabled', q.retention_enabled, 'encryptionEnabled', q.encryption_enabled,
        'deadLetterQueue', q.dead_letter_queue, 'dlqAfterMaxRetries', q.dlq_after_max_retries,
        'maxWaitTimeSeconds', q.max_wait_time_seconds)
$$;

-- Create or overwrite a queue by name (Queen's configure): every option
-- is set, a missing one back to its default; unknown keys are dropped.
-- Ensures the 'Default' partition. Bad option types raise QTBAD.
CREATE FUNCTION queen.configure_queue(
    p_queue     text,
    p_namespace text  DEFAULT NULL,
    p_task      text  DEFAULT NULL,
    p_options   jsonb DEFAULT NULL)
RETURNS TABLE (queue_id uuid, partition_id uuid, queue_name text, namespace text, task text, options jsonb)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    o      jsonb := coalesce(p_options, '{}'::jsonb);
    q      queen.queues;
    v_part uuid;
    v_key  text;
BEGIN
    IF p_queue IS NULL OR p_queue = '' THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = 'queue is required';
    END IF;
    IF jsonb_typeof(o) <> 'object' THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = 'options must be an object';
    END IF;
    -- JSON null means "absent" (default); anything else must have the right type.
    SELECT e.key INTO v_key FROM jsonb_each(o) e
     WHERE jsonb_typeof(e.value) <> 'null'
       AND ((e.key IN ('leaseTime', 'retryLimit', 'retryDelay', 'maxSize', 'ttl', 'priority',
                       'delayedProcessing', 'windowBuffer', 'retentionSeconds',
                       'completedRetentionSeconds', 'maxWaitTimeSeconds')
             AND NOT (jsonb_typeof(e.value) = 'number' AND e.value::text ~ '^[0-9]{1,9}$'))
         OR (e.key IN ('retentionEnabled', 'encryptionEnabled', 'deadLetterQueue', 'dlqAfterMaxRetries')
             AND jsonb_typeof(e.value) <> 'boolean'))
     ORDER BY e.key LIMIT 1;
    IF v_key IS NOT NULL THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('options.%s must be a %s', v_key,
                            CASE WHEN v_key IN ('retentionEnabled', 'encryptionEnabled', 'deadLetterQueue',
                                                'dlqAfterMaxRetries')
                                 THEN 'boolean' ELSE 'non-negative integer below 10^9' END);
    END IF;
    o := jsonb_strip_nulls(o);

    INSERT INTO queen.queues AS t
           (name, namespace, task, lease_time, retry_limit, retry_delay, max_size, ttl, priority,
            delayed_processing, window_buffer, retention_seconds, completed_retention_seconds,
            retention_enabled, encryption_enabled, dead_letter_queue, dlq_after_max_retries,
            max_wait_time_seconds)
    VALUES (p_queue, p_namespace, p_task,
            coalesce((o->>'leaseTime')::integer, 300),
            coalesce((o->>'retryLimit')::integer, 3),
            coalesce((o->>'retryDelay')::integer, 1000),
            coalesce((o->>'maxSize')::integer, 0),
            coalesce((o->>'ttl')::integer, 3600),
            coalesce((o->>'priority')::integer, 0),
            coalesce((o->>'delayedProcessing')::integer, 0),
            coalesce((o->>'windowBuffer')::integer, 0),
            coalesce((o->>'retentionSeconds')::integer, 0),
            coalesce((o->>'completedRetentionSeconds')::integer, 0),
            coalesce((o->>'retentionEnabled')::boolean, false),
            coalesce((o->>'encryptionEnabled')::boolean, false),
            coalesce((o->>'deadLetterQueue')::boolean, false),
            coalesce((o->>'dlqAfterMaxRetries')::boolean, false),
            coalesce((o->>'maxWaitTimeSeconds')::integer, 0))
    ON CONFLICT (name) DO UPDATE
       SET namespace = EXCLUDED.namespace, task = EXCLUDED.task,
           lease_time = EXCLUDED.lease_time, retry_limit = EXCLUDED.retry_limit,
           retry_delay = EXCLUDED.retry_delay, max_size = EXCLUDED.max_size, ttl = EXCLUDED.ttl,
           priority = EXCLUDED.priority, delayed_processing = EXCLUDED.delayed_processing,
           window_buffer = EXCLUDED.window_buffer, retention_seconds = EXCLUDED.retention_seconds,
           completed_retention_seconds = EXCLUDED.completed_retention_seconds,
           retention_enabled = EXCLUDED.retention_enabled,
           encryption_enabled = EXCLUDED.encryption_enabled,
           dead_letter_queue = EXCLUDED.dead_letter_queue,
           dlq_after_max_retries = EXCLUDED.dlq_after_max_retries,
           max_wait_time_seconds = EXCLUDED.max_wait_time_seconds,
           updated_at = now()
    RETURNING t.* INTO q;

    INSERT INTO queen.partitions AS p (queue_id, name) VALUES (q.id, 'Default')
    ON CONFLICT ON CONSTRAINT partitions_queue_name_unique DO NOTHING;
    SELECT p.id INTO v_part FROM queen.partitions p WHERE p.queue_id = q.id AND p.name = 'Default';

    RETURN QUERY SELECT q.id, v_part, q.name, q.namespace, q.task, queen.queue_options(q);
END
$$;

-- The names among p_queues whose queue encrypts at rest (push asks
-- before building payloads: the broker holds the key, not PostgreSQL).
CREATE FUNCTION queen.encrypted_queues(p_queues text[])
RETURNS SETOF text
LANGUAGE sql STABLE AS $$
    SELECT q.name FROM queen.queues q WHERE q.name = ANY (p_queues) AND q.encryption_enabled
$$;

-- Append a batch to the log, one verdict per item in input order. A
-- transaction id already in the partition (or earlier in the batch) is
-- 'duplicate' with the existing message id, never an error. Destination
-- partitions are locked first, in (queue, partition) order, as the fire does.
CREATE FUNCTION queen.push_messages(
    p_items        queen.push_item[],
    p_producer_sub text DEFAULT NULL)
RETURNS SETOF queen.push_result
LANGUAGE plpgsql AS $$
DECLARE
    it       record;
    r        queen.push_result;
    v_msg    text;
    v_part   uuid;
    v_id     uuid;
    v_txn    text;
BEGIN
    IF p_items IS NULL OR cardinality(p_items) = 0 THEN
        RETURN;
    END IF;
    SELECT CASE
             WHEN x.queue IS NULL OR x.queue = '' THEN format('items[%s]: queue is required', x.n - 1)
             WHEN x.partition = '' THEN format('items[%s]: partition may not be empty', x.n - 1)
             ELSE format('items[%s]: payload is required', x.n - 1)
           END INTO v_msg
      FROM unnest(p_items) WITH ORDINALITY AS x(queue, partition, transaction_id, trace_id, payload, is_encrypted, n)
     WHERE x.queue IS NULL OR x.queue = '' OR x.partition = '' OR x.payload IS NULL
     ORDER BY x.n LIMIT 1;
    IF v_msg IS NOT NULL THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = v_msg;
    END IF;

    PERFORM queen.lock_partition(d.queue, d.partition)
       FROM (SELECT DISTINCT x.queue, coalesce(x.partition, 'Default') AS partition
               FROM unnest(p_items) x ORDER BY 1, 2) d;

    FOR it IN
        SELECT x.*, (x.n - 1)::integer AS idx
          FROM unnest(p_items) WITH ORDINALITY AS x(queue, partition, transaction_id, trace_id, payload, is_encrypted, n)
         ORDER BY x.n
    LOOP
        v_part := queen.lock_partition(it.queue, coalesce(it.partition, 'Default'));  -- already held: a lookup
        v_txn := coalesce(nullif(it.transaction_id, ''), gen_random_uuid()::text);
        v_id := queen.uuid_v7();
        INSERT INTO queen.messages (id, transaction_id, trace_id, partition_id, payload, is_encrypted, producer_sub)
        VALUES (v_id, v_txn, it.trace_id, v_part, it.payload, coalesce(it.is_encrypted, false), p_producer_sub)
        ON CONFLICT (partition_id, transaction_id) DO NOTHING;
        IF FOUND THEN
            r := ROW(it.idx, v_txn, 'queued', v_id, v_part, it.trace_id, it.queue);
        ELSE
            SELECT m.id INTO v_id FROM queen.messages m WHERE m.partition_id = v_part AND m.transaction_id = v_txn;
            r := ROW(it.idx, v_txn, 'duplicate', v_id, v_part, NULL, it.queue);
        END IF;
        RETURN NEXT r;
    END LOOP;
END
$$;

-- Lease one partition of p_queue for a consumer group and hand out up to
-- p_batch messages after its cursor, in seq order. p_partition NULL: any
-- partition with available messages, least recently served first.
-- Partitions whose lease is unexpired, or whose consumer row another pop
-- holds (SKIP LOCKED), are passed over. p_auto_ack moves the cursor now.
CREATE FUNCTION queen.pop_messages(
    p_queue          text,
    p_partition      text        DEFAULT NULL,
    p_consumer_group text        DEFAULT '__QUEUE_MODE__',
    p_batch          integer     DEFAULT 1,
    p_auto_ack       boolean     DEFAULT false,
    p_now            timestamptz DEFAULT NULL)
RETURNS SETOF queen.popped_message
LANGUAGE plpgsql AS $$
DECLARE
    v_now     timestamptz := coalesce(p_now, now());
    v_group   text := coalesce(nullif(p_consumer_group, ''), '__QUEUE_MODE__');
    v_batch   integer := least(greatest(coalesce(p_batch, 1), 1), 10000);
    v_lease   uuid := gen_random_uuid();
    v_expires timestamptz;
    q         queen.queues;
    c         record;
    pc        queen.partition_consumers;
    v_last    bigint;
    v_n       integer;
BEGIN
    SELECT * INTO q FROM queen.queues WHERE name = p_queue;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_expires := v_now + make_interval(secs => CASE WHEN q.lease_time > 0 THEN q.lease_time ELSE 60 END);

    FOR c IN
        SELECT p.id, p.name, x.partition_id IS NULL AS no_row
          FROM queen.partitions p
          LEFT JOIN queen.partition_consumers x ON x.partition_id = p.id AND x.consumer_group = v_group
         WHERE p.queue_id = q.id
           AND (p_partition IS NULL OR p.name = p_partition)
           AND (x.lease_expires_at IS NULL OR x.lease_expires_at <= v_now)
           AND EXISTS (SELECT 1 FROM queen.messages m
                        WHERE m.partition_id = p.id AND m.seq > coalesce(x.last_consumed_seq, 0))
         ORDER BY x.updated_at NULLS FIRST, p.created_at, p.id
    LOOP
        IF c.no_row THEN
            INSERT INTO queen.partition_consumers (partition_id, consumer_group) VALUES (c.id, v_group)
            ON CONFLICT (partition_id, consumer_group) DO NOTHING;
        END IF;
        SELECT * INTO pc FROM queen.partition_consumers
         WHERE partition_id = c.id AND consumer_group = v_group
           FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;
        CONTINUE WHEN pc.lease_expires_at IS NOT NULL AND pc.lease_expires_at > v_now;

        SELECT max(s.seq), count(*) INTO v_last, v_n
          FROM (SELECT m.seq FROM queen.messages m
                 WHERE m.partition_id = c.id AND m.seq > pc.last_consumed_seq
                 ORDER BY m.seq LIMIT v_batch) s;
        CONTINUE WHEN v_n = 0;

        IF p_auto_ack THEN
            UPDATE queen.partition_consumers
               SET last_consumed_seq = v_last, lease_id = NULL, lease_expires_at = NULL,
                   batch_size = 0, acked_count = 0, batch_retry_count = 0, batch_last_seq = NULL,
                   updated_at = v_now
             WHERE partition_id = c.id AND consumer_group = v_group;
        ELSE
            UPDATE queen.partition_consumers
               SET lease_id = v_lease, lease_expires_at = v_expires, batch_size = v_n,
                   acked_count = 0, batch_last_seq = v_last, updated_at = v_now
             WHERE partition_id = c.id AND consumer_group = v_group;
        END IF;

        RETURN QUERY
        SELECT m.id, m.seq, m.transaction_id, m.trace_id, m.payload, m.is_encrypted, m.producer_sub,
               m.created_at, q.name, c.id, c.name,
               CASE WHEN p_auto_ack THEN NULL ELSE v_lease END, v_group,
               CASE WHEN p_auto_ack THEN NULL ELSE v_expires END
          FROM queen.messages m
         WHERE m.partition_id = c.id AND m.seq > pc.last_consumed_seq AND m.seq <= v_last
         ORDER BY m.seq;
        RETURN;
    END LOOP;
END
$$;

-- Acknowledge messages, one verdict per item in input order (processed
-- in partition, group, seq order). completed moves the cursor; failed
-- releases the lease for a redelivery of the batch until the queue's
-- retry_limit, then dead-letters the message and moves past it; dlq
-- dead-letters at once; retry only releases the lease. A message at or
-- behind the cursor is already consumed: acking it again changes nothing.
CREATE FUNCTION queen.ack_messages(
    p_acks queen.ack_item[],
    p_now  timestamptz DEFAULT NULL)
RETURNS SETOF queen.ack_result
LANGUAGE plpgsql AS $$
DECLARE
    v_now    timestamptz := coalesce(p_now, now());
    a        record;
    pc       queen.partition_consumers;
    r        queen.ack_result;
    v_out    queen.ack_result[] := '{}';
    v_msg    text;
    v_status text;
    v_limit  integer;
    v_acked  integer;
    v_done   boolean;
BEGIN
    IF p_acks IS NULL OR cardinality(p_acks) = 0 THEN
        RETURN;
    END IF;
    SELECT CASE
             WHEN x.transaction_id IS NULL OR x.transaction_id = '' THEN format('acknowledgments[%s]: transactionId is required', x.n - 1)
             WHEN x.partition_id IS NULL THEN format('acknowledgments[%s]: partitionId is required', x.n - 1)
             ELSE format('acknowledgments[%s]: unknown status %L', x.n - 1, x.status)
           END INTO v_msg
      FROM unnest(p_acks) WITH ORDINALITY AS x(transaction_id, partition_id, status, error, lease_id, consumer_group, n)
     WHERE x.transaction_id IS NULL OR x.transaction_id = '' OR x.partition_id IS NULL
        OR (x.status IS NOT NULL AND x.status NOT IN ('completed', 'success', 'failed', 'dlq', 'retry'))
     ORDER BY x.n LIMIT 1;
    IF v_msg IS NOT NULL THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = v_msg;
    END IF;

    FOR a IN
        SELECT x.transaction_id, x.partition_id, x.error, nullif(x.lease_id, '') AS lease_id,
               CASE coalesce(x.status, 'completed') WHEN 'success' THEN 'completed'
                    ELSE coalesce(x.status, 'completed') END AS status,
               coalesce(nullif(x.consumer_group, ''), '__QUEUE_MODE__') AS grp,
               (x.n - 1)::integer AS idx,
               m.id AS message_id, m.seq, m.payload, m.is_encrypted, m.producer_sub, m.created_at,
               p.name AS partition_name, q.name AS queue_name, q.retry_limit
          FROM unnest(p_acks) WITH ORDINALITY AS x(transaction_id, partition_id, status, error, lease_id, consumer_group, n)
          LEFT JOIN queen.messages m ON m.partition_id = x.partition_id AND m.transaction_id = x.transaction_id
          LEFT JOIN queen.partitions p ON p.id = m.partition_id
          LEFT JOIN queen.queues q ON q.id = p.queue_id
         ORDER BY x.partition_id, 6, m.seq NULLS LAST, x.n
    LOOP
        r := ROW(a.idx, a.transaction_id, false, NULL, a.queue_name, a.partition_name, false, false);
        IF a.message_id IS NULL THEN
            r.error := 'Message not found';
            v_out := v_out || r;
            CONTINUE;
        END IF;

        INSERT INTO queen.partition_consumers (partition_id, consumer_group) VALUES (a.partition_id, a.grp)
        ON CONFLICT (partition_id, consumer_group) DO NOTHING;
        SELECT * INTO pc FROM queen.partition_consumers
         WHERE partition_id = a.partition_id AND consumer_group = a.grp
           FOR UPDATE;

        IF a.lease_id IS NOT NULL
           AND NOT coalesce(pc.lease_id::text = lower(a.lease_id) AND pc.lease_expires_at > v_now, false) THEN
            r.error := 'Invalid or expired lease';
            v_out := v_out || r;
            CONTINUE;
        END IF;
        r.success := true;
        v_status := a.status;

        IF v_status = 'retry' THEN
            r.lease_released := pc.lease_id IS NOT NULL;
            UPDATE queen.partition_consumers
               SET lease_id = NULL, lease_expires_at = NULL, batch_size = 0, acked_count = 0,
                   batch_last_seq = NULL, updated_at = v_now
             WHERE partition_id = a.partition_id AND consumer_group = a.grp;
        ELSIF a.seq <= pc.last_consumed_seq THEN
            NULL;  -- already consumed
        ELSIF v_status = 'failed' AND pc.batch_retry_count < a.retry_limit THEN
            -- one retry per delivered batch: a second failed ack of the same batch finds no lease
            IF pc.lease_id IS NOT NULL THEN
                r.lease_released := true;
                UPDATE queen.partition_consumers
                   SET lease_id = NULL, lease_expires_at = NULL, batch_size = 0, acked_count = 0,
                       batch_last_seq = NULL, batch_retry_count = batch_retry_count + 1, updated_at = v_now
                 WHERE partition_id = a.partition_id AND consumer_group = a.grp;
            END IF;
        ELSE
            -- completed; or failed past the retry limit, or dlq: dead-letter, then move past it
            IF v_status IN ('failed', 'dlq') THEN
                INSERT INTO queen.dead_letter_queue
                       (message_id, partition_id, consumer_group, transaction_id, payload, is_encrypted,
                        producer_sub, error_message, retry_count, original_created_at, failed_at)
                VALUES (a.message_id, a.partition_id, a.grp, a.transaction_id, a.payload, a.is_encrypted,
                        a.producer_sub, coalesce(nullif(a.error, ''), 'Retries exhausted'),
                        pc.batch_retry_count, a.created_at, v_now);
                r.dlq := true;
            END IF;
            v_acked := pc.acked_count + 1;
            v_done := pc.lease_id IS NULL OR pc.batch_last_seq IS NULL
                      OR a.seq >= pc.batch_last_seq OR v_acked >= pc.batch_size;
            r.lease_released := v_done AND pc.lease_id IS NOT NULL;
            UPDATE queen.partition_consumers
               SET last_consumed_seq = a.seq,
                   acked_count = CASE WHEN v_done THEN 0 ELSE v_acked END,
                   lease_id = CASE WHEN v_done THEN NULL ELSE lease_id END,
                   lease_expires_at = CASE WHEN v_done THEN NULL ELSE lease_expires_at END,
                   batch_size = CASE WHEN v_done THEN 0 ELSE batch_size END,
                   batch_last_seq = CASE WHEN v_done THEN NULL ELSE batch_last_seq END,
                   batch_retry_count = CASE WHEN v_done THEN 0 ELSE batch_retry_count END,
                   updated_at = v_now
             WHERE partition_id = a.partition_id AND consumer_group = a.grp;
        END IF;
        v_out := v_out || r;
    END LOOP;

    RETURN QUERY SELECT * FROM unnest(v_out) o ORDER BY o.idx;
END
$$;

-- One message by partition id and transaction id, with its status
-- derived from the DLQ, the consumer cursors and the leases (Queen's
-- get_message_v1). No row when there is no such message.
CREATE FUNCTION queen.get_message(
    p_partition_id   uuid,
    p_transaction_id text,
    p_now            timestamptz DEFAULT NULL)
RETURNS SETOF queen.message_detail
LANGUAGE sql STABLE AS $$
    WITH m AS (
        SELECT m.*, p.name AS partition_name, q.name AS queue_name, q.namespace, q.task,
               jsonb_build_object('leaseTime', q.lease_time, 'retryLimit', q.retry_limit,
                                  'retryDelay', q.retry_delay, 'ttl', q.ttl, 'priority', q.priority) AS queue_config
          FROM queen.messages m
          JOIN queen.partitions p ON p.id = m.partition_id
          JOIN queen.queues q ON q.id = p.queue_id
         WHERE m.partition_id = p_partition_id AND m.transaction_id = p_transaction_id
    ), g AS (
        SELECT pc.*,
               pc.last_consumed_seq >= m.seq AS consumed,
               pc.lease_expires_at > coalesce(p_now, now()) AND m.seq > pc.last_consumed_seq
                   AND m.seq <= pc.batch_last_seq AS processing
          FROM m JOIN queen.partition_consumers pc ON pc.partition_id = m.partition_id
    ), d AS (
        SELECT dl.error_message, dl.retry_count
          FROM m JOIN queen.dead_letter_queue dl ON dl.message_id = m.id AND dl.partition_id = m.partition_id
         ORDER BY dl.failed_at DESC LIMIT 1
    ), agg AS (
        SELECT bool_or(g.consumed) AS any_consumed,
               bool_or(g.processing) AS any_processing,
               max(g.lease_expires_at) FILTER (WHERE g.processing) AS lease_expires_at,
               max(g.batch_retry_count) FILTER (WHERE NOT g.consumed) AS retry_count,
               bool_or(g.consumer_group = '__QUEUE_MODE__') AS has_queue_mode,
               count(*) FILTER (WHERE g.consumer_group <> '__QUEUE_MODE__') AS bus_groups,
               count(*) FILTER (WHERE g.consumed) AS consumed_by,
               coalesce(jsonb_agg(jsonb_build_object(
                   'name', g.consumer_group, 'consumed', g.consumed, 'processing', coalesce(g.processing, false),
                   'lastConsumedSeq', g.last_consumed_seq, 'leaseExpiresAt', g.lease_expires_at)
                   ORDER BY g.consumer_group) FILTER (WHERE g.consumer_group IS NOT NULL), '[]'::jsonb) AS groups
          FROM g
    )
    SELECT m.id, m.transaction_id, m.partition_id, m.queue_name, m.partition_name, m.namespace, m.task,
           CASE WHEN EXISTS (SELECT 1 FROM d) THEN 'dead_letter'
                WHEN coalesce(agg.any_consumed, false) THEN 'completed'
                WHEN coalesce(agg.any_processing, false) THEN 'processing'
                ELSE 'pending' END,
           m.payload, m.is_encrypted, m.trace_id, m.producer_sub, m.created_at,
           (SELECT d.error_message FROM d),
           coalesce((SELECT d.retry_count FROM d), agg.retry_count, 0),
           agg.lease_expires_at,
           m.queue_config,
           jsonb_build_object(
               'hasQueueMode', coalesce(agg.has_queue_mode, false),
               'busGroupsCount', agg.bus_groups,
               'consumedByGroups', agg.consumed_by,
               'type', CASE WHEN coalesce(agg.has_queue_mode, false) AND agg.bus_groups > 0 THEN 'hybrid'
                            WHEN coalesce(agg.has_queue_mode, false) THEN 'queue'
                            WHEN agg.bus_groups > 0 THEN 'bus'
                            ELSE 'none' END),
           agg.groups
      FROM m CROSS JOIN agg
$$;

-- A page of a queue's dead letters, newest first. p_queue NULL: every
-- queue; p_consumer_group NULL: every group (timer dead letters are
-- under '__QUEEN_TIMERS__'). p_limit is clamped to 1..1000 (default 100).
CREATE FUNCTION queen.list_dlq(
    p_queue          text    DEFAULT NULL,
    p_consumer_group text    DEFAULT NULL,
    p_limit          integer DEFAULT 100,
    p_offset         integer DEFAULT 0)
RETURNS SETOF queen.dlq_entry
LANGUAGE sql STABLE AS $$
    SELECT d.id, d.message_id, d.transaction_id, d.partition_id, q.name, p.name, d.consumer_group,
           d.error_message, d.retry_count, d.payload, d.is_encrypted, d.payload_zstd, d.producer_sub,
           d.original_created_at, d.failed_at
      FROM queen.dead_letter_queue d
      JOIN queen.partitions p ON p.id = d.partition_id
      JOIN queen.queues q ON q.id = p.queue_id
     WHERE (p_queue IS NULL OR q.name = p_queue)
       AND (p_consumer_group IS NULL OR d.consumer_group = p_consumer_group)
     ORDER BY d.failed_at DESC, d.id DESC
     LIMIT least(greatest(coalesce(p_limit, 100), 1), 1000)
    OFFSET greatest(coalesce(p_offset, 0), 0)
$$;

-- How many dead letters list_dlq pages over (its `total`).
CREATE FUNCTION queen.count_dlq(
    p_queue          text DEFAULT NULL,
    p_consumer_group text DEFAULT NULL)
RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT count(*)
      FROM queen.dead_letter_queue d
      JOIN queen.partitions p ON p.id = d.partition_id
      JOIN queen.queues q ON q.id = p.queue_id
     WHERE (p_queue IS NULL OR q.name = p_queue)
       AND (p_consumer_group IS NULL OR d.consumer_group = p_consumer_group)
$$;
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
