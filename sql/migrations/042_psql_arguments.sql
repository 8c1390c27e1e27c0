-- Migration 042: the functions a DBA calls from psql refuse what they cannot
-- use with QTBAD, instead of an internal error, a silent no-op or a value
-- stored that breaks later calls (an SQL review, Dec 7 evening).
-- - queen.finite_now(p_now): the clock of fire_timers, inflate_timers,
--   fire_due_timers, fail_timer, ack_messages, extend_lease and
--   apply_retention, and of take_rate_tokens, claim_timers and pop_messages
--   in place of their own copies of the check (migration 038). An infinite
--   p_now was stored (a deliver_at of -infinity made every sweeper's
--   next_timer_due_ms fail; a dead letter failed at -infinity was deleted at
--   once) or deleted by (retention at infinity).
-- - cell_settings.horizon_ms is at most 100 years, as schedule_timers'
--   p_horizon_ms (a wider one made a delay overflow the timestamp, 22008),
--   and rate_ops_per_second above 0; take_rate_tokens refuses a rate of 0 or
--   less (it divided by zero, 22012).
-- - pop_messages refuses a consumerGroup over 255 bytes (the cursors' key
--   failed with 54000) and a p_max_bytes below 1 (it handed out nothing);
--   ack_messages refuses such a group too.
-- - claim_timers and fire_due_timers take a NULL p_limit or p_lease_ms as its
--   default (greatest() skipped the NULL: nothing claimed or fired, a claim
--   of 1 ms); fail_timer refuses NULL or negative attempts and backoffs (a
--   NULL deliver_at, 23502, or endless attempts).

CREATE FUNCTION queen.finite_now(p_now timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF p_now IS NULL THEN
        RETURN now();
    END IF;
    IF NOT isfinite(p_now) THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('p_now must be a finite time, got %s', p_now);
    END IF;
    RETURN p_now;
END
$$;


-- A wider horizon only made long delays fail (22008): held to 100 years, as every
-- schedule from the broker is. A rate of 0 or less divided by zero on the second batch:
-- no value stands in for it, so such a row stops this migration (rate_positive) until
-- the operator sets a rate above 0 or NULL (no limit).
UPDATE queen.cell_settings SET horizon_ms = 3155760000000 WHERE horizon_ms > 3155760000000;
ALTER TABLE queen.cell_settings
    DROP CONSTRAINT horizon_positive,
    ADD CONSTRAINT horizon_in_range CHECK (horizon_ms BETWEEN 1 AND 3155760000000),
    ADD CONSTRAINT rate_positive CHECK (rate_ops_per_second > 0);

CREATE OR REPLACE FUNCTION queen.take_rate_tokens(
    p_tenant text,
    p_ops    integer,
    p_rate   numeric,
    p_burst  numeric,
    p_now    timestamptz DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_now    timestamptz;
    v_burst  numeric := greatest(coalesce(p_burst, p_rate), 1);
    v_tokens numeric;
    v_wait   numeric;
BEGIN
    IF p_rate IS NULL OR p_ops <= 0 THEN
        RETURN;  -- no bucket: every schedule batch without a rate limit ends here
    END IF;
    v_now := queen.finite_now(p_now);
    IF p_rate <= 0 THEN  -- a bucket refilled at no rate divided by zero (migration 042)
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('p_rate must be above 0, got %s', p_rate);
    END IF;
    INSERT INTO queen.rate_buckets AS b (tenant, tokens, refilled_at)
    VALUES (p_tenant, v_burst, v_now)
    ON CONFLICT (tenant) DO UPDATE
        SET tokens = least(v_burst, b.tokens
                       + p_rate * greatest(0, extract(epoch FROM v_now - b.refilled_at))),
            refilled_at = greatest(b.refilled_at, v_now)
    RETURNING tokens INTO v_tokens;

    IF v_tokens < least(p_ops, v_burst) THEN
        v_wait := ceil((least(p_ops, v_burst) - v_tokens) / p_rate);
        -- a bucket in debt (a batch larger than the burst went through) has 0 available
        RAISE EXCEPTION 'rate_limited'
            USING ERRCODE = 'QTRAT',
                  DETAIL  = format('tenant %s asked for %s operations; %s available at %s per second',
                                   p_tenant, p_ops, greatest(floor(v_tokens), 0), p_rate),
                  HINT    = format('retry_after_seconds=%s', greatest(1, v_wait));
    END IF;
    UPDATE queen.rate_buckets SET tokens = tokens - p_ops WHERE tenant = p_tenant;
END
$$;

CREATE OR REPLACE FUNCTION queen.claim_timers(
    p_broker    text,
    p_limit     integer     DEFAULT 100,
    p_lease_ms  integer     DEFAULT 30000,
    p_now       timestamptz DEFAULT NULL,
    p_zstd_only boolean     DEFAULT false,
    p_max_bytes bigint      DEFAULT NULL,
    p_fair_after_ms integer DEFAULT 100,
    p_turn      text        DEFAULT NULL)
RETURNS SETOF queen.claimed_timer
LANGUAGE plpgsql AS $$
DECLARE
    v_now     timestamptz := queen.finite_now(p_now);
    v_claim   uuid := gen_random_uuid();
    v_rows    queen.claimed_timer[];
    v_in      text[];
    v_tenants text[];
BEGIN
    -- NULL is the default, as for list_dlq's p_limit: greatest() skipped it, and a NULL
    -- limit claimed nothing, a NULL lease held for 1 ms (migration 042)
    p_limit := coalesce(p_limit, 100);
    p_lease_ms := coalesce(p_lease_ms, 30000);
    IF p_turn IS NOT NULL THEN  -- the caller's turn, not this session's (find_due_tenants)
        PERFORM set_config('queen.fire_turn', p_turn, false);
    END IF;
    IF (queen.get_cell_settings()).fire_paused THEN
        RETURN;
    END IF;
    SELECT array_agg(c) INTO v_rows
      FROM queen.claim_due_rows(v_claim, p_broker, p_limit, p_lease_ms, v_now, p_zstd_only, p_max_bytes) c;
    IF v_rows IS NULL THEN
        RETURN;
    END IF;
    IF coalesce(p_zstd_only, false) AND p_fair_after_ms IS NOT NULL
       AND (cardinality(v_rows) >= greatest(p_limit, 1)
            OR (SELECT sum(octet_length(r.payload)) FROM unnest(v_rows) r) >= p_max_bytes)
       AND (SELECT min(r.deliver_at) FROM unnest(v_rows) r)
           <= v_now - greatest(p_fair_after_ms, 0) * interval '1 millisecond' THEN
        SELECT array_agg(DISTINCT r.tenant) INTO v_in FROM unnest(v_rows) r;
        v_tenants := queen.find_due_tenants(v_now, p_limit, v_in, p_zstd => true);
        IF v_tenants IS NOT NULL THEN
            RETURN QUERY
            SELECT * FROM (SELECT * FROM unnest(v_rows)
                           UNION ALL
                           SELECT * FROM queen.claim_due_rows(
                               v_claim, p_broker, p_limit, p_lease_ms, v_now, true, p_max_bytes, v_tenants,
                               greatest(1, p_limit / (cardinality(v_tenants) + cardinality(v_in))))) r
             ORDER BY r.deliver_at, r.message_id;
            RETURN;
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM unnest(v_rows);
END
$$;

CREATE OR REPLACE FUNCTION queen.fire_timers(
    p_claim_id uuid,
    p_frames   queen.fire_frame[],
    p_now      timestamptz DEFAULT NULL)
RETURNS SETOF queen.fire_result
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan SET lock_timeout = '50ms' AS $$
DECLARE
    v_now  timestamptz := queen.finite_now(p_now);
    v_rows queen.timers[];
BEGIN
    WITH held AS (
        SELECT t.tenant, t.queue, t.timer_key
          FROM queen.timers t
          JOIN unnest(p_frames) f USING (tenant, queue, timer_key)
         WHERE t.claim_id = p_claim_id AND queen.timer_is_claimed(t.lease_until, v_now)
         ORDER BY t.tenant, t.queue, t.timer_key
           FOR UPDATE OF t
    ), gone AS (
        DELETE FROM queen.timers t USING held h
         WHERE (t.tenant, t.queue, t.timer_key) = (h.tenant, h.queue, h.timer_key)
        RETURNING t.*
    )
    SELECT array_agg(gone) INTO v_rows FROM gone;

    IF v_rows IS NOT NULL THEN
        RETURN QUERY SELECT * FROM queen.append_timer_frames(v_rows, p_frames);
    END IF;
    RETURN QUERY
    SELECT f.tenant, f.queue, f.timer_key, 'lost'::text, NULL::uuid, NULL::uuid, NULL::timestamptz, NULL::timestamptz
      FROM unnest(p_frames) f
     WHERE v_rows IS NULL
        OR NOT EXISTS (SELECT 1 FROM unnest(v_rows) r
                        WHERE (r.tenant, r.queue, r.timer_key) = (f.tenant, f.queue, f.timer_key));
END
$$;

CREATE OR REPLACE FUNCTION queen.fire_due_timers(
    p_limit integer     DEFAULT 100,
    p_now   timestamptz DEFAULT NULL,
    p_redo_duplicates boolean DEFAULT true,
    p_fair_after_ms integer DEFAULT 100,
    p_turn  text        DEFAULT NULL)
RETURNS SETOF queen.fire_result
LANGUAGE plpgsql AS $$
DECLARE
    v_now  timestamptz := queen.finite_now(p_now);
    v_out  queen.fire_result[];
BEGIN
    p_limit := coalesce(p_limit, 100);  -- NULL fired nothing (greatest() skipped it) (migration 042)
    IF p_turn IS NOT NULL THEN  -- the caller's turn, not this session's (find_due_tenants)
        PERFORM set_config('queen.fire_turn', p_turn, false);
    END IF;
    IF (queen.get_cell_settings()).fire_paused THEN
        RETURN;
    END IF;
    IF NOT coalesce(p_redo_duplicates, true) THEN
        v_out := queen.fire_due_batch(p_limit, v_now, p_fair_after_ms);
    ELSE
        BEGIN
            v_out := queen.fire_due_batch(p_limit, v_now, p_fair_after_ms);
        EXCEPTION
            WHEN unique_violation THEN
                -- the batch again (shares included), with the 'duplicate' answers
                BEGIN
                    v_out := queen.fire_due_batch(p_limit, v_now, p_fair_after_ms, p_redo => true);
                EXCEPTION WHEN lock_not_available THEN
                    RETURN QUERY SELECT * FROM queen.fire_due_apart(p_limit, v_now);
                    RETURN;
                END;
                RETURN QUERY SELECT * FROM unnest(v_out);
                RETURN;
            WHEN lock_not_available THEN
                -- a frame waited past 50 ms on its own tenant's transaction: tenant by tenant
                RETURN QUERY SELECT * FROM queen.fire_due_apart(p_limit, v_now);
                RETURN;
        END;
    END IF;
    IF v_out IS NULL THEN
        RETURN;
    END IF;
    -- One decrement per tenant, appended: no fire waits on a counter row.
    INSERT INTO queen.tenant_usage_deltas (tenant, pending_delta)
    SELECT o.tenant, -count(*) FROM unnest(v_out) o GROUP BY o.tenant;
    RETURN QUERY SELECT * FROM unnest(v_out);
END
$$;

CREATE OR REPLACE FUNCTION queen.inflate_timers(
    p_claim_id uuid,
    p_frames   queen.fire_frame[],
    p_now      timestamptz DEFAULT NULL)
RETURNS SETOF queen.fire_result
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan SET lock_timeout = '50ms' AS $$
DECLARE
    v_now timestamptz := queen.finite_now(p_now);
BEGIN
    RETURN QUERY
    WITH f AS (
        SELECT DISTINCT ON (x.tenant, x.queue, x.timer_key) x.* FROM unnest(p_frames) x
    ), done AS (
        UPDATE queen.timers t
           SET zstd_payload = t.payload, payload = f.payload, payload_zstd = false,
               claim_id = NULL, claimed_by = NULL, lease_until = NULL
          FROM f
         WHERE (t.tenant, t.queue, t.timer_key) = (f.tenant, f.queue, f.timer_key)
           AND f.payload IS NOT NULL AND t.payload_zstd
           AND t.claim_id = p_claim_id AND queen.timer_is_claimed(t.lease_until, v_now)
        RETURNING t.tenant, t.queue, t.timer_key
    )
    SELECT f.tenant, f.queue, f.timer_key,
           CASE WHEN d.timer_key IS NULL THEN 'lost' ELSE 'inflated' END,
           NULL::uuid, NULL::uuid, NULL::timestamptz, NULL::timestamptz
      FROM f LEFT JOIN done d ON (d.tenant, d.queue, d.timer_key) = (f.tenant, f.queue, f.timer_key);
END
$$;

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
    v_now   timestamptz := queen.finite_now(p_now);
    r       queen.timers;
    v_spend boolean;
    v_part  uuid;
BEGIN
    IF p_error_class IS NULL OR p_error_class NOT IN ('transient', 'permanent', 'config') THEN
        RAISE EXCEPTION 'timers_bad_request'
            USING ERRCODE = 'QTBAD', DETAIL = format('unknown failure class %L', p_error_class);
    END IF;
    -- NULL made deliver_at NULL (23502) or the attempts endless (migration 042)
    IF p_max_attempts IS NULL OR p_max_attempts < 1 OR p_backoff_ms IS NULL OR p_backoff_ms < 0
       OR p_backoff_max_ms IS NULL OR p_backoff_max_ms < 0 THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('p_max_attempts must be at least 1 and p_backoff_ms, p_backoff_max_ms at least 0, '
                            'got %s, %s, %s', p_max_attempts, p_backoff_ms, p_backoff_max_ms);
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
             ELSE format('acknowledgments[%s]: unknown status %L', x.n - 1, x.status)
           END INTO v_msg
      FROM unnest(p_acks) WITH ORDINALITY AS x(transaction_id, partition_id, status, error, lease_id, consumer_group, n)
     WHERE x.transaction_id IS NULL OR x.transaction_id = '' OR x.partition_id IS NULL
        OR NOT queen.log_name_fits(x.transaction_id) OR NOT queen.log_name_fits(x.consumer_group)
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

CREATE OR REPLACE FUNCTION queen.extend_lease(
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

CREATE OR REPLACE FUNCTION queen.apply_retention(
    p_limit integer     DEFAULT 1000,
    p_now   timestamptz DEFAULT NULL)
RETURNS TABLE (pending_deleted bigint, completed_deleted bigint, dlq_deleted bigint, partitions_skipped integer)
LANGUAGE plpgsql AS $$
DECLARE
    v_now       timestamptz := queen.finite_now(p_now);
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
