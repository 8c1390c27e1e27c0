"""Automatic failover under Patroni + etcd (Debian's packages), no operator step (issue 20).

scripts/patroni-cell starts a one-node etcd and two PostgreSQL 15 members under
Patroni with synchronous replication (scripts/patroni/member.yml.in, the recipe
of docs/failover.md). Two brokers on the multi-host URL schedule under HTTP
load; the leader's postmaster is SIGKILLed; Patroni promotes the synchronous
standby by itself. Every accepted schedule fires exactly once and the new
leader fires within 15 s of the kill. bench/patroni.py is the longer drill.
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
from pathlib import Path

import httpx
import psycopg
import pytest

from conftest import ROOT, start_broker

CELL = str(ROOT / "scripts" / "patroni-cell")


def test_the_failover_page_shows_the_drills_patroni_configuration():
    template = (ROOT / "scripts" / "patroni" / "member.yml.in").read_text()
    assert template in (ROOT / "docs" / "failover.md").read_text()


@pytest.fixture
def cell():
    folder = Path(tempfile.mkdtemp(prefix="queen-patroni-", dir="/tmp"))
    folder.chmod(0o755)
    try:
        subprocess.run([CELL, "start", str(folder)], check=True, capture_output=True, timeout=300)
        yield folder
    finally:
        subprocess.run([CELL, "stop", str(folder)], check=False, timeout=120)
        shutil.rmtree(folder, ignore_errors=True)


def leader(folder: Path) -> str | None:
    out = subprocess.run([CELL, "leader", str(folder)], capture_output=True, text=True)
    return out.stdout.split()[0] if out.returncode == 0 else None


def test_patroni_promotes_the_standby_and_no_accepted_timer_is_lost(cell, tmp_path):
    hosts = subprocess.run([CELL, "url", str(cell)], check=True, capture_output=True,
                           text=True).stdout.strip().split("@", 1)[1].rsplit("/", 1)[0]
    admin = f"postgresql://postgres@{hosts}/postgres?target_session_attrs=read-write"
    url = f"postgresql://postgres@{hosts}/queen?target_session_attrs=read-write&connect_timeout=2"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute("CREATE DATABASE queen")
    subprocess.run([str(ROOT / "scripts" / "install-schema"), url], check=True, capture_output=True)
    env = {"QUEEN_SWEEPER_LEASE_MS": "2000", "QUEEN_POOL_TIMEOUT_MS": "1000"}
    brokers = [start_broker(url, tmp_path, **env) for _ in range(2)]
    try:
        check_failover(cell, url, brokers)
    finally:
        for b in brokers:
            b.kill(signal.SIGTERM)


def check_failover(cell: Path, url: str, brokers: list) -> None:
    accepted: list[str] = []
    bad: list[str] = []
    stop = threading.Event()
    payload = base64.b64encode(b'{"drill":"patroni"}').decode()

    def load(w: int):
        n = 0
        with httpx.Client(timeout=15) as c:
            while not stop.is_set():
                n += 1
                keys = [f"w{w}-{n}-{i}" for i in range(8)]
                ops = [{"op": "schedule", "queue": "patroni", "timerKey": k, "txn": k, "delayMs": 500,
                        "payload": payload} for k in keys]
                try:
                    r = c.post(f"{brokers[(w + n) % 2].url}/api/v1/timers", json={"operations": ops})
                except httpx.HTTPError:
                    time.sleep(0.05)
                    continue
                if r.status_code == 200:
                    accepted.extend(v["txn"] for v in r.json()["results"] if v["ok"])
                elif r.status_code != 503 or r.headers.get("retry-after") != "1" \
                        or r.json().get("error") != "timers_unavailable":
                    bad.append(f"{r.status_code} {r.text[:100]}")
                else:
                    time.sleep(0.05)

    workers = [threading.Thread(target=load, args=(w,)) for w in range(2)]
    try:
        for t in workers:
            t.start()
        time.sleep(3)
        # synchronous_mode promotes only a synchronous standby: the drill starts from one
        sync = subprocess.run([CELL, "wait-sync", str(cell), "30"], capture_output=True, text=True)
        assert sync.returncode == 0, sync.stderr
        before = leader(cell)
        pid = int((cell / before / "data" / "postmaster.pid").read_text().split()[0])
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while leader(cell) in (None, before):
            if time.monotonic() > deadline:
                logs = subprocess.run([CELL, "logs", str(cell)], capture_output=True, text=True).stdout
                pytest.fail(f"Patroni promoted no one in 30 s\n{logs}")
            time.sleep(0.1)
        promoted = time.time()
        time.sleep(5)
    finally:
        stop.set()
        for t in workers:
            t.join()
    assert not bad, bad[:3]
    assert len(accepted) > 100
    with psycopg.connect(url, autocommit=True) as conn:
        deadline = time.monotonic() + 60
        while conn.execute("SELECT count(*) FROM queen.timers").fetchone()[0]:
            assert time.monotonic() < deadline, "accepted timers never fired after the failover"
            time.sleep(0.2)
        fired = [r[0] for r in conn.execute("SELECT transaction_id FROM queen.messages")]
        first_new = conn.execute("SELECT extract(epoch FROM min(created_at))::float8 FROM queen.messages "
                                 "WHERE created_at > to_timestamp(%s)", (promoted,)).fetchone()[0]
    assert len(fired) == len(set(fired)), "a timer fired twice"
    assert set(accepted) <= set(fired), f"lost: {sorted(set(accepted) - set(fired))[:5]}"
    assert first_new is not None and first_new - killed <= 15, first_new and first_new - killed
