-- Migration 036: due timers of one queue and partition enter the log in expiry
-- order when zstd and plain payloads mix (the contract: "two timers on the same
-- queue and partition that mature in the same cycle enter the log in expiry order").
-- The fast path fired plain rows in one transaction and the leased path the zstd
-- rows (the broker inflates them) in a later one, so every plain row of a cycle went
-- before its zstd ones, even one due later (Dec 7 audit). Now:
-- - the leased path no longer fires: queen.inflate_timers puts the inflated bytes in
--   the row (the bytes as scheduled kept in zstd_payload, for peek and list) and
--   releases its claim, and the fast path fires it with the plain rows of its
--   partition, in one transaction, in expiry order;
-- - queen.fire_due_rows leaves a plain row while a zstd row of its partition that
--   matured before it is still to be inflated (looked for only while a zstd row is
--   due, through a new partial index of zstd rows only);
-- - a reschedule clears zstd_payload; peek and list show the timer as scheduled.
-- queen.fire_timers stays, for callers that fire claimed rows themselves.

ALTER TABLE queen.timers ADD COLUMN zstd_payload bytea;
CREATE INDEX timers_zstd_partition_idx ON queen.timers (tenant, queue, partition, deliver_at) WHERE payload_zstd;

CREATE OR REPLACE FUNCTION queen.fire_due_rows(
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
    -- still to fire (the leased path inflates that one and fires it in a transaction of
    -- its own): due rows of one queue and partition enter the log in expiry order, the
    -- contract's rule (Dec 7 audit: every plain row of a cycle went before its zstd
    -- ones). Looked for only while some zstd row is due (one descent of
    -- timers_zstd_deliver_at_idx a batch); each candidate then one descent of
    -- timers_zstd_partition_idx.
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

CREATE OR REPLACE FUNCTION queen.schedule_timers(
    p_tenant       text,
    p_ops          queen.timer_op[],
    p_producer_sub text        DEFAULT NULL,
    p_horizon_ms   bigint      DEFAULT NULL,
    p_tenancy      boolean     DEFAULT NULL,
    p_now          timestamptz DEFAULT NULL,
    p_max_ops      integer     DEFAULT NULL,
    p_staged       uuid        DEFAULT NULL)
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
    v_first_at timestamptz;
BEGIN
    IF p_tenant IS NULL OR p_tenant = '' THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = 'tenant is required';
    END IF;
    -- an infinite clock would store deliver_at infinity (every sweeper's next_timer_due_ms
    -- then fails) and a rate bucket refilled at infinity; a horizon past 100 years lets
    -- a negative delay overflow the timestamp (22008) (Dec 7 audit)
    IF NOT isfinite(v_now) THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('p_now must be a finite time, got %s', v_now);
    END IF;
    IF p_horizon_ms IS NOT NULL AND p_horizon_ms NOT BETWEEN 1 AND 3155760000000 THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('p_horizon_ms must be 1 .. 3155760000000 (100 years), got %s', p_horizon_ms);
    END IF;
    IF p_ops IS NULL OR cardinality(p_ops) = 0 THEN
        -- nothing to write, but the ladder's rungs still answer: an empty batch while
        -- scheduling is paused is 503 timers_disabled, as any other (Dec 7 audit)
        PERFORM queen.check_timer_gates(p_tenant, '{}', p_horizon_ms, p_tenancy, v_now);
        RETURN;
    END IF;
    IF p_staged IS NOT NULL THEN
        -- a staged op carries an empty payload and, as raw_size, the larger
        -- of its staged and inflated sizes: the checks and the QTBIG rung
        -- read them as they would the bytes (octet_length of a TOASTed
        -- value reads its header only)
        p_ops := ARRAY(
            SELECT ROW(x.op, x.queue, x.timer_key, x.delay_ms, x.txn,
                       CASE WHEN s.n IS NULL THEN x.payload ELSE ''::bytea END, x.partition,
                       x.payload_zstd, x.encrypted,
                       CASE WHEN s.n IS NULL THEN x.raw_size
                            ELSE greatest(x.raw_size, octet_length(s.payload)) END)::queen.timer_op
              FROM unnest(p_ops) WITH ORDINALITY AS x(op, queue, timer_key, delay_ms, txn, payload,
                                                  partition, payload_zstd, encrypted, raw_size, n)
              LEFT JOIN queen.staged_payloads s ON s.batch = p_staged AND s.n = x.n
             ORDER BY x.n);
    END IF;
    PERFORM queen.check_timer_ops(p_ops, p_max_ops);
    l := queen.check_timer_gates(p_tenant, p_ops, p_horizon_ms, p_tenancy, v_now);

    IF NOT EXISTS (SELECT 1 FROM unnest(p_ops) x WHERE x.op = 'cancel') THEN
        -- every op an upsert. A batch of schedule ops (the common batch:
        -- new timers) is first tried as a plain INSERT: ON CONFLICT costs
        -- every row a speculative-insertion lock and a confirm record (a
        -- plain INSERT of the same rows ran 1.3x as fast). A key that exists
        -- raises unique_violation: the block is undone (its subtransaction)
        -- and the upsert does the batch. So a batch whose first or last key
        -- exists (one sent again) and a batch with a reschedule (keys the
        -- client expects to exist) go straight to the upsert; a staged batch
        -- too (its bytes would be written twice).
        IF p_staged IS NULL AND NOT EXISTS (SELECT 1 FROM unnest(p_ops) x WHERE x.op <> 'schedule')
           AND NOT queen.timer_key_ends_exist(p_tenant, p_ops) THEN
            BEGIN
                WITH b AS (
                    SELECT x.n::integer AS ordinal, x.op, x.queue, x.timer_key, x.payload,
                           coalesce(x.partition, 'Default') AS partition,
                           coalesce(x.payload_zstd, false) AS payload_zstd,
                           coalesce(x.encrypted, false) AS encrypted,
                           queen.uuid_v7() AS message_id,
                           x.txn,  -- required of a schedule (check_timer_ops)
                           v_now + greatest(x.delay_ms, -l.horizon_ms) * interval '1 millisecond' AS deliver_at
                      FROM unnest(p_ops) WITH ORDINALITY AS x(op, queue, timer_key, delay_ms, txn, payload,
                                                          partition, payload_zstd, encrypted, raw_size, n)
                ), ins AS (
                    INSERT INTO queen.timers
                           (tenant, queue, timer_key, partition, deliver_at, txn, message_id, payload,
                            payload_zstd, encrypted, producer_sub, created_at, updated_at)
                    SELECT p_tenant, b.queue, b.timer_key, b.partition, b.deliver_at, b.txn, b.message_id,
                           b.payload, b.payload_zstd, b.encrypted, p_producer_sub, v_now, v_now
                      FROM b
                     ORDER BY b.queue, b.timer_key COLLATE "C"
                )  -- run to the end though not read: every row is inserted, or the block fails
                SELECT array_agg(ROW(b.ordinal, b.op, true, 'scheduled', b.queue, b.timer_key, b.txn,
                                     b.message_id, b.deliver_at)::queen.timer_verdict ORDER BY b.ordinal),
                       count(*), count(*), min(b.deliver_at)
                  FROM b
                  INTO v_out, v_billed, v_pending, v_first_at;
                v_inserted := true;
            EXCEPTION WHEN unique_violation THEN
                v_inserted := false;
            END;
        END IF;
        IF v_inserted IS NOT TRUE THEN
            -- one statement (see above)
            WITH b AS (
                SELECT x.n::integer AS ordinal, x.op, x.queue, x.timer_key, x.txn,
                       CASE WHEN p_staged IS NULL THEN x.payload
                            ELSE coalesce((SELECT s.payload FROM queen.staged_payloads s
                                            WHERE s.batch = p_staged AND s.n = x.n), x.payload) END AS payload,
                       coalesce(x.partition, 'Default') AS partition,
                       coalesce(x.payload_zstd, false) AS payload_zstd,
                       coalesce(x.encrypted, false) AS encrypted,
                       queen.uuid_v7() AS message_id,
                       coalesce(nullif(x.txn, ''), queen.uuid_v7()::text) AS new_txn,
                       -- a delay in the past is due at once; clamped so that no
                       -- negative delayMs can overflow the timestamp
                       v_now + greatest(x.delay_ms, -l.horizon_ms) * interval '1 millisecond' AS deliver_at
                  FROM unnest(p_ops) WITH ORDINALITY AS x(op, queue, timer_key, delay_ms, txn, payload,
                                                      partition, payload_zstd, encrypted, raw_size, n)
            ), ins AS (
                INSERT INTO queen.timers AS t
                       (tenant, queue, timer_key, partition, deliver_at, txn, message_id, payload,
                        payload_zstd, encrypted, producer_sub, created_at, updated_at)
                SELECT p_tenant, b.queue, b.timer_key, b.partition, b.deliver_at, b.new_txn, b.message_id,
                       b.payload, b.payload_zstd, b.encrypted, p_producer_sub, v_now, v_now
                  FROM b
                 ORDER BY b.queue, b.timer_key COLLATE "C"
                ON CONFLICT (tenant, queue, timer_key) DO UPDATE
                   SET partition = EXCLUDED.partition, deliver_at = EXCLUDED.deliver_at,
                       txn = EXCLUDED.txn, message_id = EXCLUDED.message_id,
                       payload = EXCLUDED.payload, payload_zstd = EXCLUDED.payload_zstd, zstd_payload = NULL,
                       encrypted = EXCLUDED.encrypted, producer_sub = EXCLUDED.producer_sub,
                       attempts = 0, failures = 0, last_error = NULL, last_error_class = NULL,
                       claim_id = NULL, claimed_by = NULL, lease_until = NULL,
                       updated_at = v_now
                 -- an expired lease is a dead claim: the upsert takes the row over
                 WHERE NOT queen.timer_is_claimed(t.lease_until, v_now)
                RETURNING t.queue, t.timer_key, (t.xmax = 0) AS inserted
            )
            SELECT array_agg(ROW(b.ordinal, b.op, i.queue IS NOT NULL,
                                 CASE WHEN i.queue IS NULL THEN 'too_late'
                                      WHEN i.inserted THEN 'scheduled' ELSE 'rescheduled' END,
                                 b.queue, b.timer_key,
                                 CASE WHEN i.queue IS NULL THEN b.txn ELSE b.new_txn END,
                                 CASE WHEN i.queue IS NOT NULL THEN b.message_id END,
                                 CASE WHEN i.queue IS NOT NULL THEN b.deliver_at END)::queen.timer_verdict
                             ORDER BY b.ordinal),
                   count(i.queue), count(*) FILTER (WHERE i.inserted),
                   min(b.deliver_at) FILTER (WHERE i.queue IS NOT NULL)
              FROM b LEFT JOIN ins i ON i.queue = b.queue AND i.timer_key = b.timer_key
              INTO v_out, v_billed, v_pending, v_first_at;
        END IF;
    ELSE
        FOR o IN
            SELECT x.op, x.queue, x.timer_key, x.delay_ms, x.txn,
                   CASE WHEN p_staged IS NULL THEN x.payload
                        ELSE coalesce((SELECT s.payload FROM queen.staged_payloads s
                                        WHERE s.batch = p_staged AND s.n = x.n), x.payload) END AS payload,
                   x.partition, x.payload_zstd, x.encrypted, x.n::integer AS ordinal
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
                       payload = EXCLUDED.payload, payload_zstd = EXCLUDED.payload_zstd, zstd_payload = NULL,
                       encrypted = EXCLUDED.encrypted, producer_sub = EXCLUDED.producer_sub,
                       attempts = 0, failures = 0, last_error = NULL, last_error_class = NULL,
                       claim_id = NULL, claimed_by = NULL, lease_until = NULL,
                       updated_at = v_now
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
                    v_first_at := least(v_first_at, v_at);
                END IF;
            END IF;
            v_out[o.ordinal] := v;
        END LOOP;
    END IF;

    -- Metering. A batch that creates rows or bills takes the tenant's
    -- counter (base) row, with its lock until commit: every increment of
    -- pending_timers happens under it. A batch that only frees rows (its
    -- cancels) appends its decrement to the delta table, waiting on nobody.
    IF v_pending > 0 OR v_billed <> 0 THEN
        PERFORM queen.bump_tenant_usage(p_tenant, v_pending, v_billed, v_first_at);
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
    -- Wake sweepers whose next planned wake-up is later than this. A sweeper
    -- sleeps at most QUEEN_SWEEPER_MAX_SLEEP_MS (at most 60 s, config.py) and
    -- reads the soonest deliver_at again when it wakes, so a batch due more
    -- than 61 s from now (a second for the commit) is found in time without
    -- one. PostgreSQL serializes the commits of transactions that NOTIFY (a
    -- cluster-wide lock from pre-commit to the end of the commit, fsync
    -- included): the far-future batch, the common one, sends none.
    IF v_first_at < clock_timestamp() + interval '61 seconds' THEN
        PERFORM pg_notify('queen_timers', extract(epoch FROM v_first_at)::text);
    END IF;
    IF p_staged IS NOT NULL THEN
        DELETE FROM queen.staged_payloads WHERE batch = p_staged;
    END IF;

    RETURN QUERY SELECT * FROM unnest(v_out);
END
$$;

CREATE OR REPLACE FUNCTION queen.peek_timer(
    p_tenant    text,
    p_queue     text,
    p_timer_key text,
    p_now       timestamptz DEFAULT NULL)
RETURNS SETOF queen.timer_view
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_problem text := queen.timer_name_problem(p_queue, p_timer_key);
BEGIN
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = v_problem;
    END IF;
    RETURN QUERY
    SELECT t.tenant, t.queue, t.timer_key COLLATE "default", t.partition, t.deliver_at, t.txn, t.message_id,
           coalesce(t.zstd_payload, t.payload), t.payload_zstd OR t.zstd_payload IS NOT NULL, t.encrypted,
           t.producer_sub, t.attempts, t.last_error,
           queen.timer_is_claimed(t.lease_until, coalesce(p_now, now())), t.created_at, t.updated_at
      FROM queen.timers t
     WHERE t.tenant = p_tenant AND t.queue = p_queue AND t.timer_key = p_timer_key;
END
$$;

CREATE OR REPLACE FUNCTION queen.list_timers(
    p_tenant text,
    p_queue  text,
    p_after  text    DEFAULT NULL,
    p_limit  integer DEFAULT 100,
    p_now    timestamptz DEFAULT NULL)
RETURNS TABLE (
    timer_key    text,
    partition    text,
    deliver_at   timestamptz,
    txn          text,
    message_id   uuid,
    payload_zstd boolean,
    encrypted    boolean,
    producer_sub text,
    attempts     integer,
    last_error   text,
    claimed      boolean,
    created_at   timestamptz,
    updated_at   timestamptz,
    truncated    boolean,
    next_after   text)
LANGUAGE plpgsql STABLE AS $$
#variable_conflict use_column
DECLARE
    v_problem text := coalesce(
        queen.timer_name_problem(p_queue),
        CASE WHEN octet_length(p_after) > 1024
             THEN format('after is %s bytes; at most 1024, a timerKey (UTF-8)', octet_length(p_after)) END);
BEGIN
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = v_problem;
    END IF;
    RETURN QUERY
    WITH lim AS (
        SELECT least(greatest(coalesce(p_limit, 100), 1), 1000) AS n
    ), page AS (
        SELECT t.*, row_number() OVER (ORDER BY t.timer_key COLLATE "C") AS rn
          FROM queen.timers t
         WHERE t.tenant = p_tenant AND t.queue = p_queue
           AND (p_after IS NULL OR t.timer_key > p_after COLLATE "C")
         ORDER BY t.timer_key COLLATE "C"
         LIMIT (SELECT n + 1 FROM lim)
    ), flags AS (
        SELECT count(*) > (SELECT n FROM lim) AS truncated,
               max(timer_key) FILTER (WHERE rn = (SELECT n FROM lim)) AS last_key
          FROM page
    )
    SELECT p.timer_key COLLATE "default", p.partition, p.deliver_at, p.txn, p.message_id,
           p.payload_zstd OR p.zstd_payload IS NOT NULL, p.encrypted,
           p.producer_sub, p.attempts, p.last_error,
           queen.timer_is_claimed(p.lease_until, coalesce(p_now, now())), p.created_at, p.updated_at,
           f.truncated, CASE WHEN f.truncated THEN f.last_key END COLLATE "default"
      FROM page p, flags f
     WHERE p.rn <= (SELECT n FROM lim)
     ORDER BY p.timer_key COLLATE "C";
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
    v_now timestamptz := coalesce(p_now, now());
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
