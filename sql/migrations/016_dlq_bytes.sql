-- Migration 016: a page of dead letters is bounded by its payload bytes.
-- GET /api/v1/dlq lists up to 1,000 dead letters, each as large as a push
-- allowed: one page could be gigabytes, materialized by the function before
-- the broker cut it. queen.list_dlq gains p_max_bytes (trailing, so the old
-- signature is dropped and the function created anew): the first entry
-- always comes, the next ones while the payloads add up to at most it.
-- The function text equals sql/schema/50_log_api.sql.

DROP FUNCTION queen.list_dlq(text, text, text, integer, integer);

-- A page of the tenant's dead letters, newest first. p_queue NULL:
-- every queue of the tenant; p_consumer_group NULL: every group (timer
-- dead letters are under '__QUEEN_TIMERS__'). p_limit is clamped to
-- 1..1000 (default 100). p_max_bytes bounds the page's payload bytes: the
-- first entry always comes, the next ones while the payloads add up to at
-- most p_max_bytes (NULL: no bound; below 1: QTBAD). The page stops at the
-- first entry past the bound, so no payload after it is read.
CREATE FUNCTION queen.list_dlq(
    p_tenant         text,
    p_queue          text    DEFAULT NULL,
    p_consumer_group text    DEFAULT NULL,
    p_limit          integer DEFAULT 100,
    p_offset         integer DEFAULT 0,
    p_max_bytes      bigint  DEFAULT NULL)
RETURNS SETOF queen.dlq_entry
LANGUAGE plpgsql STABLE AS $$
DECLARE
    r       queen.dlq_entry;
    v_n     integer := 0;
    v_bytes bigint := 0;
BEGIN
    IF NOT queen.log_name_fits(p_queue) THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('queue is %s bytes; at most 255', octet_length(p_queue));
    END IF;
    IF p_max_bytes IS NOT NULL AND p_max_bytes < 1 THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('max_bytes must be at least 1, got %s', p_max_bytes);
    END IF;
    FOR r IN
        SELECT d.id, d.message_id, d.transaction_id, d.partition_id, q.name, p.name, d.consumer_group,
               d.error_message, d.retry_count, d.payload, d.is_encrypted, d.payload_zstd, d.producer_sub,
               d.original_created_at, d.failed_at
          FROM queen.dead_letter_queue d
          JOIN queen.partitions p ON p.id = d.partition_id
          JOIN queen.queues q ON q.id = p.queue_id
         WHERE q.tenant = p_tenant
           AND (p_queue IS NULL OR q.name = p_queue)
           AND (p_consumer_group IS NULL OR d.consumer_group = p_consumer_group)
         ORDER BY d.failed_at DESC, d.id DESC
         LIMIT least(greatest(coalesce(p_limit, 100), 1), 1000)
        OFFSET greatest(coalesce(p_offset, 0), 0)
    LOOP
        v_bytes := v_bytes + octet_length(r.payload);
        EXIT WHEN v_n > 0 AND p_max_bytes IS NOT NULL AND v_bytes > p_max_bytes;
        v_n := v_n + 1;
        RETURN NEXT r;
    END LOOP;
END
$$;
