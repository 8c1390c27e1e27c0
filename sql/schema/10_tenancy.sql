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

-- Per-tenant counters. billed_messages counts every accepted schedule
-- and reschedule (cancel and fire count zero). pending_timers is the BASE
-- of the tenant's pending count: the true count is pending_timers plus
-- the sum of the tenant's rows in queen.tenant_usage_deltas (read it with
-- queen.get_pending_timers, never this column alone). Increments (a
-- schedule creating rows) are written here, under this row's lock, which
-- also serialises the quota decisions of one tenant; decrements (fire,
-- cancel, DLQ move) go to the delta table, so they never wait on this row.
-- next_due_at is a lower bound of the deliver_at of every timer row of the
-- tenant (plain or zstd, leased or not): a schedule lowers it under this
-- row's lock (queen.bump_tenant_usage), and only the fire's fair share
-- raises it, to the tenant's true earliest, for a tenant it probed and
-- found with nothing due (queen.find_due_tenants). So the fire's shares
-- look only at tenants that may have due timers, however many are idle.
CREATE TABLE queen.tenant_usage (
    tenant              text PRIMARY KEY,
    pending_timers      bigint NOT NULL DEFAULT 0,
    billed_messages     bigint NOT NULL DEFAULT 0,
    updated_at          timestamptz NOT NULL DEFAULT now(),
    next_due_at         timestamptz NOT NULL DEFAULT '-infinity'
);
-- The candidates of the fire's fair share: tenants whose bound has passed.
CREATE INDEX tenant_usage_next_due_at_idx ON queen.tenant_usage (next_due_at);

-- Append-only decrements of tenant_usage.pending_timers (issue 12): one
-- row per fire batch and tenant, per cancel, per DLQ move. No index and
-- no key: an INSERT here touches no row another transaction holds, so
-- cancels and the brokers' fires never queue behind each other or behind
-- a schedule. queen.fold_pending_deltas (each broker's sweeper, about
-- once a second) moves them into the base row, so the table stays small
-- and a per-tenant sum over it is a scan of a few pages. Only ever
-- negative (queen.pending_decrement): every increment is taken under the
-- base row's lock. Vacuumed after every 1000 dead rows; never truncated
-- by vacuum (the truncation's ACCESS EXCLUSIVE lock would stall the
-- appends a moment).
--
-- The negative check is a domain's, not the table's (migration 030): the
-- executor reads a table's CHECK from its stored text and plans it again
-- at every INSERT statement, where a domain's comes planned from the type
-- cache. That was 2 of the 16 us of server time a queen.cancel_timer call
-- took (the same 23514 check_violation, the same constraint name).
CREATE DOMAIN queen.pending_decrement AS bigint
    CONSTRAINT pending_delta_negative CHECK (VALUE < 0);

CREATE TABLE queen.tenant_usage_deltas (
    tenant              text NOT NULL,
    pending_delta       queen.pending_decrement NOT NULL
) WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
        vacuum_truncate = false);

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
    v_now    timestamptz;
    v_burst  numeric := greatest(coalesce(p_burst, p_rate), 1);
    v_tokens numeric;
    v_wait   numeric;
BEGIN
    IF p_rate IS NULL OR p_ops <= 0 THEN
        RETURN;  -- no bucket: every schedule batch without a rate limit ends here
    END IF;
    v_now := queen.finite_now(p_now);
    IF p_rate <= 0 THEN  -- a bucket refilled at no rate divided by zero (migration 042)
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('p_rate must be above 0, got %s', p_rate);
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
        -- a bucket in debt (a batch larger than the burst went through) has 0 available
        RAISE EXCEPTION 'rate_limited'
            USING ERRCODE = 'QTRAT',
                  DETAIL  = format('tenant %s asked for %s operations; %s available at %s per second',
                                   p_tenant, p_ops, greatest(floor(v_tokens), 0), p_rate),
                  HINT    = format('retry_after_seconds=%s', greatest(1, v_wait));
    END IF;
    UPDATE queen.rate_buckets SET tokens = tokens - p_ops WHERE tenant = p_tenant;
END
$$;

-- Adjust a tenant's counters on the base row (one row write per call,
-- not per op): takes the row's lock until commit, like every quota
-- decision of the tenant. For increments and billing; a decrement alone
-- should go to queen.tenant_usage_deltas instead (it must not queue).
-- p_first_at: the earliest deliver_at the caller wrote for the tenant;
-- next_due_at moves down to it (-infinity, the default: the caller does
-- not know, so the tenant may have due timers).
-- PL/pgSQL: the statement's plan is cached per session (a SQL function's
-- body is planned again on every call).
CREATE FUNCTION queen.bump_tenant_usage(
    p_tenant   text,
    p_pending  bigint,
    p_billed   bigint,
    p_first_at timestamptz DEFAULT '-infinity')
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO queen.tenant_usage AS u (tenant, pending_timers, billed_messages, next_due_at)
    VALUES (p_tenant, greatest(p_pending, 0), p_billed, coalesce(p_first_at, '-infinity'))
    ON CONFLICT (tenant) DO UPDATE
        SET pending_timers  = greatest(0, u.pending_timers + p_pending),
            billed_messages = u.billed_messages + p_billed,
            updated_at      = now(),
            next_due_at     = least(u.next_due_at, coalesce(p_first_at, '-infinity'));
END
$$;

-- A tenant's pending timers: the base row plus its unfolded deltas, read
-- in ONE statement, so one snapshot sees a concurrent fold either wholly
-- (deltas gone, base moved) or not at all. Never below 0; 0 without a
-- counter row. Taken after the base row's lock (schedule_timers' quota
-- re-check), the value is exact for the decision: see that function.
CREATE FUNCTION queen.get_pending_timers(p_tenant text)
RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_n bigint;
BEGIN
    SELECT greatest(0, coalesce((SELECT u.pending_timers FROM queen.tenant_usage u WHERE u.tenant = p_tenant), 0)
                     + coalesce((SELECT sum(d.pending_delta) FROM queen.tenant_usage_deltas d
                                  WHERE d.tenant = p_tenant), 0))::bigint
      INTO v_n;
    RETURN v_n;
END
$$;

-- Move up to p_limit delta rows into their tenants' base rows; returns
-- how many were folded. Safe with any number of brokers calling it at
-- once and never waits: delta rows are taken FOR UPDATE SKIP LOCKED (a
-- concurrent fold takes others), and a tenant whose base row is locked
-- (a schedule batch deciding its quota, or another fold) is skipped and
-- its deltas stay for the next call. Deltas inserted by transactions not
-- yet committed are not seen and stay too, so none is lost. Deltas of a
-- tenant without a base row (an operator deleted it) are dropped, as the
-- decrement of a missing row always was: a decrement never creates the
-- counter row. The base never goes below 0. p_limit clamped to 1..100000.
-- The locked tenants are matched by a hashed IN, not `= ANY (array)`: a
-- cached generic plan compares each delta row with every element (10,000
-- deltas of 5,000 tenants: 700 ms a call, the sweeper's time, holding the
-- counter rows a schedule batch waits for). No JIT: the TID array's cost
-- estimate crossed jit_above_cost, and compiling cost 40 ms a call.
CREATE FUNCTION queen.fold_pending_deltas(p_limit integer DEFAULT 10000)
RETURNS bigint
LANGUAGE plpgsql SET jit = off AS $$
DECLARE
    v_picked  tid[];
    v_tenants text[];
    v_locked  text[];
    v_n       bigint;
BEGIN
    SELECT array_agg(d.ctid), array_agg(DISTINCT d.tenant)
      INTO v_picked, v_tenants
      FROM (SELECT x.ctid, x.tenant FROM queen.tenant_usage_deltas x
             LIMIT least(greatest(coalesce(p_limit, 10000), 1), 100000)
               FOR UPDATE SKIP LOCKED) d;
    IF v_picked IS NULL THEN
        RETURN 0;
    END IF;
    -- the base rows free now, in tenant order; the others are skipped
    SELECT array_agg(b.tenant) INTO v_locked
      FROM (SELECT u.tenant FROM queen.tenant_usage u
             WHERE u.tenant = ANY (v_tenants)
             ORDER BY u.tenant
               FOR UPDATE SKIP LOCKED) b;
    WITH gone AS (
        DELETE FROM queen.tenant_usage_deltas d
         WHERE d.ctid = ANY (v_picked)
           AND (d.tenant IN (SELECT l.tenant FROM unnest(v_locked) AS l(tenant))
                OR NOT EXISTS (SELECT 1 FROM queen.tenant_usage u WHERE u.tenant = d.tenant))
        RETURNING d.tenant, d.pending_delta
    ), sums AS (
        SELECT g.tenant, sum(g.pending_delta) AS delta, count(*) AS n FROM gone g GROUP BY g.tenant
    ), upd AS (
        UPDATE queen.tenant_usage u
           SET pending_timers = greatest(0, u.pending_timers + s.delta), updated_at = now()
          FROM sums s
         WHERE u.tenant = s.tenant AND u.tenant IN (SELECT l.tenant FROM unnest(v_locked) AS l(tenant))
    )
    SELECT coalesce(sum(s.n), 0) INTO v_n FROM sums s;
    RETURN v_n;
END
$$;
