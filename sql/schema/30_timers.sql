-- =====================================================================
-- Part 30: timers: schedule / reschedule / cancel, peek and list
--
-- State of a row (there is no status column; it is derived):
--   pending    deliver_at in the future, or due and not claimed
--   claimed    lease_until > now(): a broker holds it and is about to
--              fire; cancel and reschedule answer too_late
--   backoff    a failed fire moved deliver_at forward and dropped the
--              claim: claimed = false, cancellable
--   (gone)     fired or dead-lettered: the row is deleted, no tombstone
-- =====================================================================

-- ---------------------------------------------------------------------
-- Tables
-- ---------------------------------------------------------------------

CREATE TABLE queen.timers (
    tenant           text NOT NULL,
    queue            text NOT NULL,
    timer_key        text COLLATE "C" NOT NULL,  -- byte order: a keyset cursor is stable across machines
    partition        text NOT NULL DEFAULT 'Default',
    deliver_at       timestamptz NOT NULL,
    txn              text NOT NULL,
    message_id       uuid NOT NULL,
    payload          bytea NOT NULL,             -- as sent (or the encryption envelope)
    payload_zstd     boolean NOT NULL DEFAULT false,
    encrypted        boolean NOT NULL DEFAULT false,
    producer_sub     text,
    attempts         integer NOT NULL DEFAULT 0, -- budget spent: permanent and config failures only
    failures         integer NOT NULL DEFAULT 0, -- every failure; drives the backoff exponent
    last_error       text,
    last_error_class text,
    claim_id         uuid,
    claimed_by       text,
    lease_until      timestamptz,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    -- a zstd payload as scheduled, once the leased path has inflated the row in place
    -- (queen.inflate_timers: payload then holds the bytes to fire, payload_zstd is
    -- false); peek and list show this one. NULL otherwise.
    zstd_payload     bytea,
    PRIMARY KEY (tenant, queue, timer_key),
    CONSTRAINT timer_key_not_empty CHECK (timer_key <> ''),
    CONSTRAINT queue_not_empty CHECK (queue <> ''),
    CONSTRAINT txn_not_empty CHECK (txn <> ''),
    CONSTRAINT claim_has_lease CHECK ((claim_id IS NULL) = (lease_until IS NULL))
);
-- The sweeper's scan: due rows in expiry order.
CREATE INDEX timers_deliver_at_idx ON queen.timers (deliver_at);
-- The leased path's scan (claim_timers p_zstd_only): a backlog of plain
-- due rows must not be walked to find the few zstd ones.
CREATE INDEX timers_zstd_deliver_at_idx ON queen.timers (deliver_at) WHERE payload_zstd;
-- The fast path's fair share (queen.fire_due_batch): each tenant's due rows
-- in expiry order, found without walking another tenant's backlog.
CREATE INDEX timers_tenant_deliver_at_idx ON queen.timers (tenant, deliver_at) WHERE NOT payload_zstd;
-- The same for the leased path's shares (queen.claim_timers).
CREATE INDEX timers_tenant_zstd_deliver_at_idx ON queen.timers (tenant, deliver_at) WHERE payload_zstd;
-- A plain due row waits for the zstd rows of its partition that matured
-- before it (queen.fire_due_rows): one descent per candidate, zstd rows only.
CREATE INDEX timers_zstd_partition_idx ON queen.timers (tenant, queue, partition, deliver_at) WHERE payload_zstd;

-- The payloads of a large batch, streamed in by COPY in the transaction
-- that then calls schedule_timers(p_staged => batch): the batch's ops then
-- carry no bytes, so the checks and the gate ladder pass a small array
-- around instead of copying hundreds of MB per pass (a 256 x 1 MiB batch
-- took 16-19 s inline, most of it in those copies). schedule_timers
-- deletes its batch's rows before it returns; a failed transaction leaves
-- none. UNLOGGED: the rows never outlive their transaction, so they need
-- no WAL (and are empty on a standby and after a crash, which is right).
CREATE UNLOGGED TABLE queen.staged_payloads (
    batch    uuid NOT NULL,
    n        integer NOT NULL,  -- the op's ordinal in the batch, from 1
    payload  bytea NOT NULL,
    PRIMARY KEY (batch, n)
);

-- ---------------------------------------------------------------------
-- Types
-- ---------------------------------------------------------------------

-- One operation of a POST /api/v1/timers batch.
CREATE TYPE queen.timer_op AS (
    op            text,     -- schedule | reschedule | cancel
    queue         text,
    timer_key     text,
    delay_ms      bigint,   -- from PostgreSQL's now(); negative is legal (due at once)
    txn           text,     -- required for schedule; minted when a reschedule omits it
    payload       bytea,
    partition     text,     -- NULL: 'Default'
    payload_zstd  boolean,
    encrypted     boolean,
    raw_size      integer   -- decompressed size when payload_zstd (checked against the ceiling);
                            -- for a payload the broker encrypted (encrypted, not payload_zstd), the
                            -- client's decoded (and decompressed) size, which the ceiling is on
);

-- One verdict per operation, in input order.
CREATE TYPE queen.timer_verdict AS (
    ordinal     integer,
    op          text,
    ok          boolean,
    status      text,       -- scheduled | rescheduled | cancelled | absent | too_late
    queue       text,
    timer_key   text,
    txn         text,
    message_id  uuid,
    deliver_at  timestamptz
);

-- What peek shows of a timer (payload as stored, never decrypted).
CREATE TYPE queen.timer_view AS (
    tenant        text,
    queue         text,
    timer_key     text,
    partition     text,
    deliver_at    timestamptz,
    txn           text,
    message_id    uuid,
    payload       bytea,
    payload_zstd  boolean,
    encrypted     boolean,
    producer_sub  text,
    attempts      integer,
    last_error    text,
    claimed       boolean,
    created_at    timestamptz,
    updated_at    timestamptz
);

-- ---------------------------------------------------------------------
-- Functions
-- ---------------------------------------------------------------------

-- One queen.timer_op with named arguments, so a batch is writable by
-- hand in psql: queen.make_timer_op('cancel', 'reminders', 'k').
CREATE FUNCTION queen.make_timer_op(
    p_op           text,
    p_queue        text,
    p_timer_key    text,
    p_delay_ms     bigint  DEFAULT NULL,
    p_txn          text    DEFAULT NULL,
    p_payload      bytea   DEFAULT NULL,
    p_partition    text    DEFAULT NULL,
    p_payload_zstd boolean DEFAULT NULL,
    p_encrypted    boolean DEFAULT NULL,
    p_raw_size     integer DEFAULT NULL)
RETURNS queen.timer_op
LANGUAGE sql IMMUTABLE AS $$
    SELECT ROW(p_op, p_queue, p_timer_key, p_delay_ms, p_txn, p_payload, p_partition,
               p_payload_zstd, p_encrypted, p_raw_size)::queen.timer_op
$$;

-- The single definition of "in somebody's hands".
-- STABLE, not IMMUTABLE: with p_now NULL it reads now(), which must
-- never be folded into a cached plan.
CREATE FUNCTION queen.timer_is_claimed(p_lease_until timestamptz, p_now timestamptz DEFAULT NULL)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT p_lease_until IS NOT NULL AND p_lease_until > coalesce(p_now, now())
$$;

-- The documented limits on names, in UTF-8 bytes: queue 255, timerKey
-- 1024, txn 255, partition 255 (README "Limits"; the HTTP shell checks
-- the same numbers first). NULL when every given name is within its
-- limit, else the reason. A timerKey of megabytes would otherwise fail
-- as "index row too large", a capacity error that says "retry".
-- delete_unclaimed_timer repeats the queue/timerKey numbers inline.
-- STABLE, not IMMUTABLE, as format() is: only then is the body inlined
-- into the query that calls it (check_timer_ops' scan of a batch), where
-- a SQL function that is not inlined is run by its own executor for
-- every row (about 5 us each: 1.3 ms of a 256-op batch).
CREATE FUNCTION queen.timer_name_problem(
    p_queue     text,
    p_timer_key text DEFAULT NULL,
    p_txn       text DEFAULT NULL,
    p_partition text DEFAULT NULL)
RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE
             WHEN octet_length(p_queue) > 255
               THEN format('queue is %s bytes; at most 255 (UTF-8)', octet_length(p_queue))
             WHEN octet_length(p_timer_key) > 1024
               THEN format('timerKey is %s bytes; at most 1024 (UTF-8)', octet_length(p_timer_key))
             WHEN octet_length(p_txn) > 255
               THEN format('txn is %s bytes; at most 255 (UTF-8)', octet_length(p_txn))
             WHEN octet_length(p_partition) > 255
               THEN format('partition is %s bytes; at most 255 (UTF-8)', octet_length(p_partition))
           END
$$;

-- Internal: delete one timer unless a broker holds it, without touching
-- the tenant's counters (schedule_timers meters a whole batch at once,
-- after its row locks, so two batches cannot deadlock on the counter row).
-- Takes the row lock first, so a cancel racing a claim waits for the
-- claim and then answers too_late, and a claim (SKIP LOCKED) passes over
-- a row being cancelled. Returns cancelled | absent | too_late.
CREATE FUNCTION queen.delete_unclaimed_timer(
    p_tenant    text,
    p_queue     text,
    p_timer_key text,
    p_now       timestamptz DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_now   timestamptz := coalesce(p_now, now());
    v_lease timestamptz;
BEGIN
    IF p_queue IS NULL OR p_queue = '' OR p_timer_key IS NULL OR p_timer_key = '' THEN
        RAISE EXCEPTION 'timers_bad_request'
            USING ERRCODE = 'QTBAD', DETAIL = 'queue and timerKey are required';
    END IF;
    IF octet_length(p_queue) > 255 OR octet_length(p_timer_key) > 1024 THEN
        RAISE EXCEPTION 'timers_bad_request'
            USING ERRCODE = 'QTBAD', DETAIL = queen.timer_name_problem(p_queue, p_timer_key);
    END IF;
    SELECT lease_until INTO v_lease
      FROM queen.timers
     WHERE tenant = p_tenant AND queue = p_queue AND timer_key = p_timer_key
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 'absent';
    END IF;
    IF queen.timer_is_claimed(v_lease, v_now) THEN
        RETURN 'too_late';
    END IF;
    DELETE FROM queen.timers
     WHERE tenant = p_tenant AND queue = p_queue AND timer_key = p_timer_key;
    RETURN 'cancelled';
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
CREATE FUNCTION queen.cancel_timer(
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
-- The size the payload ceiling is on: the decoded bytes and, for zstd, the
-- decompressed ones (raw_size); for a payload the broker encrypted (encrypted
-- and raw_size, not zstd), the client's bytes: raw_size, or what the stored
-- envelope's length says they were at least (Queen's envelope is base64 of
-- them plus 77 bytes), whichever is larger.
CREATE FUNCTION queen.timer_payload_size(o queen.timer_op)
RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN o.encrypted AND o.raw_size IS NOT NULL AND NOT coalesce(o.payload_zstd, false)
                THEN greatest(o.raw_size, (octet_length(o.payload) - 77) / 4 * 3 - 2)
                ELSE greatest(octet_length(o.payload), coalesce(o.raw_size, 0)) END
$$;

CREATE FUNCTION queen.check_timer_gates(
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
    -- 7. payload ceiling, on the decoded and on the decompressed bytes. A payload the
    -- broker encrypted for its queue (encrypted with a raw_size, not zstd) is judged on
    -- the client's bytes, raw_size, not on the envelope stored (4/3 of them plus 77
    -- bytes: a 768 KiB payload was refused, Dec 8 review); the envelope's own length
    -- bounds it too, so a raw_size given from psql cannot let a larger one in.
    SELECT * INTO v_bad FROM unnest(p_ops) o
     WHERE o.op IN ('schedule', 'reschedule')
       AND queen.timer_payload_size(o) > l.max_payload_bytes LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'payload_too_large'
            USING ERRCODE = 'QTBIG',
                  DETAIL = format('payload of %s/%s is %s bytes; the ceiling is %s',
                                  v_bad.queue, v_bad.timer_key, queen.timer_payload_size(v_bad),
                                  l.max_payload_bytes);
    END IF;
    RETURN l;
END
$$;

-- Shape checks shared by every caller (HTTP validates first; this is
-- for psql users, so a DBA's batch gets the same 400 the wire gets).
CREATE FUNCTION queen.check_timer_ops(p_ops queen.timer_op[], p_max_ops integer DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_max integer := coalesce(p_max_ops, (queen.get_cell_settings()).max_ops);
    v_msg text;
BEGIN
    IF cardinality(p_ops) > v_max THEN
        RAISE EXCEPTION 'timers_bad_request'
            USING ERRCODE = 'QTBAD', DETAIL = format('%s operations; at most %s per call', cardinality(p_ops), v_max);
    END IF;
    SELECT CASE
             WHEN o.op IS NULL OR o.op NOT IN ('schedule', 'reschedule', 'cancel')
               THEN format('operation %s: unknown op %L', n, o.op)
             WHEN o.queue IS NULL OR o.queue = ''
               THEN format('operation %s: queue is required', n)
             WHEN o.timer_key IS NULL OR o.timer_key = ''
               THEN format('operation %s: timerKey is required', n)
             WHEN o.op <> 'cancel' AND o.delay_ms IS NULL
               THEN format('operation %s: delayMs is required', n)
             WHEN o.op = 'schedule' AND (o.txn IS NULL OR o.txn = '')
               THEN format('operation %s: txn is required', n)
             WHEN o.op <> 'cancel' AND o.payload IS NULL
               THEN format('operation %s: payload is required', n)
             WHEN o.partition = ''
               THEN format('operation %s: partition may not be empty', n)
             WHEN queen.timer_name_problem(o.queue, o.timer_key, o.txn, o.partition) IS NOT NULL
               THEN format('operation %s: %s', n,
                           queen.timer_name_problem(o.queue, o.timer_key, o.txn, o.partition))
           END
      INTO v_msg
      FROM unnest(p_ops) WITH ORDINALITY AS o(op, queue, timer_key, delay_ms, txn, payload,
                                              partition, payload_zstd, encrypted, raw_size, n)
     WHERE o.op IS NULL OR o.op NOT IN ('schedule', 'reschedule', 'cancel')
        OR o.queue IS NULL OR o.queue = '' OR o.timer_key IS NULL OR o.timer_key = ''
        OR (o.op <> 'cancel' AND (o.delay_ms IS NULL OR o.payload IS NULL))
        OR (o.op = 'schedule' AND (o.txn IS NULL OR o.txn = ''))
        OR o.partition = ''
        OR queen.timer_name_problem(o.queue, o.timer_key, o.txn, o.partition) IS NOT NULL
     ORDER BY n LIMIT 1;
    IF v_msg IS NOT NULL THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = v_msg;
    END IF;
    SELECT format('(%s, %s) appears more than once in the batch', queue, timer_key) INTO v_msg
      FROM unnest(p_ops) GROUP BY queue, timer_key HAVING count(*) > 1 LIMIT 1;
    IF v_msg IS NOT NULL THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = v_msg;
    END IF;
END
$$;

-- Whether the first or the last key of p_ops, in key order, is a timer of
-- p_tenant: two descents of the primary key. queen.schedule_timers asks it
-- before it tries a batch of schedule ops as a plain INSERT, so that a
-- batch sent again (every key there) goes straight to the upsert.
-- enable_seqscan off: PL/pgSQL keeps the plan for the session, and a table
-- planned while empty (a fresh install, after a TRUNCATE) would be scanned
-- whole at every call until autovacuum analyzes it.
CREATE FUNCTION queen.timer_key_ends_exist(p_tenant text, p_ops queen.timer_op[])
RETURNS boolean
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $$
BEGIN
    RETURN EXISTS (SELECT 1
                     FROM ((SELECT x.queue, x.timer_key FROM unnest(p_ops) x
                             ORDER BY x.queue, x.timer_key COLLATE "C" LIMIT 1)
                           UNION ALL
                           (SELECT x.queue, x.timer_key FROM unnest(p_ops) x
                             ORDER BY x.queue DESC, x.timer_key COLLATE "C" DESC LIMIT 1)) x
                    CROSS JOIN LATERAL (
                           SELECT 1 FROM queen.timers t
                            WHERE t.tenant = p_tenant AND t.queue = x.queue
                              AND t.timer_key = x.timer_key COLLATE "C"
                            LIMIT 1) e);
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
-- A batch of new schedules (the common case) is first tried as a plain
-- INSERT (below; queen.timer_key_ends_exist). Any other batch without
-- cancels, and that one when a key exists, is ONE statement: a single
-- INSERT ... SELECT ... ORDER BY queue, timer_key ON CONFLICT DO UPDATE
-- of every op (rows still taken in key order), whose RETURNING is joined
-- back to the ops for the verdicts. Its plan is cached like the others
-- (no plan_cache_mode trap here, see 40_fire.sql): the generic plan
-- guesses unnest() at 10 rows, but the verdict join is between two CTEs
-- and no table, so no statistic can move it off its hash join (the
-- bench's schedule profile prints the join it got). A batch with cancels
-- goes op by op in key order (a cancel and an upsert in separate
-- statements could take two batches' rows in opposite orders).
-- p_staged names a batch in queen.staged_payloads: an op whose ordinal
-- has a staged row takes that row's bytes as its payload (its own
-- payload is ignored), and the gate ladder sees their size. The staged
-- rows are deleted before the function returns.
CREATE FUNCTION queen.schedule_timers(
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
                       -- the size the ceiling is on, as the op with its staged bytes has it
                       CASE WHEN s.n IS NULL THEN x.raw_size
                            ELSE queen.timer_payload_size(ROW(x.op, x.queue, x.timer_key, x.delay_ms, x.txn,
                                                              s.payload, x.partition, x.payload_zstd,
                                                              x.encrypted, x.raw_size)::queen.timer_op)::integer
                       END)::queen.timer_op
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

-- One timer as peek shows it; no row when there is none (for this tenant).
-- A queue or timerKey over its limit is QTBAD, not a miss.
-- Key columns are handed out with the declared (default) collation, so
-- that the column's "C" collation never leaks into a caller's query.
CREATE FUNCTION queen.peek_timer(
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

-- A keyset page of one queue's pending timers, without payloads.
-- p_after is exclusive; p_limit is clamped to 1..1000 (default 100).
-- A queue, or a p_after (a timerKey), over its limit is QTBAD.
-- truncated and next_after repeat on every row of the page (an empty
-- page is never truncated).
CREATE FUNCTION queen.list_timers(
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
