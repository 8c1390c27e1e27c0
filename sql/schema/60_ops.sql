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
-- functions keep, base rows plus unfolded deltas, as
-- queen.get_pending_timers counts them, so it is cheap enough for every
-- Prometheus scrape).
CREATE FUNCTION queen.get_timer_status()
RETURNS TABLE (scheduling_paused boolean, fire_paused boolean, pending bigint)
LANGUAGE sql STABLE AS $$
    SELECT c.scheduling_paused, c.fire_paused,
           coalesce((SELECT sum(greatest(0, u.pending_timers
                                            + coalesce(d.delta, 0)))
                       FROM queen.tenant_usage u
                       LEFT JOIN (SELECT x.tenant, sum(x.pending_delta) AS delta
                                    FROM queen.tenant_usage_deltas x GROUP BY x.tenant) d
                              ON d.tenant = u.tenant), 0)::bigint
      FROM queen.cell_settings c
     WHERE c.id
$$;

-- The arguments of get_timer_stats and get_timer_totals: a tenant, 1..1440
-- buckets of 1..86400 seconds, else QTBAD.
CREATE FUNCTION queen.check_stats_args(p_tenant text, p_buckets integer, p_bucket_seconds integer)
RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF p_tenant IS NULL OR p_tenant = '' THEN
        RAISE EXCEPTION 'timers_bad_request'
            USING ERRCODE = 'QTBAD', DETAIL = 'tenant is required';
    END IF;
    IF p_buckets IS NULL OR p_buckets NOT BETWEEN 1 AND 1440 THEN
        RAISE EXCEPTION 'timers_bad_request'
            USING ERRCODE = 'QTBAD', DETAIL = format('buckets must be 1..1440, got %s', coalesce(p_buckets::text, 'null'));
    END IF;
    IF p_bucket_seconds IS NULL OR p_bucket_seconds NOT BETWEEN 1 AND 86400 THEN
        RAISE EXCEPTION 'timers_bad_request'
            USING ERRCODE = 'QTBAD', DETAIL = format('bucketSeconds must be 1..86400, got %s', coalesce(p_bucket_seconds::text, 'null'));
    END IF;
END
$$;

-- Aggregates of one tenant's pending timers, for an operator's dashboard
-- (GET /api/v1/system/timers/stats): one row per queue holding a timer of
-- the tenant, in queue order, and never a timer itself (the contract has no
-- tenant-wide list). Read-only (STABLE). Costs one pass over the tenant's
-- rows (the primary key's range, from p_after on); no other tenant's rows
-- are read.
--   pending          every timer of the queue, claimed and in backoff
--                    included: what the pending-timer quota meters
--   due              deliver_at <= now and not claimed: waiting for a sweeper
--   claimed          a broker holds it (its lease runs)
--   retrying         not claimed, and at least one fire of it failed
--   next_deliver_at  the soonest deliver_at of an unclaimed timer
--   due_by_bucket    p_buckets counts, the histogram of what comes due:
--                    element i (1-based) counts the unclaimed timers with
--                    now < deliver_at and
--                    now + (i-1) * p_bucket_seconds <= deliver_at < now + i * p_bucket_seconds
-- p_after and p_limit page through the queues: only those after p_after,
-- at most p_limit of them (NULL: every one), so that a caller bounds what
-- it receives whatever the number of the tenant's queues (the route does).
-- p_buckets 1..1440, p_bucket_seconds 1..86400, p_limit >= 1, else QTBAD.
CREATE FUNCTION queen.get_timer_stats(
    p_tenant         text,
    p_buckets        integer     DEFAULT 60,
    p_bucket_seconds integer     DEFAULT 60,
    p_now            timestamptz DEFAULT NULL,
    p_after          text        DEFAULT NULL,
    p_limit          integer     DEFAULT NULL)
RETURNS TABLE (queue text, pending bigint, due bigint, claimed bigint, retrying bigint,
               next_deliver_at timestamptz, due_by_bucket bigint[])
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
BEGIN
    PERFORM queen.check_stats_args(p_tenant, p_buckets, p_bucket_seconds);
    IF p_limit IS NOT NULL AND p_limit < 1 THEN
        RAISE EXCEPTION 'timers_bad_request'
            USING ERRCODE = 'QTBAD', DETAIL = format('limit must be at least 1, got %s', p_limit);
    END IF;
    RETURN QUERY
    WITH mine AS (
        SELECT t.queue AS q, t.deliver_at AS at, t.failures AS failures,
               queen.timer_is_claimed(t.lease_until, v_now) AS held
          FROM queen.timers t
         WHERE t.tenant = p_tenant
           AND (p_after IS NULL OR t.queue > p_after)
    ), per_queue AS (
        SELECT m.q,
               count(*) AS n_pending,
               count(*) FILTER (WHERE NOT m.held AND m.at <= v_now) AS n_due,
               count(*) FILTER (WHERE m.held) AS n_claimed,
               count(*) FILTER (WHERE NOT m.held AND m.failures > 0) AS n_retrying,
               min(m.at) FILTER (WHERE NOT m.held) AS next_at
          FROM mine m
         GROUP BY m.q
         ORDER BY m.q
         LIMIT p_limit
    ), per_bucket AS (
        SELECT m.q, floor(extract(epoch FROM m.at - v_now) / p_bucket_seconds)::bigint + 1 AS i, count(*) AS n
          FROM mine m
         WHERE NOT m.held AND m.at > v_now
           AND m.at < v_now + make_interval(secs => p_buckets::double precision * p_bucket_seconds)
           AND m.q IN (SELECT pq.q FROM per_queue pq)
         GROUP BY 1, 2
    ), histogram AS (
        SELECT pq.q, array_agg(coalesce(b.n, 0)::bigint ORDER BY g.i) AS counts
          FROM per_queue pq
         CROSS JOIN generate_series(1, p_buckets) AS g(i)
          LEFT JOIN per_bucket b ON b.q = pq.q AND b.i = g.i
         GROUP BY pq.q
    )
    SELECT pq.q, pq.n_pending, pq.n_due, pq.n_claimed, pq.n_retrying, pq.next_at, h.counts
      FROM per_queue pq
      JOIN histogram h ON h.q = pq.q
     ORDER BY pq.q;
END
$$;

-- The same aggregates over every queue of the tenant at once, one row,
-- plus the number of its queues holding a timer: the totals of the stats
-- route, which pages through the queues (get_timer_stats). One pass over
-- the tenant's rows. Same arguments and QTBAD as get_timer_stats.
CREATE FUNCTION queen.get_timer_totals(
    p_tenant         text,
    p_buckets        integer     DEFAULT 60,
    p_bucket_seconds integer     DEFAULT 60,
    p_now            timestamptz DEFAULT NULL)
RETURNS TABLE (queues bigint, pending bigint, due bigint, claimed bigint, retrying bigint,
               next_deliver_at timestamptz, due_by_bucket bigint[])
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
BEGIN
    PERFORM queen.check_stats_args(p_tenant, p_buckets, p_bucket_seconds);
    RETURN QUERY
    WITH mine AS MATERIALIZED (
        SELECT t.queue AS q, t.deliver_at AS at, t.failures AS failures,
               queen.timer_is_claimed(t.lease_until, v_now) AS held
          FROM queen.timers t
         WHERE t.tenant = p_tenant
    ), per_bucket AS (
        SELECT floor(extract(epoch FROM m.at - v_now) / p_bucket_seconds)::bigint + 1 AS i, count(*) AS n
          FROM mine m
         WHERE NOT m.held AND m.at > v_now
           AND m.at < v_now + make_interval(secs => p_buckets::double precision * p_bucket_seconds)
         GROUP BY 1
    )
    SELECT count(DISTINCT m.q),
           count(*),
           count(*) FILTER (WHERE NOT m.held AND m.at <= v_now),
           count(*) FILTER (WHERE m.held),
           count(*) FILTER (WHERE NOT m.held AND m.failures > 0),
           min(m.at) FILTER (WHERE NOT m.held),
           (SELECT array_agg(coalesce(b.n, 0)::bigint ORDER BY g.i)
              FROM generate_series(1, p_buckets) AS g(i)
              LEFT JOIN per_bucket b ON b.i = g.i)
      FROM mine m;
END
$$;
