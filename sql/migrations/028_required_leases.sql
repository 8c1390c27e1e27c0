-- Migration 028: a transaction's requiredLeases are checked as a set, by an
-- index. queen.execute_transaction compared pc.lease_id::text = lower(id)
-- for each element of p_required_leases, a scan of every cursor row that no
-- index serves: 200,000 copies of one lease against 3,000 cursor rows ran
-- into the statement timeout (503) on every retry, holding a connection for
-- seconds. Now each distinct id is parsed once (queen.lease_uuid: a
-- malformed id is held by nobody, as before) and looked up by the new
-- partial index partition_consumers_lease_idx; duplicates count once, and
-- the lease an ack without its own borrows is the one distinct lease named.
-- The HTTP route also refuses more than 10,000 entries (docs/limits.md).
-- The function texts equal sql/schema/50_log_api.sql.

-- A lease by its id (execute_transaction's requiredLeases). Partial: a
-- cursor holds a lease only between a pop and the ack that ends its batch.
CREATE INDEX partition_consumers_lease_idx ON queen.partition_consumers (lease_id)
    WHERE lease_id IS NOT NULL;

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
-- idempotent); each ack is ack_messages', and an ack that does not
-- succeed ('Message not found', 'Invalid or expired lease') undoes every
-- operation before it: the outcome is success = false with failed_index
-- and an empty results, and nothing is written (the function raises
-- SQLSTATE QTTXF inside its own block and catches it: it never escapes,
-- so it has no HTTP mapping). Every lease in
-- p_required_leases must be held (unexpired) on one of the tenant's
-- partitions, else nothing is done either (an id that is not a UUID is
-- held by nobody); duplicates count once. An ack without its own lease
-- borrows the one required lease when exactly one distinct lease is
-- named. Shape errors raise QTBAD.
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
