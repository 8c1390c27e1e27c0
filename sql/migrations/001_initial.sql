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

CREATE TABLE queen.schema_migrations (
    version     integer PRIMARY KEY,
    name        text NOT NULL,
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
-- seconds until enough have refilled. Runs inside the caller's
-- transaction: a batch refused by a later rung gives its tokens back.
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

    IF v_tokens < p_ops THEN
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

-- The single definition of "in somebody's hands".
CREATE FUNCTION queen.timer_is_claimed(p_lease_until timestamptz, p_now timestamptz DEFAULT NULL)
RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT p_lease_until IS NOT NULL AND p_lease_until > coalesce(p_now, now())
$$;

-- Remove one timer unless a broker holds it. Takes the row lock first,
-- so a cancel racing a claim waits for the claim and then answers
-- too_late, and a claim (SKIP LOCKED) passes over a row being cancelled.
-- Returns cancelled | absent | too_late and keeps the pending counter.
CREATE FUNCTION queen.cancel_timer(
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
    PERFORM queen.bump_tenant_usage(p_tenant, -1, 0);
    RETURN 'cancelled';
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
    -- 5. pending-timer quota: rows this batch would create
    IF l.max_pending_timers IS NOT NULL THEN
        SELECT count(*) INTO v_new
          FROM unnest(p_ops) o
         WHERE o.op IN ('schedule', 'reschedule')
           AND NOT EXISTS (SELECT 1 FROM queen.timers t
                            WHERE t.tenant = p_tenant AND t.queue = o.queue AND t.timer_key = o.timer_key);
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
-- Rows are touched in (queue, timer_key) order so that concurrent
-- batches cannot deadlock each other.
CREATE FUNCTION queen.schedule_timers(
    p_tenant       text,
    p_ops          queen.timer_op[],
    p_producer_sub text        DEFAULT NULL,
    p_horizon_ms   bigint      DEFAULT NULL,
    p_tenancy      boolean     DEFAULT NULL,
    p_now          timestamptz DEFAULT NULL)
RETURNS SETOF queen.timer_verdict
LANGUAGE plpgsql AS $$
DECLARE
    v_now      timestamptz := coalesce(p_now, now());
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
    PERFORM queen.check_timer_ops(p_ops);
    PERFORM queen.check_timer_gates(p_tenant, p_ops, p_horizon_ms, p_tenancy, v_now);

    FOR o IN
        SELECT x.*, x.n::integer AS ordinal
          FROM unnest(p_ops) WITH ORDINALITY AS x(op, queue, timer_key, delay_ms, txn, payload,
                                                  partition, payload_zstd, encrypted, raw_size, n)
         ORDER BY x.queue, x.timer_key COLLATE "C"
    LOOP
        v := ROW(o.ordinal, o.op, false, NULL, o.queue, o.timer_key, o.txn, NULL, NULL);
        IF o.op = 'cancel' THEN
            v_status := queen.cancel_timer(p_tenant, o.queue, o.timer_key, v_now);
            v.status := v_status;
            v.ok := v_status = 'cancelled';
        ELSE
            v_msg_id := queen.uuid_v7();
            v_txn := coalesce(nullif(o.txn, ''), queen.uuid_v7()::text);
            INSERT INTO queen.timers AS t
                   (tenant, queue, timer_key, partition, deliver_at, txn, message_id, payload,
                    payload_zstd, encrypted, producer_sub, created_at, updated_at)
            VALUES (p_tenant, o.queue, o.timer_key, coalesce(o.partition, 'Default'),
                    v_now + o.delay_ms * interval '1 millisecond', v_txn, v_msg_id, o.payload,
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
                v.deliver_at := v_now + o.delay_ms * interval '1 millisecond';
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
    -- Wake sweepers whose next planned wake-up is later than this.
    PERFORM pg_notify('queen_timers', extract(epoch FROM min(x.deliver_at))::text)
       FROM unnest(v_out) x WHERE x.deliver_at IS NOT NULL HAVING min(x.deliver_at) IS NOT NULL;

    RETURN QUERY SELECT * FROM unnest(v_out) ORDER BY ordinal;
END
$$;

-- One timer as peek shows it; no row when there is none (for this tenant).
CREATE FUNCTION queen.peek_timer(
    p_tenant    text,
    p_queue     text,
    p_timer_key text,
    p_now       timestamptz DEFAULT NULL)
RETURNS SETOF queen.timer_view
LANGUAGE sql STABLE AS $$
    SELECT tenant, queue, timer_key, partition, deliver_at, txn, message_id, payload, payload_zstd,
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
    SELECT p.timer_key, p.partition, p.deliver_at, p.txn, p.message_id, p.payload_zstd, p.encrypted,
           p.producer_sub, p.attempts, p.last_error,
           queen.timer_is_claimed(p.lease_until, coalesce(p_now, now())), p.created_at, p.updated_at,
           f.truncated, CASE WHEN f.truncated THEN f.last_key END
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

-- Append the frames of deleted timer rows to the log, in expiry order,
-- and keep the tenants' pending counters. Internal to the fire.
CREATE FUNCTION queen.append_timer_frames(p_rows queen.timers[], p_frames queen.fire_frame[] DEFAULT NULL)
RETURNS SETOF queen.fire_result
LANGUAGE plpgsql AS $$
DECLARE
    v_fired_at timestamptz := clock_timestamp();
BEGIN
    -- Lock every destination partition, in a fixed order, before appending.
    PERFORM queen.lock_partition(d.queue, d.partition)
       FROM (SELECT DISTINCT r.queue, r.partition FROM unnest(p_rows) r ORDER BY 1, 2) d;

    PERFORM queen.bump_tenant_usage(r.tenant, -count(*), 0)
       FROM unnest(p_rows) r GROUP BY r.tenant;

    RETURN QUERY
    WITH src AS (
        SELECT r.*, coalesce(f.payload, r.payload) AS frame_payload, p.id AS partition_id
          FROM unnest(p_rows) r
          JOIN queen.queues q ON q.name = r.queue
          JOIN queen.partitions p ON p.queue_id = q.id AND p.name = r.partition
          LEFT JOIN unnest(p_frames) f
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

-- Claim up to p_limit due timers for p_lease_ms, in expiry order,
-- skipping rows another session holds. A row whose lease expired (its
-- broker died) is due again. Nothing is claimed while the fire is paused.
CREATE FUNCTION queen.claim_timers(
    p_broker   text,
    p_limit    integer     DEFAULT 100,
    p_lease_ms integer     DEFAULT 30000,
    p_now      timestamptz DEFAULT NULL)
RETURNS SETOF queen.claimed_timer
LANGUAGE plpgsql AS $$
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
         ORDER BY t.deliver_at
         LIMIT greatest(p_limit, 0)
           FOR UPDATE SKIP LOCKED
    )
    UPDATE queen.timers t
       SET claim_id = v_claim, claimed_by = p_broker,
           lease_until = v_now + greatest(p_lease_ms, 1) * interval '1 millisecond'
      FROM due
     WHERE (t.tenant, t.queue, t.timer_key) = (due.tenant, due.queue, due.timer_key)
    RETURNING v_claim, t.tenant, t.queue, t.timer_key, t.partition, t.deliver_at, t.lease_until,
              t.txn, t.message_id, t.payload, t.payload_zstd, t.encrypted, t.attempts;
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
LANGUAGE plpgsql AS $$
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
CREATE FUNCTION queen.fire_due_timers(
    p_limit integer     DEFAULT 100,
    p_now   timestamptz DEFAULT NULL)
RETURNS SETOF queen.fire_result
LANGUAGE plpgsql AS $$
DECLARE
    v_now  timestamptz := coalesce(p_now, now());
    v_rows queen.timers[];
BEGIN
    IF (queen.get_cell_settings()).fire_paused THEN
        RETURN;
    END IF;
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
                producer_sub, error_message, retry_count, original_created_at, failed_at,
                timer_tenant, timer_key)
        VALUES (r.message_id, v_part, '__QUEEN_TIMERS__', r.txn, r.payload, r.encrypted,
                r.producer_sub, p_error, r.attempts + 1, r.created_at, v_now,
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
