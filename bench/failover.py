"""Failover drill: a primary and a synchronous standby (scripts/pg-replica), two
brokers on the multi-host URL, HTTP clients scheduling while timers fire;
SIGKILL of the primary's postmaster mid-load, `pg_ctl promote` of the standby.

Afterwards, on the promoted node: every schedule that answered 200 fired
exactly once (its txn is in the log once) or is still pending; no frame is
lost, none is duplicated, none exists for a txn nobody sent. Printed: the
HTTP status counts and the slowest answer (nothing hangs), the time from the
kill to the first fire and to the first 200 after the promotion, the counts,
and a verdict line.

    bench/run --only failover [--failover-seconds 30] [--failover-detect-s 1]
    .venv/bin/python bench/failover.py [seconds]        # this drill alone
"""

from __future__ import annotations

import asyncio
import base64
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import ROOT, Results, connect, fate, free_port, log, start_broker, wait_healthy, wait_until  # noqa: E402

REPLICA = str(ROOT / "scripts" / "pg-replica")
DB = "queen_failover"
QUEUE = "drill-failover"


class ReplicaPair:
    """A primary and a synchronous hot standby in a temporary folder (scripts/pg-replica)."""

    def __init__(self, fsync: str = "on"):
        self.dir = Path(tempfile.mkdtemp(prefix="queen-bench-ha-", dir="/tmp"))
        self.dir.chmod(0o755)
        self.primary_port, self.standby_port = free_port(), free_port()
        self.env = {**os.environ, "QUEEN_PG_FSYNC": fsync}

    def run(self, cmd: str, *args: str) -> None:
        subprocess.run([REPLICA, cmd, str(self.dir), *args], check=True, env=self.env, timeout=180)

    def start(self) -> None:
        self.run("start", str(self.primary_port), str(self.standby_port))

    def destroy(self) -> None:
        self.run("stop")
        shutil.rmtree(self.dir, ignore_errors=True)

    def url(self, port: int) -> str:
        return f"postgresql://postgres@127.0.0.1:{port}/{DB}"

    def multi_url(self) -> str:
        return (f"postgresql://postgres@127.0.0.1:{self.primary_port},127.0.0.1:{self.standby_port}/{DB}"
                "?target_session_attrs=read-write&connect_timeout=2")

    def create_db(self) -> None:
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{self.primary_port}/postgres",
                             autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {DB}")
        url = self.url(self.primary_port)
        subprocess.run([str(ROOT / "scripts" / "install-schema"), url], check=True)
        with connect(url) as conn:
            conn.execute("CREATE SCHEMA bench")
            conn.execute("""CREATE TABLE bench.expected (
                txn text PRIMARY KEY, queue text NOT NULL, deliver_at timestamptz,
                kind text NOT NULL DEFAULT 'fire')""")


async def _clients(urls: list[str], seconds: float, clients: int, ops: int, marks: dict,
                   on_start=None, queue: str = QUEUE) -> dict:
    """clients workers POSTing batches of ops schedules (due in 0..2000 ms), round-robin over
    the brokers. A 200's verdicts are accepted; a 503 or a transport error leaves the
    batch's outcome unknown (its commit may have happened just before the primary died)."""
    accepted: list[tuple[str, str]] = []
    unknown: list[str] = []
    codes: dict = {}
    bad: list[str] = []
    slowest = 0.0
    seq = 0
    payload = base64.b64encode(b'{"kind":"failover-drill"}').decode()
    t_end = time.monotonic() + seconds

    async def worker(w: int):
        nonlocal seq, slowest
        async with httpx.AsyncClient(timeout=30) as c:
            n = 0
            while time.monotonic() < t_end:
                n += 1
                batch = []
                for _ in range(ops):
                    seq += 1
                    key = f"{queue}-{seq}"
                    batch.append({"op": "schedule", "queue": queue, "timerKey": key,
                                  "delayMs": random.randint(0, 2000), "txn": key, "payload": payload})
                t0 = time.monotonic()
                try:
                    r = await c.post(f"{urls[(w + n) % len(urls)]}/api/v1/timers", json={"operations": batch})
                except httpx.HTTPError as exc:
                    codes[type(exc).__name__] = codes.get(type(exc).__name__, 0) + 1
                    unknown.extend(o["txn"] for o in batch)
                    await asyncio.sleep(0.05)
                    continue
                finally:
                    slowest = max(slowest, time.monotonic() - t0)
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
                if r.status_code == 200:
                    accepted.extend((v["txn"], v["deliverAt"]) for v in r.json()["results"] if v["ok"])
                    if "promoted" in marks and "first_200" not in marks:
                        marks["first_200"] = time.monotonic()
                    continue
                unknown.extend(o["txn"] for o in batch)
                try:
                    body = r.json()
                except ValueError:
                    body = {}
                if r.status_code != 503 or "retry-after" not in r.headers or body.get("error") != "timers_unavailable":
                    bad.append(f"{r.status_code} {r.headers.get('retry-after')} {r.text[:120]}")
                await asyncio.sleep(0.05)

    if on_start:
        on_start()
    await asyncio.gather(*(worker(w) for w in range(clients)))
    return {"accepted": accepted, "unknown": unknown, "codes": codes, "bad": bad, "slowest": slowest}


def all_healthy(brokers: list) -> bool:
    """Every broker answers /health within 60 s (each waited for)."""
    healthy = True
    for b in brokers:
        try:
            wait_healthy(b, 60)
        except RuntimeError:
            healthy = False
    return healthy


def record_expected(conn, queue: str, out: dict) -> None:
    """What _clients saw, in bench.expected: accepted schedules, and those whose outcome is unknown."""
    with conn.transaction(), conn.cursor() as cur:  # one commit, not one fsync per row
        cur.executemany("INSERT INTO bench.expected (txn, queue, deliver_at) VALUES (%s, %s, %s) "
                        "ON CONFLICT (txn) DO NOTHING", [(t, queue, d) for t, d in out["accepted"]])
        cur.executemany("INSERT INTO bench.expected (txn, queue, kind) VALUES (%s, %s, 'unknown') "
                        "ON CONFLICT (txn) DO NOTHING", [(t, queue) for t in out["unknown"]])


def drill_failover(res: Results, seconds: float = 30, fsync: str = "on", detect_s: float = 1.0,
                   clients: int = 4, ops: int = 16) -> bool:
    log(f"\n== drill: failover ({seconds:g} s of HTTP schedules over 2 brokers on a multi-host URL; "
        f"SIGKILL of the primary's postmaster at 1/3, pg_ctl promote of the synchronous standby "
        f"{detect_s:g} s later) ==")
    pair = ReplicaPair(fsync)
    brokers = []
    try:
        pair.start()
        pair.create_db()
        log(f"  primary :{pair.primary_port}, synchronous standby :{pair.standby_port} "
            f"(synchronous_commit=on, fsync={fsync}); QUEEN_DATABASE_URL={pair.multi_url()}")
        env = {"QUEEN_SWEEPER_LEASE_MS": 2000, "QUEEN_POOL_TIMEOUT_MS": 1000}
        brokers = [start_broker(pair.multi_url(), f"fo{n}", **env) for n in "ab"]
        marks: dict = {}

        def killer():
            time.sleep(seconds / 3)
            marks["kill_wall"], marks["killed"] = time.time(), time.monotonic()
            pair.run("kill-primary")
            time.sleep(detect_s)  # what a failover manager spends deciding the primary is gone
            marks["promote_wall"], marks["promote_called"] = time.time(), time.monotonic()
            pair.run("promote")
            marks["promoted"] = time.monotonic()

        th = threading.Thread(target=killer, daemon=True)
        out = asyncio.run(_clients([b.url for b in brokers], seconds, clients, ops, marks, on_start=th.start))
        th.join(120)
        healthy = all_healthy(brokers)
        new = pair.url(pair.standby_port)
        with connect(new) as conn:
            in_recovery = conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]
            record_expected(conn, QUEUE, out)
            drained = wait_until(lambda: conn.execute("SELECT count(*) FROM queen.timers").fetchone()[0] == 0,
                                 90, 0.2)
            # a promoted standby has no table statistics activity of its own (they are not
            # replicated), so nothing has analyzed what the drill wrote: without this the
            # planner nested-looped fate's join of ~170,000 rows for over 10 minutes
            conn.execute("ANALYZE bench.expected, queen.messages, queen.timers, queen.dead_letter_queue")
            f = fate(conn, QUEUE)
            u = fate(conn, QUEUE, kinds=("unknown",))
            strangers = conn.execute("""SELECT count(*) FROM queen.messages m WHERE NOT EXISTS
                                          (SELECT 1 FROM bench.expected e WHERE e.txn = m.transaction_id)"""
                                     ).fetchone()[0]
            first_fire = conn.execute("""SELECT extract(epoch FROM min(created_at))::float8 FROM queen.messages
                                          WHERE created_at > to_timestamp(%s)""", (marks["promote_wall"],)
                                      ).fetchone()[0]
            last_old = conn.execute("""SELECT extract(epoch FROM max(created_at))::float8 FROM queen.messages
                                        WHERE created_at <= to_timestamp(%s)""", (marks["promote_wall"],)
                                    ).fetchone()[0]
        kill_to_fire = None if first_fire is None else first_fire - marks["kill_wall"]
        kill_to_200 = marks["first_200"] - marks["killed"] if "first_200" in marks else None
        promote_s = marks["promoted"] - marks["promote_called"]
        log(f"  POST status counts {out['codes']}; 503s without Retry-After or JSON body: {len(out['bad'])}; "
            f"slowest answer {out['slowest']:.2f} s")
        log(f"  pg_ctl promote took {promote_s:.2f} s (called {detect_s:g} s after the kill); "
            f"new primary in recovery: {in_recovery}")
        if last_old is not None:
            log(f"  last frame committed by the old primary: {last_old - marks['kill_wall']:+.3f} s from the kill "
                "(its orphaned backends outlive the postmaster for a moment)")
        log(f"  kill -> first fire after the promotion: {'n/a' if kill_to_fire is None else f'{kill_to_fire:.2f} s'}; "
            f"kill -> first 200 after the promotion: {'n/a' if kill_to_200 is None else f'{kill_to_200:.2f} s'}")
        log(f"  accepted (200) {f['expected']}: fired once {f['fired']}, duplicated {f['duplicated']}, "
            f"still pending {f['pending']}, dead-lettered {f['dead_lettered']}, lost {f['lost']}")
        log(f"  outcome unknown (503 or transport error) {u['expected']}: fired once {u['fired']}, "
            f"duplicated {u['duplicated']}, never committed {u['lost']}; frames for no txn sent: {strangers}")
        ok = (f["lost"] == 0 and f["duplicated"] == 0 and u["duplicated"] == 0 and strangers == 0
              and f["dead_lettered"] == 0 and not out["bad"] and healthy and not in_recovery and drained
              and kill_to_fire is not None and all(isinstance(k, int) for k in out["codes"]))
        log(f"  VERDICT: {'PASS' if ok else 'FAIL'}: {f['fired'] + f['pending']} of {f['expected']} accepted "
            f"schedules fired exactly once or pending, {f['lost']} lost, "
            f"{f['duplicated'] + u['duplicated']} duplicated; both brokers healthy after: {healthy}")
        res.put("drill_failover", **f, unknown=u, strangers=strangers,
                codes={str(k): v for k, v in out["codes"].items()}, bad_503=len(out["bad"]),
                slowest_answer_s=round(out["slowest"], 3), promote_s=round(promote_s, 3), detect_s=detect_s,
                kill_to_first_fire_s=kill_to_fire, kill_to_first_200_s=kill_to_200, brokers_healthy=healthy,
                verdict="PASS" if ok else "FAIL")
        if not ok:
            raise AssertionError("failover drill verdict: FAIL")
        return ok
    finally:
        for b in brokers:
            b.stop()
        pair.destroy()


if __name__ == "__main__":
    secs = float(sys.argv[1]) if len(sys.argv) > 1 else 30
    try:
        drill_failover(Results(), secs)
    except AssertionError:
        sys.exit(1)
