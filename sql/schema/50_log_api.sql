-- =====================================================================
-- Part 50: the log API behind Queen's routes (configure, push, pop,
-- ack, message detail, DLQ list, transaction, lease extension). Shapes
-- follow Queen MQ; the cursor is a log position (xid, seq) inside a
-- partition, and consumers read only below queen.log_read_horizon() (see
-- queen.messages in 20_log.sql).
--
-- Every function takes the caller's tenant first: a queue is the
-- tenant's (queen.queues.tenant), and another tenant's queue, partition,
-- message, lease or dead letter is invisible (not found, nothing to pop).
-- Queue and partition names and transaction ids are at most 255 bytes
-- of UTF-8 (queen.log_name_fits); a longer one raises QTBAD.
--
-- Consumer state per (partition, consumer group) lives in
-- queen.partition_consumers: (last_consumed_xid, last_consumed_seq) is the cursor, and
-- lease_id / lease_expires_at a partition-level lease taken by pop and
-- released when the batch is acked, failed, retried or expires.
-- =====================================================================

-- ---------------------------------------------------------------------
-- Types
-- ---------------------------------------------------------------------

-- One item of POST /api/v1/push. payload is the bytes to store (the
-- compact JSON of the item's payload, or its encryption envelope).
CREATE TYPE queen.push_item AS (
    queue           text,
    partition       text,       -- NULL: 'Default'
    transaction_id  text,       -- NULL or '': a random UUID is generated
    trace_id        uuid,
    payload         bytea,
    is_encrypted    boolean
);

-- One verdict per pushed item, in input order.
CREATE TYPE queen.push_result AS (
    idx             integer,    -- 0-based input position
    transaction_id  text,
    status          text,       -- queued | duplicate
    message_id      uuid,       -- the new row, or the existing one for a duplicate
    partition_id    uuid,
    trace_id        uuid,
    queue_name      text
);

-- One message handed out by pop.
CREATE TYPE queen.popped_message AS (
    message_id        uuid,
    seq               bigint,
    transaction_id    text,
    trace_id          uuid,
    payload           bytea,
    is_encrypted      boolean,
    producer_sub      text,
    created_at        timestamptz,
    queue             text,
    partition_id      uuid,
    partition         text,
    lease_id          uuid,       -- NULL with auto-ack
    consumer_group    text,
    lease_expires_at  timestamptz
);

-- One acknowledgement of POST /api/v1/ack and /api/v1/ack/batch.
CREATE TYPE queen.ack_item AS (
    transaction_id  text,
    partition_id    uuid,
    status          text,       -- completed (default) | success | failed | dlq | retry
    error           text,
    lease_id        text,       -- checked only when non-empty
    consumer_group  text        -- NULL or '': '__QUEUE_MODE__'
);

-- One verdict per acknowledgement, in input order.
CREATE TYPE queen.ack_result AS (
    idx             integer,    -- 0-based input position
    transaction_id  text,
    success         boolean,
    error           text,       -- NULL | 'Message not found' | 'Invalid or expired lease' | 'Message not yet readable'
    queue_name      text,
    partition_name  text,
    lease_released  boolean,
    dlq             boolean
);

-- A message as GET /api/v1/messages/:partitionId/:transactionId shows it.
CREATE TYPE queen.message_detail AS (
    message_id        uuid,
    transaction_id    text,
    partition_id      uuid,
    queue             text,
    partition         text,
    namespace         text,
    task              text,
    status            text,     -- dead_letter | completed | processing | pending
    payload           bytea,
    is_encrypted      boolean,
    trace_id          uuid,
    producer_sub      text,
    created_at        timestamptz,
    error_message     text,
    retry_count       integer,
    lease_expires_at  timestamptz,
    queue_config      jsonb,    -- {leaseTime, retryLimit, retryDelay, ttl, priority}
    mode              jsonb,    -- {hasQueueMode, busGroupsCount, consumedByGroups, type}
    consumer_groups   jsonb     -- [{name, consumed, processing, lastConsumedSeq, leaseExpiresAt}]
);

-- One dead letter as GET /api/v1/dlq lists it.
CREATE TYPE queen.dlq_entry AS (
    dlq_id          uuid,
    message_id      uuid,
    transaction_id  text,
    partition_id    uuid,
    queue           text,
    partition       text,
    consumer_group  text,
    error_message   text,
    retry_count     integer,
    payload         bytea,
    is_encrypted    boolean,
    payload_zstd    boolean,
    producer_sub    text,
    created_at      timestamptz,
    failed_at       timestamptz
);

-- One operation of POST /api/v1/transaction, flattened: each pushed item
-- and each ack is one. Build them with queen.txn_push / queen.txn_ack.
CREATE TYPE queen.txn_op AS (
    type            text,       -- push | ack
    queue           text,       -- push
    partition       text,       -- push; NULL: 'Default'
    transaction_id  text,       -- push: NULL or '' generated; ack: required
    trace_id        uuid,       -- push
    payload         bytea,      -- push: the bytes to store
    is_encrypted    boolean,    -- push
    partition_id    uuid,       -- ack
    status          text,       -- ack: completed (default) | success | failed | dlq | retry
    error           text,       -- ack
    lease_id        text,       -- ack: checked when non-empty (else the bundle's one required lease)
    consumer_group  text        -- ack: NULL or '': '__QUEUE_MODE__'
);

-- One verdict per operation of a transaction, in input order.
CREATE TYPE queen.txn_result AS (
    idx             integer,    -- 0-based position among the flattened operations
    type            text,       -- push | ack
    success         boolean,
    status          text,       -- push: queued | duplicate
    transaction_id  text,
    message_id      uuid,       -- push
    partition_id    uuid,
    queue_name      text,
    partition_name  text,
    error           text,       -- ack: NULL | 'Message not found' | 'Invalid or expired lease'
    lease_released  boolean,
    dlq             boolean
);

-- What a transaction did: everything (success) or nothing (failed_index
-- names the operation that failed; results is empty).
CREATE TYPE queen.txn_outcome AS (
    transaction_id  uuid,
    success         boolean,
    error           text,
    failed_index    integer,
    results         queen.txn_result[]
);

-- ---------------------------------------------------------------------
-- Functions
-- ---------------------------------------------------------------------

-- A queue's 15 effective options, camelCase, as configure echoes them.
CREATE FUNCTION queen.queue_options(q queen.queues)
RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_build_object(
        'leaseTime', q.lease_time, 'retryLimit', q.retry_limit, 'retryDelay', q.retry_delay,
        'maxSize', q.max_size, 'ttl', q.ttl, 'priority', q.priority,
        'delayedProcessing', q.delayed_processing, 'windowBuffer', q.window_buffer,
        'retentionSeconds', q.retention_seconds, 'completedRetentionSeconds', q.completed_retention_seconds,
        'retentionEnabled', q.retention_enabled, 'encryptionEnabled', q.encryption_enabled,
        'deadLetterQueue', q.dead_letter_queue, 'dlqAfterMaxRetries', q.dlq_after_max_retries,
        'maxWaitTimeSeconds', q.max_wait_time_seconds)
$$;

-- Create or overwrite the tenant's queue by name (Queen's configure):
-- every option is set, a missing one back to its default; unknown keys
-- are dropped. Ensures the 'Default' partition. Bad option types raise
-- QTBAD.
CREATE FUNCTION queen.configure_queue(
    p_tenant    text,
    p_queue     text,
    p_namespace text  DEFAULT NULL,
    p_task      text  DEFAULT NULL,
    p_options   jsonb DEFAULT NULL)
RETURNS TABLE (queue_id uuid, partition_id uuid, queue_name text, namespace text, task text, options jsonb)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    o      jsonb := coalesce(p_options, '{}'::jsonb);
    q      queen.queues;
    v_part uuid;
    v_key  text;
BEGIN
    IF p_tenant IS NULL OR p_tenant = '' THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = 'tenant is required';
    END IF;
    IF p_queue IS NULL OR p_queue = '' THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = 'queue is required';
    END IF;
    IF NOT queen.log_name_fits(p_queue) THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('queue is %s bytes; at most 255', octet_length(p_queue));
    END IF;
    IF jsonb_typeof(o) <> 'object' THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD', DETAIL = 'options must be an object';
    END IF;
    -- JSON null means "absent" (default); anything else must have the right type.
    SELECT e.key INTO v_key FROM jsonb_each(o) e
     WHERE jsonb_typeof(e.value) <> 'null'
       AND ((e.key IN ('leaseTime', 'retryLimit', 'retryDelay', 'maxSize', 'ttl', 'priority',
                       'delayedProcessing', 'windowBuffer', 'retentionSeconds',
                       'completedRetentionSeconds', 'maxWaitTimeSeconds')
             AND NOT (jsonb_typeof(e.value) = 'number' AND e.value::text ~ '^[0-9]{1,9}$'))
         OR (e.key IN ('retentionEnabled', 'encryptionEnabled', 'deadLetterQueue', 'dlqAfterMaxRetries')
             AND jsonb_typeof(e.value) <> 'boolean'))
     ORDER BY e.key LIMIT 1;
    IF v_key IS NOT NULL THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('options.%s must be a %s', v_key,
                            CASE WHEN v_key IN ('retentionEnabled', 'encryptionEnabled', 'deadLetterQueue',
                                                'dlqAfterMaxRetries')
                                 THEN 'boolean' ELSE 'non-negative integer below 10^9' END);
    END IF;
    o := jsonb_strip_nulls(o);

    INSERT INTO queen.queues AS t
           (tenant, name, namespace, task, lease_time, retry_limit, retry_delay, max_size, ttl, priority,
            delayed_processing, window_buffer, retention_seconds, completed_retention_seconds,
            retention_enabled, encryption_enabled, dead_letter_queue, dlq_after_max_retries,
            max_wait_time_seconds)
    VALUES (p_tenant, p_queue, p_namespace, p_task,
            coalesce((o->>'leaseTime')::integer, 300),
            coalesce((o->>'retryLimit')::integer, 3),
            coalesce((o->>'retryDelay')::integer, 1000),
            coalesce((o->>'maxSize')::integer, 0),
            coalesce((o->>'ttl')::integer, 3600),
            coalesce((o->>'priority')::integer, 0),
            coalesce((o->>'delayedProcessing')::integer, 0),
            coalesce((o->>'windowBuffer')::integer, 0),
            coalesce((o->>'retentionSeconds')::integer, 0),
            coalesce((o->>'completedRetentionSeconds')::integer, 0),
            coalesce((o->>'retentionEnabled')::boolean, false),
            coalesce((o->>'encryptionEnabled')::boolean, false),
            coalesce((o->>'deadLetterQueue')::boolean, false),
            coalesce((o->>'dlqAfterMaxRetries')::boolean, false),
            coalesce((o->>'maxWaitTimeSeconds')::integer, 0))
    ON CONFLICT (tenant, name) DO UPDATE
       SET namespace = EXCLUDED.namespace, task = EXCLUDED.task,
           lease_time = EXCLUDED.lease_time, retry_limit = EXCLUDED.retry_limit,
           retry_delay = EXCLUDED.retry_delay, max_size = EXCLUDED.max_size, ttl = EXCLUDED.ttl,
           priority = EXCLUDED.priority, delayed_processing = EXCLUDED.delayed_processing,
           window_buffer = EXCLUDED.window_buffer, retention_seconds = EXCLUDED.retention_seconds,
           completed_retention_seconds = EXCLUDED.completed_retention_seconds,
           retention_enabled = EXCLUDED.retention_enabled,
           encryption_enabled = EXCLUDED.encryption_enabled,
           dead_letter_queue = EXCLUDED.dead_letter_queue,
           dlq_after_max_retries = EXCLUDED.dlq_after_max_retries,
           max_wait_time_seconds = EXCLUDED.max_wait_time_seconds,
           updated_at = now()
    RETURNING t.* INTO q;

    INSERT INTO queen.partitions AS p (queue_id, name) VALUES (q.id, 'Default')
    ON CONFLICT ON CONSTRAINT partitions_queue_name_unique DO NOTHING;
    SELECT p.id INTO v_part FROM queen.partitions p WHERE p.queue_id = q.id AND p.name = 'Default';

    RETURN QUERY SELECT q.id, v_part, q.name, q.namespace, q.task, queen.queue_options(q);
END
$$;

-- The names among p_queues whose queue (the tenant's) encrypts at rest
-- (push and schedule ask before building payloads: the broker holds the
-- key, not PostgreSQL).
CREATE FUNCTION queen.encrypted_queues(p_tenant text, p_queues text[])
RETURNS SETOF text
LANGUAGE sql STABLE AS $$
    SELECT q.name FROM queen.queues q
     WHERE q.tenant = p_tenant AND q.name = ANY (p_queues) AND q.encryption_enabled
$$;

-- Append a batch to the tenant's queues (created on first use), one
-- verdict per item in input order. A transaction id already in the
-- partition (or earlier in the batch) is 'duplicate' with the existing
-- message id, never an error. No partition lock is taken (see
-- queen.messages): pushes and fires append to one partition at once.
CREATE FUNCTION queen.push_messages(
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
-- p_max_bytes bounds the batch by its stored payload bytes: it ends at
-- the message whose predecessors' bytes reach it (the first is always
-- handed out), so what a pop makes the broker hold is its setting
-- (QUEEN_POP_MAX_BYTES), not batch x the largest message.
-- Its plans walk messages_partition_xid_seq_idx in order and stop at the
-- batch whatever the statistics say: no seq or bitmap scans, no sort it can
-- avoid, no JIT (as the fire, migration 025), and the check for frames after
-- a partition's cursor a subquery with LIMIT, which cannot become a join.
-- With the statistics of an empty table (a large push not yet committed
-- when autovacuum analyzed messages) a pop took every frame after the cursor
-- and sorted them, and the check scanned the index from its start.
CREATE FUNCTION queen.pop_messages(
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

-- Acknowledge messages, one verdict per item in input order (processed
-- in partition, group, log (xid, seq) order). completed moves the cursor; failed
-- releases the lease for a redelivery of the batch until the queue's
-- retry_limit, then dead-letters the message and moves past it; dlq
-- dead-letters at once; retry only releases the lease. A message at or
-- behind the cursor is already consumed: acking it again changes nothing.
-- A partition of another tenant's queue holds no message for this one:
-- 'Message not found', and nothing is written. A failed or retry item whose
-- lease an earlier item of the same call released (a batch nacked as a list:
-- queen-mq's ack(messages, False)) succeeds and changes nothing more: the
-- batch comes back whole, one retry spent (migration 033). A completed or
-- dlq item after that release is refused ('Invalid or expired lease'): the
-- cursor cannot pass the failed message, so the batch comes back with it.
-- An item that would move the cursor to a frame at or past the read horizon
-- (queen.log_read_horizon: no pop has handed it out, an older transaction
-- still runs) is refused ('Message not yet readable'): the cursor would skip
-- that transaction's frames when it commits (migration 040).
-- Each item is one lookup of the unique (partition_id, transaction_id), a
-- subquery with LIMIT and no seq or bitmap scan: with the statistics of an
-- empty table, a join hashed every frame of the partition, and a bitmap
-- scan of the log order's index read them all for each item.
-- A dead letter keeps the first 8,192 characters of its item's error
-- (migration 041): a client's text of any length made every DLQ page and
-- message detail that showed it as large, and a failed ack refused for its
-- length would only bring the message back to fail again.
CREATE FUNCTION queen.ack_messages(
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

-- One message by partition id and transaction id, with its status
-- derived from the DLQ, the consumer cursors and the leases (Queen's
-- get_message_v1). No row when there is no such message in the tenant's
-- queues. Its consumerGroups list the first 1,000 groups by name; the
-- mode's counts cover every group (migration 041: any ack may name a new
-- group, and 10,000 of them made a 3 MB detail of a 7-byte message).
CREATE FUNCTION queen.get_message(
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
               count(*) FILTER (WHERE g.consumed) AS consumed_by
          FROM g
    ), shown AS (  -- the groups listed: the first 1,000 by name (the counts above cover all)
        SELECT coalesce(jsonb_agg(jsonb_build_object(
                   'name', s.consumer_group, 'consumed', s.consumed, 'processing', coalesce(s.processing, false),
                   'lastConsumedSeq', s.last_consumed_seq, 'leaseExpiresAt', s.lease_expires_at)
                   ORDER BY s.consumer_group), '[]'::jsonb) AS groups
          FROM (SELECT * FROM g WHERE g.consumer_group IS NOT NULL ORDER BY g.consumer_group LIMIT 1000) s
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
           shown.groups
      FROM m CROSS JOIN agg CROSS JOIN shown;
END
$$;

-- A page of the tenant's dead letters, newest first. p_queue NULL:
-- every queue of the tenant; p_consumer_group NULL: every group (timer
-- dead letters are under '__QUEEN_TIMERS__'). p_limit is clamped to
-- 1..1000 (default 100). p_max_bytes bounds the page's bytes (payloads,
-- error texts and producers' subs): the first entry always comes, the next
-- ones while they add up to at most p_max_bytes (NULL: no bound; below 1:
-- QTBAD). The page stops at the first entry past the bound, so no payload
-- after it is read. Error texts counted too (migration 041): dead letters
-- stored with 7 MiB errors made a page of 22 MB under a bound of 16 MiB.
CREATE FUNCTION queen.list_dlq(
    p_tenant         text,
    p_queue          text    DEFAULT NULL,
    p_consumer_group text    DEFAULT NULL,
    p_limit          integer DEFAULT 100,
    p_offset         integer DEFAULT 0,
    p_max_bytes      bigint  DEFAULT NULL)
RETURNS SETOF queen.dlq_entry
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $$
DECLARE
    r        queen.dlq_entry;
    c        refcursor;
    v_n      integer := 0;
    v_bytes  bigint := 0;
    v_limit  integer := least(greatest(coalesce(p_limit, 100), 1), 1000);
    v_offset integer := greatest(coalesce(p_offset, 0), 0);
BEGIN
    IF NOT queen.log_name_fits(p_queue) THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('queue is %s bytes; at most 255', octet_length(p_queue));
    END IF;
    IF p_max_bytes IS NOT NULL AND p_max_bytes < 1 THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('max_bytes must be at least 1, got %s', p_max_bytes);
    END IF;
    -- The page by an index in its order, then the names of its rows only (a deep offset
    -- walks the index, not a join of every row before it): the tenant's dead letters by
    -- dead_letter_queue_tenant_idx, or one queue's by its partitions' index.
    IF p_queue IS NULL THEN
        OPEN c FOR
            SELECT d.id, d.message_id, d.transaction_id, d.partition_id, q.name, p.name, d.consumer_group,
                   d.error_message, d.retry_count, d.payload, d.is_encrypted, d.payload_zstd, d.producer_sub,
                   d.original_created_at, d.failed_at
              FROM (SELECT x.* FROM queen.dead_letter_queue x
                     WHERE x.tenant = p_tenant
                       AND (p_consumer_group IS NULL OR x.consumer_group = p_consumer_group)
                     ORDER BY x.failed_at DESC, x.id DESC
                     LIMIT v_limit OFFSET v_offset) d
              JOIN queen.partitions p ON p.id = d.partition_id
              JOIN queen.queues q ON q.id = p.queue_id
             ORDER BY d.failed_at DESC, d.id DESC;
    ELSE
        OPEN c FOR
            SELECT d.id, d.message_id, d.transaction_id, d.partition_id, q.name, p.name, d.consumer_group,
                   d.error_message, d.retry_count, d.payload, d.is_encrypted, d.payload_zstd, d.producer_sub,
                   d.original_created_at, d.failed_at
              FROM queen.queues q
              JOIN queen.partitions p ON p.queue_id = q.id
              JOIN queen.dead_letter_queue d ON d.partition_id = p.id
             WHERE q.tenant = p_tenant AND q.name = p_queue
               AND (p_consumer_group IS NULL OR d.consumer_group = p_consumer_group)
             ORDER BY d.failed_at DESC, d.id DESC
             LIMIT v_limit OFFSET v_offset;
    END IF;
    LOOP
        FETCH c INTO r;
        EXIT WHEN NOT FOUND;
        v_bytes := v_bytes + octet_length(r.payload) + coalesce(octet_length(r.error_message), 0)
                   + coalesce(octet_length(r.producer_sub), 0);
        EXIT WHEN v_n > 0 AND p_max_bytes IS NOT NULL AND v_bytes > p_max_bytes;
        v_n := v_n + 1;
        RETURN NEXT r;
    END LOOP;
    CLOSE c;
END
$$;

-- How many of the tenant's dead letters list_dlq pages over (its `total`): an
-- index-only count on dead_letter_queue_tenant_idx (migration 032).
CREATE FUNCTION queen.count_dlq(
    p_tenant         text,
    p_queue          text DEFAULT NULL,
    p_consumer_group text DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql STABLE SET enable_seqscan = off AS $$
BEGIN
    IF NOT queen.log_name_fits(p_queue) THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('queue is %s bytes; at most 255', octet_length(p_queue));
    END IF;
    RETURN (SELECT count(*)
              FROM queen.dead_letter_queue d
             WHERE d.tenant = p_tenant
               AND (p_consumer_group IS NULL OR d.consumer_group = p_consumer_group)
               AND (p_queue IS NULL OR d.partition_id IN (
                      SELECT p.id FROM queen.partitions p JOIN queen.queues q ON q.id = p.queue_id
                       WHERE q.tenant = p_tenant AND q.name = p_queue)));
END
$$;

-- A push operation of a transaction (psql: queen.txn_push('q', '{"a":1}')).
CREATE FUNCTION queen.txn_push(
    p_queue          text,
    p_payload        bytea,
    p_transaction_id text    DEFAULT NULL,
    p_partition      text    DEFAULT NULL,
    p_trace_id       uuid    DEFAULT NULL,
    p_is_encrypted   boolean DEFAULT false)
RETURNS queen.txn_op
LANGUAGE sql IMMUTABLE AS $$
    SELECT ROW('push', p_queue, p_partition, p_transaction_id, p_trace_id, p_payload, p_is_encrypted,
               NULL, NULL, NULL, NULL, NULL)::queen.txn_op
$$;

-- An ack operation of a transaction.
CREATE FUNCTION queen.txn_ack(
    p_transaction_id text,
    p_partition_id   uuid,
    p_status         text DEFAULT 'completed',
    p_lease_id       text DEFAULT NULL,
    p_consumer_group text DEFAULT NULL,
    p_error          text DEFAULT NULL)
RETURNS queen.txn_op
LANGUAGE sql IMMUTABLE AS $$
    SELECT ROW('ack', NULL, NULL, p_transaction_id, NULL, NULL, NULL, p_partition_id, p_status, p_error,
               p_lease_id, p_consumer_group)::queen.txn_op
$$;

-- A lease id as sent (text) as the uuid partition_consumers.lease_id
-- holds, or NULL when it is not one: only the canonical 8-4-4-4-12 hex
-- form, in either case, as the text comparison it replaces matched
-- (pc.lease_id::text = lower(id)). NULL matches no lease.
CREATE FUNCTION queen.lease_uuid(p_id text)
RETURNS uuid
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN p_id ~ '^[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}$'
                THEN p_id::uuid END
$$;

-- The position in p_leases of the first id that is not a lease the tenant
-- p_tenant holds unexpired at p_now (a malformed id, or NULL, is held by
-- nobody), or NULL when every one is held. Each id is one probe of
-- partition_consumers_lease_idx, whatever the statistics say: the lookup is
-- a subquery per id whose one indexable condition is the lease (the
-- tenant is a lookup of the row's partition by its key), and seq and bitmap
-- scans are off. Planned as a join, with the statistics of an empty table,
-- it scanned every cursor row once per id.
CREATE FUNCTION queen.first_unheld_lease(p_tenant text, p_leases text[], p_now timestamptz)
RETURNS bigint
LANGUAGE sql STABLE SET enable_seqscan = off SET enable_bitmapscan = off AS $$
    SELECT x.n
      FROM unnest(p_leases) WITH ORDINALITY AS x(l, n)
     WHERE (SELECT true
              FROM queen.partition_consumers pc
             WHERE pc.lease_id = queen.lease_uuid(x.l) AND pc.lease_expires_at > p_now
               AND (SELECT q.tenant FROM queen.partitions p JOIN queen.queues q ON q.id = p.queue_id
                     WHERE p.id = pc.partition_id) = p_tenant
             LIMIT 1) IS NULL
     ORDER BY x.n
     LIMIT 1
$$;

-- Queen's transaction: pushes and acks, in order, all or nothing, in the
-- tenant's queues. Each push is push_messages' (a transaction id already
-- in the partition is 'duplicate', which makes a retried transaction
-- idempotent); each run of consecutive acks is one ack_messages call, as
-- POST /api/v1/ack/batch makes it (migration 039: one call per ack refused
-- the second item of a batch nacked as a list, queen-mq's
-- transaction().ack(messages, 'failed'), and completed acks listed out of
-- log order, once an earlier item had released the lease); an ack that
-- does not succeed ('Message not found', 'Invalid or expired lease') undoes
-- every operation: the outcome is success = false with failed_index (the
-- first such ack) and an empty results, and nothing is written (the function raises
-- SQLSTATE QTTXF inside its own block and catches it: it never escapes,
-- so it has no HTTP mapping). Every lease in
-- p_required_leases must be held (unexpired) on one of the tenant's
-- partitions, else nothing is done either (an id that is not a UUID is
-- held by nobody); duplicates count once. An ack without its own lease
-- borrows the one required lease when exactly one distinct lease is
-- named. Shape errors raise QTBAD.
CREATE FUNCTION queen.execute_transaction(
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
    v_named  text[];
    v_unheld bigint;
    v_lease  text;
    v_failed integer;
    o        record;
    pr       queen.push_result;
    ar       queen.ack_result;
    v_acks   queen.ack_item[] := '{}';  -- the run of acks being gathered, and their positions
    v_at     integer[] := '{}';
    v_pids   uuid[] := '{}';
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

    -- Every required lease must be held now, on one of the tenant's partitions:
    -- the distinct ids, in the order first named, one index probe each
    -- (queen.first_unheld_lease); the first one not held is reported.
    v_named := ARRAY(SELECT u.l FROM unnest(p_required_leases) WITH ORDINALITY AS u(l, n)
                      GROUP BY u.l ORDER BY min(u.n));
    v_unheld := queen.first_unheld_lease(p_tenant, v_named, v_now);
    IF v_unheld IS NOT NULL THEN
        RETURN ROW(v_id, false, format('Invalid or expired lease: %s', v_named[v_unheld]), NULL,
                   '{}')::queen.txn_outcome;
    END IF;
    -- every id names a held lease: one distinct lease (however often, in either case) is lent
    SELECT CASE WHEN count(*) = 1 THEN min(d.lease) END INTO v_lease
      FROM (SELECT DISTINCT queen.lease_uuid(l)::text AS lease FROM unnest(v_named) l) d;

    BEGIN
        -- queues and partitions a push creates here are undone too when an ack fails;
        -- created in (queue, partition) order, as push_messages and the fire do
        PERFORM queen.ensure_partition(p_tenant, d.queue, d.partition)
           FROM (SELECT DISTINCT x.queue, coalesce(x.partition, 'Default') AS partition
                   FROM unnest(p_ops) x WHERE x.type = 'push' ORDER BY 1, 2) d;
        FOR o IN
            SELECT x.*, (x.n - 1)::integer AS idx,
                   lead(x.type) OVER (ORDER BY x.n) IS DISTINCT FROM 'ack' AS run_ends
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
                v_acks := v_acks || ROW(o.transaction_id, o.partition_id, o.status, o.error,
                                        coalesce(nullif(o.lease_id, ''), v_lease), o.consumer_group)::queen.ack_item;
                v_at := v_at || o.idx;
                v_pids := v_pids || o.partition_id;
                CONTINUE WHEN NOT o.run_ends;
                -- the run's verdicts come back in its order (ar.idx: 0-based within the run)
                FOR ar IN SELECT * FROM queen.ack_messages(p_tenant, v_acks, v_now) LOOP
                    IF NOT ar.success THEN
                        v_failed := v_at[ar.idx + 1];
                        v_msg := format('ACK operation failed: %s', ar.error);
                        RAISE EXCEPTION 'transaction_failed' USING ERRCODE = 'QTTXF';
                    END IF;
                    v_out := v_out || ROW(v_at[ar.idx + 1], 'ack', true, NULL, ar.transaction_id, NULL,
                                          v_pids[ar.idx + 1], ar.queue_name, ar.partition_name, NULL,
                                          ar.lease_released, ar.dlq)::queen.txn_result;
                END LOOP;
                v_acks := '{}';
                v_at := '{}';
                v_pids := '{}';
            END IF;
        END LOOP;
    EXCEPTION WHEN SQLSTATE 'QTTXF' THEN
        -- every write of the block (messages, cursors, DLQ rows, new queues) is undone
        RETURN ROW(v_id, false, v_msg, v_failed, '{}')::queen.txn_outcome;
    END;
    RETURN ROW(v_id, true, NULL, NULL, v_out)::queen.txn_outcome;
END
$$;

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
CREATE FUNCTION queen.extend_lease(
    p_tenant   text,
    p_lease_id text,
    p_seconds  integer     DEFAULT 60,
    p_now      timestamptz DEFAULT NULL)
RETURNS TABLE (lease_id text, success boolean, error text, expires_at timestamptz, renewed integer)
LANGUAGE plpgsql SET enable_seqscan = off SET enable_indexscan = off AS $$
#variable_conflict use_column
DECLARE
    v_now     timestamptz := queen.finite_now(p_now);
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
