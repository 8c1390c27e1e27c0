"""One tenant's open transaction never holds another tenant's fire (migration 031).

A frame can wait only on a transaction of its own tenant: the queue or partition that
transaction is creating, or a message of the same txn it is pushing into the same
partition. A batch holds many tenants' frames, so before migration 031 one tenant's
push of 10,000 items that created the queue of its due timer held every tenant's fire
for 1-2 s at a time (Dec 7 audit). Now the fire waits at most 50 ms for a lock; the
sweeper's redo path then fires tenant by tenant, leaving the waiting tenant for the
next cycle with its rows untouched, and nothing is lost or fired twice.
"""

from __future__ import annotations

import time

import psycopg
import pytest
from psycopg.rows import dict_row

from sweeper_support import (  # noqa: F401  (fixtures)
    messages, schedule, sdb, sweeper_broker, timer, timer_count, wait_until,
)

SWEEPER_FIRE = "SELECT * FROM queen.fire_due_timers(256, p_redo_duplicates => false)"
SWEEPER_REDO = "SELECT * FROM queen.fire_due_timers(256)"


@pytest.fixture
def holder(database_url):
    """A second session whose transaction stays open until the test commits it."""
    with psycopg.connect(database_url, row_factory=dict_row) as conn:
        yield conn


def fired(rows) -> dict[tuple[str, str], str]:
    return {(r["tenant"], r["timer_key"]): r["outcome"] for r in rows}


def fire_as_the_sweeper(sdb) -> tuple[dict, float]:
    """The sweeper's two statements: the plain one, then the redo on a lock timeout or a duplicate."""
    sdb.execute("SET statement_timeout = '10s'")
    t = time.monotonic()
    try:
        rows = sdb.execute(SWEEPER_FIRE).fetchall()
    except (psycopg.errors.LockNotAvailable, psycopg.errors.UniqueViolation):
        rows = sdb.execute(SWEEPER_REDO).fetchall()
    return fired(rows), time.monotonic() - t


@pytest.mark.parametrize("blocker", ["queue", "partition", "txn"])
def test_a_tenants_open_transaction_holds_only_its_own_timer(sdb, holder, blocker):
    schedule(sdb, [timer("held-q", "a1", -1000, b'{"a":1}', txn="same-txn", partition="p1")], tenant="acme")
    schedule(sdb, [timer("free-q", "b1", -500, b'{"b":1}')], tenant="globex")
    if blocker == "partition":  # the queue exists; the partition is being created
        sdb.execute("SELECT queen.ensure_queue('acme', 'held-q')")
    if blocker == "txn":  # the partition exists; a message of the same txn is being pushed into it
        sdb.execute("SELECT queen.ensure_partition('acme', 'held-q', 'p1')")
        holder.execute("""SELECT * FROM queen.push_messages('acme', ARRAY[ROW('held-q', 'p1', 'same-txn', NULL,
                              convert_to('{"pushed":1}', 'UTF8'), false)::queen.push_item])""")
    else:
        holder.execute("SELECT queen.ensure_partition('acme', 'held-q', 'p1')")
    # acme's transaction is open: globex's timer fires, acme's stays, and the fire did not
    # wait for acme (before migration 031 it waited until the statement timeout)
    out, took = fire_as_the_sweeper(sdb)
    assert out == {("globex", "b1"): "fired"}
    assert took < 2, took
    assert [r["timer_key"] for r in sdb.execute("SELECT timer_key FROM queen.timers").fetchall()] == ["a1"]
    holder.commit()
    out, _ = fire_as_the_sweeper(sdb)
    assert out == {("acme", "a1"): "duplicate" if blocker == "txn" else "fired"}
    assert timer_count(sdb) == 0
    frames = sorted((m["queue"], m["txn"]) for m in messages(sdb))
    assert frames == [("free-q", "txn-free-q-b1"), ("held-q", "same-txn")]  # each once
    # the pending counters: both timers gone, once each
    sdb.execute("SELECT queen.fold_pending_deltas(1000)")
    assert sdb.execute("SELECT coalesce(sum(queen.get_pending_timers(t)), 0) AS n "
                       "FROM unnest(ARRAY['acme', 'globex']) t").fetchone()["n"] == 0


def test_the_sweeper_fires_the_other_tenants_while_one_holds_its_queue_open(sdb, holder, sweeper_broker):
    holder.execute("SELECT queen.ensure_partition('acme', 'held-q', 'Default')")  # open until commit
    sweeper_broker()
    schedule(sdb, [timer("held-q", f"a{i}", -1000, b"{}") for i in range(50)], tenant="acme")
    schedule(sdb, [timer("free-q", f"b{i}", 0, b"{}") for i in range(50)], tenant="globex")
    # globex's timers fire while acme's transaction stays open (a zstd one through the leased path too)
    schedule(sdb, [timer("free-q", "bz", 0, b'{"z":1}', compressed=True)], tenant="globex")
    # the sweeper end to end (the SQL-level test above is the one that fails without
    # migration 031; here the sweeper's row-by-row retry also got globex's through)
    wait_until(lambda: sdb.execute("SELECT count(*) AS n FROM queen.timers WHERE tenant = 'globex'")
               .fetchone()["n"] == 0, 3, message="globex's timers fired behind acme's open transaction")
    assert sdb.execute("SELECT count(*) AS n FROM queen.timers WHERE tenant = 'acme'").fetchone()["n"] == 50
    holder.commit()
    wait_until(lambda: timer_count(sdb) == 0, 20, message="acme's timers fired once its transaction ended")
    got = messages(sdb)
    assert len(got) == 101 and len({(m["queue"], m["txn"]) for m in got}) == 101
