"""Several brokers on one database: no loss and no duplicate, and a broker
killed while holding claims loses nothing (another fires after the lease)."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from sweeper_support import (  # noqa: F401  (fixtures)
    messages, sample, schedule, scrape, sdb, sweeper_broker, sweeper_url, timer, timer_count, wait_until,
)

pytestmark = pytest.mark.slow


def assert_each_txn_once(conn, expected: dict[str, bytes]) -> None:
    dupes = conn.execute("""SELECT transaction_id, count(*) AS n FROM queen.messages
                             GROUP BY transaction_id HAVING count(*) > 1 LIMIT 5""").fetchall()
    assert dupes == []
    got = {m["txn"]: bytes(m["payload"]) for m in messages(conn)}
    assert got.keys() == expected.keys(), (len(got), len(expected))
    wrong = [t for t, p in expected.items() if got[t] != p]
    assert wrong == [], wrong[:5]


def test_three_brokers_fire_ten_thousand_timers_exactly_once(sdb, sweeper_broker):
    brokers = [sweeper_broker(QUEEN_BROKER_ID=f"multi-{n}") for n in range(3)]
    total = 10_000
    timers, expected = [], {}
    for i in range(total):
        payload = b'{"i":%d,"pad":"%s"}' % (i, b"p" * (i % 50))
        t = timer(f"mq{i % 4}", f"k{i:05d}", (i * 2000) // total, payload, compressed=(i % 3 == 0))
        timers.append(t)
        expected[t["txn"]] = payload
    schedule(sdb, timers)

    wait_until(lambda: timer_count(sdb) == 0, 120, interval=0.25, message="all 10,000 timers fired")
    assert_each_txn_once(sdb, expected)

    fired, duplicates, per_broker = 0.0, 0.0, []
    for b in brokers:
        r, s = scrape(b)
        assert r.status_code == 200
        per_broker.append(sample(s, "queen_timers_fired_total", outcome="fired"))
        duplicates += sample(s, "queen_timers_fired_total", outcome="duplicate")
    fired = sum(per_broker)
    assert fired == total, per_broker
    assert duplicates == 0
    # the cell really shared the work (SKIP LOCKED claims, not one broker doing it all)
    assert sum(1 for n in per_broker if n > 0) >= 2, per_broker


def test_broker_killed_holding_claims_loses_nothing(sdb, sweeper_broker):
    lease_ms = 1500
    # big zstd payloads widen the window between claim and fire (inflate + send)
    victim = sweeper_broker(QUEEN_BROKER_ID="victim", QUEEN_SWEEPER_LEASE_MS=lease_ms, QUEEN_SWEEPER_BATCH=64)
    pid = victim.proc.pid
    expected: dict[str, bytes] = {}
    held_rows = "SELECT count(*) AS n FROM queen.timers WHERE claimed_by = 'victim' AND lease_until > now()"

    caught = 0
    for round_ in range(5):
        sdb.execute("SELECT queen.pause_fire()")
        timers = []
        for i in range(300):
            payload = b'{"r":%d,"i":%d,"blob":"%s"}' % (round_, i, b"z" * 65536)
            t = timer("killq", f"r{round_}-{i:04d}", 0, payload, compressed=True)
            timers.append(t)
            expected[t["txn"]] = payload
        schedule(sdb, timers)
        sdb.execute("SELECT queen.resume_fire()")
        while timer_count(sdb) > 0:
            time.sleep(random.uniform(0, 0.03))
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.1)  # a statement the victim's backend was running finishes meanwhile
            n1 = sdb.execute(held_rows).fetchone()["n"]
            time.sleep(0.05)
            n2 = sdb.execute(held_rows).fetchone()["n"]
            if n1 > 0 and n1 == n2:
                caught = n2
                break
            os.kill(pid, signal.SIGCONT)
        if caught:
            break
    assert caught, "never caught the victim holding claims"

    victim.kill(signal.SIGKILL)
    time.sleep(0.2)
    orphaned = sdb.execute("SELECT count(*) AS n FROM queen.timers WHERE claimed_by = 'victim'").fetchone()["n"]
    assert orphaned >= caught
    # while the lease runs nobody can cancel them: they are in the dead broker's hands
    held = sdb.execute("SELECT queue, timer_key FROM queen.timers WHERE claimed_by = 'victim' AND lease_until > now()"
                       " LIMIT 1").fetchone()
    if held is not None:
        v = sdb.execute("SELECT queen.cancel_timer('default', %s, %s) AS v",
                        (held["queue"], held["timer_key"])).fetchone()["v"]
        assert v == "too_late"

    heir = sweeper_broker(QUEEN_BROKER_ID="heir")
    wait_until(lambda: timer_count(sdb) == 0, 60, interval=0.1, message="the heir fires the orphaned claims")
    assert_each_txn_once(sdb, expected)
    _, s = scrape(heir)
    assert sample(s, "queen_timers_fired_total", outcome="fired") >= orphaned
    assert sample(s, "queen_timers_fired_total", outcome="duplicate") == 0
