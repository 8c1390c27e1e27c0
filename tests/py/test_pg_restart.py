"""PostgreSQL restarted under two brokers that schedule and fire: nothing lost, nothing
duplicated (README: "kill -9, a PostgreSQL restart and a failover lose and duplicate
nothing"; bench/drills.py's pgrestart drill is the long version).

A cluster of the test's own (scripts/pg-cluster), two brokers with a 2 s lease, two HTTP
clients scheduling timers due 0-1.5 s later for 8 s. At 2.5 s PostgreSQL stops, fast (a
clean shutdown: connections closed) or immediate (SIGQUIT to the postmaster: no checkpoint,
crash recovery at start), and starts 1.5 s later. Every POST answers 200 or a JSON 503
with Retry-After (a transport error only for a request caught in the middle); every
timer a 200 scheduled is fired exactly once, and one whose answer was lost at most once;
the brokers recover on their own and serve 200s after the restart.
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psycopg
import pytest

from conftest import ROOT, free_port, start_broker

pytestmark = pytest.mark.slow

CLUSTER = str(ROOT / "scripts" / "pg-cluster")
PAYLOAD = base64.b64encode(b'{"kind":"restart"}').decode()
QUEUE = "restart"


@pytest.fixture
def own_cluster():
    folder = Path(tempfile.mkdtemp(prefix="queen-restart-", dir="/tmp"))
    folder.chmod(0o755)
    port = free_port()
    env = {**os.environ, "QUEEN_PG_FSYNC": "off"}

    def start() -> None:
        subprocess.run([CLUSTER, "start", str(folder), str(port)], check=True, timeout=120, env=env,
                       stdout=subprocess.DEVNULL)

    start()
    try:
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres", autocommit=True) as conn:
            conn.execute("CREATE DATABASE queen_restart")
        url = f"postgresql://postgres@127.0.0.1:{port}/queen_restart?connect_timeout=2"
        subprocess.run([str(ROOT / "scripts" / "install-schema"), url], check=True, timeout=120,
                       stdout=subprocess.DEVNULL)
        yield folder, url, start
    finally:
        subprocess.run([CLUSTER, "stop", str(folder)], timeout=120)
        shutil.rmtree(folder, ignore_errors=True)


def stop_postgres(folder: Path, mode: str) -> None:
    if mode == "fast":
        subprocess.run([CLUSTER, "stop", str(folder)], check=True, timeout=120)
        return
    # immediate: the postmaster's SIGQUIT, as `pg_ctl stop -m immediate`; no checkpoint
    pid = int((folder / "data" / "postmaster.pid").read_text().split()[0])
    os.kill(pid, signal.SIGQUIT)
    deadline = time.monotonic() + 60
    while (folder / "data" / "postmaster.pid").exists():
        assert time.monotonic() < deadline, "the postmaster did not exit"
        time.sleep(0.05)


class Scheduler(threading.Thread):
    """Batches of 8 schedules, each key and txn new, until told to stop."""

    def __init__(self, url: str, name: str, stop: threading.Event):
        super().__init__(daemon=True)
        self.url, self.name, self.stop = url, name, stop
        self.scheduled: set[str] = set()  # answered 200 scheduled
        self.unknown: set[str] = set()  # 503 or a transport error: at most once
        self.codes: dict[int | str, int] = {}
        self.bad: list[str] = []  # anything outside the documented shapes
        self.ok_times: list[float] = []

    def run(self) -> None:
        n = 0
        with httpx.Client(base_url=self.url, timeout=10) as c:
            while not self.stop.is_set():
                txns = [f"{self.name}-{n + i}" for i in range(8)]
                n += 8
                ops = [{"op": "schedule", "queue": QUEUE, "timerKey": t, "txn": t, "delayMs": (i * 211) % 1500,
                        "payload": PAYLOAD} for i, t in enumerate(txns)]
                try:
                    r = c.post("/api/v1/timers", json={"operations": ops})
                except httpx.TransportError as exc:
                    self.codes[type(exc).__name__] = self.codes.get(type(exc).__name__, 0) + 1
                    self.unknown.update(txns)
                    continue
                self.codes[r.status_code] = self.codes.get(r.status_code, 0) + 1
                if r.status_code == 200:
                    statuses = [v["status"] for v in r.json()["results"]]
                    if statuses != ["scheduled"] * 8:
                        self.bad.append(f"200 with {statuses}")
                    self.scheduled.update(txns)
                    self.ok_times.append(time.monotonic())
                elif (r.status_code == 503 and r.headers.get("content-type") == "application/json"
                      and r.json().get("error") == "timers_unavailable" and r.headers.get("retry-after")):
                    self.unknown.update(txns)
                    time.sleep(0.05)
                else:
                    self.bad.append(f"{r.status_code} {r.headers.get('content-type')} {r.text[:200]}")


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_a_postgres_restart_under_schedules_and_fires_loses_and_duplicates_nothing(own_cluster, tmp_path, mode):
    folder, url, start = own_cluster
    brokers = [start_broker(url, tmp_path, QUEEN_SWEEPER_LEASE_MS="2000") for _ in range(2)]
    stop = threading.Event()
    clients = [Scheduler(b.url, f"{mode}-{i}", stop) for i, b in enumerate(brokers)]
    try:
        for c in clients:
            c.start()
        time.sleep(2.5)
        stop_postgres(folder, mode)
        down_at = time.monotonic()
        time.sleep(1.5)
        start()
        up_at = time.monotonic()
        time.sleep(4)
        stop.set()
        for c in clients:
            c.join(60)
        bad = [line for c in clients for line in c.bad]
        assert bad == [], bad
        codes = sum((Counter(c.codes) for c in clients), Counter())
        assert set(codes) <= {200, 503, "ReadError", "RemoteProtocolError", "ReadTimeout"}, codes
        assert codes[503] > 0, codes  # the restart happened under the load: requests were refused meanwhile
        # both brokers served before PostgreSQL went and after it came back
        for c in clients:
            assert any(t < down_at for t in c.ok_times) and any(t > up_at for t in c.ok_times), codes
        scheduled = set().union(*(c.scheduled for c in clients))
        unknown = set().union(*(c.unknown for c in clients))
        with psycopg.connect(url, autocommit=True) as conn:
            deadline = time.monotonic() + 60
            while conn.execute("SELECT count(*) FROM queen.timers").fetchone()[0]:
                assert time.monotonic() < deadline, "timers still pending a minute after the restart"
                time.sleep(0.2)
            frames = conn.execute("SELECT transaction_id, count(*) FROM queen.messages GROUP BY 1").fetchall()
            dead = conn.execute("SELECT count(*) FROM queen.dead_letter_queue").fetchone()[0]
        fired = dict(frames)
        assert {t for t, n in fired.items() if n > 1} == set(), "duplicated"
        assert scheduled - fired.keys() == set(), "lost: answered 200 scheduled, never fired"
        assert fired.keys() <= scheduled | unknown, "a frame no schedule asked for"
        assert dead == 0  # a restart's failures are transient: no attempt spent, nothing dead-lettered
        assert len(scheduled) > 100, codes
        for b in brokers:
            assert b.alive(), b.log()[-2000:]
            assert httpx.get(f"{b.url}/health", timeout=10).json()["status"] == "healthy"
    finally:
        stop.set()
        for b in brokers:
            b.kill(signal.SIGTERM)
