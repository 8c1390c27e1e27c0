"""Section `patroni`: automatic failover under Patroni + etcd, no operator step (issue 20).

scripts/patroni-cell starts a one-node etcd and two PostgreSQL 15 members under
Patroni with synchronous replication (scripts/patroni/member.yml.in, the recipe
of docs/failover.md). Two brokers on the multi-host URL; HTTP clients schedule
while timers fire (failover._clients). Round 1: SIGKILL of the leader's
postmaster. Round 2 (once the old leader has rejoined as the synchronous
standby): the leader's Patroni is stopped (SIGTERM). Patroni promotes the other
member by itself; the brokers follow the multi-host URL.

Printed per round: the POST status counts (every 503 must carry Retry-After and
the JSON body), accepted schedules and their fate (fired exactly once, lost,
duplicated), the seconds from the kill to the new leader and to the first fire
after it. Targets: 0 lost, 0 duplicated, first fire <= 15 s after the kill.

    bench/run --only patroni [--patroni-seconds 30]
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psycopg

from failover import _clients, all_healthy, record_expected
from harness import ROOT, connect, fate, keep_logs_and_remove, log, start_broker, wait_until

CELL = str(ROOT / "scripts" / "patroni-cell")
DB = "queen"
TARGET_FIRST_FIRE_S = 15


class PatroniCell:
    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="queen-bench-patroni-", dir="/tmp"))
        self.dir.chmod(0o755)

    def run(self, cmd: str) -> str:
        return subprocess.run([CELL, cmd, str(self.dir)], check=True, capture_output=True, text=True,
                              timeout=300).stdout.strip()

    def start(self) -> None:
        self.run("start")

    def leader(self) -> tuple[str, int, int] | None:
        try:
            name, port, pid = self.run("leader").split()
        except subprocess.CalledProcessError:
            return None
        return name, int(port), int(pid)

    def url(self, dbname: str = DB) -> str:
        hosts = self.run("url").split("@", 1)[1].rsplit("/", 1)[0]
        return f"postgresql://postgres@{hosts}/{dbname}?target_session_attrs=read-write&connect_timeout=2"

    def has_sync_standby(self) -> bool:
        return "Sync Standby" in self.run("list")

    def why_no_failover(self, name: str) -> str:
        """What the crashed leader's Patroni logged instead of failing over (its refusals in
        ha.is_failover_possible), or what it did."""
        try:
            lines = (self.dir / f"{name}.log").read_text(errors="replace").splitlines()
        except OSError:
            return "no log"
        said = [ln.split("INFO: ", 1)[-1] for ln in lines
                if any(k in ln for k in ("Member ", "members list is empty", "Primary crashed",
                                         "crash recovery", "starting as a primary"))]
        return "; ".join(dict.fromkeys(said)) or "nothing about it"

    def destroy(self) -> None:
        subprocess.run([CELL, "stop", str(self.dir)], check=False, timeout=120)
        # the members' Patroni and PostgreSQL logs outlive the cell: a round's verdict can be read
        keep_logs_and_remove(self.dir, {f"{n}.log": f"patroni-{n}.log" for n in ("m1", "m2", "etcd")})


def _create_db(cell: PatroniCell) -> str:
    with psycopg.connect(cell.url("postgres"), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {DB}")
    url = cell.url()
    subprocess.run([str(ROOT / "scripts" / "install-schema"), url], check=True)
    with connect(url) as conn:
        conn.execute("CREATE SCHEMA bench")
        conn.execute("""CREATE TABLE bench.expected (
            txn text PRIMARY KEY, queue text NOT NULL, deliver_at timestamptz,
            kind text NOT NULL DEFAULT 'fire')""")
    return url


def _round(cell: PatroniCell, url: str, brokers: list, n: int, how: str, seconds: float, res) -> bool:
    queue = f"drill-patroni-{n}"
    before = cell.leader()
    assert before is not None, "no leader before the round"
    marks: dict = {}

    def killer():
        time.sleep(seconds / 3)
        name, _, patroni_pid = before
        marks["kill_wall"], marks["killed"] = time.time(), time.monotonic()
        if how == "kill-postmaster":
            pid = int((cell.dir / name / "data" / "postmaster.pid").read_text().split()[0])
            os.kill(pid, signal.SIGKILL)
        else:
            os.kill(patroni_pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = cell.leader()
            if now is not None and now[0] != name:
                marks["promoted"], marks["promoted_wall"] = time.monotonic(), time.time()
                return
            time.sleep(0.1)

    th = threading.Thread(target=killer, daemon=True)
    out = asyncio.run(_clients([b.url for b in brokers], seconds, 4, 16, marks, on_start=th.start, queue=queue))
    th.join(90)
    healthy = all_healthy(brokers)
    after = cell.leader()
    with connect(url) as conn:
        record_expected(conn, queue, out)
        drained = wait_until(lambda: conn.execute("SELECT count(*) FROM queen.timers t JOIN queen.queues q "
                                                  "ON q.name = t.queue WHERE t.queue = %s", (queue,)
                                                  ).fetchone()[0] == 0, 90, 0.2)
        conn.execute("ANALYZE bench.expected, queen.messages, queen.timers")  # statistics are not replicated
        f = fate(conn, queue)
        u = fate(conn, queue, kinds=("unknown",))
        # the first frame the new leader committed (a stopping Patroni's primary may fire a moment longer)
        first_fire = conn.execute(
            """SELECT extract(epoch FROM min(m.created_at))::float8 FROM queen.messages m
                JOIN queen.partitions p ON p.id = m.partition_id JOIN queen.queues q ON q.id = p.queue_id
               WHERE q.name = %s AND m.created_at > to_timestamp(%s)""",
            (queue, marks.get("promoted_wall", marks["kill_wall"]))).fetchone()[0]
    kill_to_leader = marks["promoted"] - marks["killed"] if "promoted" in marks else None
    kill_to_fire = None if first_fire is None else first_fire - marks["kill_wall"]
    n503 = out["codes"].get(503, 0)
    log(f"  round {n} ({how}): leader {before[0]} -> {after[0] if after else 'none'}; "
        f"POST status counts {out['codes']}; 503s {n503}, of them without Retry-After or JSON: {len(out['bad'])}; "
        f"slowest answer {out['slowest']:.2f} s")
    if after is not None and after[0] == before[0]:
        log(f"    Patroni kept {before[0]} as the leader (restarted in place); its log: {cell.why_no_failover(before[0])}")
    log(f"    kill -> new leader {'n/a' if kill_to_leader is None else f'{kill_to_leader:.2f} s'}; "
        f"kill -> first fire by the new leader {'n/a' if kill_to_fire is None else f'{kill_to_fire:.2f} s'} "
        f"(target <= {TARGET_FIRST_FIRE_S} s)")
    log(f"    accepted {f['expected']}: delivered exactly once {f['fired']}, lost {f['lost']}, "
        f"duplicated {f['duplicated']}, pending {f['pending']}; outcome unknown {u['expected']}: fired once "
        f"{u['fired']}, duplicated {u['duplicated']}, never committed {u['lost']}")
    ok = (f["lost"] == 0 and f["duplicated"] == 0 and u["duplicated"] == 0 and not out["bad"] and healthy
          and drained and kill_to_fire is not None and kill_to_fire <= TARGET_FIRST_FIRE_S
          and after is not None and after[0] != before[0])
    log(f"    VERDICT: {'PASS' if ok else 'FAIL'}")
    res.put(f"patroni_round_{n}", how=how, accepted=f["expected"], fired_once=f["fired"], lost=f["lost"],
            duplicated=f["duplicated"] + u["duplicated"], pending=f["pending"], unknown=u["expected"],
            codes={str(k): v for k, v in out["codes"].items()}, responses_503=n503, bad_503=len(out["bad"]),
            kill_to_new_leader_s=kill_to_leader, kill_to_first_fire_s=kill_to_fire,
            verdict="PASS" if ok else "FAIL")
    return ok


def drill_patroni(res, seconds: float = 30) -> bool:
    log(f"\n== drill: Patroni + etcd automatic failover ({seconds:g} s of HTTP schedules per round over 2 "
        "brokers on the multi-host URL; round 1 SIGKILL of the leader's postmaster, round 2 SIGTERM of the "
        "leader's Patroni; no operator step) ==")
    cell = PatroniCell()
    brokers = []
    try:
        cell.start()
        url = _create_db(cell)
        versions = subprocess.run(["patroni", "--version"], capture_output=True, text=True).stdout.strip()
        log(f"  {versions}; etcd {subprocess.run(['etcd', '--version'], capture_output=True, text=True).stdout.split()[2]}; "
            f"ttl 10, loop_wait 1, retry_timeout 3, primary_start_timeout 0, synchronous_mode on, "
            f"maximum_lag_on_failover 64 MB; "
            f"QUEEN_DATABASE_URL={url}")
        env = {"QUEEN_SWEEPER_LEASE_MS": 2000, "QUEEN_POOL_TIMEOUT_MS": 1000}
        brokers = [start_broker(url, f"pat{n}", **env) for n in "ab"]
        ok1 = _round(cell, url, brokers, 1, "kill-postmaster", seconds, res)
        # round 2 starts from a healthy pair: the old leader rejoined as the synchronous standby
        rejoined = wait_until(cell.has_sync_standby, 120, 0.5)
        log(f"  the old leader rejoined as the synchronous standby: {rejoined}")
        ok2 = rejoined and _round(cell, url, brokers, 2, "stop-patroni", seconds, res)
        if not (ok1 and ok2):
            raise AssertionError("patroni drill verdict: FAIL")
        return True
    finally:
        for b in brokers:
            b.stop()
        cell.destroy()
