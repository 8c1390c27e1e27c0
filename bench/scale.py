"""Issue 9 sections: brokers that add throughput (scale), fire lag with two brokers (lag2),
and a broker's memory while it drains a million due timers (rss).

Every figure is measured in this run; rounds rotate their order and the verdicts are on medians.
Where the CPU went is printed with each figure (the machine's busy share, the brokers' and the
PostgreSQL backends' CPU seconds from /proc), because on 2 shared cores that is what decides
whether a second broker can add anything.
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from pathlib import Path

import zstandard

from harness import Broker, Cluster, connect, load_timers, log, proc_cpu, reset, start_broker, wait_until
from perf import bench_lag, first_fire, last_commit, vacuum

# -------------------------------------------------------------------------
# CPU accounting from /proc
# -------------------------------------------------------------------------

def _children(ppid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == ppid:
                out.append(int(d.name))
        except (OSError, ValueError, IndexError):
            pass
    return out


def _machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from the first line of /proc/stat."""
    v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


class CpuMeter:
    """CPU seconds of the brokers and of the cluster's backends, and the machine's busy share,
    between start() and stop()."""

    def __init__(self, cluster: Cluster, brokers: list[Broker]):
        self.postmaster = int((cluster.dir / "data" / "postmaster.pid").read_text().split()[0])
        self.brokers = brokers

    def _snap(self) -> dict:
        pg = sum(proc_cpu(p) for p in _children(self.postmaster))
        return {"brokers": [proc_cpu(b.proc.pid) for b in self.brokers], "pg": pg, "machine": _machine_busy(),
                "t": time.monotonic()}

    def start(self) -> None:
        self.a = self._snap()

    def stop(self) -> dict:
        b = self._snap()
        busy = b["machine"][0] - self.a["machine"][0]
        total = b["machine"][1] - self.a["machine"][1]
        return {"wall_s": b["t"] - self.a["t"],
                "brokers_cpu_s": [round(y - x, 2) for x, y in zip(self.a["brokers"], b["brokers"])],
                # backends that ended in between are missed; the sweepers' connections live on
                "pg_cpu_s": round(b["pg"] - self.a["pg"], 2),
                "machine_busy": round(busy / total, 3) if total else None}


def _cpu_text(c: dict) -> str:
    return (f"CPU over {c['wall_s']:.1f} s: machine {c['machine_busy'] * 100:.0f}% busy of {os.cpu_count()} cores; "
            f"broker(s) {' + '.join(f'{x:.1f}' for x in c['brokers_cpu_s']) or 'none'} s; PostgreSQL {c['pg_cpu_s']:.1f} s")


# -------------------------------------------------------------------------
# scale: two brokers on one database
# -------------------------------------------------------------------------

def _load_queues(conn, n: int, queues: list[str], prefix: str) -> None:
    conn.execute("TRUNCATE queen.timers, queen.messages")
    conn.execute("DELETE FROM queen.tenant_usage_deltas")
    conn.execute("UPDATE queen.tenant_usage SET pending_timers = 0")
    per = n // len(queues)
    for i, q in enumerate(queues):
        # interleaved deliver times, so that every batch in expiry order spans all the queues
        load_timers(conn, queue=q, n=per, prefix=f"{prefix}{i}", expected=False,
                    deliver_sql=f"now() - interval '1 hour' + (g * {len(queues)} + {i}) * interval '1 microsecond'")
    vacuum(conn)


def _checkpoints(conn) -> int:
    return conn.execute("SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter").fetchone()[0]


def _timers_left(conn) -> bool:
    return conn.execute("SELECT EXISTS (SELECT 1 FROM queen.timers)").fetchone()[0]


def _fire_span(conn) -> float | None:
    """Seconds from the first fire transaction's start to the last frame's commit (database clock)."""
    first = first_fire(conn)
    return last_commit(conn) - first if first else None


def _drain(conn, timeout: float) -> float | None:
    """Resume the fire; seconds from the first fire transaction's start to the last frame's commit
    (the poll for an empty table is lazy and not part of the figure)."""
    conn.execute("SELECT queen.resume_fire()")
    ok = wait_until(lambda: not _timers_left(conn), timeout, 0.2)
    conn.execute("SELECT queen.pause_fire()")
    return _fire_span(conn) if ok else None


def _drain_sql(conn, sessions: list, batch: int, timeout: float) -> float | None:
    """The same drain with no broker: the `sessions` (open connections, so that the CPU meter
    counts their backends) call queen.fire_due_timers(batch) back to back (the sweeper's call)
    until it answers nothing. What the statement can do on this machine with one and two
    sessions: the ceiling the brokers' ratio is read against."""
    deadline = time.monotonic() + timeout
    errors: list[BaseException] = []

    def work(c) -> None:
        try:
            while time.monotonic() < deadline and c.execute(
                    "SELECT count(*) FROM queen.fire_due_timers(%s, NULL, false)", (batch,)).fetchone()[0]:
                pass
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    conn.execute("SELECT queen.resume_fire()")
    threads = [threading.Thread(target=work, args=(c,)) for c in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    conn.execute("SELECT queen.pause_fire()")
    if errors:
        raise errors[0]
    return None if _timers_left(conn) else _fire_span(conn)


SQL_ONE, SQL_TWO = "1 session, 4 queues (SQL)", "2 sessions, 4 queues (SQL)"


def bench_scale(cluster: Cluster, url: str, broker: Broker, res, n: int, rounds: int) -> None:
    log(f"\n== scale: {n} due timers drained by one broker vs two brokers on one database, into 1 queue "
        f"and into 4 queues (the same backlog split), and by one vs two bare SQL sessions into 4 queues "
        f"(no broker: the machine's ceiling), {rounds} rounds ==")
    second = start_broker(url, "scale")
    batch = int(os.environ.get("QUEEN_SWEEPER_BATCH", "256"))  # the brokers' batch (they read the same variable)
    cases = ["1 broker, 1 queue", "2 brokers, 1 queue", "1 broker, 4 queues", "2 brokers, 4 queues", SQL_ONE, SQL_TWO]
    rates: dict[str, list[float]] = {c: [] for c in cases}
    by_round: list[dict[str, float]] = []  # per round, for the paired ratios
    cpu: dict[str, list[dict]] = {c: [] for c in cases}
    try:
        with connect(url) as conn:
            for r in range(rounds):
                by_round.append({})
                for case in cases[r % len(cases):] + cases[:r % len(cases)]:
                    two = case.startswith("2")
                    sql = "SQL" in case
                    # who must not fire in this drain: the second broker for one broker, both for SQL
                    stopped = [broker, second] if sql else [] if two else [second]
                    queues = ["bench-scale"] if "1 queue" in case else [f"bench-scale-{i}" for i in range(4)]
                    conn.execute("SELECT queen.pause_fire()")
                    _load_queues(conn, n, queues, f"s{r}")
                    # every drain starts right after a checkpoint, so each pays the same full-page
                    # writes; a checkpoint the load's WAL forced would otherwise land in some
                    # drains (rounds drifted 25% slower from the third on without this)
                    conn.execute("CHECKPOINT")
                    ckpt = _checkpoints(conn)
                    for b in stopped:
                        b.proc.send_signal(signal.SIGSTOP)
                    meter = CpuMeter(cluster, [b for b in (broker, second) if b not in stopped])
                    sessions = [connect(url) for _ in range(2 if two else 1)] if sql else []
                    try:
                        meter.start()
                        if sql:
                            secs = _drain_sql(conn, sessions, batch, timeout=max(60, n / 500))
                        else:
                            secs = _drain(conn, timeout=max(60, n / 500))
                        c = meter.stop()
                    finally:
                        for s in sessions:
                            s.close()
                        for b in stopped:
                            b.proc.send_signal(signal.SIGCONT)
                    if secs is None:
                        log(f"  round {r + 1} {case}: NOT drained in time")
                        continue
                    rates[case].append(n / secs)
                    by_round[-1][case] = n / secs
                    cpu[case].append(c)
                    during = _checkpoints(conn) - ckpt
                    log(f"  round {r + 1} {case:26s}: {n / secs:8.0f} timers/s ({secs:.2f} s)  {_cpu_text(c)}"
                        + (f"; {during} checkpoint(s) during the drain" if during else ""))
            conn.execute("SELECT queen.resume_fire()")
    finally:
        second.stop()
    med = {c: statistics.median(v) for c, v in rates.items() if v}
    for c in cases:
        if c in med:
            log(f"  median {c:26s}: {med[c]:8.0f} timers/s  (rounds: {', '.join(f'{x:.0f}' for x in rates[c])})")
    figures = {"n": n, "rounds": rounds, "median_rates_per_s": {c: round(v) for c, v in med.items()},
               "rates_per_s": {c: [round(x) for x in v] for c, v in rates.items()},
               "cpu": {c: v for c, v in cpu.items()}}
    for two, one, target, key in (("2 brokers, 1 queue", "1 broker, 1 queue", 1.4, "ratio_1_queue"),
                                  ("2 brokers, 4 queues", "1 broker, 4 queues", 1.6, "ratio_4_queues")):
        if two in med and one in med:
            ratio = med[two] / med[one]
            figures[key] = round(ratio, 3)
            # the same ratio within each round (its two drains ran close together in time), for
            # how much the machine's noise moves it; the verdict is on the medians
            paired = [x[two] / x[one] for x in by_round if two in x and one in x]
            figures[f"{key}_per_round"] = [round(x, 3) for x in paired]
            log(f"  ratio {two} / {one}: {ratio:.2f} on the medians; per round "
                f"{', '.join(f'{x:.2f}' for x in paired)}, median {statistics.median(paired):.2f} "
                f"(target >= {target}) -> {'met' if ratio >= target else 'MISSED'}")
    if SQL_ONE in med and SQL_TWO in med:
        ratio = med[SQL_TWO] / med[SQL_ONE]
        figures["ratio_4_queues_sql"] = round(ratio, 3)
        paired = [x[SQL_TWO] / x[SQL_ONE] for x in by_round if SQL_TWO in x and SQL_ONE in x]
        log(f"  ratio {SQL_TWO} / {SQL_ONE}: {ratio:.2f} on the medians; per round "
            f"{', '.join(f'{x:.2f}' for x in paired)} (no broker: what two sessions of the statement add here)")
        if "2 brokers, 4 queues" in med:
            log(f"  brokers / bare sessions, 4 queues: one {med['1 broker, 4 queues'] / med[SQL_ONE]:.2f}, "
                f"two {med['2 brokers, 4 queues'] / med[SQL_TWO]:.2f}")
    if "2 brokers, 4 queues" in med and "1 broker, 1 queue" in med:
        ratio = med["2 brokers, 4 queues"] / med["1 broker, 1 queue"]
        figures["ratio_4_queues_vs_1_broker_1_queue"] = round(ratio, 3)
        log(f"  ratio 2 brokers, 4 queues / 1 broker, 1 queue: {ratio:.2f}")
    res.put("scale", **figures)


# -------------------------------------------------------------------------
# lag2: fire lag at 2,000 timers/s with two brokers
# -------------------------------------------------------------------------

def bench_lag_brokers(cluster: Cluster, url: str, broker: Broker, res, rate: int, seconds: float,
                      brokers: int, target_ms: float) -> None:
    others = [start_broker(url, f"lag{i}") for i in range(1, brokers)]
    meter = CpuMeter(cluster, [broker, *others])
    try:
        meter.start()
        bench_lag(url, broker, res, rate, seconds, section=f"fire_lag_{brokers}b", cancels=False,
                  queue="bench-lag2", prefix="l2", others=tuple(others), target_ms=target_ms)
        c = meter.stop()
        log(f"  {_cpu_text(c)} (load, {seconds:g} s of fire and the drain)")
        res.put(f"fire_lag_{brokers}b", cpu=c)
    finally:
        for b in others:
            b.stop()


# -------------------------------------------------------------------------
# rss: a broker's memory while it drains a million due timers
# -------------------------------------------------------------------------

def _rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def bench_rss(cluster: Cluster, url: str, res, n: int, zstd_n: int, zstd_bytes: int, limit_mb: float = 200,
              **env) -> None:
    log(f"\n== rss: one broker drains {n} due plain timers and {zstd_n} zstd timers of {zstd_bytes} bytes "
        f"inflated (the leased path); VmRSS sampled every 0.5 s{f'; broker env {env}' if env else ''} ==")
    with connect(url) as conn:
        reset(conn)
        conn.execute("SELECT queen.pause_fire()")
        t0 = time.perf_counter()
        load_timers(conn, queue="bench-rss", n=n, prefix="r", expected=False,
                    deliver_sql="now() - interval '1 hour' + g * interval '1 microsecond'")
        if zstd_n:
            blob = zstandard.ZstdCompressor().compress(b'{"pad":"' + b"z" * (zstd_bytes - 10) + b'"}')
            # spread through the plain backlog's expiry order, so both paths run side by side
            conn.execute("""
                INSERT INTO queen.timers (tenant, queue, timer_key, partition, deliver_at, txn, message_id, payload,
                                          payload_zstd)
                SELECT 'default', 'bench-rss', 'z-' || g, 'Default',
                       now() - interval '1 hour' + (g * %s) * interval '1 microsecond', 'z-' || g,
                       gen_random_uuid(), %s, true
                  FROM generate_series(1, %s) g""", (max(1, n // zstd_n), blob, zstd_n))
            conn.execute("SELECT queen.bump_tenant_usage('default', %s, 0)", (zstd_n,))
        vacuum(conn)
        log(f"  loaded in {time.perf_counter() - t0:.1f} s")
        b = start_broker(url, "rss", **env)
        try:
            time.sleep(1)
            base = _rss_kb(b.proc.pid)
            samples: list[int] = []
            stop = threading.Event()

            def sample():
                while not stop.is_set():
                    v = _rss_kb(b.proc.pid)
                    if v is not None:
                        samples.append(v)
                    stop.wait(0.5)

            th = threading.Thread(target=sample, daemon=True)
            th.start()
            meter = CpuMeter(cluster, [b])
            meter.start()
            secs = _drain(conn, timeout=max(120, (n + zstd_n) / 1000))
            c = meter.stop()
            stop.set()
            th.join()
            end = _rss_kb(b.proc.pid)
            fired = conn.execute("SELECT count(*) FROM queen.messages").fetchone()[0]
            conn.execute("SELECT queen.resume_fire()")
        finally:
            b.stop()
    mx = max(samples) if samples else None
    log(f"  drained {fired} frames in {secs or 0:.1f} s ({(n + zstd_n) / secs if secs else 0:.0f} timers/s); "
        f"{len(samples)} samples")
    log(f"  VmRSS: idle before {base / 1024:.1f} MB, max while draining {mx / 1024:.1f} MB, after {end / 1024:.1f} MB "
        f"(target max <= {limit_mb:g} MB) -> {'met' if mx / 1024 <= limit_mb else 'MISSED'}")
    log(f"  {_cpu_text(c)}")
    res.put("rss", env=env, n=n, zstd_n=zstd_n, zstd_bytes=zstd_bytes, fired=fired, drain_s=round(secs, 2) if secs else None,
            rss_idle_mb=round(base / 1024, 1), rss_max_mb=round(mx / 1024, 1), rss_after_mb=round(end / 1024, 1),
            samples=len(samples), target_mb=limit_mb, cpu=c)
