-- Migration 008: the log order inside a partition is (xid, seq), the
-- appending transaction's xid8 then the append order (issue 9: the
-- partition lock serialised every broker firing into one partition).
-- Writers no longer lock the partition (queen.lock_partition is replaced
-- by queen.ensure_partition, a lock-free lookup / creation); consumers
-- read only below queen.log_read_horizon() (the snapshot's xmin), so a
-- cursor still never skips a frame that commits late. Every existing
-- frame gets xid 0 (all committed before anything new), every cursor and
-- batch end (0, its seq): the same positions in the new order.
-- Function texts equal sql/schema/.

ALTER TABLE queen.messages ADD COLUMN xid xid8 NOT NULL DEFAULT '0';
ALTER TABLE queen.messages ALTER COLUMN xid SET DEFAULT pg_current_xact_id();
CREATE INDEX messages_partition_xid_seq_idx ON queen.messages (partition_id, xid, seq);
DROP INDEX queen.messages_partition_seq_idx;

ALTER TABLE queen.partition_consumers ADD COLUMN last_consumed_xid xid8 NOT NULL DEFAULT '0';
ALTER TABLE queen.partition_consumers ADD COLUMN batch_last_xid xid8;
UPDATE queen.partition_consumers SET batch_last_xid = '0' WHERE batch_last_seq IS NOT NULL;

DROP FUNCTION queen.lock_partition(text, text, text);

-- The partition's id (of the tenant's queue), created on first use. No
-- lock is taken: appends need none (see queen.messages).
CREATE OR REPLACE FUNCTION queen.ensure_partition(p_tenant text, p_queue text, p_partition text DEFAULT 'Default')
RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_queue_id uuid := queen.ensure_queue(p_tenant, p_queue);
    v_id uuid;
BEGIN
    SELECT id INTO v_id FROM queen.partitions
     WHERE queue_id = v_queue_id AND name = coalesce(p_partition, 'Default');
    IF FOUND THEN
        RETURN v_id;
    END IF;
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

-- The read horizon of the log: a consumer may read (and move its cursor
-- to) a frame only if its xid is below this. It is the xmin of the
-- calling statement's snapshot: every transaction with a smaller xid has
-- ended, and every xid assigned later is larger, so no frame can ever
-- commit before a position a cursor took from below the horizon. The
-- caller's own frames are readable too (as they were before) when its
-- own xid is that xmin (no older transaction runs): the horizon is then
-- its xid + 1, and a frame it appends later gets a larger seq. Call it
-- before the statements that read the log (under READ COMMITTED they
-- take newer snapshots, which see every transaction below it ended).
CREATE OR REPLACE FUNCTION queen.log_read_horizon()
RETURNS xid8
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN pg_current_xact_id_if_assigned() = pg_snapshot_xmin(s)
                THEN (pg_snapshot_xmin(s)::text::bigint + 1)::text::xid8
                ELSE pg_snapshot_xmin(s) END
      FROM pg_current_snapshot() s
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
-- A timer's dead letter is refused with QTRPL: its frame never had a
-- consumer group, and republishing it into a phantom group has no
-- defined meaning.
CREATE OR REPLACE FUNCTION queen.replay_dlq_entry(p_tenant text, p_dlq_id uuid)
RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    d      queen.dead_letter_queue;
    v_id   uuid := queen.uuid_v7();
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
    INSERT INTO queen.messages (id, transaction_id, partition_id, payload, is_encrypted, producer_sub)
    VALUES (v_id, d.transaction_id || '#replay-' || d.id, d.partition_id, d.payload, d.is_encrypted, d.producer_sub);
    DELETE FROM queen.dead_letter_queue WHERE id = p_dlq_id;
    RETURN v_id;
END
$$;

-- Append a batch to the tenant's queues (created on first use), one
-- verdict per item in input order. A transaction id already in the
-- partition (or earlier in the batch) is 'duplicate' with the existing
-- message id, never an error. No partition lock is taken (see
-- queen.messages): pushes and fires append to one partition at once.
CREATE OR REPLACE FUNCTION queen.push_messages(
    p_tenant       text,
    p_items        queen.push_item[],
    p_producer_sub text DEFAULT NULL)
RETURNS SETOF queen.push_result
LANGUAGE plpgsql AS $$
DECLARE
    it       record;
    r        queen.push_result;
    v_msg    text;
    v_part   uuid;
    v_id     uuid;
    v_txn    text;
BEGIN
    IF p_tenant IS NULL OR p_tenant = '' THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = 'tenant is required';
    END IF;
    IF p_items IS NULL OR cardinality(p_items) = 0 THEN
        RETURN;
    END IF;
    SELECT CASE
             WHEN x.queue IS NULL OR x.queue = '' THEN format('items[%s]: queue is required', x.n - 1)
             WHEN x.partition = '' THEN format('items[%s]: partition may not be empty', x.n - 1)
             WHEN x.payload IS NULL THEN format('items[%s]: payload is required', x.n - 1)
             WHEN NOT queen.log_name_fits(x.queue)
               THEN format('items[%s]: queue is %s bytes; at most 255', x.n - 1, octet_length(x.queue))
             WHEN NOT queen.log_name_fits(x.partition)
               THEN format('items[%s]: partition is %s bytes; at most 255', x.n - 1, octet_length(x.partition))
             ELSE format('items[%s]: transactionId is %s bytes; at most 255', x.n - 1, octet_length(x.transaction_id))
           END INTO v_msg
      FROM unnest(p_items) WITH ORDINALITY AS x(queue, partition, transaction_id, trace_id, payload, is_encrypted, n)
     WHERE x.queue IS NULL OR x.queue = '' OR x.partition = '' OR x.payload IS NULL
        OR NOT (queen.log_name_fits(x.queue) AND queen.log_name_fits(x.partition)
                AND queen.log_name_fits(x.transaction_id))
     ORDER BY x.n LIMIT 1;
    IF v_msg IS NOT NULL THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = v_msg;
    END IF;

    -- Queues and partitions new to the batch are created first, in (queue, partition)
    -- order, as the fire does: two first pushes naming them in opposite orders cannot
    -- deadlock on each other's uncommitted rows. No lock is taken (see queen.messages).
    PERFORM queen.ensure_partition(p_tenant, d.queue, d.partition)
       FROM (SELECT DISTINCT x.queue, coalesce(x.partition, 'Default') AS partition
               FROM unnest(p_items) x ORDER BY 1, 2) d;

    FOR it IN
        SELECT x.*, (x.n - 1)::integer AS idx
          FROM unnest(p_items) WITH ORDINALITY AS x(queue, partition, transaction_id, trace_id, payload, is_encrypted, n)
         ORDER BY x.n
    LOOP
        v_part := queen.ensure_partition(p_tenant, it.queue, coalesce(it.partition, 'Default'));  -- exists: a lookup
        v_txn := coalesce(nullif(it.transaction_id, ''), gen_random_uuid()::text);
        v_id := queen.uuid_v7();
        INSERT INTO queen.messages (id, transaction_id, trace_id, partition_id, payload, is_encrypted, producer_sub)
        VALUES (v_id, v_txn, it.trace_id, v_part, it.payload, coalesce(it.is_encrypted, false), p_producer_sub)
        ON CONFLICT (partition_id, transaction_id) DO NOTHING;
        IF FOUND THEN
            r := ROW(it.idx, v_txn, 'queued', v_id, v_part, it.trace_id, it.queue);
        ELSE
            SELECT m.id INTO v_id FROM queen.messages m WHERE m.partition_id = v_part AND m.transaction_id = v_txn;
            r := ROW(it.idx, v_txn, 'duplicate', v_id, v_part, NULL, it.queue);
        END IF;
        RETURN NEXT r;
    END LOOP;
END
$$;

-- Lease one partition of the tenant's p_queue (nothing when the tenant
-- has no such queue) for a consumer group and hand out up to
-- p_batch messages after its cursor, in log order (xid, seq), below the
-- read horizon (queen.log_read_horizon: a frame of a transaction that has
-- not ended, or that a still-running one with a smaller xid might precede,
-- waits). p_partition NULL: any partition with available messages, least
-- recently served first.
-- Partitions whose lease is unexpired, or whose consumer row another pop
-- holds (SKIP LOCKED), are passed over. p_auto_ack moves the cursor now.
CREATE OR REPLACE FUNCTION queen.pop_messages(
    p_tenant         text,
    p_queue          text,
    p_partition      text        DEFAULT NULL,
    p_consumer_group text        DEFAULT '__QUEUE_MODE__',
    p_batch          integer     DEFAULT 1,
    p_auto_ack       boolean     DEFAULT false,
    p_now            timestamptz DEFAULT NULL)
RETURNS SETOF queen.popped_message
LANGUAGE plpgsql AS $$
DECLARE
    v_now     timestamptz := coalesce(p_now, now());
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
           AND EXISTS (SELECT 1 FROM queen.messages m
                        WHERE m.partition_id = p.id AND m.xid < v_horizon
                          AND (m.xid, m.seq) > (coalesce(x.last_consumed_xid, '0'), coalesce(x.last_consumed_seq, 0)))
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

        SELECT s.xid, s.seq, s.n INTO v_lxid, v_lseq, v_n
          FROM (SELECT m.xid, m.seq, row_number() OVER (ORDER BY m.xid, m.seq) AS n
                  FROM queen.messages m
                 WHERE m.partition_id = c.id AND m.xid < v_horizon
                   AND (m.xid, m.seq) > (pc.last_consumed_xid, pc.last_consumed_seq)
                 ORDER BY m.xid, m.seq LIMIT v_batch) s
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

        RETURN QUERY
        SELECT m.id, m.seq, m.transaction_id, m.trace_id, m.payload, m.is_encrypted, m.producer_sub,
               m.created_at, q.name, c.id, c.name,
               CASE WHEN p_auto_ack THEN NULL ELSE v_lease END, v_group,
               CASE WHEN p_auto_ack THEN NULL ELSE v_expires END
          FROM queen.messages m
         WHERE m.partition_id = c.id
           AND (m.xid, m.seq) > (pc.last_consumed_xid, pc.last_consumed_seq)
           AND (m.xid, m.seq) <= (v_lxid, v_lseq)
         ORDER BY m.xid, m.seq;
        RETURN;
    END LOOP;
END
$$;

-- Acknowledge messages, one verdict per item in input order (processed
-- in partition, group, log (xid, seq) order). completed moves the cursor; failed
-- releases the lease for a redelivery of the batch until the queue's
-- retry_limit, then dead-letters the message and moves past it; dlq
-- dead-letters at once; retry only releases the lease. A message at or
-- behind the cursor is already consumed: acking it again changes nothing.
-- A partition of another tenant's queue holds no message for this one:
-- 'Message not found', and nothing is written.
CREATE OR REPLACE FUNCTION queen.ack_messages(
    p_tenant text,
    p_acks   queen.ack_item[],
    p_now    timestamptz DEFAULT NULL)
RETURNS SETOF queen.ack_result
LANGUAGE plpgsql AS $$
DECLARE
    v_now    timestamptz := coalesce(p_now, now());
    a        record;
    pc       queen.partition_consumers;
    r        queen.ack_result;
    v_out    queen.ack_result[] := '{}';
    v_msg    text;
    v_status text;
    v_limit  integer;
    v_acked  integer;
    v_done   boolean;
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
             ELSE format('acknowledgments[%s]: unknown status %L', x.n - 1, x.status)
           END INTO v_msg
      FROM unnest(p_acks) WITH ORDINALITY AS x(transaction_id, partition_id, status, error, lease_id, consumer_group, n)
     WHERE x.transaction_id IS NULL OR x.transaction_id = '' OR x.partition_id IS NULL
        OR NOT queen.log_name_fits(x.transaction_id)
        OR (x.status IS NOT NULL AND x.status NOT IN ('completed', 'success', 'failed', 'dlq', 'retry'))
     ORDER BY x.n LIMIT 1;
    IF v_msg IS NOT NULL THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = v_msg;
    END IF;

    FOR a IN
        SELECT x.transaction_id, x.partition_id, x.error, nullif(x.lease_id, '') AS lease_id,
               CASE coalesce(x.status, 'completed') WHEN 'success' THEN 'completed'
                    ELSE coalesce(x.status, 'completed') END AS status,
               coalesce(nullif(x.consumer_group, ''), '__QUEUE_MODE__') AS grp,
               (x.n - 1)::integer AS idx,
               m.id AS message_id, m.xid, m.seq, m.payload, m.is_encrypted, m.producer_sub, m.created_at,
               p.name AS partition_name, q.name AS queue_name, q.retry_limit
          FROM unnest(p_acks) WITH ORDINALITY AS x(transaction_id, partition_id, status, error, lease_id, consumer_group, n)
          LEFT JOIN (queen.messages m
                     JOIN queen.partitions p ON p.id = m.partition_id
                     JOIN queen.queues q ON q.id = p.queue_id AND q.tenant = p_tenant)
                 ON m.partition_id = x.partition_id AND m.transaction_id = x.transaction_id
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
            r.error := 'Invalid or expired lease';
            v_out := v_out || r;
            CONTINUE;
        END IF;
        r.success := true;
        v_status := a.status;

        IF v_status = 'retry' THEN
            r.lease_released := pc.lease_id IS NOT NULL;
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
                UPDATE queen.partition_consumers
                   SET lease_id = NULL, lease_expires_at = NULL, batch_size = 0, acked_count = 0,
                       batch_last_xid = NULL, batch_last_seq = NULL, batch_retry_count = batch_retry_count + 1,
                       updated_at = v_now
                 WHERE partition_id = a.partition_id AND consumer_group = a.grp;
            END IF;
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

-- One message by partition id and transaction id, with its status
-- derived from the DLQ, the consumer cursors and the leases (Queen's
-- get_message_v1). No row when there is no such message in the tenant's
-- queues.
CREATE OR REPLACE FUNCTION queen.get_message(
    p_tenant         text,
    p_partition_id   uuid,
    p_transaction_id text,
    p_now            timestamptz DEFAULT NULL)
RETURNS SETOF queen.message_detail
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF NOT queen.log_name_fits(p_transaction_id) THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('transactionId is %s bytes; at most 255', octet_length(p_transaction_id));
    END IF;
    RETURN QUERY
    WITH m AS (
        SELECT m.*, p.name AS partition_name, q.name AS queue_name, q.namespace, q.task,
               jsonb_build_object('leaseTime', q.lease_time, 'retryLimit', q.retry_limit,
                                  'retryDelay', q.retry_delay, 'ttl', q.ttl, 'priority', q.priority) AS queue_config
          FROM queen.messages m
          JOIN queen.partitions p ON p.id = m.partition_id
          JOIN queen.queues q ON q.id = p.queue_id
         WHERE m.partition_id = p_partition_id AND m.transaction_id = p_transaction_id
           AND q.tenant = p_tenant
    ), g AS (
        SELECT pc.*,
               (pc.last_consumed_xid, pc.last_consumed_seq) >= (m.xid, m.seq) AS consumed,
               pc.lease_expires_at > coalesce(p_now, now())
                   AND (m.xid, m.seq) > (pc.last_consumed_xid, pc.last_consumed_seq)
                   AND (m.xid, m.seq) <= (pc.batch_last_xid, pc.batch_last_seq) AS processing
          FROM m JOIN queen.partition_consumers pc ON pc.partition_id = m.partition_id
    ), d AS (
        SELECT dl.error_message, dl.retry_count
          FROM m JOIN queen.dead_letter_queue dl ON dl.message_id = m.id AND dl.partition_id = m.partition_id
         ORDER BY dl.failed_at DESC LIMIT 1
    ), agg AS (
        SELECT bool_or(g.consumed) AS any_consumed,
               bool_or(g.processing) AS any_processing,
               max(g.lease_expires_at) FILTER (WHERE g.processing) AS lease_expires_at,
               max(g.batch_retry_count) FILTER (WHERE NOT g.consumed) AS retry_count,
               bool_or(g.consumer_group = '__QUEUE_MODE__') AS has_queue_mode,
               count(*) FILTER (WHERE g.consumer_group <> '__QUEUE_MODE__') AS bus_groups,
               count(*) FILTER (WHERE g.consumed) AS consumed_by,
               coalesce(jsonb_agg(jsonb_build_object(
                   'name', g.consumer_group, 'consumed', g.consumed, 'processing', coalesce(g.processing, false),
                   'lastConsumedSeq', g.last_consumed_seq, 'leaseExpiresAt', g.lease_expires_at)
                   ORDER BY g.consumer_group) FILTER (WHERE g.consumer_group IS NOT NULL), '[]'::jsonb) AS groups
          FROM g
    )
    SELECT m.id, m.transaction_id, m.partition_id, m.queue_name, m.partition_name, m.namespace, m.task,
           CASE WHEN EXISTS (SELECT 1 FROM d) THEN 'dead_letter'
                WHEN coalesce(agg.any_consumed, false) THEN 'completed'
                WHEN coalesce(agg.any_processing, false) THEN 'processing'
                ELSE 'pending' END,
           m.payload, m.is_encrypted, m.trace_id, m.producer_sub, m.created_at,
           (SELECT d.error_message FROM d),
           coalesce((SELECT d.retry_count FROM d), agg.retry_count, 0),
           agg.lease_expires_at,
           m.queue_config,
           jsonb_build_object(
               'hasQueueMode', coalesce(agg.has_queue_mode, false),
               'busGroupsCount', agg.bus_groups,
               'consumedByGroups', agg.consumed_by,
               'type', CASE WHEN coalesce(agg.has_queue_mode, false) AND agg.bus_groups > 0 THEN 'hybrid'
                            WHEN coalesce(agg.has_queue_mode, false) THEN 'queue'
                            WHEN agg.bus_groups > 0 THEN 'bus'
                            ELSE 'none' END),
           agg.groups
      FROM m CROSS JOIN agg;
END
$$;

-- Queen's transaction: pushes and acks, in order, all or nothing, in the
-- tenant's queues. Each push is push_messages' (a transaction id already
-- in the partition is 'duplicate', which makes a retried transaction
-- idempotent); each ack is ack_messages', and an ack that does not
-- succeed ('Message not found', 'Invalid or expired lease') undoes every
-- operation before it: the outcome is success = false with failed_index
-- and an empty results, and nothing is written (the function raises
-- SQLSTATE QTTXF inside its own block and catches it: it never escapes,
-- so it has no HTTP mapping). Every lease in
-- p_required_leases must be held (unexpired) on one of the tenant's
-- partitions, else nothing is done either; an ack without its own lease
-- borrows the one required lease when exactly one is named. Shape
-- errors raise QTBAD.
CREATE OR REPLACE FUNCTION queen.execute_transaction(
    p_tenant          text,
    p_ops             queen.txn_op[],
    p_required_leases text[]      DEFAULT NULL,
    p_producer_sub    text        DEFAULT NULL,
    p_now             timestamptz DEFAULT NULL)
RETURNS queen.txn_outcome
LANGUAGE plpgsql AS $$
DECLARE
    v_now    timestamptz := coalesce(p_now, now());
    v_id     uuid := gen_random_uuid();
    v_out    queen.txn_result[] := '{}';
    v_msg    text;
    v_lease  text;
    v_failed integer;
    o        record;
    pr       queen.push_result;
    ar       queen.ack_result;
BEGIN
    IF p_tenant IS NULL OR p_tenant = '' THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = 'tenant is required';
    END IF;
    IF p_ops IS NULL OR cardinality(p_ops) = 0 THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = 'the transaction has no operations';
    END IF;
    SELECT CASE
             WHEN x.type IS NULL OR x.type NOT IN ('push', 'ack')
               THEN format('operation %s: unknown type %L', x.n - 1, x.type)
             WHEN x.type = 'push' AND (x.queue IS NULL OR x.queue = '')
               THEN format('operation %s: queue is required', x.n - 1)
             WHEN x.type = 'push' AND x.partition = ''
               THEN format('operation %s: partition may not be empty', x.n - 1)
             WHEN x.type = 'push' AND x.payload IS NULL
               THEN format('operation %s: payload is required', x.n - 1)
             WHEN x.type = 'ack' AND (x.transaction_id IS NULL OR x.transaction_id = '')
               THEN format('operation %s: transactionId is required', x.n - 1)
             WHEN x.type = 'ack' AND x.partition_id IS NULL
               THEN format('operation %s: partitionId is required', x.n - 1)
             WHEN x.type = 'ack' AND x.status IS NOT NULL
                  AND x.status NOT IN ('completed', 'success', 'failed', 'dlq', 'retry')
               THEN format('operation %s: unknown status %L', x.n - 1, x.status)
             WHEN NOT queen.log_name_fits(x.queue)
               THEN format('operation %s: queue is %s bytes; at most 255', x.n - 1, octet_length(x.queue))
             WHEN NOT queen.log_name_fits(x.partition)
               THEN format('operation %s: partition is %s bytes; at most 255', x.n - 1, octet_length(x.partition))
             ELSE format('operation %s: transactionId is %s bytes; at most 255', x.n - 1,
                         octet_length(x.transaction_id))
           END INTO v_msg
      FROM unnest(p_ops) WITH ORDINALITY AS x(type, queue, partition, transaction_id, trace_id, payload,
                                              is_encrypted, partition_id, status, error, lease_id,
                                              consumer_group, n)
     WHERE x.type IS NULL OR x.type NOT IN ('push', 'ack')
        OR (x.type = 'push' AND (x.queue IS NULL OR x.queue = '' OR x.partition = '' OR x.payload IS NULL))
        OR (x.type = 'ack' AND (x.transaction_id IS NULL OR x.transaction_id = '' OR x.partition_id IS NULL
                                OR (x.status IS NOT NULL
                                    AND x.status NOT IN ('completed', 'success', 'failed', 'dlq', 'retry'))))
        OR NOT (queen.log_name_fits(x.queue) AND queen.log_name_fits(x.partition)
                AND queen.log_name_fits(x.transaction_id))
     ORDER BY x.n LIMIT 1;
    IF v_msg IS NOT NULL THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = v_msg;
    END IF;

    -- Every required lease must be held now, on one of the tenant's partitions.
    SELECT l INTO v_msg
      FROM unnest(p_required_leases) l
     WHERE NOT EXISTS (
           SELECT 1 FROM queen.partition_consumers pc
             JOIN queen.partitions p ON p.id = pc.partition_id
             JOIN queen.queues q ON q.id = p.queue_id
            WHERE q.tenant = p_tenant AND pc.lease_id::text = lower(l) AND pc.lease_expires_at > v_now)
     LIMIT 1;
    IF FOUND THEN
        RETURN ROW(v_id, false, format('Invalid or expired lease: %s', v_msg), NULL, '{}')::queen.txn_outcome;
    END IF;
    IF cardinality(p_required_leases) = 1 THEN
        v_lease := nullif(p_required_leases[1], '');
    END IF;

    BEGIN
        -- queues and partitions a push creates here are undone too when an ack fails;
        -- created in (queue, partition) order, as push_messages and the fire do
        PERFORM queen.ensure_partition(p_tenant, d.queue, d.partition)
           FROM (SELECT DISTINCT x.queue, coalesce(x.partition, 'Default') AS partition
                   FROM unnest(p_ops) x WHERE x.type = 'push' ORDER BY 1, 2) d;
        FOR o IN
            SELECT x.*, (x.n - 1)::integer AS idx
              FROM unnest(p_ops) WITH ORDINALITY AS x(type, queue, partition, transaction_id, trace_id, payload,
                                                      is_encrypted, partition_id, status, error, lease_id,
                                                      consumer_group, n)
             ORDER BY x.n
        LOOP
            IF o.type = 'push' THEN
                SELECT * INTO pr FROM queen.push_messages(p_tenant,
                    ARRAY[ROW(o.queue, o.partition, o.transaction_id, o.trace_id, o.payload,
                              o.is_encrypted)::queen.push_item], p_producer_sub);
                v_out := v_out || ROW(o.idx, 'push', true, pr.status, pr.transaction_id, pr.message_id,
                                      pr.partition_id, pr.queue_name, coalesce(o.partition, 'Default'),
                                      NULL, false, false)::queen.txn_result;
            ELSE
                SELECT * INTO ar FROM queen.ack_messages(p_tenant,
                    ARRAY[ROW(o.transaction_id, o.partition_id, o.status, o.error,
                              coalesce(nullif(o.lease_id, ''), v_lease), o.consumer_group)::queen.ack_item], v_now);
                IF NOT ar.success THEN
                    v_failed := o.idx;
                    v_msg := format('ACK operation failed: %s', ar.error);
                    RAISE EXCEPTION 'transaction_failed' USING ERRCODE = 'QTTXF';
                END IF;
                v_out := v_out || ROW(o.idx, 'ack', true, NULL, ar.transaction_id, NULL, o.partition_id,
                                      ar.queue_name, ar.partition_name, NULL, ar.lease_released,
                                      ar.dlq)::queen.txn_result;
            END IF;
        END LOOP;
    EXCEPTION WHEN SQLSTATE 'QTTXF' THEN
        -- every write of the block (messages, cursors, DLQ rows, new queues) is undone
        RETURN ROW(v_id, false, v_msg, v_failed, '{}')::queen.txn_outcome;
    END;
    RETURN ROW(v_id, true, NULL, NULL, v_out)::queen.txn_outcome;
END
$$;

-- Delete what retention allows, at most p_limit rows in all (frames and
-- dead letters), partition by partition in (tenant, queue, partition) order.
-- Safe to call from any number of sessions at once: a partition with
-- something to delete is worked on by one session at a time (a
-- transaction-level pg_try_advisory_xact_lock(7261005, hashtext(partition
-- id)); a session that finds it taken skips the partition and counts it in
-- partitions_skipped, it never waits). A partition with nothing to delete
-- costs two index probes and no lock; one call locks at most 1000
-- partitions (the lock table is finite), the next call goes on. It
-- takes no partition row lock, so appends (push, the fire) never wait on
-- it; dead letters a replay holds are skipped (SKIP LOCKED).
--   pending_deleted   frames deleted that some group had not consumed
--                     (or in a partition no group reads)
--   completed_deleted frames deleted that every group had consumed
--   dlq_deleted       dead letters deleted
-- A full batch (the three counts add up to p_limit, clamped to
-- 1..100000) means there may be more: call again.
CREATE OR REPLACE FUNCTION queen.apply_retention(
    p_limit integer     DEFAULT 1000,
    p_now   timestamptz DEFAULT NULL)
RETURNS TABLE (pending_deleted bigint, completed_deleted bigint, dlq_deleted bigint, partitions_skipped integer)
LANGUAGE plpgsql AS $$
DECLARE
    v_now       timestamptz := coalesce(p_now, now());
    v_room      bigint := least(greatest(coalesce(p_limit, 1000), 1), 100000);
    v_dlq_secs  integer := (queen.get_cell_settings()).dlq_retention_seconds;
    c           record;
    v_pend_cut  timestamptz;  -- pending rule: created_at before this
    v_done_cut  timestamptz;  -- completed rule: created_at before this
    v_min_xid   xid8;         -- the lowest cursor (xid, seq) of the partition's groups (NULL: no group)
    v_min_seq   bigint;
    v_upto_xid  xid8;         -- completed rule: (xid, seq) at or before this
    v_upto_seq  bigint;
    v_xid       xid8;
    v_seq       bigint;
    v_at        timestamptz;
    v_n         bigint;
    v_nc        bigint;
    v_pending   bigint := 0;
    v_completed bigint := 0;
    v_dlq       bigint := 0;
    v_skipped   integer := 0;
    v_locked    integer := 0;
    v_head_due  boolean;
    v_dlq_due   boolean;
BEGIN
    FOR c IN
        SELECT p.id, q.retention_seconds, q.completed_retention_seconds
          FROM queen.queues q
          JOIN queen.partitions p ON p.queue_id = q.id
         WHERE q.retention_enabled
           AND (q.retention_seconds > 0 OR q.completed_retention_seconds > 0 OR v_dlq_secs > 0)
         ORDER BY q.tenant, q.name, p.name
    LOOP
        EXIT WHEN v_room <= 0 OR v_locked >= 1000;
        v_pend_cut := CASE WHEN c.retention_seconds > 0
                           THEN v_now - make_interval(secs => c.retention_seconds) END;
        v_done_cut := CASE WHEN c.completed_retention_seconds > 0
                           THEN v_now - make_interval(secs => c.completed_retention_seconds) END;
        v_min_xid := NULL;
        v_min_seq := NULL;
        SELECT pc.last_consumed_xid, pc.last_consumed_seq INTO v_min_xid, v_min_seq
          FROM queen.partition_consumers pc WHERE pc.partition_id = c.id
         ORDER BY pc.last_consumed_xid, pc.last_consumed_seq LIMIT 1;
        v_upto_xid := CASE WHEN v_done_cut IS NOT NULL THEN v_min_xid END;
        v_upto_seq := CASE WHEN v_done_cut IS NOT NULL THEN v_min_seq END;

        -- index probes, before any lock: is the first frame deletable, is a dead letter old enough?
        -- (cursors only move forward, so the lowest cursor read now is safe to use after the lock)
        SELECT m.xid, m.seq, m.created_at INTO v_xid, v_seq, v_at
          FROM queen.messages m WHERE m.partition_id = c.id ORDER BY m.xid, m.seq LIMIT 1;
        v_head_due := FOUND AND (coalesce(v_at < v_pend_cut, false)
                                 OR coalesce((v_xid, v_seq) <= (v_upto_xid, v_upto_seq) AND v_at < v_done_cut, false));
        v_dlq_due := v_dlq_secs > 0 AND EXISTS (
            SELECT 1 FROM queen.dead_letter_queue d
             WHERE d.partition_id = c.id AND d.failed_at < v_now - make_interval(secs => v_dlq_secs));
        CONTINUE WHEN NOT (v_head_due OR v_dlq_due);
        IF NOT pg_try_advisory_xact_lock(7261005, hashtext(c.id::text)) THEN
            v_skipped := v_skipped + 1;
            CONTINUE;
        END IF;
        v_locked := v_locked + 1;

        IF v_head_due THEN
            WITH head AS (
                SELECT m.id, row_number() OVER (ORDER BY m.xid, m.seq) AS n,
                       (m.xid, m.seq) <= (v_min_xid, v_min_seq) AS consumed,
                       coalesce(m.created_at < v_pend_cut, false)
                       OR coalesce((m.xid, m.seq) <= (v_upto_xid, v_upto_seq) AND m.created_at < v_done_cut, false) AS ok
                  FROM queen.messages m
                 WHERE m.partition_id = c.id
                 ORDER BY m.xid, m.seq
                 LIMIT v_room
            ), stop AS (
                SELECT min(h.n) AS n FROM head h WHERE NOT h.ok
            ), del AS (
                DELETE FROM queen.messages m
                 USING head h
                 WHERE m.id = h.id
                   AND h.n < coalesce((SELECT s.n FROM stop s), 9223372036854775807)
                RETURNING h.consumed
            )
            SELECT count(*), count(*) FILTER (WHERE d.consumed) INTO v_n, v_nc FROM del d;
            v_completed := v_completed + v_nc;
            v_pending := v_pending + v_n - v_nc;
            v_room := v_room - v_n;
        END IF;

        IF v_dlq_due AND v_room > 0 THEN
            WITH old AS (
                SELECT d.id
                  FROM queen.dead_letter_queue d
                 WHERE d.partition_id = c.id
                   AND d.failed_at < v_now - make_interval(secs => v_dlq_secs)
                 ORDER BY d.failed_at
                 LIMIT v_room
                   FOR UPDATE SKIP LOCKED
            )
            DELETE FROM queen.dead_letter_queue d USING old o WHERE d.id = o.id;
            GET DIAGNOSTICS v_n = ROW_COUNT;
            v_dlq := v_dlq + v_n;
            v_room := v_room - v_n;
        END IF;
    END LOOP;
    RETURN QUERY SELECT v_pending, v_completed, v_dlq, v_skipped;
END
$$;
