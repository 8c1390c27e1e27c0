-- Migration 025: the fire's choice of due rows does not depend on statistics.
-- queen.fire_due_rows, queen.claim_due_rows and queen.find_due_tenants run
-- with enable_seqscan, enable_bitmapscan and enable_sort off, so that their
-- plans walk the deliver_at indexes in order and stop at their LIMIT. An
-- autovacuum ANALYZE that ran while a bulk load was not yet committed left
-- queen.timers "empty" over thousands of pages: every plan took all due rows
-- by a bitmap scan and sorted them, at every batch, until the next ANALYZE
-- (a backlog of 1,000,000 fired at half speed, and another tenant's timer
-- waited 460-670 ms). And jit off: the cost of a disabled node an
-- unavoidable sort carries crosses jit_above_cost. The bodies are unchanged.
-- The settings equal sql/schema/40_fire.sql.

ALTER FUNCTION queen.claim_due_rows(uuid, text, integer, integer, timestamptz, boolean, bigint, text[], integer)
    SET enable_seqscan = off;
ALTER FUNCTION queen.claim_due_rows(uuid, text, integer, integer, timestamptz, boolean, bigint, text[], integer)
    SET enable_bitmapscan = off;
ALTER FUNCTION queen.claim_due_rows(uuid, text, integer, integer, timestamptz, boolean, bigint, text[], integer)
    SET enable_sort = off;
ALTER FUNCTION queen.claim_due_rows(uuid, text, integer, integer, timestamptz, boolean, bigint, text[], integer)
    SET jit = off;

ALTER FUNCTION queen.find_due_tenants(timestamptz, integer, text[], boolean) SET enable_seqscan = off;
ALTER FUNCTION queen.find_due_tenants(timestamptz, integer, text[], boolean) SET enable_bitmapscan = off;
ALTER FUNCTION queen.find_due_tenants(timestamptz, integer, text[], boolean) SET enable_sort = off;
ALTER FUNCTION queen.find_due_tenants(timestamptz, integer, text[], boolean) SET jit = off;

ALTER FUNCTION queen.fire_due_rows(integer, timestamptz, text[], integer, boolean) SET enable_seqscan = off;
ALTER FUNCTION queen.fire_due_rows(integer, timestamptz, text[], integer, boolean) SET enable_bitmapscan = off;
ALTER FUNCTION queen.fire_due_rows(integer, timestamptz, text[], integer, boolean) SET enable_sort = off;
ALTER FUNCTION queen.fire_due_rows(integer, timestamptz, text[], integer, boolean) SET jit = off;
