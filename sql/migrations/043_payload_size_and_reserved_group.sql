-- Migration 043: what a review of the log and timer routes found (Dec 8).
-- - The payload ceiling of a timer into a queue that encrypts at rest is on the
--   client's decoded (and decompressed) bytes, as the contract says, not on
--   the envelope stored (4/3 of them plus 77 bytes): a payload of 768 KiB to
--   1 MiB was refused 413. queen.timer_payload_size(op) is the size the
--   ceiling is on: for an op the broker encrypted (encrypted with a raw_size,
--   not zstd), raw_size, or what the envelope's length says the bytes were
--   at least; check_timer_gates' QTBIG rung and schedule_timers' staged path
--   use it.
-- - pop_messages and ack_messages refuse the consumer group
--   '__QUEEN_TIMERS__' (QTBAD): timers' dead letters are filed under it, and
--   replay_dlq_entry refuses those; a consumer's dead letter acked in that
--   group could not be replayed.

CREATE FUNCTION queen.timer_payload_size(o queen.timer_op)
RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN o.encrypted AND o.raw_size IS NOT NULL AND NOT coalesce(o.payload_zstd, false)
                THEN greatest(o.raw_size, (octet_length(o.payload) - 77) / 4 * 3 - 2)
                ELSE greatest(octet_length(o.payload), coalesce(o.raw_size, 0)) END
$$;

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

CREATE OR REPLACE FUNCTION queen.pop_messages(
    p_tenant         text,
    p_queue          text,
    p_partition      text        DEFAULT NULL,
    p_consumer_group text        DEFAULT '__QUEUE_MODE__',
    p_batch          integer     DEFAULT 1,
    p_auto_ack       boolean     DEFAULT false,
    p_now            timestamptz DEFAULT NULL,
    p_max_bytes      bigint      DEFAULT NULL)
RETURNS SETOF queen.popped_message
LANGUAGE plpgsql SET enable_seqscan = off SET enable_bitmapscan = off SET enable_sort = off SET jit = off AS $$
DECLARE
    v_now     timestamptz := queen.finite_now(p_now);
    v_group   text := coalesce(nullif(p_consumer_group, ''), '__QUEUE_MODE__');
    v_batch   integer := least(greatest(coalesce(p_batch, 1), 1), 10000);
    v_lease   uuid := gen_random_uuid();
    v_expires timestamptz;
    q         queen.queues;
    c         record;
    pc        queen.partition_consumers;
    v_horizon xid8;
    v_lxid    xid8;
    v_lseq    bigint;
    v_n       integer;
BEGIN
    IF NOT (queen.log_name_fits(p_queue) AND queen.log_name_fits(p_partition)) THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = 'queue and partition names are at most 255 bytes';
    END IF;
    -- a longer group is a key no index holds (54000); a bound below 1 handed out nothing,
    -- not the first message it promises (migration 042)
    IF NOT queen.log_name_fits(p_consumer_group) THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('consumerGroup is %s bytes; at most 255', octet_length(p_consumer_group));
    END IF;
    -- the group timers' dead letters are filed under: no consumer reads or acks in it,
    -- so replay_dlq_entry can tell a timer's dead letter by it (migration 043)
    IF p_consumer_group = '__QUEEN_TIMERS__' THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = 'consumerGroup __QUEEN_TIMERS__ is reserved: the group of timers'' dead letters';
    END IF;
    IF p_max_bytes IS NOT NULL AND p_max_bytes < 1 THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('max_bytes must be at least 1, got %s', p_max_bytes);
    END IF;
    SELECT * INTO q FROM queen.queues WHERE tenant = p_tenant AND name = p_queue;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_expires := v_now + make_interval(secs => CASE WHEN q.lease_time > 0 THEN q.lease_time ELSE 60 END);
    -- before any statement that reads the log (they see every transaction below it ended)
    v_horizon := queen.log_read_horizon();

    FOR c IN
        SELECT p.id, p.name, x.partition_id IS NULL AS no_row
          FROM queen.partitions p
          LEFT JOIN queen.partition_consumers x ON x.partition_id = p.id AND x.consumer_group = v_group
         WHERE p.queue_id = q.id
           AND (p_partition IS NULL OR p.name = p_partition)
           AND (x.lease_expires_at IS NULL OR x.lease_expires_at <= v_now)
           AND (SELECT true FROM queen.messages m
                 WHERE m.partition_id = p.id AND m.xid < v_horizon
                   AND (m.xid, m.seq) > (coalesce(x.last_consumed_xid, '0'), coalesce(x.last_consumed_seq, 0))
                 LIMIT 1)
         ORDER BY x.updated_at NULLS FIRST, p.created_at, p.id
    LOOP
        IF c.no_row THEN
            INSERT INTO queen.partition_consumers (partition_id, consumer_group) VALUES (c.id, v_group)
            ON CONFLICT (partition_id, consumer_group) DO NOTHING;
        END IF;
        SELECT * INTO pc FROM queen.partition_consumers
         WHERE partition_id = c.id AND consumer_group = v_group
           FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;
        CONTINUE WHEN pc.lease_expires_at IS NOT NULL AND pc.lease_expires_at > v_now;

        -- octet_length of a TOASTed payload reads its header, not its bytes
        SELECT s.xid, s.seq, s.n INTO v_lxid, v_lseq, v_n
          FROM (SELECT m.xid, m.seq, row_number() OVER w AS n,
                       sum(octet_length(m.payload)) OVER w - octet_length(m.payload) AS bytes_before
                  FROM queen.messages m
                 WHERE m.partition_id = c.id AND m.xid < v_horizon
                   AND (m.xid, m.seq) > (pc.last_consumed_xid, pc.last_consumed_seq)
                WINDOW w AS (ORDER BY m.xid, m.seq)
                 ORDER BY m.xid, m.seq LIMIT v_batch) s
         WHERE p_max_bytes IS NULL OR s.bytes_before < p_max_bytes
         ORDER BY s.n DESC LIMIT 1;
        CONTINUE WHEN NOT FOUND;

        IF p_auto_ack THEN
            UPDATE queen.partition_consumers
               SET last_consumed_xid = v_lxid, last_consumed_seq = v_lseq, lease_id = NULL,
                   lease_expires_at = NULL, batch_size = 0, acked_count = 0, batch_retry_count = 0,
                   batch_last_xid = NULL, batch_last_seq = NULL, updated_at = v_now
             WHERE partition_id = c.id AND consumer_group = v_group;
        ELSE
            UPDATE queen.partition_consumers
               SET lease_id = v_lease, lease_expires_at = v_expires, batch_size = v_n,
                   acked_count = 0, batch_last_xid = v_lxid, batch_last_seq = v_lseq, updated_at = v_now
             WHERE partition_id = c.id AND consumer_group = v_group;
        END IF;

        -- LIMIT v_n: a btree scan ends at the row bound below only past v_lxid
        -- (it stops on a row comparison's first column alone), so without it
        -- every later frame of v_lxid's transaction was read.
        RETURN QUERY
        SELECT m.id, m.seq, m.transaction_id, m.trace_id, m.payload, m.is_encrypted, m.producer_sub,
               m.created_at, q.name, c.id, c.name,
               CASE WHEN p_auto_ack THEN NULL ELSE v_lease END, v_group,
               CASE WHEN p_auto_ack THEN NULL ELSE v_expires END
          FROM queen.messages m
         WHERE m.partition_id = c.id
           AND (m.xid, m.seq) > (pc.last_consumed_xid, pc.last_consumed_seq)
           AND (m.xid, m.seq) <= (v_lxid, v_lseq)
         ORDER BY m.xid, m.seq
         LIMIT v_n;
        RETURN;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION queen.ack_messages(
    p_tenant text,
    p_acks   queen.ack_item[],
    p_now    timestamptz DEFAULT NULL)
RETURNS SETOF queen.ack_result
LANGUAGE plpgsql SET enable_seqscan = off SET enable_bitmapscan = off AS $$
DECLARE
    v_now    timestamptz := queen.finite_now(p_now);
    a        record;
    pc       queen.partition_consumers;
    r        queen.ack_result;
    v_out    queen.ack_result[] := '{}';
    v_msg    text;
    v_status text;
    v_limit  integer;
    v_acked  integer;
    v_done   boolean;
    v_released text[] := '{}';  -- partition/group/lease released by a failed or retry item of this call
    v_horizon  xid8;  -- the read horizon, taken once: no pop before this call read at or past it
BEGIN
    IF p_acks IS NULL OR cardinality(p_acks) = 0 THEN
        RETURN;
    END IF;
    SELECT CASE
             WHEN x.transaction_id IS NULL OR x.transaction_id = '' THEN format('acknowledgments[%s]: transactionId is required', x.n - 1)
             WHEN x.partition_id IS NULL THEN format('acknowledgments[%s]: partitionId is required', x.n - 1)
             WHEN NOT queen.log_name_fits(x.transaction_id)
               THEN format('acknowledgments[%s]: transactionId is %s bytes; at most 255', x.n - 1,
                           octet_length(x.transaction_id))
             WHEN NOT queen.log_name_fits(x.consumer_group)  -- a key no index holds (migration 042)
               THEN format('acknowledgments[%s]: consumerGroup is %s bytes; at most 255', x.n - 1,
                           octet_length(x.consumer_group))
             WHEN x.consumer_group = '__QUEEN_TIMERS__'  -- timers' dead letters' group (migration 043)
               THEN format('acknowledgments[%s]: consumerGroup __QUEEN_TIMERS__ is reserved: the group of timers'' dead letters', x.n - 1)
             ELSE format('acknowledgments[%s]: unknown status %L', x.n - 1, x.status)
           END INTO v_msg
      FROM unnest(p_acks) WITH ORDINALITY AS x(transaction_id, partition_id, status, error, lease_id, consumer_group, n)
     WHERE x.transaction_id IS NULL OR x.transaction_id = '' OR x.partition_id IS NULL
        OR NOT queen.log_name_fits(x.transaction_id) OR NOT queen.log_name_fits(x.consumer_group)
        OR x.consumer_group = '__QUEEN_TIMERS__'
        OR (x.status IS NOT NULL AND x.status NOT IN ('completed', 'success', 'failed', 'dlq', 'retry'))
     ORDER BY x.n LIMIT 1;
    IF v_msg IS NOT NULL THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = v_msg;
    END IF;

    FOR a IN
        SELECT x.transaction_id, x.partition_id, left(x.error, 8192) AS error,
               nullif(x.lease_id, '') AS lease_id,
               CASE coalesce(x.status, 'completed') WHEN 'success' THEN 'completed'
                    ELSE coalesce(x.status, 'completed') END AS status,
               coalesce(nullif(x.consumer_group, ''), '__QUEUE_MODE__') AS grp,
               (x.n - 1)::integer AS idx,
               m.id AS message_id, m.xid, m.seq, m.payload, m.is_encrypted, m.producer_sub, m.created_at,
               m.partition_name, m.queue_name, m.retry_limit
          FROM unnest(p_acks) WITH ORDINALITY AS x(transaction_id, partition_id, status, error, lease_id, consumer_group, n)
          LEFT JOIN LATERAL (
                 SELECT m.id, m.xid, m.seq, m.payload, m.is_encrypted, m.producer_sub, m.created_at,
                        p.name AS partition_name, q.name AS queue_name, q.retry_limit
                   FROM queen.messages m
                   JOIN queen.partitions p ON p.id = m.partition_id
                   JOIN queen.queues q ON q.id = p.queue_id AND q.tenant = p_tenant
                  WHERE m.partition_id = x.partition_id AND m.transaction_id = x.transaction_id
                  LIMIT 1) m ON true
         ORDER BY x.partition_id, 6, m.xid NULLS LAST, m.seq NULLS LAST, x.n
    LOOP
        r := ROW(a.idx, a.transaction_id, false, NULL, a.queue_name, a.partition_name, false, false);
        IF a.message_id IS NULL THEN
            r.error := 'Message not found';
            v_out := v_out || r;
            CONTINUE;
        END IF;

        INSERT INTO queen.partition_consumers (partition_id, consumer_group) VALUES (a.partition_id, a.grp)
        ON CONFLICT (partition_id, consumer_group) DO NOTHING;
        SELECT * INTO pc FROM queen.partition_consumers
         WHERE partition_id = a.partition_id AND consumer_group = a.grp
           FOR UPDATE;

        IF a.lease_id IS NOT NULL
           AND NOT coalesce(pc.lease_id::text = lower(a.lease_id) AND pc.lease_expires_at > v_now, false) THEN
            IF a.status IN ('failed', 'retry')
               AND concat_ws('/', a.partition_id, a.grp, lower(a.lease_id)) = ANY (v_released) THEN
                -- an earlier item of this call released that lease: the batch comes back
                -- whole, this item with it (a client's nack of a batch as a list)
                r.success := true;
                v_out := v_out || r;
                CONTINUE;
            END IF;
            r.error := 'Invalid or expired lease';
            v_out := v_out || r;
            CONTINUE;
        END IF;
        r.success := true;
        v_status := a.status;
        IF v_horizon IS NULL AND v_status <> 'retry' THEN
            v_horizon := queen.log_read_horizon();
        END IF;

        IF v_status = 'retry' THEN
            r.lease_released := pc.lease_id IS NOT NULL;
            v_released := v_released || concat_ws('/', a.partition_id, a.grp, pc.lease_id);
            UPDATE queen.partition_consumers
               SET lease_id = NULL, lease_expires_at = NULL, batch_size = 0, acked_count = 0,
                   batch_last_xid = NULL, batch_last_seq = NULL, updated_at = v_now
             WHERE partition_id = a.partition_id AND consumer_group = a.grp;
        ELSIF (a.xid, a.seq) <= (pc.last_consumed_xid, pc.last_consumed_seq) THEN
            NULL;  -- already consumed
        ELSIF v_status = 'failed' AND pc.batch_retry_count < a.retry_limit THEN
            -- one retry per delivered batch: a second failed ack of the same batch finds no lease
            IF pc.lease_id IS NOT NULL THEN
                r.lease_released := true;
                v_released := v_released || concat_ws('/', a.partition_id, a.grp, pc.lease_id);
                UPDATE queen.partition_consumers
                   SET lease_id = NULL, lease_expires_at = NULL, batch_size = 0, acked_count = 0,
                       batch_last_xid = NULL, batch_last_seq = NULL, batch_retry_count = batch_retry_count + 1,
                       updated_at = v_now
                 WHERE partition_id = a.partition_id AND consumer_group = a.grp;
            END IF;
        ELSIF a.xid >= v_horizon THEN
            -- no pop handed it out yet: a transaction older than it still runs, and moving
            -- the cursor here would skip that transaction's frames when it commits
            r.success := false;
            r.error := 'Message not yet readable';
        ELSE
            -- completed; or failed past the retry limit, or dlq: dead-letter, then move past it
            IF v_status IN ('failed', 'dlq') THEN
                INSERT INTO queen.dead_letter_queue
                       (message_id, partition_id, consumer_group, transaction_id, payload, is_encrypted,
                        producer_sub, error_message, retry_count, original_created_at, failed_at)
                VALUES (a.message_id, a.partition_id, a.grp, a.transaction_id, a.payload, a.is_encrypted,
                        a.producer_sub, coalesce(nullif(a.error, ''), 'Retries exhausted'),
                        pc.batch_retry_count, a.created_at, v_now);
                r.dlq := true;
            END IF;
            v_acked := pc.acked_count + 1;
            v_done := pc.lease_id IS NULL OR pc.batch_last_seq IS NULL
                      OR (a.xid, a.seq) >= (pc.batch_last_xid, pc.batch_last_seq) OR v_acked >= pc.batch_size;
            r.lease_released := v_done AND pc.lease_id IS NOT NULL;
            UPDATE queen.partition_consumers
               SET last_consumed_xid = a.xid, last_consumed_seq = a.seq,
                   acked_count = CASE WHEN v_done THEN 0 ELSE v_acked END,
                   lease_id = CASE WHEN v_done THEN NULL ELSE lease_id END,
                   lease_expires_at = CASE WHEN v_done THEN NULL ELSE lease_expires_at END,
                   batch_size = CASE WHEN v_done THEN 0 ELSE batch_size END,
                   batch_last_xid = CASE WHEN v_done THEN NULL ELSE batch_last_xid END,
                   batch_last_seq = CASE WHEN v_done THEN NULL ELSE batch_last_seq END,
                   batch_retry_count = CASE WHEN v_done THEN 0 ELSE batch_retry_count END,
                   updated_at = v_now
             WHERE partition_id = a.partition_id AND consumer_group = a.grp;
        END IF;
        v_out := v_out || r;
    END LOOP;

    RETURN QUERY SELECT * FROM unnest(v_out) o ORDER BY o.idx;
END
$$;
