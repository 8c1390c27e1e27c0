"""A tenant's dead letters are paged by an index of their own (migration 032).

Before, queen.list_dlq reached the tenant through the partition and the queue and sorted
every dead letter of the tenant for each page: with a million, 3.4 s for the first page and
the statement timeout's 503 for a deep one (Dec 7 audit). The pages, their order, their
filters and the count are what they were; what a page reads is its own rows.
"""

from __future__ import annotations

import psycopg
import pytest

N = 20_000


@pytest.fixture
def dead(db):
    """N dead letters of acme over two queues (two groups), 3 of globex; failed_at spread, some tied."""
    for tenant, queue in (("acme", "q1"), ("acme", "q2"), ("globex", "q1")):
        db.execute("SELECT queen.ensure_partition(%s, %s, 'Default')", (tenant, queue))
    db.execute("""
        INSERT INTO queen.dead_letter_queue (message_id, partition_id, consumer_group, transaction_id, payload, failed_at)
        SELECT gen_random_uuid(), p.id, CASE WHEN g %% 3 = 0 THEN 'g3' ELSE 'workers' END, 't' || g, '\\x7b7d',
               timestamptz '2030-01-01' + (g / 2) * interval '1 second'
          FROM generate_series(1, %s) g
          JOIN queen.queues q ON q.tenant = 'acme' AND q.name = CASE WHEN g %% 2 = 0 THEN 'q1' ELSE 'q2' END
          JOIN queen.partitions p ON p.queue_id = q.id""", (N,))
    db.execute("""
        INSERT INTO queen.dead_letter_queue (message_id, partition_id, consumer_group, transaction_id, payload)
        SELECT gen_random_uuid(), p.id, 'workers', 'g' || g, '\\x7b7d'
          FROM generate_series(1, 3) g, queen.queues q JOIN queen.partitions p ON p.queue_id = q.id
         WHERE q.tenant = 'globex'""")
    db.execute("ANALYZE queen.dead_letter_queue")
    return db


def reference(db, tenant, queue=None, group=None, limit=100, offset=0):
    return [r["id"] for r in db.execute("""
        SELECT d.id FROM queen.dead_letter_queue d JOIN queen.partitions p ON p.id = d.partition_id
          JOIN queen.queues q ON q.id = p.queue_id
         WHERE q.tenant = %s AND (%s::text IS NULL OR q.name = %s) AND (%s::text IS NULL OR d.consumer_group = %s)
         ORDER BY d.failed_at DESC, d.id DESC LIMIT %s OFFSET %s""",
        (tenant, queue, queue, group, group, limit, offset)).fetchall()]


def page(db, tenant, queue=None, group=None, limit=100, offset=0):
    return [r["dlq_id"] for r in db.execute("SELECT dlq_id FROM queen.list_dlq(%s, %s, %s, %s, %s)",
                                        (tenant, queue, group, limit, offset)).fetchall()]


def test_every_dead_letter_carries_its_partitions_tenant_whoever_inserted_it(dead):
    got = dead.execute("""SELECT count(*) FILTER (WHERE d.tenant IS DISTINCT FROM q.tenant) AS wrong, count(*) AS n
                            FROM queen.dead_letter_queue d JOIN queen.partitions p ON p.id = d.partition_id
                            JOIN queen.queues q ON q.id = p.queue_id""").fetchone()
    assert got == {"wrong": 0, "n": N + 3}
    # a tenant given by the inserter is not believed
    dead.execute("""INSERT INTO queen.dead_letter_queue (message_id, partition_id, consumer_group, transaction_id,
                                                         payload, tenant)
                    SELECT gen_random_uuid(), p.id, 'w', 'forged', '\\x00', 'globex'
                      FROM queen.partitions p JOIN queen.queues q ON q.id = p.queue_id
                     WHERE q.tenant = 'acme' AND q.name = 'q1'""")
    assert dead.execute("SELECT tenant FROM queen.dead_letter_queue WHERE transaction_id = 'forged'"
                        ).fetchone()["tenant"] == "acme"


@pytest.mark.parametrize("queue, group, limit, offset", [
    (None, None, 100, 0), (None, None, 1000, 0), (None, None, 10, 19_990), (None, None, 50, 7_777),
    ("q1", None, 100, 0), ("q2", None, 20, 9_000), (None, "g3", 100, 500), ("q1", "g3", 30, 100),
    (None, None, 100, N + 10),
])
def test_pages_filters_and_count_are_the_joined_order(dead, queue, group, limit, offset):
    assert page(dead, "acme", queue, group, limit, offset) == reference(dead, "acme", queue, group, limit, offset)
    assert dead.execute("SELECT queen.count_dlq('acme', %s, %s) AS n", (queue, group)).fetchone()["n"] == \
        len(reference(dead, "acme", queue, group, 10 ** 9, 0))
    assert len(page(dead, "globex")) == 3 and dead.execute("SELECT queen.count_dlq('globex') AS n").fetchone()["n"] == 3


def test_the_first_page_reads_its_own_rows_not_the_tenants_whole_dlq(dead, database_url):
    # one transaction's own counters (pg_stat_xact_user_tables): before migration 032 the page
    # joined and sorted all 20,000 of acme's dead letters
    counters = """SELECT seq_scan, coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables
                   WHERE relid = 'queen.dead_letter_queue'::regclass"""
    with psycopg.connect(database_url) as conn:
        conn.execute("SELECT * FROM queen.list_dlq('acme', NULL, NULL, 10, 0)").fetchall()
        assert conn.execute(counters).fetchone() == (0, 10)
    # the count reads the tenant's index entries (index-only once vacuumed), not the other tenants'
    dead.execute("VACUUM queen.dead_letter_queue")
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT queen.count_dlq('globex')").fetchone()[0] == 3
        assert conn.execute(counters).fetchone()[0] == 0
