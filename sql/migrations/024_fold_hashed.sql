-- Migration 024: the fold of the pending-counter deltas, fast with many tenants.
-- queen.fold_pending_deltas matched each delta row against the array of the
-- tenants whose counter rows it locked with `= ANY (array)`, which a cached
-- generic plan evaluates by comparing with every element: 10,000 deltas of
-- 5,000 tenants (a backlog of thousands of tenants firing at once writes a
-- delta per tenant and batch) took 700 ms a call, on the sweeper's connection
-- between two fire calls, holding 5,000 counter rows that schedule batches
-- wait for. A hashed IN instead, and no JIT (the TID array's cost estimate
-- crossed jit_above_cost: 40 ms of compiling a call).
-- The text equals sql/schema/10_tenancy.sql.

DROP FUNCTION queen.fold_pending_deltas(integer);

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
