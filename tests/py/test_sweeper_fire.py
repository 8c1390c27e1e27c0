"""The sweeper fires: prompt delivery (NOTIFY wake-up), zstd through the leased
path, too_late while a claim is held, operator pauses, Prometheus metrics."""

from __future__ import annotations

import time
from datetime import timedelta

import httpx
import jwt
import psycopg
import pytest

from sweeper_support import (  # noqa: F401  (fixtures)
    messages, sample, schedule, scrape, sdb, sweeper_broker, sweeper_url, timer, timer_count, wait_until,
)

JWT_SECRET = "sweeper-test-secret-0123456789abcdef0123456789"


def token(role: str, tenant: str = "default") -> dict:
    claims = {"sub": f"ops-{role}", "tenant": tenant, "role": role, "exp": int(time.time()) + 600}
    t = jwt.encode(claims, JWT_SECRET, algorithm="HS256")
    return {"Authorization": f"Bearer {t}"}


def test_short_timers_are_delivered_by_the_notify_wakeup(sdb, sweeper_broker):
    # A 5 s maximum sleep: without the LISTEN wake-up a 300 ms timer could wait ~5 s.
    sweeper_broker(QUEEN_SWEEPER_MAX_SLEEP_MS=5000)
    time.sleep(0.5)  # the sweeper found nothing to do and planned its longest sleep
    verdicts = schedule(sdb, [timer("wake", "now", 0, b'{"n":0}'), timer("wake", "soon", 300, b'{"n":300}')])
    due = {v["timer_key"]: v["deliver_at"] for v in verdicts}

    wait_until(lambda: len(messages(sdb)) == 2, 10, message="both frames")
    assert timer_count(sdb) == 0
    frames = {m["txn"]: m for m in messages(sdb)}
    assert bytes(frames["txn-wake-now"]["payload"]) == b'{"n":0}'
    assert bytes(frames["txn-wake-soon"]["payload"]) == b'{"n":300}'
    # deliverAt is a floor, and the wake-up beat the 5 s sleep by far (PostgreSQL's clock on both sides)
    for key, txn in (("now", "txn-wake-now"), ("soon", "txn-wake-soon")):
        lag = frames[txn]["created_at"] - due[key]
        assert timedelta(0) <= lag < timedelta(seconds=2.5), (key, lag)


def test_zstd_timers_are_delivered_decompressed(sdb, sweeper_broker):
    b = sweeper_broker(QUEEN_BROKER_ID="zstd-broker")
    body = b'{"order":42,"note":"' + b"x" * 5000 + b'"}'
    schedule(sdb, [timer("zq", f"k{i}", 0, body + bytes([48 + i]), compressed=True) for i in range(5)]
             + [timer("zq", "plain", 0, b"plain bytes")])
    wait_until(lambda: timer_count(sdb) == 0, 10, message="zstd timers fired")
    frames = {m["txn"]: bytes(m["payload"]) for m in messages(sdb)}
    assert frames == {**{f"txn-zq-k{i}": body + bytes([48 + i]) for i in range(5)}, "txn-zq-plain": b"plain bytes"}
    _, s = scrape(b)
    assert sample(s, "queen_timers_fired_total", outcome="fired") == 6


def test_zstd_and_plain_timers_of_one_partition_enter_the_log_in_expiry_order(sdb, sweeper_broker):
    # The contract: two timers of one queue and partition maturing in one cycle enter the log in
    # expiry order. The fast path fired every plain row of a cycle before the leased path's zstd
    # rows, even one due later (Dec 7 audit; migration 036).
    sweeper_broker(QUEEN_BROKER_ID="order-broker")
    sdb.execute("SELECT queen.pause_fire()")
    schedule(sdb, [timer("oq", "plain-first", -30, b"1"), timer("oq", "zstd-second", -20, b"2", compressed=True),
                   timer("oq", "plain-third", -10, b"3"), timer("oq", "zstd-fourth", -5, b"4", compressed=True),
                   timer("oq", "elsewhere", -25, b"x", partition="other")])
    sdb.execute("SELECT queen.resume_fire()")  # all five mature in the cycle the resume wakes
    wait_until(lambda: timer_count(sdb) == 0, 10, message="all fired")
    order = [r["transaction_id"] for r in sdb.execute(
        "SELECT m.transaction_id FROM queen.messages m JOIN queen.partitions p ON p.id = m.partition_id "
        "WHERE p.name = 'Default' ORDER BY m.xid, m.seq").fetchall()]
    assert order == ["txn-oq-plain-first", "txn-oq-zstd-second", "txn-oq-plain-third", "txn-oq-zstd-fourth"]


def test_leased_path_bounded_by_bytes_fires_everything_once(sdb, sweeper_broker):
    # QUEEN_SWEEPER_BATCH_BYTES=6000: the claim stops once the stored bytes before a row reach it
    # (the stored zstd payloads are a few dozen bytes, so claims of many rows), and the inflated
    # frames (5 kB each) are fired whenever they reach 6000 bytes: two at a time. Every timer
    # still fires exactly once, in its own frame, decompressed; the lag histogram counts them all.
    b = sweeper_broker(QUEEN_BROKER_ID="bytes-broker", QUEEN_SWEEPER_BATCH_BYTES=6000)
    body = b'{"note":"' + b"y" * 5000 + b'"}'
    schedule(sdb, [timer("bq", f"k{i:02d}", 0, body + str(i).encode(), compressed=True) for i in range(25)])
    wait_until(lambda: timer_count(sdb) == 0, 15, message="zstd timers fired")
    frames = {m["txn"]: bytes(m["payload"]) for m in messages(sdb)}
    assert frames == {f"txn-bq-k{i:02d}": body + str(i).encode() for i in range(25)}
    _, s = scrape(b)
    assert sample(s, "queen_timers_fired_total", outcome="fired") == 25
    assert sample(s, "queen_timers_fire_lag_seconds_count") == 25
    assert sample(s, "queen_timers_fire_lag_seconds_bucket", le="+Inf") == 25
    assert sample(s, "queen_timers_fire_lag_seconds_bucket", le="300.0") == 25


def test_cancel_while_claimed_is_too_late(sdb, sweeper_url):
    # No broker needed: claim it from SQL as a broker would, at a pinned future instant.
    schedule(sdb, [timer("tl", "held", 60_000, b"p")])
    claimed = sdb.execute("SELECT * FROM queen.claim_timers('sql-broker', 10, 60000, now() + interval '61 s')")\
        .fetchall()
    assert [c["timer_key"] for c in claimed] == ["held"]
    verdict = sdb.execute("SELECT queen.cancel_timer('default', 'tl', 'held') AS v").fetchone()["v"]
    assert verdict == "too_late"
    assert timer_count(sdb) == 1
    # the claim still fires it
    fired = sdb.execute("SELECT * FROM queen.fire_timers(%s, ARRAY[ROW('default','tl','held',NULL)::queen.fire_frame],"
                        " now() + interval '62 s')", (claimed[0]["claim_id"],)).fetchall()
    assert [f["outcome"] for f in fired] == ["fired"]
    assert sdb.execute("SELECT queen.cancel_timer('default', 'tl', 'held') AS v").fetchone()["v"] == "absent"


def test_cancel_while_claimed_is_too_late_over_http(sdb, sweeper_broker):
    b = sweeper_broker()
    schedule(sdb, [timer("tl", "tenant/42", 60_000, b"p")])
    sdb.execute("SELECT * FROM queen.claim_timers('sql-broker', 10, 60000, now() + interval '61 s')").fetchall()
    r = httpx.delete(f"{b.url}/api/v1/timers/tl/tenant/42", timeout=10)
    if r.status_code in (404, 405) and "json" not in r.headers.get("content-type", ""):
        pytest.skip("DELETE /api/v1/timers route not present")
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "too_late"
    assert timer_count(sdb) == 1


def test_pausing_the_fire_stops_delivery_and_resuming_delivers(sdb, sweeper_broker):
    b = sweeper_broker(QUEEN_SWEEPER_MAX_SLEEP_MS=200)
    with b.client() as c:
        r = c.post("/api/v1/system/timers/fire", json={"paused": True})
        assert r.status_code == 200, r.text
        assert r.json() == {"schedulingPaused": False, "firePaused": True, "pending": 0}
        schedule(sdb, [timer("pz", "a", 0, b"a"), timer("pz", "z", 0, b"z", compressed=True)])
        time.sleep(1.5)  # several sweeper cycles
        assert timer_count(sdb) == 2 and messages(sdb) == []
        assert c.get("/api/v1/system/timers").json() == {"schedulingPaused": False, "firePaused": True, "pending": 2}
        _, s = scrape(b)
        assert sample(s, "queen_timers_pending") == 2
        assert sample(s, "queen_timers_fire_paused") == 1

        r = c.post("/api/v1/system/timers/fire", json={"paused": False})
        assert r.status_code == 200 and r.json()["firePaused"] is False
        wait_until(lambda: timer_count(sdb) == 0, 10, message="fire after resume")
        assert sorted(m["txn"] for m in messages(sdb)) == ["txn-pz-a", "txn-pz-z"]
        assert c.get("/api/v1/system/timers").json()["pending"] == 0


def test_resuming_the_fire_wakes_a_sleeping_sweeper_at_once(sdb, sweeper_broker):
    # A 60 s maximum sleep: while paused the sweeper plans its longest sleep (nothing is due
    # for it), so without the resume's NOTIFY the backlog would wait up to a minute.
    sdb.execute("SELECT queen.pause_fire()")
    sweeper_broker(QUEEN_SWEEPER_MAX_SLEEP_MS=60000)
    schedule(sdb, [timer("rw", f"k{i}", 0, b"x") for i in range(3)])
    time.sleep(1.0)  # the schedule's NOTIFY woke it, it found the fire paused and slept again
    assert timer_count(sdb) == 3
    resumed = sdb.execute("SELECT clock_timestamp() AS at, queen.resume_fire() AS running").fetchone()
    assert resumed["running"] is True
    wait_until(lambda: timer_count(sdb) == 0, 5, message="fire right after resume")
    first = min(m["created_at"] for m in messages(sdb))
    assert first - resumed["at"] < timedelta(seconds=2.5)  # PostgreSQL's clock on both sides


def test_resume_notifies_the_soonest_due_time_and_pause_notifies_nothing(sdb, sweeper_url):
    schedule(sdb, [timer("rn", "later", 3_600_000, b"l"), timer("rn", "sooner", 60_000, b"s")])
    soonest = sdb.execute("SELECT extract(epoch FROM min(deliver_at))::text AS e FROM queen.timers").fetchone()["e"]
    with psycopg.connect(sweeper_url, autocommit=True) as listen:
        listen.execute("LISTEN queen_timers")
        sdb.execute("SELECT queen.pause_fire()")
        assert list(listen.notifies(timeout=0.5, stop_after=1)) == []
        sdb.execute("SELECT queen.resume_fire()")
        notes = list(listen.notifies(timeout=5, stop_after=1))
        assert [n.payload for n in notes] == [soonest]
        # nothing pending: a resume has nothing to wake anyone for
        sdb.execute("DELETE FROM queen.timers")
        sdb.execute("SELECT queen.resume_fire()")
        assert list(listen.notifies(timeout=0.5, stop_after=1)) == []


def test_a_schedule_wakes_sweepers_only_for_a_timer_due_within_a_minute(sdb, sweeper_url):
    # A sweeper sleeps at most 60 s (QUEEN_SWEEPER_MAX_SLEEP_MS's bound) and then reads the
    # soonest due time again: a batch due later needs no NOTIFY, whose commit PostgreSQL serializes.
    with psycopg.connect(sweeper_url, autocommit=True) as listen:
        listen.execute("LISTEN queen_timers")
        schedule(sdb, [timer("nw", "hour", 3_600_000, b"h"), timer("nw", "twomin", 120_000, b"m")])
        assert list(listen.notifies(timeout=0.5, stop_after=1)) == []
        schedule(sdb, [timer("nw", "day", 86_400_000, b"d"), timer("nw", "halfmin", 30_000, b"s")])
        notes = list(listen.notifies(timeout=5, stop_after=1))
        soonest = sdb.execute("SELECT extract(epoch FROM deliver_at)::text AS e FROM queen.timers "
                              "WHERE timer_key = 'halfmin'").fetchone()["e"]
        assert [n.payload for n in notes] == [soonest]
        # a reschedule from an hour to now moves the soonest: it wakes them
        schedule(sdb, [timer("nw", "hour", 0, b"h")])
        assert len(list(listen.notifies(timeout=5, stop_after=1))) == 1


def test_the_longest_sleep_is_bounded_by_the_schedules_wake_up_horizon():
    from queen_timers.config import ConfigError, Settings
    base = {"QUEEN_DATABASE_URL": "postgresql://localhost/x"}
    assert Settings.from_env({**base, "QUEEN_SWEEPER_MAX_SLEEP_MS": "60000"}).sweeper_max_sleep_ms == 60000
    with pytest.raises(ConfigError, match="QUEEN_SWEEPER_MAX_SLEEP_MS must be <= 60000"):
        Settings.from_env({**base, "QUEEN_SWEEPER_MAX_SLEEP_MS": "60001"})


def test_pausing_scheduling_leaves_the_fire_running(sdb, sweeper_broker):
    b = sweeper_broker()
    schedule(sdb, [timer("ps", "before", 400, b"x")])
    with b.client() as c:
        r = c.post("/api/v1/system/timers/scheduling", json={"paused": True})
        assert r.status_code == 200 and r.json()["schedulingPaused"] is True and r.json()["firePaused"] is False
        with pytest.raises(psycopg.Error) as err:
            schedule(sdb, [timer("ps", "during", 0, b"y")])
        assert err.value.sqlstate == "QTOFF"
        r = c.post("/api/v1/timers", json={"operations": [
            {"op": "schedule", "queue": "ps", "timerKey": "http", "delayMs": 0, "txn": "t", "payload": "eA=="}]})
        if r.status_code != 404:
            assert r.status_code == 503 and r.json()["error"] == "timers_disabled"
        wait_until(lambda: timer_count(sdb) == 0, 10, message="the fire while scheduling is paused")
        assert [m["txn"] for m in messages(sdb)] == ["txn-ps-before"]
        assert c.post("/api/v1/system/timers/scheduling", json={"paused": False}).json()["schedulingPaused"] is False
    schedule(sdb, [timer("ps", "after", 0, b"z")])
    wait_until(lambda: len(messages(sdb)) == 2, 10, message="the timer scheduled after resume")


@pytest.mark.parametrize("body", [{}, {"paused": "yes"}, {"paused": True, "extra": 1}, [True]])
def test_operator_switch_rejects_bad_bodies(sdb, sweeper_broker, body):
    b = sweeper_broker()
    with b.client() as c:
        r = c.post("/api/v1/system/timers/fire", json=body)
        assert r.status_code == 400 and r.json()["error"] == "timers_bad_request", r.text
        assert c.get("/api/v1/system/timers").json()["firePaused"] is False


def test_operator_routes_need_admin(sdb, sweeper_broker):
    b = sweeper_broker(QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET)
    with b.client() as c:
        assert c.get("/api/v1/system/timers").status_code == 401
        r = c.post("/api/v1/system/timers/fire", json={"paused": True}, headers=token("read-write"))
        assert r.status_code == 403 and r.json()["error"] == "forbidden"
        assert sdb.execute("SELECT fire_paused FROM queen.cell_settings").fetchone()["fire_paused"] is False
        r = c.post("/api/v1/system/timers/fire", json={"paused": True}, headers=token("admin"))
        assert r.status_code == 200 and r.json()["firePaused"] is True
        assert sdb.execute("SELECT fire_paused FROM queen.cell_settings").fetchone()["fire_paused"] is True
        # the scrape is public
        assert c.get("/metrics/prometheus").status_code == 200


@pytest.mark.parametrize("operator", [None, "ops"])
def test_another_tenants_admin_cannot_flip_the_cells_switches(sdb, sweeper_broker, operator):
    """A pause stops every tenant's timers: only an admin of the operator tenant
    (QUEEN_OPERATOR_TENANT, `default` unless set) flips it or reads the cell's count."""
    env = {} if operator is None else {"QUEEN_OPERATOR_TENANT": operator}
    b = sweeper_broker(QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET, **env)
    ops = operator or "default"
    others = ["acme"] + ([] if operator is None else ["default"])
    with b.client() as c:
        for tenant in others:
            for path in ("/api/v1/system/timers/fire", "/api/v1/system/timers/scheduling"):
                r = c.post(path, json={"paused": True}, headers=token("admin", tenant))
                assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
                assert "QUEEN_OPERATOR_TENANT" in r.json()["detail"]
            r = c.get("/api/v1/system/timers", headers=token("admin", tenant))
            assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
            assert "pending" not in r.json()
            # its own tenant's routes: admin includes read-write
            assert c.get("/api/v1/system/timers/stats", headers=token("admin", tenant)).status_code == 200
        settings = sdb.execute("SELECT fire_paused, scheduling_paused FROM queen.cell_settings").fetchone()
        assert settings == {"fire_paused": False, "scheduling_paused": False}
        assert c.post("/api/v1/system/timers/scheduling", json={"paused": True},
                      headers=token("read-write", ops)).status_code == 403
        r = c.post("/api/v1/system/timers/scheduling", json={"paused": True}, headers=token("admin", ops))
        assert r.status_code == 200 and r.json()["schedulingPaused"] is True, r.text
        r = c.get("/api/v1/system/timers", headers=token("admin", ops))
        assert r.status_code == 200 and r.json()["schedulingPaused"] is True


def test_a_duplicate_txn_in_a_batch_is_redone_and_nothing_else_changes(sdb, sweeper_broker):
    """The sweeper fires without fire_due_timers' subtransaction; a txn already in
    the partition fails that call (rolled back whole) and the batch is fired again
    through the redo path: the duplicate answers 'duplicate', every other timer of
    the batch fires once, and no fire failure is counted."""
    b = sweeper_broker()
    schedule(sdb, [timer("dq", "first", 0, b"0")])
    wait_until(lambda: timer_count(sdb) == 0, 10, message="first fire")
    sdb.execute("SELECT queen.pause_fire()")
    batch = [timer("dq", f"k{i:03d}", 0, str(i).encode()) for i in range(60)]
    batch.insert(30, timer("dq", "again", 0, b"again", txn="txn-dq-first"))
    schedule(sdb, batch)
    sdb.execute("SELECT queen.resume_fire()")
    wait_until(lambda: timer_count(sdb) == 0, 15, message="the batch with a duplicate fired")

    txns = [m["txn"] for m in messages(sdb)]
    assert sorted(txns) == sorted(["txn-dq-first"] + [f"txn-dq-k{i:03d}" for i in range(60)])
    r, s = scrape(b)
    assert sample(s, "queen_timers_fired_total", outcome="fired") == 61
    assert sample(s, "queen_timers_fired_total", outcome="duplicate") == 1
    for cls in ("transient", "permanent", "config"):
        assert sample(s, "queen_timers_fire_failures_total", **{"class": cls}) == 0
    assert sdb.execute("SELECT queen.get_pending_timers('default') AS n").fetchone()["n"] == 0
    assert "isolating row by row" not in b.log()  # redone as a batch, not row by row


def test_prometheus_exposes_the_families(sdb, sweeper_broker):
    b = sweeper_broker()
    schedule(sdb, [timer("mq", "one", 0, b"1")])
    wait_until(lambda: timer_count(sdb) == 0, 10, message="first fire")
    # the same txn again in the same partition: the log already has it -> duplicate, no second frame
    schedule(sdb, [timer("mq", "two", 0, b"2", txn="txn-mq-one")])
    wait_until(lambda: timer_count(sdb) == 0, 10, message="duplicate fire")
    schedule(sdb, [timer("mq", "later", 3_600_000, b"3")])

    r, s = scrape(b)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert len(messages(sdb)) == 1
    assert sample(s, "queen_timers_fired_total", outcome="fired") == 1
    assert sample(s, "queen_timers_fired_total", outcome="duplicate") == 1
    assert sample(s, "queen_timers_fire_lag_seconds_count") == 1
    assert ("queen_timers_fire_lag_seconds_bucket", (("le", "+Inf"),)) in s
    for cls in ("transient", "permanent", "config"):
        assert ("queen_timers_fire_failures_total", (("class", cls),)) in s
    assert ("queen_timers_dlq_moves_total", ()) in s
    assert ("queen_timers_claims_lost_total", ()) in s
    assert sample(s, "queen_timers_pending") == 1


def test_sweeper_reconnects_when_its_connections_are_terminated(sdb, sweeper_broker):
    b = sweeper_broker(QUEEN_BROKER_ID="phoenix", QUEEN_SWEEPER_MAX_SLEEP_MS=300)
    schedule(sdb, [timer("rc", "before", 0, b"1")])
    wait_until(lambda: timer_count(sdb) == 0, 10, message="first fire")
    killed = sdb.execute("""SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) AS n FROM pg_stat_activity
                             WHERE application_name LIKE 'queen-sweeper%:phoenix'""").fetchone()["n"]
    assert killed == 2  # the fire connection and the LISTEN connection
    schedule(sdb, [timer("rc", "after", 0, b"2"), timer("rc", "after-z", 200, b"3", compressed=True)])
    wait_until(lambda: timer_count(sdb) == 0, 15, message="fire after reconnecting")
    assert sorted(m["txn"] for m in messages(sdb)) == ["txn-rc-after", "txn-rc-after-z", "txn-rc-before"]
    assert b.alive()
    wait_until(lambda: sdb.execute("""SELECT count(*) AS n FROM pg_stat_activity
                                       WHERE application_name LIKE 'queen-sweeper%:phoenix'""").fetchone()["n"] == 2,
               10, message="both sweeper connections back")
