-- Migration 027: a pop and an ack read what they hand out or ack whatever the
-- statistics say. With the statistics of an empty table (a large push not
-- yet committed when autovacuum analyzed queen.messages; the fire's
-- migration 025 met the same on queen.timers):
-- - queen.pop_messages took every frame after the cursor by a bitmap scan
--   and sorted them, and its check for frames after a partition's cursor,
--   a semi-join, scanned the log order's index from its start. It now runs
--   with enable_seqscan, enable_bitmapscan and enable_sort off, and jit off,
--   and the check is a subquery with LIMIT;
-- - queen.ack_messages hashed every frame of the partition to find the
--   acked ones. Each item is now one lookup of the unique (partition_id,
--   transaction_id), a subquery with LIMIT, with enable_seqscan and
--   enable_bitmapscan off.
-- 10,000 frames: a pop of 10 visited 272-726 pages, an ack of 10 409-460
-- (three runs); now 11-12 and 30-40 (tests/sql/87_consumer_stale_stats.sql).
-- The function texts equal sql/schema/50_log_api.sql.

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
-- 'Message not found', and nothing is written.
-- Each item is one lookup of the unique (partition_id, transaction_id), a
-- subquery with LIMIT and no seq or bitmap scan: with the statistics of an
-- empty table, a join hashed every frame of the partition, and a bitmap
-- scan of the log order's index read them all for each item.
CREATE OR REPLACE FUNCTION queen.ack_messages(
    p_tenant text,
    p_acks   queen.ack_item[],
    p_now    timestamptz DEFAULT NULL)
RETURNS SETOF queen.ack_result
LANGUAGE plpgsql SET enable_seqscan = off SET enable_bitmapscan = off AS $$
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
