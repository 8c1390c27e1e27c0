-- Migration 007: delta-aggregated pending counter (issue 12's missed
-- cancel target, issue 9). Decrements of tenant_usage.pending_timers
-- (fire, cancel, DLQ move) are appended to queen.tenant_usage_deltas
-- instead of updating the tenant's counter row, so cancels and the
-- brokers' fires never queue on that row; increments and billing stay on
-- the row, under its lock, with the quota decision.
-- queen.fold_pending_deltas folds the deltas into the row (each broker's
-- sweeper), queen.get_pending_timers reads row + deltas.
-- bump_tenant_usage becomes PL/pgSQL (no replanning per call).
-- Function texts equal sql/schema/.

-- Append-only decrements of tenant_usage.pending_timers (issue 12): one
-- row per fire batch and tenant, per cancel, per DLQ move. No index and
-- no key: an INSERT here touches no row another transaction holds, so
-- cancels and the brokers' fires never queue behind each other or behind
-- a schedule. queen.fold_pending_deltas (each broker's sweeper, about
-- once a second) moves them into the base row, so the table stays small
-- and a per-tenant sum over it is a scan of a few pages. Only ever
-- negative (a CHECK): every increment is taken under the base row's lock.
-- Vacuumed after every 1000 dead rows; never truncated by vacuum (the
-- truncation's ACCESS EXCLUSIVE lock would stall the appends a moment).
CREATE TABLE queen.tenant_usage_deltas (
    tenant              text NOT NULL,
    pending_delta       bigint NOT NULL,
    CONSTRAINT pending_delta_negative CHECK (pending_delta < 0)
) WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
        vacuum_truncate = false);

-- Adjust a tenant's counters on the base row (one row write per call,
-- not per op): takes the row's lock until commit, like every quota
-- decision of the tenant. For increments and billing; a decrement alone
-- should go to queen.tenant_usage_deltas instead (it must not queue).
-- PL/pgSQL: the statement's plan is cached per session (a SQL function's
-- body is planned again on every call).
CREATE OR REPLACE FUNCTION queen.bump_tenant_usage(
    p_tenant  text,
    p_pending bigint,
    p_billed  bigint)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO queen.tenant_usage AS u (tenant, pending_timers, billed_messages)
    VALUES (p_tenant, greatest(p_pending, 0), p_billed)
    ON CONFLICT (tenant) DO UPDATE
        SET pending_timers  = greatest(0, u.pending_timers + p_pending),
            billed_messages = u.billed_messages + p_billed,
            updated_at      = now();
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
CREATE FUNCTION queen.fold_pending_deltas(p_limit integer DEFAULT 10000)
RETURNS bigint
LANGUAGE plpgsql AS $$
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
           AND (d.tenant = ANY (coalesce(v_locked, '{}'))
                OR NOT EXISTS (SELECT 1 FROM queen.tenant_usage u WHERE u.tenant = d.tenant))
        RETURNING d.tenant, d.pending_delta
    ), sums AS (
        SELECT g.tenant, sum(g.pending_delta) AS delta, count(*) AS n FROM gone g GROUP BY g.tenant
    ), upd AS (
        UPDATE queen.tenant_usage u
           SET pending_timers = greatest(0, u.pending_timers + s.delta), updated_at = now()
          FROM sums s
         WHERE u.tenant = s.tenant AND u.tenant = ANY (coalesce(v_locked, '{}'))
    )
    SELECT coalesce(sum(s.n), 0) INTO v_n FROM sums s;
    RETURN v_n;
END
$$;

-- Cancel one timer (DELETE /api/v1/timers/:queue/*timerKey): passes no
-- rung of the gate ladder. Returns cancelled | absent | too_late;
-- absent also for another tenant's key. Keeps the pending counter; a
-- cancel bills nothing and never creates the counter row (none reads 0).
-- The common case is two statements: the DELETE of the unclaimed row
-- (it takes the row lock delete_unclaimed_timer would take, so a cancel
-- racing a claim waits for it and a claim skips a row being cancelled)
-- and the INSERT of a -1 into queen.tenant_usage_deltas, which waits on
-- no other transaction (the tenant's counter row is not touched). Only
-- when the DELETE finds nothing does delete_unclaimed_timer check the
-- input and tell absent from too_late under the row lock; bad input
-- always gets there, since it cannot match a row (the key columns are
-- NOT NULL and non-empty). A claim that ended in between is cancelled
-- there. Plain PL/pgSQL statements only: their plans are cached per
-- session (a SQL function's body would be planned again on every call).
CREATE OR REPLACE FUNCTION queen.cancel_timer(
    p_tenant    text,
    p_queue     text,
    p_timer_key text,
    p_now       timestamptz DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_status text;
BEGIN
    DELETE FROM queen.timers
     WHERE tenant = p_tenant AND queue = p_queue AND timer_key = p_timer_key
       AND NOT queen.timer_is_claimed(lease_until, p_now);
    IF NOT FOUND THEN
        v_status := queen.delete_unclaimed_timer(p_tenant, p_queue, p_timer_key, p_now);
        IF v_status <> 'cancelled' THEN
            RETURN v_status;
        END IF;
    END IF;
    INSERT INTO queen.tenant_usage_deltas (tenant, pending_delta) VALUES (p_tenant, -1);
    RETURN 'cancelled';
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
        SELECT count(*) FILTER (WHERE o.op IN ('schedule', 'reschedule') AND t.timer_key IS NULL)
             - count(*) FILTER (WHERE o.op = 'cancel' AND t.timer_key IS NOT NULL
                                  AND NOT queen.timer_is_claimed(t.lease_until, v_now))
          INTO v_new
          FROM unnest(p_ops) o
          LEFT JOIN queen.timers t
                 ON t.tenant = p_tenant AND t.queue = o.queue AND t.timer_key = o.timer_key;
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

-- The batch behind POST /api/v1/timers: shape checks, the gate ladder,
-- then every operation, one verdict each, in input order. schedule and
-- reschedule are the same upsert on (tenant, queue, timer_key); an
-- upsert of a claimed row answers too_late and changes nothing. Each
-- accepted upsert mints a new message id, resets attempts, clears the
-- last error and is billed one message; cancels bill nothing.
-- Rows are touched in (queue, timer_key) order and the counter row last,
-- so that concurrent batches cannot deadlock each other. p_max_ops is
-- the broker's QUEEN_TIMERS_MAX_OPS (NULL: the cell's).
CREATE OR REPLACE FUNCTION queen.schedule_timers(
    p_tenant       text,
    p_ops          queen.timer_op[],
    p_producer_sub text        DEFAULT NULL,
    p_horizon_ms   bigint      DEFAULT NULL,
    p_tenancy      boolean     DEFAULT NULL,
    p_now          timestamptz DEFAULT NULL,
    p_max_ops      integer     DEFAULT NULL)
RETURNS SETOF queen.timer_verdict
LANGUAGE plpgsql AS $$
DECLARE
    v_now      timestamptz := coalesce(p_now, now());
    l          queen.tenant_limits;
    v_at       timestamptz;
    v_count    bigint;
    v_out      queen.timer_verdict[] := '{}';
    v          queen.timer_verdict;
    o          record;
    v_inserted boolean;
    v_msg_id   uuid;
    v_txn      text;
    v_status   text;
    v_pending  bigint := 0;
    v_billed   bigint := 0;
BEGIN
    IF p_tenant IS NULL OR p_tenant = '' THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = 'tenant is required';
    END IF;
    IF p_ops IS NULL OR cardinality(p_ops) = 0 THEN
        RETURN;
    END IF;
    PERFORM queen.check_timer_ops(p_ops, p_max_ops);
    l := queen.check_timer_gates(p_tenant, p_ops, p_horizon_ms, p_tenancy, v_now);

    FOR o IN
        SELECT x.*, x.n::integer AS ordinal
          FROM unnest(p_ops) WITH ORDINALITY AS x(op, queue, timer_key, delay_ms, txn, payload,
                                                  partition, payload_zstd, encrypted, raw_size, n)
         ORDER BY x.queue, x.timer_key COLLATE "C"
    LOOP
        v := ROW(o.ordinal, o.op, false, NULL, o.queue, o.timer_key, o.txn, NULL, NULL);
        IF o.op = 'cancel' THEN
            v_status := queen.delete_unclaimed_timer(p_tenant, o.queue, o.timer_key, v_now);
            v.status := v_status;
            v.ok := v_status = 'cancelled';
            IF v.ok THEN
                v_pending := v_pending - 1;
            END IF;
        ELSE
            v_msg_id := queen.uuid_v7();
            v_txn := coalesce(nullif(o.txn, ''), queen.uuid_v7()::text);
            -- a delay in the past is due at once; clamped so that no
            -- negative delayMs can overflow the timestamp
            v_at := v_now + greatest(o.delay_ms, -l.horizon_ms) * interval '1 millisecond';
            INSERT INTO queen.timers AS t
                   (tenant, queue, timer_key, partition, deliver_at, txn, message_id, payload,
                    payload_zstd, encrypted, producer_sub, created_at, updated_at)
            VALUES (p_tenant, o.queue, o.timer_key, coalesce(o.partition, 'Default'),
                    v_at, v_txn, v_msg_id, o.payload,
                    coalesce(o.payload_zstd, false), coalesce(o.encrypted, false), p_producer_sub,
                    v_now, v_now)
            ON CONFLICT (tenant, queue, timer_key) DO UPDATE
               SET partition = EXCLUDED.partition, deliver_at = EXCLUDED.deliver_at,
                   txn = EXCLUDED.txn, message_id = EXCLUDED.message_id,
                   payload = EXCLUDED.payload, payload_zstd = EXCLUDED.payload_zstd,
                   encrypted = EXCLUDED.encrypted, producer_sub = EXCLUDED.producer_sub,
                   attempts = 0, failures = 0, last_error = NULL, last_error_class = NULL,
                   claim_id = NULL, claimed_by = NULL, lease_until = NULL,
                   updated_at = v_now
             -- an expired lease is a dead claim: the upsert takes the row over
             WHERE NOT queen.timer_is_claimed(t.lease_until, v_now)
            RETURNING (xmax = 0) INTO v_inserted;
            IF NOT FOUND THEN
                v.status := 'too_late';
            ELSE
                v.ok := true;
                v.status := CASE WHEN v_inserted THEN 'scheduled' ELSE 'rescheduled' END;
                v.txn := v_txn;
                v.message_id := v_msg_id;
                v.deliver_at := v_at;
                v_billed := v_billed + 1;
                IF v_inserted THEN
                    v_pending := v_pending + 1;
                END IF;
            END IF;
        END IF;
        v_out := v_out || v;
    END LOOP;

    -- Metering. A batch that creates rows or bills takes the tenant's
    -- counter (base) row, with its lock until commit: every increment of
    -- pending_timers happens under it. A batch that only frees rows (its
    -- cancels) appends its decrement to the delta table, waiting on nobody.
    IF v_pending > 0 OR v_billed <> 0 THEN
        PERFORM queen.bump_tenant_usage(p_tenant, v_pending, v_billed);
    ELSIF v_pending < 0 THEN
        INSERT INTO queen.tenant_usage_deltas (tenant, pending_delta) VALUES (p_tenant, v_pending);
    END IF;
    -- The quota rung read the counter without a lock; re-check it under
    -- the base row's lock so that concurrent batches cannot overshoot.
    -- Exact at this moment: this statement runs after the lock was taken
    -- (READ COMMITTED: a new snapshot), so it sees the base row as the
    -- last holder of the lock left it plus our own increment, and every
    -- delta committed before now. While we hold the lock no other batch
    -- can add (increments happen only under it) and no fold can move
    -- deltas of this tenant (it skips a locked base row), and a fold that
    -- committed earlier is seen wholly (one snapshot, one statement).
    -- The only changes we cannot see are decrements not yet committed
    -- (fires, cancels, DLQ moves in flight): they can only make the count
    -- read here too high, so the decision errs toward refusing, never
    -- toward letting the tenant exceed its quota.
    IF l.max_pending_timers IS NOT NULL AND v_pending > 0 THEN
        v_count := queen.get_pending_timers(p_tenant);
        IF v_count > l.max_pending_timers THEN
            RAISE EXCEPTION 'timers_quota_exceeded'
                USING ERRCODE = 'QTQUO',
                      DETAIL = format('tenant %s would have %s pending timers of %s',
                                      p_tenant, v_count, l.max_pending_timers);
        END IF;
    END IF;
    -- Wake sweepers whose next planned wake-up is later than this.
    PERFORM pg_notify('queen_timers', extract(epoch FROM min(x.deliver_at))::text)
       FROM unnest(v_out) x WHERE x.deliver_at IS NOT NULL HAVING min(x.deliver_at) IS NOT NULL;

    RETURN QUERY SELECT * FROM unnest(v_out) ORDER BY ordinal;
END
$$;

-- Append the frames of deleted timer rows to the log, in expiry order,
-- and keep the tenants' pending counters (one delta row per tenant, in
-- queen.tenant_usage_deltas: no counter row is locked). Internal to the fire. A frame
-- goes into the queue of its timer's tenant.
CREATE OR REPLACE FUNCTION queen.append_timer_frames(p_rows queen.timers[], p_frames queen.fire_frame[] DEFAULT NULL)
RETURNS SETOF queen.fire_result
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    v_fired_at timestamptz := clock_timestamp();
BEGIN
    -- Lock every destination partition, in a fixed order, before appending.
    PERFORM queen.lock_partition(d.tenant, d.queue, d.partition)
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

-- Claim and fire in one transaction: the row lock is the claim, so no
-- lease is needed and a broker dying mid-call loses nothing (the
-- transaction rolls back). Used for every due timer whose frame needs
-- nothing from the broker (no zstd to inflate). Expiry order, SKIP LOCKED.
-- The common case is one statement with a plain INSERT (no join back from
-- the log, no ON CONFLICT arbiter: together they halved the fire rate);
-- a txn already in its partition raises unique_violation, and the batch
-- is redone through append_timer_frames, which answers 'duplicate'.
CREATE OR REPLACE FUNCTION queen.fire_due_timers(
    p_limit integer     DEFAULT 100,
    p_now   timestamptz DEFAULT NULL)
RETURNS SETOF queen.fire_result
LANGUAGE plpgsql AS $$
DECLARE
    v_now  timestamptz := coalesce(p_now, now());
    v_out  queen.fire_result[];
    v_rows queen.timers[];
BEGIN
    IF (queen.get_cell_settings()).fire_paused THEN
        RETURN;
    END IF;
    BEGIN
        WITH due AS (
            SELECT t.tenant, t.queue, t.timer_key
              FROM queen.timers t
             WHERE t.deliver_at <= v_now
               AND NOT t.payload_zstd
               AND NOT queen.timer_is_claimed(t.lease_until, v_now)
             ORDER BY t.deliver_at
             LIMIT greatest(p_limit, 0)
               FOR UPDATE SKIP LOCKED
        ), gone AS (
            DELETE FROM queen.timers t USING due d
             WHERE t.tenant = d.tenant AND t.queue = d.queue AND t.timer_key = d.timer_key
            RETURNING t.*
        ), parts AS (
            -- every destination partition (of the timer's tenant's queue) locked,
            -- in a fixed order, before a row joined to it can be appended (see
            -- queen.messages.seq)
            SELECT x.tenant, x.queue, x.partition,
                   queen.lock_partition(x.tenant, x.queue, x.partition) AS partition_id
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
    EXCEPTION WHEN unique_violation THEN
        v_out := NULL;
        WITH due AS (
            SELECT t.tenant, t.queue, t.timer_key
              FROM queen.timers t
             WHERE t.deliver_at <= v_now
               AND NOT t.payload_zstd
               AND NOT queen.timer_is_claimed(t.lease_until, v_now)
             ORDER BY t.deliver_at
             LIMIT greatest(p_limit, 0)
               FOR UPDATE SKIP LOCKED
        ), gone AS (
            DELETE FROM queen.timers t USING due d
             WHERE (t.tenant, t.queue, t.timer_key) = (d.tenant, d.queue, d.timer_key)
            RETURNING t.*
        )
        SELECT array_agg(gone) INTO v_rows FROM gone;
        IF v_rows IS NOT NULL THEN
            RETURN QUERY SELECT * FROM queen.append_timer_frames(v_rows, NULL);
        END IF;
        RETURN;
    END;
    IF v_out IS NULL THEN
        RETURN;
    END IF;
    -- One decrement per tenant, appended: no fire waits on a counter row.
    INSERT INTO queen.tenant_usage_deltas (tenant, pending_delta)
    SELECT o.tenant, -count(*) FROM unnest(v_out) o GROUP BY o.tenant;
    RETURN QUERY SELECT * FROM unnest(v_out);
END
$$;

-- A failed fire of a claimed timer. The claim is dropped; the timer
-- backs off exponentially (p_backoff_ms * 2^(failures-1), at most
-- p_backoff_max_ms). Only 'permanent' and 'config' failures spend the
-- attempt budget; 'transient' ones cost nothing. When attempts reach
-- p_max_attempts the timer moves to its queue's DLQ (the queue of the
-- timer's tenant) under the group
-- '__QUEEN_TIMERS__'. Returns backoff | dead_lettered | lost.
CREATE OR REPLACE FUNCTION queen.fail_timer(
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
    v_now   timestamptz := coalesce(p_now, now());
    r       queen.timers;
    v_spend boolean;
    v_part  uuid;
BEGIN
    IF p_error_class IS NULL OR p_error_class NOT IN ('transient', 'permanent', 'config') THEN
        RAISE EXCEPTION 'timers_bad_request'
            USING ERRCODE = 'QTBAD', DETAIL = format('unknown failure class %L', p_error_class);
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
        v_part := queen.lock_partition(r.tenant, r.queue, r.partition);
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

-- The operator's view of the fire: the two switches and the number of
-- pending timers in the cell (from the per-tenant counters the timer
-- functions keep, base rows plus unfolded deltas, as
-- queen.get_pending_timers counts them, so it is cheap enough for every
-- Prometheus scrape).
CREATE OR REPLACE FUNCTION queen.get_timer_status()
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
