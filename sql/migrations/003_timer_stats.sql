-- 003: queen.get_timer_stats, the per-queue aggregates behind GET /api/v1/system/timers/stats
-- (the operator dashboard). Read-only; no table changes.

-- Aggregates of one tenant's pending timers, for an operator's dashboard
-- (GET /api/v1/system/timers/stats): one row per queue holding a timer of
-- the tenant, and never a timer itself (the contract has no tenant-wide
-- list). Read-only (STABLE). Costs one pass over the tenant's rows (the
-- primary key's range); no other tenant's rows are read.
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
-- p_buckets 1..1440, p_bucket_seconds 1..86400, else QTBAD.
CREATE FUNCTION queen.get_timer_stats(
    p_tenant         text,
    p_buckets        integer     DEFAULT 60,
    p_bucket_seconds integer     DEFAULT 60,
    p_now            timestamptz DEFAULT NULL)
RETURNS TABLE (queue text, pending bigint, due bigint, claimed bigint, retrying bigint,
               next_deliver_at timestamptz, due_by_bucket bigint[])
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
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
    RETURN QUERY
    WITH mine AS (
        SELECT t.queue AS q, t.deliver_at AS at, t.failures AS failures,
               queen.timer_is_claimed(t.lease_until, v_now) AS held
          FROM queen.timers t
         WHERE t.tenant = p_tenant
    ), per_queue AS (
        SELECT m.q,
               count(*) AS n_pending,
               count(*) FILTER (WHERE NOT m.held AND m.at <= v_now) AS n_due,
               count(*) FILTER (WHERE m.held) AS n_claimed,
               count(*) FILTER (WHERE NOT m.held AND m.failures > 0) AS n_retrying,
               min(m.at) FILTER (WHERE NOT m.held) AS next_at
          FROM mine m
         GROUP BY m.q
    ), per_bucket AS (
        SELECT m.q, floor(extract(epoch FROM m.at - v_now) / p_bucket_seconds)::bigint + 1 AS i, count(*) AS n
          FROM mine m
         WHERE NOT m.held AND m.at > v_now
           AND m.at < v_now + make_interval(secs => p_buckets::double precision * p_bucket_seconds)
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
