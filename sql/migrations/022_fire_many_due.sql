-- Migration 022: the fire when more tenants have rows due than the fair
-- share's window holds, and a batch spread over many tenants' queues.
-- 1. queen.find_due_tenants took its 64 candidates a call from the 4,096
--    tenants with the oldest bound; a served tenant's bound is not raised,
--    so with more than 4,096 due at once the same ones held the window and
--    a tenant past them waited until they drained (15.9-36.1 s behind 5,000
--    tenants' backlogs, bench/many_due_compare.py). With the window full,
--    the 64 are now the next of every tenant past its bound, in tenant order
--    from the session's turn: every one is probed once a lap.
-- 2. Its p_except (the batch's tenants) is taken out by a hashed NOT IN
--    after the scans instead of a `<> ALL` filter that compared every row
--    read with every element.
-- 3. queen.ensure_partition finds a partition that exists with one lookup
--    (queues joined to partitions) instead of calling ensure_queue first;
--    the fire calls it once per destination partition of a batch.
-- The text equals sql/schema/40_fire.sql and sql/schema/20_log.sql.

-- The partition's id (of the tenant's queue), created on first use. No
-- lock is taken: appends need none (see queen.messages). A partition that
-- exists (the common case) is one lookup, with no call of ensure_queue: the
-- fire calls this once per destination partition of a batch, and a batch
-- into 256 tenants' queues spent 10-20 ms in the two calls (migration 022).
-- enable_seqscan off: the session keeps the lookup's plan, and one made while
-- the cell had a page of queues would read every queue at each call later.
CREATE OR REPLACE FUNCTION queen.ensure_partition(p_tenant text, p_queue text, p_partition text DEFAULT 'Default')
RETURNS uuid
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_queue_id uuid;
    v_id uuid;
BEGIN
    SELECT p.id INTO v_id
      FROM queen.queues q JOIN queen.partitions p ON p.queue_id = q.id
     WHERE q.tenant = p_tenant AND q.name = p_queue AND p.name = coalesce(p_partition, 'Default');
    IF FOUND THEN
        RETURN v_id;
    END IF;
    v_queue_id := queen.ensure_queue(p_tenant, p_queue);
    INSERT INTO queen.partitions (queue_id, name)
    VALUES (v_queue_id, coalesce(p_partition, 'Default'))
    ON CONFLICT (queue_id, name) DO NOTHING
    RETURNING id INTO v_id;
    IF v_id IS NULL THEN
        SELECT id INTO v_id FROM queen.partitions
         WHERE queue_id = v_queue_id AND name = coalesce(p_partition, 'Default');
    END IF;
    RETURN v_id;
END
$$;

-- The tenants, other than p_except, with rows due for the fast path (no
-- zstd; p_zstd: for the leased path, zstd only), the one whose oldest due
-- row is oldest first, at most p_limit of them. The candidates are the
-- tenants whose usage row counts pending timers (every timer is scheduled
-- through queen.schedule_timers, which counts it there; the count folds
-- its decrements about once a second, so it is never below the true one)
-- and whose next_due_at, a lower bound of their timers' deliver_at, has
-- passed: a tenant whose timers are all in the future is not looked at,
-- however many there are. Of those, the 4,096 with the oldest bound
-- (tenant_usage_next_due_at_idx), 64 a call, taken in turn: the session's
-- setting queen.fire_turn keeps the last one probed and the next call
-- starts after it (wrapping). When all 4,096 places are taken, the 64 are
-- the next of every tenant past its bound, in tenant order from the turn
-- (the counter rows' primary key): a served tenant's bound is not raised,
-- so the same 4,096 would hold the window until they drained, and a tenant
-- past them would wait for all their backlogs (migration 022). Each is
-- probed with one descent of
-- timers_tenant_deliver_at_idx (timers_tenant_zstd_deliver_at_idx), so no
-- tenant's backlog is walked. A candidate found with nothing due has its
-- bound raised to its earliest timer (infinity: none), so it is not
-- probed again before then; its usage row is taken FOR UPDATE SKIP LOCKED
-- before its timers are read, so a schedule of the tenant either committed
-- before (its rows are read) or lowers the bound after (it waits for the
-- lock); a row another transaction holds is left as it is.
-- Internal to queen.fire_due_batch and queen.claim_timers.
CREATE OR REPLACE FUNCTION queen.find_due_tenants(p_now timestamptz, p_limit integer, p_except text[] DEFAULT NULL,
                                       p_zstd boolean DEFAULT false)
RETURNS text[]
LANGUAGE plpgsql AS $$
DECLARE
    v_turn text := coalesce(current_setting('queen.fire_turn', true), '');
    v_cand text[];
    v_due  text[];
    v_idle text[];
    v_now  timestamptz := coalesce(p_now, now());
    v_full boolean;
    v_take integer;
BEGIN
    -- PL/pgSQL, not SQL: its plans are cached (a SQL function is planned at
    -- every call). The next 64 candidates after the last one probed, wrapping.
    -- p_except (the batch's tenants, up to its size) taken out after the
    -- scan by a hashed NOT IN, here and below, not by a filter on the scan:
    -- `<> ALL` compares every row read with every element (20 ms a batch
    -- with 4,096 due and 300 excepted).
    WITH b AS MATERIALIZED (
        SELECT u.tenant FROM queen.tenant_usage u
         WHERE u.next_due_at <= v_now AND u.pending_timers > 0
         ORDER BY u.next_due_at LIMIT 4096)
    SELECT (SELECT array_agg(c.tenant ORDER BY c.lap, c.tenant)
              FROM (SELECT b.tenant, b.tenant <= v_turn AS lap FROM b
                     WHERE b.tenant NOT IN (SELECT e.tenant FROM unnest(p_except) AS e(tenant))
                     ORDER BY 2, 1 LIMIT 64) c),
           (SELECT count(*) FROM b) = 4096
      INTO v_cand, v_full;
    IF v_full THEN
        -- the window is full: the next 64 of all, by the primary key from the
        -- turn (past it first, then from the start), no sort of the rest; as
        -- many more as p_except has, which the NOT IN then takes out
        v_take := 64 + coalesce(cardinality(p_except), 0);
        SELECT array_agg(c.tenant ORDER BY c.lap, c.tenant) INTO v_cand
          FROM (SELECT x.tenant, x.lap
                  FROM ((SELECT u.tenant, false AS lap FROM queen.tenant_usage u
                          WHERE u.tenant > v_turn AND u.next_due_at <= v_now AND u.pending_timers > 0
                          ORDER BY u.tenant LIMIT v_take)
                        UNION ALL
                        (SELECT u.tenant, true AS lap FROM queen.tenant_usage u
                          WHERE u.tenant <= v_turn AND u.next_due_at <= v_now AND u.pending_timers > 0
                          ORDER BY u.tenant LIMIT v_take)) x
                 WHERE x.tenant NOT IN (SELECT e.tenant FROM unnest(p_except) AS e(tenant))
                 ORDER BY x.lap, x.tenant LIMIT 64) c;
    END IF;
    IF v_cand IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM set_config('queen.fire_turn', v_cand[cardinality(v_cand)], false);
    -- Two statements, one per partial index. (tenant = c.tenant written as
    -- row comparisons: an equality would let the planner walk
    -- timers_deliver_at_idx filtering on the tenant, all of another tenant's
    -- backlog; (tenant, deliver_at) order only the tenant-led index gives,
    -- bounded on both sides.)
    IF p_zstd THEN
        SELECT array_agg(d.tenant ORDER BY d.first, d.tenant) INTO v_due
          FROM (SELECT c.tenant, o.first
                  FROM unnest(v_cand) AS c(tenant)
                 CROSS JOIN LATERAL (
                        SELECT t.deliver_at AS first
                          FROM queen.timers t
                         WHERE (t.tenant, t.deliver_at) >= (c.tenant, '-infinity'::timestamptz)
                           AND (t.tenant, t.deliver_at) <= (c.tenant, v_now)
                           AND t.payload_zstd
                         ORDER BY t.tenant, t.deliver_at
                         LIMIT 1) o) d;
    ELSE
        SELECT array_agg(d.tenant ORDER BY d.first, d.tenant) INTO v_due
          FROM (SELECT c.tenant, o.first
                  FROM unnest(v_cand) AS c(tenant)
                 CROSS JOIN LATERAL (
                        SELECT t.deliver_at AS first
                          FROM queen.timers t
                         WHERE (t.tenant, t.deliver_at) >= (c.tenant, '-infinity'::timestamptz)
                           AND (t.tenant, t.deliver_at) <= (c.tenant, v_now)
                           AND NOT t.payload_zstd
                         ORDER BY t.tenant, t.deliver_at
                         LIMIT 1) o) d;
    END IF;
    -- The candidates with nothing due of this kind: lock, then raise their
    -- bound to their earliest timer of either kind (read after the lock).
    SELECT array_agg(l.tenant) INTO v_idle
      FROM (SELECT u.tenant FROM queen.tenant_usage u
             WHERE u.tenant = ANY (v_cand) AND u.tenant <> ALL (coalesce(v_due, '{}'))
               FOR UPDATE SKIP LOCKED) l;
    IF v_idle IS NOT NULL THEN
        UPDATE queen.tenant_usage u
           SET next_due_at = f.first
          FROM (SELECT c.tenant,
                       coalesce(least(
                           (SELECT t.deliver_at FROM queen.timers t
                             WHERE (t.tenant, t.deliver_at) >= (c.tenant, '-infinity'::timestamptz)
                               AND (t.tenant, t.deliver_at) <= (c.tenant, 'infinity'::timestamptz)
                               AND NOT t.payload_zstd
                             ORDER BY t.tenant, t.deliver_at LIMIT 1),
                           (SELECT t.deliver_at FROM queen.timers t
                             WHERE (t.tenant, t.deliver_at) >= (c.tenant, '-infinity'::timestamptz)
                               AND (t.tenant, t.deliver_at) <= (c.tenant, 'infinity'::timestamptz)
                               AND t.payload_zstd
                             ORDER BY t.tenant, t.deliver_at LIMIT 1)), 'infinity') AS first
                  FROM unnest(v_idle) AS c(tenant)) f
         WHERE u.tenant = f.tenant AND u.next_due_at < f.first;
    END IF;
    RETURN CASE WHEN p_limit > 0 THEN v_due[1:p_limit] END;
END
$$;
