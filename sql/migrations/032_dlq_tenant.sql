-- Migration 032: a tenant's dead letters by an index of their own.
-- queen.dead_letter_queue reached its tenant through the partition and the
-- queue, so list_dlq joined and sorted every dead letter of the tenant for
-- each page: with a million, 3.4 s for the first page and the statement
-- timeout's 503 for a deep one, and count_dlq counted through the same join
-- (Dec 7 audit). The row now carries its tenant (set by a trigger from its
-- partition, whoever inserts it), with an index in list_dlq's order. The
-- backfill and the index read the table once, under its lock: a moment for
-- a DLQ of thousands, a minute or so for millions.

ALTER TABLE queen.dead_letter_queue ADD COLUMN tenant text;
UPDATE queen.dead_letter_queue d
   SET tenant = q.tenant
  FROM queen.partitions p JOIN queen.queues q ON q.id = p.queue_id
 WHERE p.id = d.partition_id;
ALTER TABLE queen.dead_letter_queue ALTER COLUMN tenant SET NOT NULL;
-- A tenant's page of dead letters (queen.list_dlq), newest first, and its count.
-- Through the partition and the queue, a tenant with a million dead letters
-- sorted all of them for every page: 3.4 s for the first, the statement
-- timeout's 503 for a deep one (migration 032).
CREATE INDEX dead_letter_queue_tenant_idx ON queen.dead_letter_queue (tenant, failed_at DESC, id DESC);

-- The tenant of a dead letter is its partition's queue's, whoever inserts it
-- (the ack, the fire's DLQ move, a DBA's INSERT).
CREATE FUNCTION queen.set_dlq_tenant()
RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.tenant := (SELECT q.tenant FROM queen.partitions p JOIN queen.queues q ON q.id = p.queue_id
                    WHERE p.id = NEW.partition_id);
    RETURN NEW;
END
$$;
CREATE TRIGGER dead_letter_queue_tenant BEFORE INSERT OR UPDATE OF partition_id ON queen.dead_letter_queue
    FOR EACH ROW EXECUTE FUNCTION queen.set_dlq_tenant();

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
        v_bytes := v_bytes + octet_length(r.payload);
        EXIT WHEN v_n > 0 AND p_max_bytes IS NOT NULL AND v_bytes > p_max_bytes;
        v_n := v_n + 1;
        RETURN NEXT r;
    END LOOP;
    CLOSE c;
END
$$;

CREATE OR REPLACE FUNCTION queen.count_dlq(
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
