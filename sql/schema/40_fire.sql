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
LANGUAGE plpgsql AS $$
DECLARE
    v_paused boolean;
BEGIN
    IF p_paused IS NULL THEN  -- not the cell_settings column's NOT NULL (23502)
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = 'p_paused must be true or false';
    END IF;
    UPDATE queen.cell_settings SET scheduling_paused = p_paused, updated_at = now() WHERE id
    RETURNING scheduling_paused INTO v_paused;
    RETURN v_paused;
END
$$;

CREATE FUNCTION queen.resume_scheduling()
RETURNS boolean
LANGUAGE sql AS $$
    SELECT NOT queen.pause_scheduling(false)
$$;

-- Pause or resume the fire in every broker of the cell. This is the only
-- switch that stops the fire; no automatic rung ever does. A resume wakes
-- every sleeping sweeper at its commit (NOTIFY queen_timers with the
-- soonest deliver_at, as a schedule does): a paused sweeper sleeps
-- QUEEN_SWEEPER_MAX_SLEEP_MS, and the backlog would otherwise start late
-- and on each broker at a different moment.
CREATE FUNCTION queen.pause_fire(p_paused boolean DEFAULT true)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_paused boolean;
    v_first  timestamptz;
BEGIN
    IF p_paused IS NULL THEN  -- not the cell_settings column's NOT NULL (23502)
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = 'p_paused must be true or false';
    END IF;
    UPDATE queen.cell_settings SET fire_paused = p_paused, updated_at = now() WHERE id
    RETURNING fire_paused INTO v_paused;
    IF NOT v_paused THEN
        SELECT min(t.deliver_at) INTO v_first FROM queen.timers t;
        IF v_first IS NOT NULL THEN
            PERFORM pg_notify('queen_timers', extract(epoch FROM v_first)::text);
        END IF;
    END IF;
    RETURN v_paused;
END
$$;

CREATE FUNCTION queen.resume_fire()
RETURNS boolean
LANGUAGE sql AS $$
    SELECT NOT queen.pause_fire(false)
$$;

-- ---------------------------------------------------------------------
-- Claim and fire
-- ---------------------------------------------------------------------
-- enable_seqscan, enable_bitmapscan and enable_sort off on the functions
-- that choose due rows (fire_due_rows, claim_due_rows, find_due_tenants):
-- they must walk the deliver_at indexes in order and stop at their LIMIT,
-- whatever the statistics say. An autovacuum ANALYZE that ran while a bulk
-- load was not yet committed left queen.timers "empty" over thousands of
-- pages; every plan then took all due rows by a bitmap scan and sorted
-- them, at every batch, until the next ANALYZE (a backlog of 1,000,000
-- fired at half speed, another tenant's timer 460-670 ms late; see
-- tests/sql/48_fire_stale_stats.sql). The sorts of a batch's own rows stay,
-- and the cost of a disabled node they carry would cross jit_above_cost: no
-- JIT there either (it compiled for 170 ms a call of find_due_tenants).
-- plan_cache_mode = force_custom_plan on the functions that join a batch
-- array: after five calls PL/pgSQL switches to a generic plan that guesses
-- unnest(array) at 10 rows and joins the batch by nested loop, quadratic
-- in the batch (bench/RESULTS.md: fire_timers of 1024 frames 45 ms ->
-- 400 ms). fire_due_timers joins no array and keeps its cached plan.

-- Append the frames of deleted timer rows to the log, in expiry order,
-- and keep the tenants' pending counters (one delta row per tenant, in
-- queen.tenant_usage_deltas: no counter row is locked). Internal to the fire. A frame
-- goes into the queue of its timer's tenant.
CREATE FUNCTION queen.append_timer_frames(p_rows queen.timers[], p_frames queen.fire_frame[] DEFAULT NULL)
RETURNS SETOF queen.fire_result
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    v_fired_at timestamptz := clock_timestamp();
BEGIN
    -- Every destination partition exists before appending (no lock: see queen.messages).
    PERFORM queen.ensure_partition(d.tenant, d.queue, d.partition)
       FROM (SELECT DISTINCT r.tenant, r.queue, r.partition FROM unnest(p_rows) r ORDER BY 1, 2, 3) d;

    -- One decrement per tenant, appended: no fire waits on a counter row.
    INSERT INTO queen.tenant_usage_deltas (tenant, pending_delta)
    SELECT r.tenant, -count(*) FROM unnest(p_rows) r GROUP BY r.tenant;

    RETURN QUERY
    WITH src AS (
        SELECT r.*, coalesce(f.payload, r.payload) AS frame_payload, p.id AS partition_id
          FROM unnest(p_rows) r
          JOIN queen.queues q ON q.tenant = r.tenant AND q.name = r.queue
          JOIN queen.partitions p ON p.queue_id = q.id AND p.name = r.partition
          LEFT JOIN (SELECT DISTINCT ON (x.tenant, x.queue, x.timer_key) x.*
                       FROM unnest(p_frames) x) f
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

-- The claim's statements: up to p_limit due rows, in expiry order,
-- SKIP LOCKED, leased to p_broker under p_claim for p_lease_ms and answered
-- in expiry order. Either the cell's oldest (p_tenants NULL; p_zstd_only:
-- zstd rows only) or the p_share oldest zstd rows of each tenant of
-- p_tenants (the shares of queen.claim_timers). p_max_bytes (NULL: no
-- bound) bounds the stored payload bytes claimed: rows are taken in expiry
-- order (the shares: each tenant's oldest, then each one's second, ...)
-- while the bytes before them are under it, so the first row is always
-- claimed, however large; the rows left are not claimed. Internal to
-- queen.claim_timers.
CREATE FUNCTION queen.claim_due_rows(
    p_claim     uuid,
    p_broker    text,
    p_limit     integer,
    p_lease_ms  integer,
    p_now       timestamptz,
    p_zstd_only boolean,
    p_max_bytes bigint,
    p_tenants   text[]  DEFAULT NULL,
    p_share     integer DEFAULT NULL)
RETURNS SETOF queen.claimed_timer
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan
    SET enable_seqscan = off SET enable_bitmapscan = off SET enable_sort = off SET jit = off AS $$
DECLARE
    v_ids tid[];
BEGIN
    -- Two statements, as queen.fire_due_rows: the rows chosen, locked and
    -- bounded by bytes (one of two plain statements), then leased by ctid.
    IF p_tenants IS NULL THEN
        SELECT array_agg(d.row_id) INTO v_ids
          FROM (SELECT d.row_id, coalesce(sum(d.bytes) OVER (ORDER BY d.deliver_at, d.tenant, d.queue, d.timer_key
                                                ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS before
                  FROM (SELECT t.ctid AS row_id, t.tenant, t.queue, t.timer_key, t.deliver_at,
                               octet_length(t.payload) AS bytes
                          FROM queen.timers t
                         WHERE t.deliver_at <= p_now  -- octet_length: the TOAST header, not the bytes
                           AND NOT queen.timer_is_claimed(t.lease_until, p_now)
                           AND (t.payload_zstd OR NOT p_zstd_only)
                         ORDER BY t.deliver_at
                         LIMIT greatest(p_limit, 0)
                           FOR UPDATE SKIP LOCKED) d) d
         WHERE p_max_bytes IS NULL OR d.before < greatest(p_max_bytes, 1);
    ELSE
        -- the shares go round the tenants under the byte bound: every
        -- tenant's oldest before anyone's second
        SELECT array_agg(d.row_id) INTO v_ids
          FROM (SELECT d.row_id, coalesce(sum(d.bytes) OVER (ORDER BY d.turn, d.deliver_at, d.tenant, d.queue, d.timer_key
                                                ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS before
                  FROM (SELECT s.*, row_number() OVER (PARTITION BY s.tenant ORDER BY s.deliver_at, s.queue, s.timer_key) AS turn
                          FROM unnest(p_tenants) AS tn(tenant)
                         CROSS JOIN LATERAL (
                                SELECT t.ctid AS row_id, t.tenant, t.queue, t.timer_key, t.deliver_at,
                                       octet_length(t.payload) AS bytes
                                  FROM queen.timers t
                                 WHERE (t.tenant, t.deliver_at) >= (tn.tenant, '-infinity'::timestamptz)  -- see find_due_tenants
                                   AND (t.tenant, t.deliver_at) <= (tn.tenant, p_now)
                                   AND t.payload_zstd
                                   AND NOT queen.timer_is_claimed(t.lease_until, p_now)
                                 ORDER BY t.tenant, t.deliver_at
                                 LIMIT greatest(p_share, 0)
                                   FOR UPDATE SKIP LOCKED) s) d) d
         WHERE p_max_bytes IS NULL OR d.before < greatest(p_max_bytes, 1);
    END IF;
    IF v_ids IS NULL THEN
        RETURN;
    END IF;
    RETURN QUERY
    WITH claimed AS (
        UPDATE queen.timers t
           SET claim_id = p_claim, claimed_by = p_broker,
               lease_until = p_now + greatest(p_lease_ms, 1) * interval '1 millisecond'
         WHERE t.ctid = ANY (v_ids)
        RETURNING t.tenant, t.queue, t.timer_key, t.partition, t.deliver_at, t.lease_until,
                  t.txn, t.message_id, t.payload, t.payload_zstd, t.encrypted, t.attempts
    )
    SELECT p_claim, c.tenant, c.queue, c.timer_key::text, c.partition, c.deliver_at, c.lease_until,
           c.txn, c.message_id, c.payload, c.payload_zstd, c.encrypted, c.attempts
      FROM claimed c
     ORDER BY c.deliver_at, c.message_id;
END
$$;

-- Claim up to p_limit due timers for p_lease_ms, in expiry order (and
-- returned in it), skipping rows another session holds. A row whose
-- lease expired (its broker died) is due again. Nothing is claimed
-- while the fire is paused. p_zstd_only: only rows whose frame needs the
-- broker (zstd to inflate); fire_due_timers takes the rest, lease-free.
-- p_max_bytes (NULL: no bound) bounds the stored payload bytes claimed
-- (see queen.claim_due_rows). With p_zstd_only, behind a backlog (the
-- claim came back full, by rows or bytes, and its oldest row was due
-- p_fair_after_ms ago or more) each tenant with due zstd rows that the
-- claim left out also gets up to p_limit / (the number of tenants with due
-- zstd rows) of its oldest, under the same claim and a second p_max_bytes:
-- as queen.fire_due_batch does for the fast path.
CREATE FUNCTION queen.claim_timers(
    p_broker    text,
    p_limit     integer     DEFAULT 100,
    p_lease_ms  integer     DEFAULT 30000,
    p_now       timestamptz DEFAULT NULL,
    p_zstd_only boolean     DEFAULT false,
    p_max_bytes bigint      DEFAULT NULL,
    p_fair_after_ms integer DEFAULT 100,
    p_turn      text        DEFAULT NULL)
RETURNS SETOF queen.claimed_timer
LANGUAGE plpgsql AS $$
DECLARE
    v_now     timestamptz := queen.finite_now(p_now);
    v_claim   uuid := gen_random_uuid();
    v_rows    queen.claimed_timer[];
    v_in      text[];
    v_tenants text[];
BEGIN
    -- NULL is the default, as for list_dlq's p_limit: greatest() skipped it, and a NULL
    -- limit claimed nothing, a NULL lease held for 1 ms (migration 042)
    p_limit := coalesce(p_limit, 100);
    p_lease_ms := coalesce(p_lease_ms, 30000);
    IF p_turn IS NOT NULL THEN  -- the caller's turn, not this session's (find_due_tenants)
        PERFORM set_config('queen.fire_turn', p_turn, false);
    END IF;
    IF (queen.get_cell_settings()).fire_paused THEN
        RETURN;
    END IF;
    SELECT array_agg(c) INTO v_rows
      FROM queen.claim_due_rows(v_claim, p_broker, p_limit, p_lease_ms, v_now, p_zstd_only, p_max_bytes) c;
    IF v_rows IS NULL THEN
        RETURN;
    END IF;
    IF coalesce(p_zstd_only, false) AND p_fair_after_ms IS NOT NULL
       AND (cardinality(v_rows) >= greatest(p_limit, 1)
            OR (SELECT sum(octet_length(r.payload)) FROM unnest(v_rows) r) >= p_max_bytes)
       AND (SELECT min(r.deliver_at) FROM unnest(v_rows) r)
           <= v_now - greatest(p_fair_after_ms, 0) * interval '1 millisecond' THEN
        SELECT array_agg(DISTINCT r.tenant) INTO v_in FROM unnest(v_rows) r;
        v_tenants := queen.find_due_tenants(v_now, p_limit, v_in, p_zstd => true);
        IF v_tenants IS NOT NULL THEN
            RETURN QUERY
            SELECT * FROM (SELECT * FROM unnest(v_rows)
                           UNION ALL
                           SELECT * FROM queen.claim_due_rows(
                               v_claim, p_broker, p_limit, p_lease_ms, v_now, true, p_max_bytes, v_tenants,
                               greatest(1, p_limit / (cardinality(v_tenants) + cardinality(v_in))))) r
             ORDER BY r.deliver_at, r.message_id;
            RETURN;
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM unnest(v_rows);
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
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan SET lock_timeout = '50ms' AS $$
DECLARE
    v_now  timestamptz := queen.finite_now(p_now);
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
-- starts after it (wrapping). Behind a transaction pooler each call may
-- run on another server connection, whose setting is another caller's: a
-- caller that carries its own turn passes it (p_turn of fire_due_timers
-- and claim_timers, which set it before anything) and reads the new one
-- back in the same statement, current_setting('queen.fire_turn', true)
-- over the call, as the sweeper does (migration 023). When all 4,096
-- places are taken, the 64 are the next of every tenant past its bound,
-- in tenant order from the turn (the counter rows' primary key): a served
-- tenant's bound is not raised, so the same 4,096 would hold the window
-- until they drained, and a tenant past them would wait for all their
-- backlogs (migration 022). Each is probed with one descent of
-- timers_tenant_deliver_at_idx (timers_tenant_zstd_deliver_at_idx), so no
-- tenant's backlog is walked. A candidate found with nothing due has its
-- bound raised to its earliest timer (infinity: none), so it is not
-- probed again before then; its usage row is taken FOR UPDATE SKIP LOCKED
-- before its timers are read, so a schedule of the tenant either committed
-- before (its rows are read) or lowers the bound after (it waits for the
-- lock); a row another transaction holds is left as it is.
-- Internal to queen.fire_due_batch and queen.claim_timers.
CREATE FUNCTION queen.find_due_tenants(p_now timestamptz, p_limit integer, p_except text[] DEFAULT NULL,
                                       p_zstd boolean DEFAULT false)
RETURNS text[]
LANGUAGE plpgsql SET enable_seqscan = off SET enable_bitmapscan = off SET enable_sort = off SET jit = off AS $$
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

-- The fast path's statements, with no subtransaction: due rows (expiry
-- order, SKIP LOCKED) deleted and their frames appended, answered as fire
-- results. Either the p_limit oldest due rows of the cell (p_tenants NULL)
-- or the p_share oldest due rows of each tenant of p_tenants. A txn already
-- in its partition raises unique_violation (nothing of the batch stays);
-- with p_redo it answers 'duplicate' instead (the slower statement of
-- queen.fire_due_timers' redo). Internal to queen.fire_due_batch.
CREATE FUNCTION queen.fire_due_rows(
    p_limit   integer,
    p_now     timestamptz,
    p_tenants text[]  DEFAULT NULL,
    p_share   integer DEFAULT NULL,
    p_redo    boolean DEFAULT false)
RETURNS queen.fire_result[]
LANGUAGE plpgsql SET enable_seqscan = off SET enable_bitmapscan = off SET enable_sort = off SET jit = off AS $$
DECLARE
    v_now  timestamptz := coalesce(p_now, now());
    v_ids  tid[];
    v_out  queen.fire_result[];
    v_rows queen.timers[];
    v_zstd boolean;
BEGIN
    -- A plain row waits while a zstd row of its partition that matured before it is
    -- still to be inflated (the leased path inflates it in place, queen.inflate_timers,
    -- and a later batch fires it with the rows after it): due rows of one queue and
    -- partition enter the log in expiry order, the contract's rule (Dec 7 audit: every
    -- plain row of a cycle went before its zstd ones). Looked for only while some zstd
    -- row is due (one descent of timers_zstd_deliver_at_idx a batch); each candidate
    -- then one descent of timers_zstd_partition_idx.
    v_zstd := EXISTS (SELECT 1 FROM queen.timers z WHERE z.payload_zstd AND z.deliver_at <= v_now);
    -- Two statements: the rows chosen and locked (one of two plain ones),
    -- then deleted by ctid and fired. One statement with both choices as a
    -- UNION ALL planned both at every call: +0.3 ms a batch, which the
    -- sweeper's small batches (a few timers due at a time) paid in fire lag.
    IF p_tenants IS NULL THEN
        SELECT array_agg(o.row_id) INTO v_ids
          FROM (SELECT t.ctid AS row_id
                  FROM queen.timers t
                 WHERE t.deliver_at <= v_now
                   AND NOT t.payload_zstd
                   AND NOT queen.timer_is_claimed(t.lease_until, v_now)
                   AND (NOT v_zstd OR NOT EXISTS (
                        SELECT 1 FROM queen.timers z
                         WHERE z.payload_zstd AND z.tenant = t.tenant AND z.queue = t.queue
                           AND z.partition = t.partition AND z.deliver_at < t.deliver_at))
                 ORDER BY t.deliver_at
                 LIMIT greatest(p_limit, 0)
                   FOR UPDATE SKIP LOCKED) o;
    ELSE
        SELECT array_agg(s.row_id) INTO v_ids
          FROM unnest(p_tenants) AS tn(tenant)
         CROSS JOIN LATERAL (
                SELECT t.ctid AS row_id
                  FROM queen.timers t
                 WHERE (t.tenant, t.deliver_at) >= (tn.tenant, '-infinity'::timestamptz)  -- see find_due_tenants
                   AND (t.tenant, t.deliver_at) <= (tn.tenant, v_now)
                   AND NOT t.payload_zstd
                   AND NOT queen.timer_is_claimed(t.lease_until, v_now)
                   AND (NOT v_zstd OR NOT EXISTS (
                        SELECT 1 FROM queen.timers z
                         WHERE z.payload_zstd AND z.tenant = t.tenant AND z.queue = t.queue
                           AND z.partition = t.partition AND z.deliver_at < t.deliver_at))
                 ORDER BY t.tenant, t.deliver_at
                 LIMIT greatest(p_share, 0)
                   FOR UPDATE SKIP LOCKED) s;
    END IF;
    IF v_ids IS NULL THEN
        RETURN NULL;
    END IF;
    IF p_redo THEN
        -- each frame through append_timer_frames (ON CONFLICT: a txn already
        -- in its partition answers 'duplicate'; it appends the counter
        -- decrements itself)
        WITH gone AS (
            DELETE FROM queen.timers t WHERE t.ctid = ANY (v_ids) RETURNING t.*
        )
        SELECT array_agg(gone) INTO v_rows FROM gone;
        IF v_rows IS NOT NULL THEN
            SELECT array_agg(r ORDER BY r.deliver_at, r.message_id) INTO v_out
              FROM queen.append_timer_frames(v_rows, NULL) r;
        END IF;
        RETURN v_out;
    END IF;
    WITH gone AS (
        -- by the locked rows' ctids: one TID fetch per row (a join on the key
        -- let a cached plan hash the whole table: bench/RESULTS.md). This
        -- statement's snapshot is newer than the lock, and the lock holds
        -- every row as it was locked (an update before the lock: its newest
        -- version, whose ctid the lock answered).
        DELETE FROM queen.timers t WHERE t.ctid = ANY (v_ids) RETURNING t.*
    ), parts AS (
        -- every destination partition (of the timer's tenant's queue), created
        -- on first use; no lock (see queen.messages)
        SELECT x.tenant, x.queue, x.partition,
               queen.ensure_partition(x.tenant, x.queue, x.partition) AS partition_id
          FROM (SELECT DISTINCT g.tenant, g.queue, g.partition FROM gone g ORDER BY 1, 2, 3) x
    ), src AS (
        SELECT g.*, p.partition_id
          FROM gone g JOIN parts p ON p.tenant = g.tenant AND p.queue = g.queue AND p.partition = g.partition
    ), ins AS (
        INSERT INTO queen.messages (id, transaction_id, partition_id, payload, is_encrypted, producer_sub)
        SELECT s.message_id, s.txn, s.partition_id, s.payload, s.encrypted, s.producer_sub
          FROM src s
         ORDER BY s.deliver_at, s.message_id
    )
    SELECT array_agg(ROW(s.tenant, s.queue, s.timer_key, 'fired', s.message_id, s.partition_id,
                         s.deliver_at, clock_timestamp())::queen.fire_result
                     ORDER BY s.deliver_at, s.message_id)
      INTO v_out
      FROM src s;
    RETURN v_out;
END
$$;

-- One batch of the fast path: the p_limit oldest due rows of the cell
-- (queen.fire_due_rows). When that batch is full and its oldest row was due
-- p_fair_after_ms ago or more (a backlog), expiry order alone would hold
-- every other tenant's due timers until the backlog is fired (a million of
-- one tenant's timers due at 09:00 held another tenant's timer due at
-- 09:00:00.1 for 27 s). So each tenant with due rows that the batch left
-- out also gets, in the same transaction, up to p_limit / (the number of
-- tenants with due rows) of its own oldest (at most p_limit such tenants,
-- the longest waiting first): a batch holds at most 2 * p_limit rows.
-- p_fair_after_ms NULL: expiry order only. No subtransaction; a duplicate
-- txn raises unique_violation (p_redo: answers 'duplicate', and the
-- counter decrements are appended). Answers in expiry order. Internal to
-- queen.fire_due_timers.
CREATE FUNCTION queen.fire_due_batch(
    p_limit          integer,
    p_now            timestamptz,
    p_fair_after_ms  integer DEFAULT 100,
    p_redo           boolean DEFAULT false)
RETURNS queen.fire_result[]
LANGUAGE plpgsql SET lock_timeout = '50ms' AS $$
DECLARE
    v_now     timestamptz := coalesce(p_now, now());
    v_out     queen.fire_result[];
    v_in      text[];
    v_tenants text[];
    v_more    queen.fire_result[];
BEGIN
    v_out := queen.fire_due_rows(p_limit, v_now, p_redo => p_redo);
    IF p_fair_after_ms IS NULL OR coalesce(cardinality(v_out), 0) < greatest(p_limit, 1)
       OR v_out[1].deliver_at > v_now - greatest(p_fair_after_ms, 0) * interval '1 millisecond' THEN
        RETURN v_out;  -- every due row it could take, or the fire keeps up
    END IF;
    SELECT array_agg(DISTINCT o.tenant) INTO v_in FROM unnest(v_out) o;
    v_tenants := queen.find_due_tenants(v_now, p_limit, v_in);
    IF v_tenants IS NULL THEN
        RETURN v_out;
    END IF;
    v_more := queen.fire_due_rows(p_limit, v_now, v_tenants,
                                  greatest(1, p_limit / (cardinality(v_tenants) + cardinality(v_in))), p_redo);
    IF v_more IS NOT NULL THEN
        SELECT array_agg(o ORDER BY o.deliver_at, o.message_id) INTO v_out FROM unnest(v_out || v_more) o;
    END IF;
    RETURN v_out;
END
$$;

-- The fire's waits on other transactions are bounded: a frame can only wait
-- on a transaction of its own tenant (a queue or partition it is creating, a
-- message of the same txn it is pushing), since names are per tenant, but one
-- batch holds many tenants' frames. A push of 10,000 items that created the
-- queue a due timer fires into held every tenant's fire for 1-2 s at a time
-- (Dec 7 audit). So the fire functions wait at most 50 ms for a lock
-- (lock_not_available, 55P03), and queen.fire_due_timers then fires the due
-- rows tenant by tenant, each in a subtransaction: a tenant that still
-- waits is left for the next cycle, its rows untouched; the others fire.
-- At most p_limit rows in all, from the tenants queen.find_due_tenants gives
-- (in turn), answering 'duplicate' as the redo does. Internal to
-- queen.fire_due_timers.
CREATE FUNCTION queen.fire_due_apart(p_limit integer, p_now timestamptz)
RETURNS SETOF queen.fire_result
LANGUAGE plpgsql SET lock_timeout = '50ms' AS $$
DECLARE
    v_left   integer := greatest(p_limit, 0);
    v_tenant text;
    v_got    queen.fire_result[];
BEGIN
    FOREACH v_tenant IN ARRAY coalesce(queen.find_due_tenants(p_now, greatest(p_limit, 1)), '{}') LOOP
        EXIT WHEN v_left <= 0;
        BEGIN
            v_got := queen.fire_due_rows(v_left, p_now, ARRAY[v_tenant], v_left, p_redo => true);
        EXCEPTION WHEN lock_not_available THEN
            CONTINUE;  -- its own transaction holds what its frames need: the next cycle tries again
        END;
        IF v_got IS NOT NULL THEN
            v_left := v_left - cardinality(v_got);
            RETURN QUERY SELECT * FROM unnest(v_got);
        END IF;
    END LOOP;
END
$$;

-- Claim and fire in one transaction: the row lock is the claim, so no
-- lease is needed and a broker dying mid-call loses nothing (the
-- transaction rolls back). Used for every due timer whose frame needs
-- nothing from the broker (no zstd to inflate). Expiry order, SKIP LOCKED;
-- behind a backlog (a full batch whose oldest row was due p_fair_after_ms
-- ago or more) the tenants it left out get their share of the batch too
-- (queen.fire_due_batch).
-- The common case is a statement with a plain INSERT (no join back from
-- the log, no ON CONFLICT arbiter: together they halved the fire rate),
-- queen.fire_due_rows. A txn already in its partition raises
-- unique_violation there. With p_redo_duplicates (the default) the batch
-- runs in a subtransaction and is redone (in expiry order) through
-- append_timer_frames, which answers 'duplicate'; a lock waited for past
-- 50 ms (lock_not_available) fires the due rows tenant by tenant instead
-- (queen.fire_due_apart). The sweeper passes false: no subtransaction
-- on its common path; a duplicate or a lock timeout fails its call (which
-- rolls back whole) and it calls again with true.
CREATE FUNCTION queen.fire_due_timers(
    p_limit integer     DEFAULT 100,
    p_now   timestamptz DEFAULT NULL,
    p_redo_duplicates boolean DEFAULT true,
    p_fair_after_ms integer DEFAULT 100,
    p_turn  text        DEFAULT NULL)
RETURNS SETOF queen.fire_result
LANGUAGE plpgsql AS $$
DECLARE
    v_now  timestamptz := queen.finite_now(p_now);
    v_out  queen.fire_result[];
BEGIN
    p_limit := coalesce(p_limit, 100);  -- NULL fired nothing (greatest() skipped it) (migration 042)
    IF p_turn IS NOT NULL THEN  -- the caller's turn, not this session's (find_due_tenants)
        PERFORM set_config('queen.fire_turn', p_turn, false);
    END IF;
    IF (queen.get_cell_settings()).fire_paused THEN
        RETURN;
    END IF;
    IF NOT coalesce(p_redo_duplicates, true) THEN
        v_out := queen.fire_due_batch(p_limit, v_now, p_fair_after_ms);
    ELSE
        BEGIN
            v_out := queen.fire_due_batch(p_limit, v_now, p_fair_after_ms);
        EXCEPTION
            WHEN unique_violation THEN
                -- the batch again (shares included), with the 'duplicate' answers
                BEGIN
                    v_out := queen.fire_due_batch(p_limit, v_now, p_fair_after_ms, p_redo => true);
                EXCEPTION WHEN lock_not_available THEN
                    RETURN QUERY SELECT * FROM queen.fire_due_apart(p_limit, v_now);
                    RETURN;
                END;
                RETURN QUERY SELECT * FROM unnest(v_out);
                RETURN;
            WHEN lock_not_available THEN
                -- a frame waited past 50 ms on its own tenant's transaction: tenant by tenant
                RETURN QUERY SELECT * FROM queen.fire_due_apart(p_limit, v_now);
                RETURN;
        END;
    END IF;
    IF v_out IS NULL THEN
        RETURN;
    END IF;
    -- One decrement per tenant, appended: no fire waits on a counter row.
    INSERT INTO queen.tenant_usage_deltas (tenant, pending_delta)
    SELECT o.tenant, -count(*) FROM unnest(v_out) o GROUP BY o.tenant;
    RETURN QUERY SELECT * FROM unnest(v_out);
END
$$;

-- The leased path's end for a zstd timer (the sweeper's): the broker inflated its
-- payload (and sealed it again when its queue encrypts), and the row becomes an
-- ordinary due row holding those bytes, its claim released. queen.fire_due_timers
-- then fires it with the plain rows of its partition in one transaction, in expiry
-- order (migration 036: fired apart, a cycle's zstd frames went after all its plain
-- ones, even those due later). The bytes as scheduled stay for peek and list
-- (zstd_payload). A frame without bytes, or whose row is not a zstd row still held
-- by p_claim_id, answers 'lost' and changes nothing. Answers 'inflated' or 'lost'
-- per frame (queen.fire_result, the other columns NULL).
CREATE FUNCTION queen.inflate_timers(
    p_claim_id uuid,
    p_frames   queen.fire_frame[],
    p_now      timestamptz DEFAULT NULL)
RETURNS SETOF queen.fire_result
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan SET lock_timeout = '50ms' AS $$
DECLARE
    v_now timestamptz := queen.finite_now(p_now);
BEGIN
    RETURN QUERY
    WITH f AS (
        SELECT DISTINCT ON (x.tenant, x.queue, x.timer_key) x.* FROM unnest(p_frames) x
    ), done AS (
        UPDATE queen.timers t
           SET zstd_payload = t.payload, payload = f.payload, payload_zstd = false,
               claim_id = NULL, claimed_by = NULL, lease_until = NULL
          FROM f
         WHERE (t.tenant, t.queue, t.timer_key) = (f.tenant, f.queue, f.timer_key)
           AND f.payload IS NOT NULL AND t.payload_zstd
           AND t.claim_id = p_claim_id AND queen.timer_is_claimed(t.lease_until, v_now)
        RETURNING t.tenant, t.queue, t.timer_key
    )
    SELECT f.tenant, f.queue, f.timer_key,
           CASE WHEN d.timer_key IS NULL THEN 'lost' ELSE 'inflated' END,
           NULL::uuid, NULL::uuid, NULL::timestamptz, NULL::timestamptz
      FROM f LEFT JOIN done d ON (d.tenant, d.queue, d.timer_key) = (f.tenant, f.queue, f.timer_key);
END
$$;

-- A failed fire of a claimed timer. The claim is dropped; the timer
-- backs off exponentially (p_backoff_ms * 2^(failures-1), at most
-- p_backoff_max_ms). Only 'permanent' and 'config' failures spend the
-- attempt budget; 'transient' ones cost nothing. When attempts reach
-- p_max_attempts the timer moves to its queue's DLQ (the queue of the
-- timer's tenant) under the group
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
    v_now   timestamptz := queen.finite_now(p_now);
    r       queen.timers;
    v_spend boolean;
    v_part  uuid;
BEGIN
    IF p_error_class IS NULL OR p_error_class NOT IN ('transient', 'permanent', 'config') THEN
        RAISE EXCEPTION 'timers_bad_request'
            USING ERRCODE = 'QTBAD', DETAIL = format('unknown failure class %L', p_error_class);
    END IF;
    -- NULL made deliver_at NULL (23502) or the attempts endless (migration 042)
    IF p_max_attempts IS NULL OR p_max_attempts < 1 OR p_backoff_ms IS NULL OR p_backoff_ms < 0
       OR p_backoff_max_ms IS NULL OR p_backoff_max_ms < 0 THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('p_max_attempts must be at least 1 and p_backoff_ms, p_backoff_max_ms at least 0, '
                            'got %s, %s, %s', p_max_attempts, p_backoff_ms, p_backoff_max_ms);
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
        v_part := queen.ensure_partition(r.tenant, r.queue, r.partition);
        INSERT INTO queen.dead_letter_queue
               (message_id, partition_id, consumer_group, transaction_id, payload, is_encrypted,
                payload_zstd, producer_sub, error_message, retry_count, original_created_at, failed_at,
                timer_tenant, timer_key)
        VALUES (r.message_id, v_part, '__QUEEN_TIMERS__', r.txn, r.payload, r.encrypted,
                r.payload_zstd, r.producer_sub, p_error, r.attempts + 1, r.created_at, v_now,
                r.tenant, r.timer_key);
        INSERT INTO queen.tenant_usage_deltas (tenant, pending_delta) VALUES (r.tenant, -1);
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

-- Replay one of the tenant's DLQ rows into its partition as a new frame
-- (new message id, transaction id '<original>#replay-<dlq id>'), deleting
-- the DLQ row. Another tenant's row is not found (QTNFD), like an unknown id.
-- The transaction id stays within the log's 255 bytes, or the replayed frame
-- could be popped but never acked (migration 039): a replay of a replay
-- replaces the earlier '#replay-<id>' instead of adding one, and an original
-- longer than 211 bytes is cut (on a character boundary) to fit the suffix.
-- A timer's dead letter is refused with QTRPL: its frame never had a
-- consumer group, and republishing it into a phantom group has no
-- defined meaning.
CREATE FUNCTION queen.replay_dlq_entry(p_tenant text, p_dlq_id uuid)
RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    d      queen.dead_letter_queue;
    v_id   uuid := queen.uuid_v7();
    v_base text;
BEGIN
    SELECT dl.* INTO d
      FROM queen.dead_letter_queue dl
      JOIN queen.partitions p ON p.id = dl.partition_id
      JOIN queen.queues q ON q.id = p.queue_id
     WHERE dl.id = p_dlq_id AND q.tenant = p_tenant
       FOR UPDATE OF dl;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'not_found' USING ERRCODE = 'QTNFD', DETAIL = format('no DLQ entry %s', p_dlq_id);
    END IF;
    IF d.consumer_group = '__QUEEN_TIMERS__' THEN
        RAISE EXCEPTION 'dlq_replay_refused'
            USING ERRCODE = 'QTRPL',
                  DETAIL = 'a timer''s dead letter never had a consumer group and its offset is not a position; schedule a new timer instead';
    END IF;
    -- '#replay-' and a uuid take 44 bytes of the 255
    v_base := left(regexp_replace(d.transaction_id, '#replay-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}$', ''), 211);
    WHILE octet_length(v_base) > 211 LOOP
        v_base := left(v_base, -1);
    END LOOP;
    INSERT INTO queen.messages (id, transaction_id, partition_id, payload, is_encrypted, producer_sub)
    VALUES (v_id, v_base || '#replay-' || d.id, d.partition_id, d.payload, d.is_encrypted, d.producer_sub);
    DELETE FROM queen.dead_letter_queue WHERE id = p_dlq_id;
    RETURN v_id;
END
$$;
