"""The broker behind a real pgbouncer (Debian's 1.18) in transaction pooling mode (issue 20).

pgbouncer is started by scripts/pgbouncer with the common configuration
(`ignore_startup_parameters = extra_float_digits` only), a pool of 4 server
connections and a query_wait_timeout of 2 s. The brokers run with
QUEEN_POOL_MODE=transaction: no startup options, no prepared statements, the
statement timeout per transaction. Every route, the CLI, a pgbouncer restart
and PAUSE/RESUME mid-load (nothing lost, nothing fired twice), an exhausted
pool (503 with Retry-After), the statement timeout and the broker's deadline over a commit
waiting for a synchronous standby are checked through it.
A second pgbouncer hands out its idle server connections in turn
(server_round_robin): the sweeper's fair share keeps its turn across them.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psycopg
import pytest

from conftest import ROOT, TEST_DB, free_port
from timers_util import op, post

POOL = 4


@contextlib.contextmanager
def running_bouncer(admin_dsn: str, **env: str):
    """(port, folder) of a pgbouncer of POOL server connections in front of the test cluster;
    env: more of scripts/pgbouncer's settings."""
    # under /tmp itself: pgbouncer runs as postgres, who cannot enter pytest's 0700 folders
    folder = Path(tempfile.mkdtemp(prefix="queen-pgbouncer-", dir="/tmp"))
    folder.chmod(0o755)
    pg_port = psycopg.conninfo.conninfo_to_dict(admin_dsn)["port"]
    port = free_port()
    script = str(ROOT / "scripts" / "pgbouncer")
    subprocess.run([script, "start", str(folder), str(pg_port), str(port), str(POOL), "2"], check=True,
                   env={**os.environ, **env})
    try:
        yield port, folder
    finally:
        subprocess.run([script, "stop", str(folder)], check=False)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def bouncer(admin_dsn, database_url):
    """(pgbouncer's port, its folder) in front of the test cluster."""
    with running_bouncer(admin_dsn) as running:
        yield running


def admin(folder: Path, command: str) -> str:
    return subprocess.run([str(ROOT / "scripts" / "pgbouncer"), "admin", str(folder), command],
                          check=True, capture_output=True, text=True).stdout


def via(port: int) -> str:
    return f"postgresql://postgres@127.0.0.1:{port}/{TEST_DB}"


@pytest.fixture
def pooled(bouncer, spawn_broker):
    """spawn(**env): a broker whose every connection goes through pgbouncer."""
    port, _ = bouncer

    def spawn(**env):
        return spawn_broker(QUEEN_DATABASE_URL=via(port), QUEEN_POOL_MODE="transaction", **env)
    return spawn


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_every_timer_and_log_route_works_through_pgbouncer(pooled, db):
    b = pooled()
    with b.client() as c:
        r = post(c, op("schedule", "later"), op("schedule", "soon", delayMs=0, payload=b64(b'{"n":1}')))
        assert [v["status"] for v in r.json()["results"]] == ["scheduled", "scheduled"]
        assert c.get("/api/v1/timers/reminders/later").json()["found"] is True
        assert "later" in [row["timerKey"] for row in c.get("/api/v1/timers/reminders").json()["rows"]]
        assert c.delete("/api/v1/timers/reminders/later").json()["status"] == "cancelled"
        # a claimed row answers too_late, as directly
        post(c, op("schedule", "claimed"))
        db.execute("UPDATE queen.timers SET claim_id = gen_random_uuid(), claimed_by = 'x', "
                   "lease_until = now() + interval '1 hour' WHERE timer_key = 'claimed'")
        assert c.delete("/api/v1/timers/reminders/claimed").json()["status"] == "too_late"
        # the sweeper fires through pgbouncer; pop and ack through it
        deadline = time.monotonic() + 15
        while True:
            r = c.get("/api/v1/pop/queue/reminders", params={"batch": 10})
            if r.status_code == 200:
                break
            assert time.monotonic() < deadline, "the due timer never reached the log"
            time.sleep(0.1)
        message = r.json()["messages"][0]
        assert message["data"] == {"n": 1} and message["transactionId"] == "txn-soon"
        ack = c.post("/api/v1/ack", json={"transactionId": message["transactionId"],
                                          "partitionId": message["partitionId"], "status": "completed",
                                          "leaseId": message["leaseId"]})
        assert ack.status_code == 200 and ack.json()[0]["success"] is True, ack.text
        assert c.post("/api/v1/push", json={"items": [{"queue": "direct", "payload": {"x": 1}}]}).status_code == 201
        assert c.get("/api/v1/system/timers/stats").status_code == 200
        assert c.get("/health").json()["database"] == "connected"


def test_the_statement_timeout_is_applied_per_transaction(pooled, db, database_url):
    b = pooled(QUEEN_STATEMENT_TIMEOUT_MS="300")
    with b.client() as c:
        assert post(c, op("schedule", "k")).status_code == 200
    with psycopg.connect(database_url) as blocker:  # direct, not through pgbouncer
        blocker.execute("LOCK TABLE queen.timers IN ACCESS EXCLUSIVE MODE")
        start = time.monotonic()
        with b.client() as c:
            r = c.get("/api/v1/timers/reminders/k")
        took = time.monotonic() - start
        blocker.rollback()
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"] == "timers_unavailable"
    assert took < 2.5, f"the 300 ms timeout did not apply: {took:.1f} s"


def test_a_commit_waiting_for_a_synchronous_standby_answers_503_by_the_broker_deadline(pooled, db, admin_dsn):
    """Behind the pooler too the commit of the request's transaction (COMMIT, after the SET LOCAL
    timeout and the statement) waits for a standby with no timeout of PostgreSQL's: the broker's
    deadline answers it (test_deadline), and pgbouncer serves again once the standby requirement
    is lifted."""
    from test_deadline import LATEST_S, TIMEOUTS, no_synchronous_standby
    b = pooled(**TIMEOUTS)
    with b.client(timeout=30) as c:
        assert post(c, op("schedule", "held")).status_code == 200
        with no_synchronous_standby(admin_dsn):
            for send in (lambda: c.delete("/api/v1/timers/reminders/held"), lambda: post(c, op("schedule", "new"))):
                start = time.monotonic()
                r = send()
                assert time.monotonic() - start < LATEST_S
                assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
                assert r.json()["detail"] == "the database did not answer in time", r.text
        assert post(c, op("schedule", "after")).json()["results"][0]["status"] == "scheduled"
        assert c.delete("/api/v1/timers/reminders/after").json()["status"] == "cancelled"
    assert "Traceback" not in b.log()


def test_an_exhausted_pool_answers_503_with_retry_after(pooled, bouncer, db):
    port, _ = bouncer
    b = pooled()
    sleepers = [threading.Thread(target=lambda: psycopg.connect(via(port), autocommit=True)
                                 .execute("SELECT pg_sleep(4)")) for _ in range(POOL)]
    for t in sleepers:
        t.start()
    time.sleep(0.5)
    try:
        with b.client() as c:
            r = c.get("/api/v1/timers/reminders/any")
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1" and r.json()["error"] == "timers_unavailable"
    finally:
        for t in sleepers:
            t.join()
    with b.client() as c:  # the pool frees up: the same call works
        assert c.get("/api/v1/timers/reminders/any").json() == {"found": False}


def test_a_pgbouncer_restart_and_pause_lose_nothing(pooled, bouncer, db, database_url):
    port, folder = bouncer
    b = pooled(QUEEN_POOL_TIMEOUT_MS="1000")
    accepted: list[str] = []
    refused = {"503": 0, "other": 0}
    stop = threading.Event()

    def load():
        n = 0
        with httpx.Client(base_url=b.url, timeout=10) as c:
            while not stop.is_set():
                n += 1
                txn = f"load-{n}"
                try:
                    r = post(c, op("schedule", f"k{n}", queue="load", txn=txn, delayMs=200))
                except httpx.HTTPError:
                    refused["other"] += 1
                    continue
                if r.status_code == 200 and r.json()["results"][0]["status"] == "scheduled":
                    accepted.append(txn)
                elif r.status_code == 503:
                    assert r.headers.get("retry-after") == "1"
                    refused["503"] += 1
                else:
                    refused["other"] += 1
                time.sleep(0.01)

    loader = threading.Thread(target=load)
    loader.start()
    try:
        time.sleep(1.5)
        admin(folder, "PAUSE")
        time.sleep(1.0)
        admin(folder, "RESUME")
        time.sleep(1.5)
        script = str(ROOT / "scripts" / "pgbouncer")
        pg_port = psycopg.conninfo.conninfo_to_dict(database_url)["port"]
        subprocess.run([script, "stop", str(folder)], check=True)
        time.sleep(0.5)
        subprocess.run([script, "start", str(folder), str(pg_port), str(port), str(POOL), "2"], check=True)
        time.sleep(2.0)
    finally:
        stop.set()
        loader.join()
    assert len(accepted) > 50, (accepted, refused)
    deadline = time.monotonic() + 30
    with psycopg.connect(database_url, autocommit=True) as direct:
        while direct.execute("SELECT count(*) FROM queen.timers WHERE queue = 'load'").fetchone()[0]:
            assert time.monotonic() < deadline, "accepted timers were never fired"
            time.sleep(0.2)
        fired = [r[0] for r in direct.execute(
            "SELECT transaction_id FROM queen.messages m JOIN queen.partitions p ON p.id = m.partition_id "
            "JOIN queen.queues q ON q.id = p.queue_id WHERE q.name = 'load'")]
    assert sorted(fired) == sorted(set(fired)), "a timer was fired twice"
    assert set(accepted) <= set(fired), f"lost: {sorted(set(accepted) - set(fired))[:5]}"
    # nothing fired that no one scheduled (a 503'd schedule may still have committed: it may fire)
    assert all(t.startswith("load-") for t in fired)


def test_the_cli_works_through_pgbouncer(bouncer, db, tmp_path):
    port, _ = bouncer
    rows = tmp_path / "ops.jsonl"
    rows.write_text("".join(json.dumps({"queue": "cli", "timerKey": f"k{i}", "txn": f"t{i}", "delayMs": 3600000,
                                        "payload": b64(b"x")}) + "\n" for i in range(12)))
    env = {**os.environ, "QUEEN_DATABASE_URL": via(port), "QUEEN_POOL_MODE": "transaction",
           "QUEEN_TIMERS_MAX_OPS": "2"}  # six batches: past psycopg's prepare threshold of 5
    proc = subprocess.run([sys.executable, "-m", "queen_timers", "schedule", "--file", str(rows), "--json"],
                          env=env, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert db.execute("SELECT count(*) AS n FROM queen.timers WHERE queue = 'cli'").fetchone()["n"] == 12


def test_a_broker_behind_pgbouncer_without_the_transaction_mode_does_not_start(bouncer, db):
    # The migrations connect without startup options and passed; the request pool sends the
    # statement timeout as one, which pgbouncer refuses: the broker started and answered 503
    # to every request (Dec 7 audit). Now it exits at once and names the setting.
    port, _ = bouncer
    env = {**os.environ, "QUEEN_DATABASE_URL": via(port), "QUEEN_PORT": "1"}
    env.pop("QUEEN_POOL_MODE", None)
    proc = subprocess.run([sys.executable, "-m", "queen_timers", "serve"], env=env, capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert proc.returncode != 0
    assert "QUEEN_POOL_MODE=transaction" in proc.stderr and "bad_configuration" in proc.stderr, proc.stderr


LISTENERS = "SELECT count(*) AS n FROM pg_stat_activity WHERE query = 'LISTEN queen_timers'"


def test_the_sweeper_takes_its_session_on_the_direct_url_or_polls(pooled, db, database_url):
    # through pgbouncer alone no LISTEN is attempted (it would hold no session): the sweeper polls
    b = pooled(QUEEN_SWEEPER_MAX_SLEEP_MS="60000")
    with b.client() as c:
        post(c, op("schedule", "polled", delayMs=0))
    deadline = time.monotonic() + 10
    while db.execute("SELECT count(*) AS n FROM queen.timers").fetchone()["n"]:
        assert time.monotonic() < deadline, "a pooled broker without LISTEN must poll"
        time.sleep(0.05)
    assert db.execute(LISTENERS).fetchone()["n"] == 0
    b.kill()
    # with QUEEN_DIRECT_DATABASE_URL the sweeper's session and its LISTEN are there
    pooled(QUEEN_DIRECT_DATABASE_URL=database_url)
    deadline = time.monotonic() + 10
    while db.execute(LISTENERS).fetchone()["n"] != 1:
        assert time.monotonic() < deadline, "no LISTEN session on the direct URL"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def round_robin_bouncer(admin_dsn):
    """A second pgbouncer of POOL server connections whose idle ones are taken oldest
    first (server_round_robin): one client's transactions run on each in turn."""
    with running_bouncer(admin_dsn, PGBOUNCER_SERVER_ROUND_ROBIN="1") as (port, _):
        yield port


def test_the_fair_share_keeps_its_turn_across_server_connections(round_robin_bouncer, db, spawn_broker):
    # The fair share probes 64 tenants a batch, starting after the last one it probed (its
    # turn). Through a transaction pooler with no direct URL, the sweeper's calls run on
    # whichever server connection is free: here each of POOL in turn. With the turn kept in
    # the server connection's session, a batch started from that connection's own turn and
    # probed again tenants another connection had just served: 300 tenants waited about
    # twice the ceil(300 / 64) = 5 batches. The sweeper carries its turn (migration 023).
    from sweeper_support import schedule, timer
    port = round_robin_bouncer
    db.execute("SELECT queen.pause_fire()")
    schedule(db, [timer("rr", f"big-{i}", -3000, b"{}") for i in range(3000)], tenant="rr-big")
    tenants = [f"rr-{i:03d}" for i in range(300)]
    for t in tenants:
        schedule(db, [timer("rr", "one", -2000, b"{}")], tenant=t)
    # every server connection of the pool open (idle) before the sweeper starts
    barrier = threading.Barrier(POOL)

    def hold():
        with psycopg.connect(via(port), autocommit=True) as c:
            with c.transaction():
                c.execute("SELECT 1")
                barrier.wait(timeout=10)
    threads = [threading.Thread(target=hold) for _ in range(POOL)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spawn_broker(QUEEN_DATABASE_URL=via(port), QUEEN_POOL_MODE="transaction", QUEEN_SWEEPER_BATCH="100")
    db.execute("SELECT queen.resume_fire()")
    deadline = time.monotonic() + 60
    while db.execute("SELECT count(*) AS n FROM queen.timers").fetchone()["n"]:
        assert time.monotonic() < deadline, "every timer fired"
        time.sleep(0.05)
    order = [r["tenant"] for r in db.execute("""
        SELECT q.tenant FROM queen.messages m
          JOIN queen.partitions p ON p.id = m.partition_id JOIN queen.queues q ON q.id = p.queue_id
         WHERE q.name = 'rr' ORDER BY m.seq""").fetchall()]
    assert len(order) == 3300 and sorted(set(order) - {"rr-big"}) == tenants
    last = max(i for i, t in enumerate(order) if t != "rr-big")
    # each batch: rr-big's 100 oldest, then one each for up to 64 of the others, in turn
    assert last < 5 * (100 + 64), f"the last of the 300 tenants fired after {last} frames"
