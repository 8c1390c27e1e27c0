"""Bench harness: a throwaway PostgreSQL cluster, databases, broker processes, figures.

Everything is loopback only and bounded: every wait has a deadline, every
process started here is stopped here (by its own pid).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import httpx
import psycopg

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"


def log(msg: str) -> None:
    print(msg, flush=True)


def proc_cpu(pid: int) -> float:
    """utime + stime of one process from /proc, in seconds (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # fields 14 and 15 of proc(5)


def stop_on_sigterm() -> None:
    """A runner's SIGTERM (`kill`, a CI job's timeout) raises SystemExit in its main thread,
    so that its finally blocks stop the clusters, cells, poolers and brokers it started: by
    default the signal ended the runner at once and left them all running (Ctrl-C, SIGINT,
    already unwound through them)."""
    def stop(signum, _frame):
        signal.signal(signum, signal.SIG_DFL)  # a second SIGTERM ends the runner at once
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def free_port() -> int:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "free-port")],
                         check=True, capture_output=True, text=True)
    return int(out.stdout)


def pct(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (p in 0..100) of a list; None when empty."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(p / 100 * len(s) + 0.5)) - 1))
    return s[k]


def ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:.1f} ms"


class Cluster:
    """A PostgreSQL 15 cluster in a temporary folder, started through scripts/pg-cluster."""

    # Settings the bench needs besides pg-cluster's own: commit timestamps
    # (fire lag measured at the commit of the frame) and the statement
    # statistics used by the profile.
    SYSTEM = {
        "track_commit_timestamp": "on",
        "shared_preload_libraries": "'pg_stat_statements'",
        "shared_buffers": "'512MB'",
    }

    def __init__(self, fsync: str = "on"):
        self.dir = Path(tempfile.mkdtemp(prefix="queen-bench-", dir="/tmp"))
        self.dir.chmod(0o755)
        self.port = free_port()
        self.fsync = fsync
        self.admin = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _pg(self, *args: str) -> None:
        env = {**os.environ, "QUEEN_PG_FSYNC": self.fsync}
        subprocess.run([str(ROOT / "scripts" / "pg-cluster"), *args], check=True, env=env)

    def start(self) -> None:
        self._pg("start", str(self.dir), str(self.port))

    def stop(self) -> None:
        self._pg("stop", str(self.dir))

    def setup(self) -> None:
        self.start()
        with psycopg.connect(self.admin, autocommit=True) as conn:
            for k, v in self.SYSTEM.items():
                conn.execute(f"ALTER SYSTEM SET {k} = {v}")
        self.stop()
        self.start()
        with psycopg.connect(self.admin, autocommit=True) as conn:
            # nested statements too: the fire's SQL runs inside PL/pgSQL functions
            conn.execute("ALTER SYSTEM SET pg_stat_statements.track = 'all'")
            conn.execute("SELECT pg_reload_conf()")

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def create_db(self, name: str, root: Path = ROOT) -> str:
        """A fresh database with the schema of the checkout at `root` (bench/ab_delete.py: another commit's)."""
        with psycopg.connect(self.admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"')
        url = psycopg.conninfo.make_conninfo(self.admin, dbname=name)
        subprocess.run([str(root / "scripts" / "install-schema"), url], check=True)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.execute("CREATE SCHEMA bench")
            # What the bench expects to fire: one row per timer it scheduled.
            conn.execute("""CREATE TABLE bench.expected (
                txn text PRIMARY KEY, queue text NOT NULL, deliver_at timestamptz,
                kind text NOT NULL DEFAULT 'fire')""")
        return url

    def server_version(self) -> str:
        with psycopg.connect(self.admin, autocommit=True) as conn:
            return conn.execute("SHOW server_version").fetchone()[0]


def build_db(cluster: Cluster, name: str, root: Path) -> str:
    """A new database `name` with the schema of the checkout at `root` (its own
    scripts/install-schema and sql/)."""
    with psycopg.connect(cluster.admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    url = psycopg.conninfo.make_conninfo(cluster.admin, dbname=name)
    subprocess.run([str(root / "scripts" / "install-schema"), url], check=True)
    return url


@contextmanager
def checkouts(prefix: str, compare: Path | None, setup: bool = True) -> Iterator[tuple[Cluster, dict, dict]]:
    """The before/after scripts' cluster (fsync on; Cluster.setup's settings unless
    setup=False) and one database per checkout, each with that checkout's schema:
    `this` (this one) and, given compare, `compare` (e.g. a worktree of the commit
    before a change). Yields (cluster, {side: url}, {side: checkout root}); the
    cluster is destroyed after."""
    cluster = Cluster(fsync="on")
    if setup:
        cluster.setup()
    else:
        cluster.start()
    try:
        roots = {"this": ROOT, **({"compare": compare.resolve()} if compare else {})}
        yield cluster, {side: build_db(cluster, f"{prefix}_{side}", root) for side, root in roots.items()}, roots
    finally:
        cluster.destroy()


def rotated(names: list, r: int) -> list:
    """names in round r's order: rotated by r, so that each side takes each place in turn."""
    k = r % len(names)
    return names[k:] + names[:k]


@dataclass
class Broker:
    url: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    broker_id: str
    env: dict = field(default_factory=dict)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def died(self) -> str | None:
        """None while it runs; else how it ended (a signal names what killed it: SIGKILL
        and no log line is the OOM killer or a pkill, not the broker) and its log's end."""
        if self.alive():
            return None
        rc = self.proc.returncode
        how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with {rc}"
        tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
        return f"broker {self.broker_id} {how}; its log ends:\n{tail}"

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 30) -> None:
        if self.alive():
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def stop(self) -> None:
        self.kill(signal.SIGTERM, timeout=15)

    def metrics(self) -> str | None:
        for path in ("/metrics/prometheus", "/metrics"):
            try:
                r = httpx.get(self.url + path, timeout=5)
                if r.status_code == 200 and "queen_timers" in r.text:
                    return r.text
            except httpx.HTTPError:
                pass
        return None


def metric_sum(text: str | None, name: str, **labels: str) -> float | None:
    """Sum of a Prometheus series in an exposition text (None when absent)."""
    if not text:
        return None
    total, seen = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        if series.split("{", 1)[0] != name:
            continue
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
            seen = True
    return total if seen else None


_broker_seq = 0


def start_broker(database_url: str, name: str = "b", wait: bool = True, argv: list[str] | None = None,
                 **env) -> Broker:
    """A real `python -m queen_timers` process (or `python *argv`) on a free loopback port."""
    global _broker_seq
    _broker_seq += 1
    port = free_port()
    broker_id = f"bench-{name}-{_broker_seq}"
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "logs").mkdir(exist_ok=True)
    full_env = {
        **os.environ,
        "QUEEN_DATABASE_URL": database_url,
        "QUEEN_PORT": str(port),
        "QUEEN_HOST": "127.0.0.1",
        "QUEEN_BROKER_ID": broker_id,
        "PYTHONUNBUFFERED": "1",
        **{k: str(v) for k, v in env.items()},
    }
    log_path = OUT / "logs" / f"{broker_id}.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, *(argv or ["-m", "queen_timers"])], env=full_env,
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    b = Broker(url=f"http://127.0.0.1:{port}", port=port, proc=proc, log_path=log_path,
               broker_id=broker_id, env=env)
    if wait:
        wait_healthy(b)
    return b


def wait_healthy(b: Broker, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not b.alive():
            raise RuntimeError(f"broker {b.broker_id} exited with {b.proc.returncode}:\n"
                               + b.log_path.read_text(errors="replace")[-3000:])
        try:
            if httpx.get(f"{b.url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    b.kill()
    raise RuntimeError(f"broker {b.broker_id} did not become healthy")


def keep_logs_and_remove(folder: Path, logs: dict[str, str]) -> None:
    """A stopped helper's folder (a pgbouncer, a Patroni cell): each log named in `logs`
    (its file -> its name under bench/out/logs/) kept, the folder removed."""
    (OUT / "logs").mkdir(parents=True, exist_ok=True)
    for name, kept in logs.items():
        try:
            shutil.copy(folder / name, OUT / "logs" / kept)
        except OSError:
            pass
    shutil.rmtree(folder, ignore_errors=True)


def wait_until(pred, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def connect(url: str) -> psycopg.Connection:
    return psycopg.connect(url, autocommit=True)


# -------------------------------------------------------------------------
# Fixtures loaded straight into queen.timers (a bench may load fixtures;
# tenant_usage is kept consistent with the rows inserted).
# -------------------------------------------------------------------------

def load_timers(conn: psycopg.Connection, *, queue: str, n: int, prefix: str,
                deliver_sql: str = "now() - interval '1 second'", payload_bytes: int = 64,
                start: int = 1, expected: bool = True, tenant: str = "default") -> None:
    """Insert n timers (keys prefix-i, txn prefix-i) straight into queen.timers.

    deliver_sql may use `g` (1..n) to spread deliver times.
    """
    conn.execute("SELECT queen.ensure_partition(%s, %s, 'Default')", (tenant, queue))
    conn.execute(f"""
        INSERT INTO queen.timers (tenant, queue, timer_key, partition, deliver_at, txn, message_id, payload)
        SELECT %(t)s, %(q)s, %(p)s || '-' || g, 'Default', {deliver_sql}, %(p)s || '-' || g,
               gen_random_uuid(), convert_to(rpad('{{"n":' || g || '}}', %(pb)s, ' '), 'UTF8')
          FROM generate_series(%(s)s::bigint, %(e)s::bigint) g""",
                 {"t": tenant, "q": queue, "p": prefix, "pb": payload_bytes, "s": start, "e": start + n - 1})
    conn.execute("SELECT queen.bump_tenant_usage(%s, %s, 0)", (tenant, n))
    if expected:
        conn.execute("""INSERT INTO bench.expected (txn, queue, deliver_at)
                        SELECT txn, queue, deliver_at FROM queen.timers
                         WHERE queue = %s AND txn LIKE %s || '-%%'
                        ON CONFLICT (txn) DO NOTHING""", (queue, prefix))


def reset(conn: psycopg.Connection) -> None:
    """Empty the timers, the log and the bench's expectations; resume everything."""
    conn.execute("TRUNCATE queen.timers, queen.messages, queen.dead_letter_queue, queen.tenant_usage, queen.tenant_usage_deltas, "
                 "queen.rate_buckets, bench.expected")
    conn.execute("UPDATE queen.cell_settings SET fire_paused = false, scheduling_paused = false")


def pending(conn: psycopg.Connection, queue: str | None = None) -> int:
    if queue:
        return conn.execute("SELECT count(*) FROM queen.timers WHERE queue = %s", (queue,)).fetchone()[0]
    return conn.execute("SELECT count(*) FROM queen.timers").fetchone()[0]


def exists_pending(conn: psycopg.Connection, queue: str) -> bool:
    return conn.execute("SELECT EXISTS (SELECT 1 FROM queen.timers WHERE queue = %s)", (queue,)).fetchone()[0]


def lag_stats(conn: psycopg.Connection, queue: str, kind: str = "fire") -> dict:
    """Fire lag per message: commit time of the frame (track_commit_timestamp)
    and the fire transaction's start (messages.created_at), each minus deliver_at."""
    rows = conn.execute("""
        SELECT extract(epoch FROM pg_xact_commit_timestamp(m.xmin) - e.deliver_at)::float8,
               extract(epoch FROM m.created_at - e.deliver_at)::float8
          FROM bench.expected e
          JOIN queen.messages m ON m.transaction_id = e.txn
          JOIN queen.partitions p ON p.id = m.partition_id
          JOIN queen.queues q ON q.id = p.queue_id AND q.name = e.queue
         WHERE e.queue = %s AND e.kind = %s""", (queue, kind)).fetchall()
    commit = [r[0] for r in rows if r[0] is not None]
    start = [r[1] for r in rows]
    return {
        "n": len(rows),
        "commit_p50": pct(commit, 50), "commit_p99": pct(commit, 99), "commit_max": max(commit) if commit else None,
        "start_p50": pct(start, 50), "start_p99": pct(start, 99), "start_max": max(start) if start else None,
    }


def fate(conn: psycopg.Connection, queue: str | None = None, kinds=("fire",)) -> dict:
    """fired / lost / duplicated / still pending / dead-lettered, by txn, over bench.expected."""
    row = conn.execute("""
        WITH e AS (SELECT * FROM bench.expected WHERE (%(q)s::text IS NULL OR queue = %(q)s) AND kind = ANY(%(k)s)),
             m AS (SELECT m.transaction_id AS txn, count(*) AS n
                     FROM queen.messages m JOIN e ON e.txn = m.transaction_id GROUP BY 1),
             t AS (SELECT t.txn FROM queen.timers t JOIN e ON e.txn = t.txn),
             d AS (SELECT d.transaction_id AS txn FROM queen.dead_letter_queue d JOIN e ON e.txn = d.transaction_id)
        SELECT (SELECT count(*) FROM e),
               (SELECT count(*) FROM m WHERE n = 1),
               (SELECT count(*) FROM m WHERE n > 1),
               (SELECT count(*) FROM t),
               (SELECT count(*) FROM d),
               (SELECT count(*) FROM e WHERE NOT EXISTS (SELECT 1 FROM m WHERE m.txn = e.txn)
                                         AND NOT EXISTS (SELECT 1 FROM t WHERE t.txn = e.txn)
                                         AND NOT EXISTS (SELECT 1 FROM d WHERE d.txn = e.txn))
    """, {"q": queue, "k": list(kinds)}).fetchone()
    return {"expected": row[0], "fired": row[1], "duplicated": row[2], "pending": row[3],
            "dead_lettered": row[4], "lost": row[5]}


class Results:
    """Figures of one run: printed as they come and written to bench/out/results.json."""

    def __init__(self):
        self.data: dict = {}
        OUT.mkdir(parents=True, exist_ok=True)

    def put(self, section: str, **figures) -> None:
        self.data.setdefault(section, {}).update(figures)
        self.save()

    def save(self) -> None:
        (OUT / "results.json").write_text(json.dumps(self.data, indent=2, default=str))


def explain_nested_statements(conn) -> None:
    """Inside an open transaction: auto_explain every statement, nested ones too, with
    ANALYZE and BUFFERS, as NOTICEs on this connection (SET LOCAL: gone at its end)."""
    conn.execute("LOAD 'auto_explain'")
    for k, v in (("log_min_duration", "0"), ("log_analyze", "on"), ("log_buffers", "on"),
                 ("log_nested_statements", "on"), ("log_timing", "on"), ("log_level", "notice")):
        conn.execute(f"SET LOCAL auto_explain.{k} = {v}")


def explain_rolled_back(conn, run, prepare=None) -> tuple[object, float, list[str]]:
    """In a transaction that is rolled back: auto_explain every statement run(conn)
    executes, nested ones too (explain_nested_statements). prepare(conn), if given,
    runs first and is not reported. Returns (run's result, its seconds, the plans)."""
    notices: list[str] = []
    handler = lambda d: notices.append(d.message_primary or "")  # noqa: E731
    conn.add_notice_handler(handler)
    try:
        conn.execute("BEGIN")
        try:
            explain_nested_statements(conn)
            if prepare is not None:
                prepare(conn)
            notices.clear()
            t0 = time.perf_counter()
            result = run(conn)
            secs = time.perf_counter() - t0
        finally:
            conn.execute("ROLLBACK")
    finally:
        conn.remove_notice_handler(handler)
    return result, secs, notices
