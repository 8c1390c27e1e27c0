-- Migration 015: the stats route pages through a tenant's queues.
-- GET /api/v1/system/timers/stats answered every queue of the tenant with a
-- histogram of up to 1440 counts each, all held by the broker at once: a
-- tenant with thousands of queues made one request weigh hundreds of MB.
-- queen.get_timer_stats gains p_after and p_limit (trailing, so the old
-- signature is dropped and the function created anew), the totals come
-- from queen.get_timer_totals, and both check their arguments with
-- queen.check_stats_args. Function texts equal sql/schema/60_ops.sql.

DROP FUNCTION queen.get_timer_stats(text, integer, integer, timestamptz);

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
