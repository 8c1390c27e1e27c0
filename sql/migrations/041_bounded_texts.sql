-- Migration 041: what a client stores beside a message no longer sizes the
-- answers that show it beyond their bounds (an HTTP review, Dec 7 evening).
-- - queen.ack_messages keeps the first 8,192 characters of an item's error as
--   the dead letter's error_message: an ack could store 7 MiB of text, and a
--   DLQ page of a few such dead letters was a 22 MB answer under a bound of
--   16 MiB. Refusing a long error would only bring a failing message back.
-- - queen.list_dlq counts error texts and producers' subs with the payloads
--   against p_max_bytes, so dead letters stored before this one stay bounded.
-- - queen.get_message lists the first 1,000 consumer groups by name (the
--   mode's counts still cover all): any ack may name a new group, and 10,000
--   of them made a 3 MB detail of a 7-byte message.

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

CREATE OR REPLACE FUNCTION queen.list_dlq(
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
