-- Migration 039: two defects of the log surface (the Dec 7 log-surface audit).
-- * queen.replay_dlq_entry named the replayed frame '<original>#replay-<dlq id>'
--   whatever its length: 44 more bytes each replay, past the log's 255 for an
--   original over 211 bytes or a uuid replayed five times. Pop handed such a frame
--   out and every ack of it was refused (400), so its partition came back to the
--   group at every lease's end. A replay of a replay now replaces the earlier
--   suffix, and a long original is cut on a character boundary to fit.
-- * queen.execute_transaction made one ack_messages call per ack operation, so
--   the leases an earlier item released were not known to the next: a batch
--   nacked as a list (queen-mq's transaction().ack(messages, 'failed')) failed
--   at its second item, and so did completed acks listed out of log order. Each
--   run of consecutive acks is now one call, as POST /api/v1/ack/batch makes it.

CREATE OR REPLACE FUNCTION queen.replay_dlq_entry(p_tenant text, p_dlq_id uuid)
RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    d      queen.dead_letter_queue;
    v_id   uuid := queen.uuid_v7();
    v_base text;
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
    -- '#replay-' and a uuid take 44 bytes of the 255
    v_base := left(regexp_replace(d.transaction_id, '#replay-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}$', ''), 211);
    WHILE octet_length(v_base) > 211 LOOP
        v_base := left(v_base, -1);
    END LOOP;
    INSERT INTO queen.messages (id, transaction_id, partition_id, payload, is_encrypted, producer_sub)
    VALUES (v_id, v_base || '#replay-' || d.id, d.partition_id, d.payload, d.is_encrypted, d.producer_sub);
    DELETE FROM queen.dead_letter_queue WHERE id = p_dlq_id;
    RETURN v_id;
END
$$;

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
