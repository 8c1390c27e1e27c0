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


def test_the_sweepers_statements_read_back_the_turn(sdb):
    # The sweeper carries the fair share's turn (migration 023): each statement passes it and
    # reads back, in the same statement, the turn the call left (the last tenant it probed).
    # 'aa-big': 10 plain and 10 zstd timers due 3 s ago; tt-00 .. tt-69 one of each, due 2 s ago.
    from queen_timers.sweeper import CLAIM, FIRE_DUE, FIRE_DUE_REDO
    big = [timer("fair", f"big-{z}{g}", -3000, b"{}", compressed=z == "z") for g in range(10) for z in "pz"]
    schedule(sdb, big, tenant="aa-big")
    for i in range(70):
        schedule(sdb, [timer("fair", f"one-{z}", -2000, b"{}", compressed=z == "z") for z in "pz"],
                 tenant=f"tt-{i:02d}")
    sdb.execute("SELECT set_config('queen.fire_turn', 'tt-50', false)")  # another caller's turn

    def turn_after(sql: str, params: tuple) -> str:
        rows = sdb.execute(sql, params).fetchall()
        assert rows and len({r["turn"] for r in rows}) == 1
        return rows[0]["turn"]

    # a full claim of aa-big's oldest 5 zstd timers: then 64 candidates after tt-10, wrapping
    assert turn_after(CLAIM, ("b1", 5, 60000, True, 1 << 20, "tt-10")) == "tt-04"
    # the fast path, both statements: after tt-30 (tt-31 .. tt-69, tt-00 .. tt-24), after tt-24
    assert turn_after(FIRE_DUE, (5, "tt-30")) == "tt-24"
    assert turn_after(FIRE_DUE_REDO, (5, "tt-24")) == "tt-18"
    # a batch that probes nobody hands back the turn it was given
    sdb.execute("SELECT queen.pause_fire()")
    assert turn_after(FIRE_DUE, (5, "tt-42")) == "tt-42"
