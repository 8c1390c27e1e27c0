-- Migration 029: queen.extend_lease finds the lease by an index. It compared
-- pc.lease_id::text = lower(p_lease_id), which no index serves: every renew
-- read every cursor row (by the primary key with the statistics of an empty
-- table, by a seq scan once analyzed), twice when it failed. Both
-- lookups (the renew and the reason a failure names) now compare
-- pc.lease_id = queen.lease_uuid(p_lease_id) (migration 028: the canonical
-- form in either case, anything else or NULL is no lease, the same answers as
-- the text comparison) and look it up in partition_consumers_lease_idx,
-- whatever the statistics say: the tenant is a lookup of the row's partition
-- by its key, and the function runs with seq and plain index scans off (a
-- plain scan of the primary key serves the lock order's ORDER BY with no
-- sort, and with the statistics of an empty table the planner chose it).
-- The function text equals sql/schema/50_log_api.sql.

-- Queen's lease extension: push the expiry of the tenant's lease
-- p_lease_id (every partition a pop leased under it) to at least
-- now + p_seconds; never shortens it. A lease that is unknown, released
-- (acked, failed, retried) or another tenant's answers 'Lease not found';
-- one whose expiry has passed answers 'Lease already expired' (a pop may
-- take the partition again). renewed counts the partitions extended.
-- The lease is found by partition_consumers_lease_idx whatever the
-- statistics say (migration 029): the id is read by queen.lease_uuid (the
-- canonical form in either case; anything else, or NULL, is no lease, as
-- the text comparison it replaces matched), the lookups' one indexable
-- condition is the lease (the tenant is a lookup of the row's partition by
-- its key), and seq and plain index scans are off, so the lease index is
-- read by a bitmap scan. A plain index scan of the primary key serves the
-- ORDER BY (the lock order) with no sort: with the statistics of an empty
-- table the planner chose it, and a renew read every cursor row.
CREATE OR REPLACE FUNCTION queen.extend_lease(
    p_tenant   text,
    p_lease_id text,
    p_seconds  integer     DEFAULT 60,
    p_now      timestamptz DEFAULT NULL)
RETURNS TABLE (lease_id text, success boolean, error text, expires_at timestamptz, renewed integer)
LANGUAGE plpgsql SET enable_seqscan = off SET enable_indexscan = off AS $$
#variable_conflict use_column
DECLARE
    v_now     timestamptz := coalesce(p_now, now());
    v_expires timestamptz;
    v_n       integer;
BEGIN
    IF p_seconds IS NULL OR p_seconds < 1 OR p_seconds > 86400 THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('seconds must be an integer from 1 to 86400, not %s', p_seconds);
    END IF;
    WITH mine AS (
        SELECT pc.partition_id, pc.consumer_group
          FROM queen.partition_consumers pc
         WHERE pc.lease_id = queen.lease_uuid(p_lease_id) AND pc.lease_expires_at > v_now
           AND (SELECT q.tenant FROM queen.partitions p JOIN queen.queues q ON q.id = p.queue_id
                 WHERE p.id = pc.partition_id) = p_tenant
         ORDER BY pc.partition_id, pc.consumer_group
           FOR UPDATE OF pc
    ), ext AS (
        UPDATE queen.partition_consumers pc
           SET lease_expires_at = greatest(pc.lease_expires_at, v_now + make_interval(secs => p_seconds))
          FROM mine m
         WHERE pc.partition_id = m.partition_id AND pc.consumer_group = m.consumer_group
        RETURNING pc.lease_expires_at
    )
    SELECT count(*), max(ext.lease_expires_at) INTO v_n, v_expires FROM ext;
    IF v_n > 0 THEN
        RETURN QUERY SELECT p_lease_id, true, NULL::text, v_expires, v_n;
        RETURN;
    END IF;
    RETURN QUERY
    SELECT p_lease_id, false,
           CASE WHEN EXISTS (SELECT 1 FROM queen.partition_consumers pc
                              WHERE pc.lease_id = queen.lease_uuid(p_lease_id)
                                AND (SELECT q.tenant FROM queen.partitions p JOIN queen.queues q ON q.id = p.queue_id
                                      WHERE p.id = pc.partition_id) = p_tenant)
                THEN 'Lease already expired' ELSE 'Lease not found' END,
           NULL::timestamptz, 0;
END
$$;
