-- =====================================================================
-- Part 20: the minimal Queen-compatible log a timer fires into
-- =====================================================================

-- ---------------------------------------------------------------------
-- Tables
-- ---------------------------------------------------------------------

-- A queue belongs to one tenant: its name is unique per tenant, not per
-- cell, and another tenant's queue of the same name is a different queue
-- (invisible to the first). With QUEEN_AUTH=off every queue is 'default's.
-- tenant is the last column because migration 002 added it.
CREATE TABLE queen.queues (
    id                           uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    name                         text NOT NULL,
    namespace                    text,
    task                         text,
    lease_time                   integer NOT NULL DEFAULT 300,    -- seconds
    retry_limit                  integer NOT NULL DEFAULT 3,
    retry_delay                  integer NOT NULL DEFAULT 1000,   -- ms, stored and echoed (as Queen)
    max_size                     integer NOT NULL DEFAULT 0,
    ttl                          integer NOT NULL DEFAULT 3600,
    priority                     integer NOT NULL DEFAULT 0,
    delayed_processing           integer NOT NULL DEFAULT 0,
    window_buffer                integer NOT NULL DEFAULT 0,
    retention_seconds            integer NOT NULL DEFAULT 0,
    completed_retention_seconds  integer NOT NULL DEFAULT 0,
    retention_enabled            boolean NOT NULL DEFAULT false,
    encryption_enabled           boolean NOT NULL DEFAULT false,
    dead_letter_queue            boolean NOT NULL DEFAULT false,
    dlq_after_max_retries        boolean NOT NULL DEFAULT false,
    max_wait_time_seconds        integer NOT NULL DEFAULT 0,
    created_at                   timestamptz NOT NULL DEFAULT now(),
    updated_at                   timestamptz NOT NULL DEFAULT now(),
    tenant                       text NOT NULL DEFAULT 'default',
    CONSTRAINT queue_name_not_empty CHECK (name <> ''),
    CONSTRAINT queues_tenant_name_unique UNIQUE (tenant, name)
);

CREATE TABLE queen.partitions (
    id          uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    queue_id    uuid NOT NULL REFERENCES queen.queues (id) ON DELETE CASCADE,
    name        text NOT NULL DEFAULT 'Default',
    created_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT partitions_queue_name_unique UNIQUE (queue_id, name),
    CONSTRAINT partition_name_not_empty CHECK (name <> '')
);

-- Frames. The log order inside a partition is (xid, seq): xid is the
-- appending transaction's id (a 64-bit xid8, which never wraps and goes
-- on across a failover), seq the append order inside that transaction.
-- Writers take no partition lock, so any number of them (brokers firing,
-- pushes) append to one partition at once; a consumer reads only the
-- frames below queen.log_read_horizon() (every other transaction with a
-- smaller xid has ended), so nothing can commit behind its cursor later.
-- Rows older than migration 008 have xid 0 (all committed before it).
-- xid is the last column because migration 008 added it.
CREATE TABLE queen.messages (
    id              uuid PRIMARY KEY,
    seq             bigint GENERATED ALWAYS AS IDENTITY,
    transaction_id  text NOT NULL,
    trace_id        uuid,
    partition_id    uuid NOT NULL REFERENCES queen.partitions (id) ON DELETE CASCADE,
    payload         bytea NOT NULL,
    is_encrypted    boolean NOT NULL DEFAULT false,
    producer_sub    text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    xid             xid8 NOT NULL DEFAULT pg_current_xact_id(),
    CONSTRAINT messages_partition_transaction_unique UNIQUE (partition_id, transaction_id)
);
CREATE INDEX messages_partition_xid_seq_idx ON queen.messages (partition_id, xid, seq);

-- A consumer group's cursor and lease on one partition (Queen's
-- partition_consumers). '__QUEUE_MODE__' is the competing-consumers group.
-- The cursor is the log position (last_consumed_xid, last_consumed_seq)
-- of the last frame consumed, and (batch_last_xid, batch_last_seq) the
-- last frame of the batch a lease covers (see queen.messages). The xid
-- columns are last because migration 008 added them.
CREATE TABLE queen.partition_consumers (
    partition_id        uuid NOT NULL REFERENCES queen.partitions (id) ON DELETE CASCADE,
    consumer_group      text NOT NULL,
    last_consumed_seq   bigint NOT NULL DEFAULT 0,
    lease_id            uuid,
    lease_expires_at    timestamptz,
    batch_size          integer NOT NULL DEFAULT 0,
    acked_count         integer NOT NULL DEFAULT 0,
    batch_retry_count   integer NOT NULL DEFAULT 0,
    batch_last_seq      bigint,
    updated_at          timestamptz NOT NULL DEFAULT now(),
    last_consumed_xid   xid8 NOT NULL DEFAULT '0',
    batch_last_xid      xid8,
    PRIMARY KEY (partition_id, consumer_group)
);
-- A lease by its id (execute_transaction's requiredLeases). Partial: a
-- cursor holds a lease only between a pop and the ack that ends its batch.
CREATE INDEX partition_consumers_lease_idx ON queen.partition_consumers (lease_id)
    WHERE lease_id IS NOT NULL;

-- Dead letters, per queue (through the partition) and consumer group.
-- A timer that exhausted its attempts lands here under the synthetic
-- group '__QUEEN_TIMERS__'; its frame never entered the log, so the row
-- carries the payload itself and message_id is not a foreign key.
CREATE TABLE queen.dead_letter_queue (
    id                   uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    message_id           uuid NOT NULL,
    partition_id         uuid NOT NULL REFERENCES queen.partitions (id) ON DELETE CASCADE,
    consumer_group       text NOT NULL,
    transaction_id       text NOT NULL,
    payload              bytea NOT NULL,
    is_encrypted         boolean NOT NULL DEFAULT false,
    payload_zstd         boolean NOT NULL DEFAULT false,  -- a timer's zstd payload, dead-lettered as stored
    producer_sub         text,
    error_message        text,
    retry_count          integer NOT NULL DEFAULT 0,
    original_created_at  timestamptz,
    failed_at            timestamptz NOT NULL DEFAULT now(),
    timer_tenant         text,            -- set for timer dead letters
    timer_key            text COLLATE "C", -- set for timer dead letters
    tenant               text NOT NULL    -- the partition's queue's, set by queen.set_dlq_tenant
);
CREATE INDEX dead_letter_queue_partition_idx ON queen.dead_letter_queue (partition_id, failed_at DESC);
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

-- ---------------------------------------------------------------------
-- Functions
-- ---------------------------------------------------------------------

-- Whether a queue name, partition name or transaction id fits the log:
-- at most 255 bytes of UTF-8 (Queen's varchar(255) columns). NULL fits
-- (absent). The log functions raise QTBAD for a name that does not.
CREATE FUNCTION queen.log_name_fits(p_value text)
RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT p_value IS NULL OR octet_length(p_value) <= 255
$$;

-- The tenant's queue id, creating the queue with defaults when it does
-- not exist yet (queues and partitions are created on first use, as in
-- Queen).
CREATE FUNCTION queen.ensure_queue(p_tenant text, p_queue text)
RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid;
BEGIN
    SELECT id INTO v_id FROM queen.queues WHERE tenant = p_tenant AND name = p_queue;
    IF FOUND THEN
        RETURN v_id;
    END IF;
    -- a name the broker refuses is refused here too, as QTBAD (not the table's 23502/23514)
    IF coalesce(p_tenant, '') = '' OR coalesce(p_queue, '') = '' OR NOT queen.log_name_fits(p_queue) THEN
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('tenant and queue are required, the queue at most 255 bytes (got %s bytes)',
                            octet_length(p_queue));
    END IF;
    INSERT INTO queen.queues (tenant, name, namespace, task)
    VALUES (p_tenant, p_queue, nullif(split_part(p_queue, '.', 1), p_queue), nullif(split_part(p_queue, '.', 2), ''))
    ON CONFLICT (tenant, name) DO NOTHING
    RETURNING id INTO v_id;
    IF v_id IS NULL THEN
        SELECT id INTO v_id FROM queen.queues WHERE tenant = p_tenant AND name = p_queue;
    END IF;
    RETURN v_id;
END
$$;

-- The partition's id (of the tenant's queue), created on first use. No
-- lock is taken: appends need none (see queen.messages). A partition that
-- exists (the common case) is one lookup, with no call of ensure_queue: the
-- fire calls this once per destination partition of a batch, and a batch
-- into 256 tenants' queues spent 10-20 ms in the two calls (migration 022).
-- enable_seqscan off: the session keeps the lookup's plan, and one made while
-- the cell had a page of queues would read every queue at each call later.
CREATE FUNCTION queen.ensure_partition(p_tenant text, p_queue text, p_partition text DEFAULT 'Default')
RETURNS uuid
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    v_queue_id uuid;
    v_id uuid;
BEGIN
    SELECT p.id INTO v_id
      FROM queen.queues q JOIN queen.partitions p ON p.queue_id = q.id
     WHERE q.tenant = p_tenant AND q.name = p_queue AND p.name = coalesce(p_partition, 'Default');
    IF FOUND THEN
        RETURN v_id;
    END IF;
    v_queue_id := queen.ensure_queue(p_tenant, p_queue);
    IF p_partition = '' OR NOT queen.log_name_fits(p_partition) THEN  -- QTBAD, not the table's 23514
        RAISE EXCEPTION 'timers_bad_request' USING ERRCODE = 'QTBAD',
            DETAIL = format('a partition is 1 to 255 bytes (got %s bytes)', octet_length(p_partition));
    END IF;
    INSERT INTO queen.partitions (queue_id, name)
    VALUES (v_queue_id, coalesce(p_partition, 'Default'))
    ON CONFLICT (queue_id, name) DO NOTHING
    RETURNING id INTO v_id;
    IF v_id IS NULL THEN
        SELECT id INTO v_id FROM queen.partitions
         WHERE queue_id = v_queue_id AND name = coalesce(p_partition, 'Default');
    END IF;
    RETURN v_id;
END
$$;

-- The read horizon of the log: a consumer may read (and move its cursor
-- to) a frame only if its xid is below this. It is the xmin of the
-- calling statement's snapshot: every transaction with a smaller xid has
-- ended, and every xid assigned later is larger, so no frame can ever
-- commit before a position a cursor took from below the horizon. The
-- caller's own frames are readable too (as they were before) when its
-- own xid is that xmin (no older transaction runs): the horizon is then
-- its xid + 1, and a frame it appends later gets a larger seq. Call it
-- before the statements that read the log (under READ COMMITTED they
-- take newer snapshots, which see every transaction below it ended).
CREATE FUNCTION queen.log_read_horizon()
RETURNS xid8
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN pg_current_xact_id_if_assigned() = pg_snapshot_xmin(s)
                THEN (pg_snapshot_xmin(s)::text::bigint + 1)::text::xid8
                ELSE pg_snapshot_xmin(s) END
      FROM pg_current_snapshot() s
$$;
