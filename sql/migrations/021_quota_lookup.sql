-- Migration 021: the quota rung counts a batch's new timers by one lookup
-- per op. check_timer_gates joined the batch to queen.timers; PL/pgSQL keeps
-- a plan per session, and one made while the tenant had few rows (a fresh
-- install, or a generic plan's estimate of one tenant among many) was a hash
-- join over every row of the tenant, at every batch: 27.7 ms a batch of 256
-- at 102,400 rows against 5.9 ms without a quota. The count is now
-- queen.count_new_timers, a LATERAL lookup per op with enable_seqscan off.
-- Verdicts and refusals are unchanged. The text equals
-- sql/schema/30_timers.sql.

-- The pending timers a batch would add: its schedule and reschedule ops
-- whose key is not a timer of p_tenant, less its cancel ops whose key is an
-- unclaimed timer (the quota rung of queen.check_timer_gates). One descent
-- of the primary key per op: the LIMIT keeps each lookup a subquery that the
-- planner cannot turn into a join, and enable_seqscan off keeps it on the
-- index. As a join, planned while the tenant had few rows (a fresh install,
-- a generic plan's estimate of one tenant among many), it was a hash join
-- over every row of the tenant, at every batch of the session: 27.7 ms a
-- batch of 256 at 100,000 rows, 6.6 ms now (bench/quota_compare.py).
CREATE FUNCTION queen.count_new_timers(p_tenant text, p_ops queen.timer_op[], p_now timestamptz)
RETURNS bigint
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $$
BEGIN
    RETURN (SELECT count(*) FILTER (WHERE o.op IN ('schedule', 'reschedule') AND t.found IS NULL)
                 - count(*) FILTER (WHERE o.op = 'cancel' AND t.found
                                      AND NOT queen.timer_is_claimed(t.lease_until, p_now))
              FROM unnest(p_ops) o
              LEFT JOIN LATERAL (
                     SELECT true AS found, x.lease_until FROM queen.timers x
                      WHERE x.tenant = p_tenant AND x.queue = o.queue
                        AND x.timer_key = o.timer_key COLLATE "C"
                      LIMIT 1) t ON true);
END
$$;

-- The gate ladder of POST /api/v1/timers, in order, before any write.
-- Refuses the whole batch by raising; passing it has no visible effect
-- besides the rate tokens taken (undone if the caller's batch fails).
CREATE OR REPLACE FUNCTION queen.check_timer_gates(
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
        v_new := queen.count_new_timers(p_tenant, p_ops, v_now);
        -- unlocked, a fast refusal; the exact decision is schedule_timers' re-check
        v_pending := queen.get_pending_timers(p_tenant);
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
