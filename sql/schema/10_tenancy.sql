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
