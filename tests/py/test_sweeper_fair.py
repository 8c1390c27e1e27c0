"""The sweeper behind a backlog: one tenant's due timers do not hold another
tenant's until they are all fired (queen.fire_due_batch adds the share of each
tenant a full, late batch left out)."""

from __future__ import annotations

from sweeper_support import (  # noqa: F401  (fixtures)
    BATCH, schedule, sdb, sweeper_broker, timer, timer_count, wait_until,
)

# the log in append order: seq is the log's identity, one broker fires batch after batch
LOG_ORDER = """
SELECT q.tenant FROM queen.messages m
  JOIN queen.partitions p ON p.id = m.partition_id JOIN queen.queues q ON q.id = p.queue_id
 ORDER BY m.seq
"""


def schedule_due(conn, tenant: str, n: int, delay_ms: int, compressed: bool = False) -> None:
    """n timers of tenant, all due delay_ms from now (negative: already due), through schedule_timers;
    compressed: their payload stored as zstd (the leased path's)."""
    schedule(conn, [timer("fair", f"{tenant}-{g}", delay_ms, b"{}", compressed=compressed) for g in range(n)],
             tenant=tenant)


def fire_all(sdb, sweeper_broker) -> list[str]:
    sweeper_broker(QUEEN_SWEEPER_BATCH=BATCH)  # the helper's schedule batch too
    sdb.execute("SELECT queen.resume_fire()")
    wait_until(lambda: timer_count(sdb) == 0, 120, message="every timer fired")
    return [r["tenant"] for r in sdb.execute(LOG_ORDER).fetchall()]


def test_another_tenants_timer_fires_in_the_first_batch_behind_a_backlog(sdb, sweeper_broker):
    # 20,000 of tenant A due 2 s ago, then one of tenant B due 1 s ago; in expiry order B's
    # frame would be the 20,001st in the log.
    sdb.execute("SELECT queen.pause_fire()")
    schedule_due(sdb, "fair-a", 20_000, -2000)
    schedule_due(sdb, "fair-b", 1, -1000)
    order = fire_all(sdb, sweeper_broker)
    assert len(order) == 20_001
    assert order.count("fair-b") == 1
    # the first batch: A's BATCH oldest, then B's one (its share, appended after them)
    assert order.index("fair-b") <= BATCH, order.index("fair-b")


def test_two_backlogs_share_every_batch(sdb, sweeper_broker):
    # 5,000 of A due before 5,000 of B. Expiry order alone: the first 5,000 frames all A's. Each
    # batch is A's BATCH oldest and B's share, BATCH / 2 tenants: a third of the first 2,000 frames.
    sdb.execute("SELECT queen.pause_fire()")
    schedule_due(sdb, "fair-a", 5_000, -3000)
    schedule_due(sdb, "fair-b", 5_000, -2000)
    order = fire_all(sdb, sweeper_broker)
    assert len(order) == 10_000
    first = order[:2000]
    assert 600 <= first.count("fair-b") <= 700, first.count("fair-b")


def test_the_leased_path_shares_too(sdb, sweeper_broker):
    # zstd payloads go through the leased path (claim_timers): the same shares.
    sdb.execute("SELECT queen.pause_fire()")
    schedule_due(sdb, "fair-a", 3_000, -2000, compressed=True)
    schedule_due(sdb, "fair-b", 1, -1000, compressed=True)
    order = fire_all(sdb, sweeper_broker)
    assert len(order) == 3_001
    assert order.index("fair-b") <= BATCH, order.index("fair-b")
