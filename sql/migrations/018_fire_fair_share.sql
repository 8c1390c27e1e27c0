-- Migration 018: the tenants with due timers share the fire behind a
-- backlog. The fire took due timers in deliver_at order across tenants, so
-- one tenant's backlog held every other tenant's timers until it was fired
-- (1,000,000 of one tenant's timers due at once: another tenant's timer due
-- 100 ms after them fired 26.6-30.1 s late on one broker). Now a full batch
-- whose oldest row was due p_fair_after_ms (100) ago or more also takes a
-- share of each tenant it left out, on the fast path (queen.fire_due_batch)
-- and on the leased path (queen.claim_timers, zstd rows).
-- New: the partial indexes timers_tenant_deliver_at_idx and
-- timers_tenant_zstd_deliver_at_idx (built here with a plain CREATE INDEX,
-- which holds writes to queen.timers while it builds: on a large table,
-- build them first with CREATE INDEX CONCURRENTLY under the same names and
-- definitions, and these statements are skipped); queen.find_due_tenants;
-- queen.fire_due_rows (the statement of the old queen.fire_due_batch, its
-- rows chosen and locked first by one of two statements: the cell's oldest,
-- or each tenant's share); queen.claim_due_rows (the same for the statement
-- of the old queen.claim_timers). queen.fire_due_batch,
-- queen.fire_due_timers and queen.claim_timers gain a trailing
-- p_fair_after_ms (the old signatures are dropped and the functions created
-- anew). The text equals sql/schema/30_timers.sql and sql/schema/40_fire.sql.

-- The fast path's fair share (queen.fire_due_batch): each tenant's due rows
-- in expiry order, found without walking another tenant's backlog.
CREATE INDEX IF NOT EXISTS timers_tenant_deliver_at_idx ON queen.timers (tenant, deliver_at) WHERE NOT payload_zstd;
-- The same for the leased path's shares (queen.claim_timers).
CREATE INDEX IF NOT EXISTS timers_tenant_zstd_deliver_at_idx ON queen.timers (tenant, deliver_at) WHERE payload_zstd;

DROP FUNCTION queen.fire_due_timers(integer, timestamptz, boolean);
DROP FUNCTION queen.fire_due_batch(integer, timestamptz);
DROP FUNCTION queen.claim_timers(text, integer, integer, timestamptz, boolean, bigint);

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
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
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
    p_fair_after_ms integer DEFAULT 100)
RETURNS SETOF queen.claimed_timer
LANGUAGE plpgsql AS $$
DECLARE
    v_now     timestamptz := coalesce(p_now, now());
    v_claim   uuid := gen_random_uuid();
    v_rows    queen.claimed_timer[];
    v_in      text[];
    v_tenants text[];
BEGIN
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

-- The tenants, other than p_except, with rows due for the fast path (no
-- zstd; p_zstd: for the leased path, zstd only), the one whose oldest due
-- row is oldest first, at most p_limit of them. The candidates are the
-- tenants whose usage row counts pending timers (every timer is scheduled
-- through queen.schedule_timers, which counts it there; the count folds
-- its decrements about once a second, so it is never below the true one),
-- at most 64 a call, taken in turn: the session's setting queen.fire_turn
-- keeps the last one probed, and the next call starts after it (wrapping),
-- so a cell of 10,000 such tenants costs 64 probes a batch, not 10,000
-- (30 ms), and each tenant is probed at least every ceil(N / 64) calls of
-- a session. Each is probed with one descent of timers_tenant_deliver_at_idx
-- (timers_tenant_zstd_deliver_at_idx), so no tenant's backlog is walked.
-- Internal to queen.fire_due_batch and queen.claim_timers.
CREATE FUNCTION queen.find_due_tenants(p_now timestamptz, p_limit integer, p_except text[] DEFAULT NULL,
                                       p_zstd boolean DEFAULT false)
RETURNS text[]
LANGUAGE plpgsql AS $$
DECLARE
    v_turn text := coalesce(current_setting('queen.fire_turn', true), '');
    v_cand text[];
    v_now  timestamptz := coalesce(p_now, now());
BEGIN
    -- PL/pgSQL, not SQL: its plans are cached (a SQL function is planned at
    -- every call). The next 64 candidates after the last one probed, wrapping.
    SELECT array_agg(c.tenant ORDER BY c.lap, c.tenant) INTO v_cand
      FROM ((SELECT u.tenant, 1 AS lap FROM queen.tenant_usage u
              WHERE u.tenant > v_turn AND u.pending_timers > 0 AND u.tenant <> ALL (coalesce(p_except, '{}'))
              ORDER BY u.tenant LIMIT 64)
            UNION ALL
            (SELECT u.tenant, 2 AS lap FROM queen.tenant_usage u
              WHERE u.tenant <= v_turn AND u.pending_timers > 0 AND u.tenant <> ALL (coalesce(p_except, '{}'))
              ORDER BY u.tenant LIMIT 64)
            LIMIT 64) c;
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
        RETURN (
            SELECT array_agg(d.tenant ORDER BY d.first, d.tenant)
              FROM (SELECT c.tenant, o.first
                      FROM unnest(v_cand) AS c(tenant)
                     CROSS JOIN LATERAL (
                            SELECT t.deliver_at AS first
                              FROM queen.timers t
                             WHERE (t.tenant, t.deliver_at) >= (c.tenant, '-infinity'::timestamptz)
                               AND (t.tenant, t.deliver_at) <= (c.tenant, v_now)
                               AND t.payload_zstd
                             ORDER BY t.tenant, t.deliver_at
                             LIMIT 1) o
                     ORDER BY o.first, c.tenant
                     LIMIT greatest(p_limit, 0)) d
        );
    END IF;
    RETURN (
        SELECT array_agg(d.tenant ORDER BY d.first, d.tenant)
          FROM (SELECT c.tenant, o.first
                  FROM unnest(v_cand) AS c(tenant)
                 CROSS JOIN LATERAL (
                        SELECT t.deliver_at AS first
                          FROM queen.timers t
                         WHERE (t.tenant, t.deliver_at) >= (c.tenant, '-infinity'::timestamptz)
                           AND (t.tenant, t.deliver_at) <= (c.tenant, v_now)
                           AND NOT t.payload_zstd
                         ORDER BY t.tenant, t.deliver_at
                         LIMIT 1) o
                 ORDER BY o.first, c.tenant
                 LIMIT greatest(p_limit, 0)) d
    );
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
LANGUAGE plpgsql AS $$
DECLARE
    v_now  timestamptz := coalesce(p_now, now());
    v_ids  tid[];
    v_out  queen.fire_result[];
    v_rows queen.timers[];
BEGIN
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
LANGUAGE plpgsql AS $$
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
-- append_timer_frames, which answers 'duplicate'. The sweeper passes false: no subtransaction
-- on its common path; a duplicate fails its call (which rolls back whole)
-- and it calls again with true.
CREATE FUNCTION queen.fire_due_timers(
    p_limit integer     DEFAULT 100,
    p_now   timestamptz DEFAULT NULL,
    p_redo_duplicates boolean DEFAULT true,
    p_fair_after_ms integer DEFAULT 100)
RETURNS SETOF queen.fire_result
LANGUAGE plpgsql AS $$
DECLARE
    v_now  timestamptz := coalesce(p_now, now());
    v_out  queen.fire_result[];
BEGIN
    IF (queen.get_cell_settings()).fire_paused THEN
        RETURN;
    END IF;
    IF NOT coalesce(p_redo_duplicates, true) THEN
        v_out := queen.fire_due_batch(p_limit, v_now, p_fair_after_ms);
    ELSE
        BEGIN
            v_out := queen.fire_due_batch(p_limit, v_now, p_fair_after_ms);
        EXCEPTION WHEN unique_violation THEN
            -- the batch again (shares included), with the 'duplicate' answers
            RETURN QUERY SELECT * FROM unnest(queen.fire_due_batch(p_limit, v_now, p_fair_after_ms, p_redo => true));
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
