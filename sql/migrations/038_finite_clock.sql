-- Migration 038: an infinite p_now (the test clock, from psql) was stored where
-- it does lasting harm; it is refused with QTBAD, as queen.schedule_timers has
-- refused it since migration 034:
-- * queen.take_rate_tokens: the bucket's refilled_at; every later batch of the
--   tenant failed ("cannot subtract infinite timestamps");
-- * queen.claim_timers: the claim's lease; its timers never fired;
-- * queen.pop_messages: the consumer's lease; its frames were never delivered again.
-- And the rate refusal's DETAIL said "-1 available" after a batch larger than
-- the burst left the bucket in debt: it says 0.

CREATE OR REPLACE FUNCTION queen.take_rate_tokens(
    p_tenant text,
    p_ops    integer,
    p_rate   numeric,
    p_burst  numeric,
    p_now    timestamptz DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_now    timestamptz := coalesce(p_now, now());
    v_burst  numeric := greatest(coalesce(p_burst, p_rate), 1);
    v_tokens numeric;
    v_wait   numeric;
BEGIN
    IF p_rate IS NULL OR p_ops <= 0 THEN
        RETURN;
    END IF;
    -- an infinite instant would be stored (every later refill of the bucket fails) (migration 038)
    IF NOT isfinite(v_now) THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('p_now must be a finite time, got %s', v_now);
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
    v_now     timestamptz := coalesce(p_now, now());
    v_claim   uuid := gen_random_uuid();
    v_rows    queen.claimed_timer[];
    v_in      text[];
    v_tenants text[];
BEGIN
    -- an infinite instant would be stored (a claim held forever: its timers would never fire) (migration 038)
    IF NOT isfinite(v_now) THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('p_now must be a finite time, got %s', v_now);
    END IF;
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
    -- an infinite instant would be stored (a lease that never ends: its frames would never be delivered again) (migration 038)
    IF NOT isfinite(v_now) THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('p_now must be a finite time, got %s', v_now);
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
