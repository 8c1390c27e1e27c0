-- Migration 026: a pop reads the frames it hands out, not the rest of their
-- transaction. queen.pop_messages bounded its batch by (xid, seq) <= (the
-- batch's last frame), which a btree scan ends only past that frame's xid:
-- in a partition whose frames share one transaction (one large push, a
-- DBA's pushes in one transaction), every pop read all of that
-- transaction's later frames (1,000,000: 40-65 ms a pop of 10). LIMIT with
-- the batch's count ends the scan at the batch.
-- The function text equals sql/schema/50_log_api.sql.

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
