-- Migration 023: the fair share's turn carried by the caller.
-- queen.find_due_tenants starts its 64 candidates after the last tenant the
-- session probed (the setting queen.fire_turn). Behind a transaction pooler
-- with no QUEEN_DIRECT_DATABASE_URL, each of the sweeper's calls may run on
-- another server connection, whose setting is another caller's: a batch
-- started from that connection's turn, and the ceil(n / 64) batches a tenant
-- past its bound waits to be probed could grow by the pool's size.
-- queen.fire_due_timers and queen.claim_timers take p_turn (NULL: the
-- session's, as before), set before anything; the sweeper passes its own
-- and reads the new one back in the same statement.
-- The text equals sql/schema/40_fire.sql.

DROP FUNCTION queen.claim_timers(text, integer, integer, timestamptz, boolean, bigint, integer);
DROP FUNCTION queen.fire_due_timers(integer, timestamptz, boolean, integer);

-- Claim up to p_limit due timers for p_lease_ms, in expiry order (and
-- returned in it), skipping rows another session holds. A row whose
-- lease expired (its broker died) is due again. Nothing is claimed
-- while the fire is paused. p_zstd_only: only rows whose frame needs the
-- broker (zstd to inflate); fire_due_timers takes the rest, lease-free.
-- p_max_bytes (NULL: no bound) bounds the stored payload bytes claimed
-- (see queen.claim_due_rows). With p_zstd_only, behind a backlog (the
-- claim came back full, by rows or bytes, and its oldest row was due
-- p_fair_after_ms ago or more) each tenant with due zstd rows that the
-- claim left out also gets up to p_limit / (the number of tenants with due
-- zstd rows) of its oldest, under the same claim and a second p_max_bytes:
-- as queen.fire_due_batch does for the fast path.
CREATE FUNCTION queen.claim_timers(
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

-- Claim and fire in one transaction: the row lock is the claim, so no
-- lease is needed and a broker dying mid-call loses nothing (the
-- transaction rolls back). Used for every due timer whose frame needs
-- nothing from the broker (no zstd to inflate). Expiry order, SKIP LOCKED;
-- behind a backlog (a full batch whose oldest row was due p_fair_after_ms
-- ago or more) the tenants it left out get their share of the batch too
-- (queen.fire_due_batch).
-- The common case is a statement with a plain INSERT (no join back from
-- the log, no ON CONFLICT arbiter: together they halved the fire rate),
-- queen.fire_due_rows. A txn already in its partition raises
-- unique_violation there. With p_redo_duplicates (the default) the batch
-- runs in a subtransaction and is redone (in expiry order) through
-- append_timer_frames, which answers 'duplicate'. The sweeper passes false: no subtransaction
-- on its common path; a duplicate fails its call (which rolls back whole)
-- and it calls again with true.
CREATE FUNCTION queen.fire_due_timers(
    p_limit integer     DEFAULT 100,
    p_now   timestamptz DEFAULT NULL,
    p_redo_duplicates boolean DEFAULT true,
    p_fair_after_ms integer DEFAULT 100,
    p_turn  text        DEFAULT NULL)
RETURNS SETOF queen.fire_result
LANGUAGE plpgsql AS $$
DECLARE
    v_now  timestamptz := coalesce(p_now, now());
    v_out  queen.fire_result[];
BEGIN
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
        EXCEPTION WHEN unique_violation THEN
            -- the batch again (shares included), with the 'duplicate' answers
            RETURN QUERY SELECT * FROM unnest(queen.fire_due_batch(p_limit, v_now, p_fair_after_ms, p_redo => true));
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
