"""queen-timers benchmarks and fault drills (`make bench`, `bench/run [options]`).

Starts its own throwaway PostgreSQL cluster and broker processes on
loopback, prints every figure measured in this run, writes them to
bench/out/results.json (and the console to bench/out/run.log), and stops
everything it started.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    OUT, Cluster, Results, connect, explain_rolled_back, load_timers, log, start_broker, stop_on_sigterm)
import cancel  # noqa: E402
import conns  # noqa: E402
import drills  # noqa: E402
import fairness  # noqa: E402
import failover  # noqa: E402
import mem  # noqa: E402
import patroni  # noqa: E402
import pgbouncer  # noqa: E402
import perf  # noqa: E402
import retention  # noqa: E402
import scale  # noqa: E402
import schedule  # noqa: E402
import soak  # noqa: E402

SECTIONS = ("fire", "scale", "schedule", "lag", "lag2", "growth", "profile", "retention", "cancel", "mem", "conns", "fairness",
            "pgbouncer", "rss", "kill", "pgrestart", "pool", "failover", "patroni")
EXTRA = ("soak",)  # only when named in --only: an hour by default


def machine() -> dict:
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kb = next((int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal")), 0)
    return {"date": subprocess.run(["date"], capture_output=True, text=True).stdout.strip(),
            "nproc": os.cpu_count(), "memory_gib": round(mem_kb / 1024 / 1024, 1), "cpu": cpu,
            "python": platform.python_version()}


# -------------------------------------------------------------------------
# Profile of the hot path
# -------------------------------------------------------------------------

def explain_fire(conn, label: str, batch: int = perf.BATCH) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of every statement inside queen.fire_due_timers(batch),
    through auto_explain's nested statements, in a transaction that is rolled back."""
    n, secs, notices = explain_rolled_back(
        conn, lambda c: c.execute("SELECT count(*) FROM queen.fire_due_timers(%s)", (batch,)).fetchone()[0],
        prepare=lambda c: c.execute("SELECT queen.pause_fire(false)"))
    return f"-- {label}: queen.fire_due_timers({batch}) fired {n} in {secs * 1000:.1f} ms\n" + "\n\n".join(notices)


def _durations(explain_text: str) -> list[tuple[float, str]]:
    """(duration ms, first query line) of each auto_explain block."""
    out = []
    for block in explain_text.split("duration: ")[1:]:
        try:
            d = float(block.split(" ms", 1)[0])
        except ValueError:
            continue
        q = block.split("Query Text:", 1)[1].strip().splitlines()[0][:90] if "Query Text:" in block else "?"
        out.append((d, q))
    return out


def pyspy_available() -> str | None:
    exe = Path(sys.executable).parent / "py-spy"
    return str(exe) if exe.exists() else None


def summarize_pyspy(raw: Path, top: int = 15) -> str:
    self_t: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        n = int(n)
        total += n
        frames = stack.split(";")
        leaf = frames[-1]
        self_t[leaf] = self_t.get(leaf, 0) + n
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
    if not total:
        return "py-spy: no samples"
    lines = [f"py-spy: {total} samples of the broker process (all threads, idle included)", "top self time:"]
    for f, n in sorted(self_t.items(), key=lambda x: -x[1])[:top]:
        lines.append(f"  {100 * n / total:5.1f}%  {f}")
    lines.append("top inclusive (queen_timers / psycopg frames):")
    for f, n in sorted(((f, n) for f, n in incl.items() if "queen_timers" in f or "psycopg" in f),
                       key=lambda x: -x[1])[:top]:
        lines.append(f"  {100 * n / total:5.1f}%  {f}")
    return "\n".join(lines)


def bench_profile(url: str, broker, res, n: int) -> None:
    log(f"\n== profile: the fire of {n} due timers (pg_stat_statements, auto_explain, py-spy) ==")
    report = []
    with connect(url) as conn:
        conn.execute("SELECT queen.pause_fire()")
        conn.execute("TRUNCATE queen.timers, queen.messages, bench.expected")
        load_timers(conn, queue="bench-prof", n=n, prefix="pr", expected=False)
        perf.vacuum(conn)
        ex = explain_fire(conn, f"{n} due timers")
        report.append(ex)
        for d, q in _durations(ex):
            if d >= 0.2:
                log(f"  auto_explain {d:8.2f} ms  {q}")
        conn.execute("SELECT pg_stat_statements_reset()")
        spy = None
        raw = OUT / "pyspy.raw"
        exe = pyspy_available()
        if exe:
            spy = subprocess.Popen([exe, "record", "--pid", str(broker.proc.pid), "--rate", "250", "--format", "raw",
                                    "--output", str(raw), "--duration", "120", "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(1.0)
        out = perf.fire_by_broker(conn, "bench-prof", timeout=120)
        if spy:
            spy.send_signal(signal.SIGINT)
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait(5)
        rows = conn.execute("""
            SELECT round(total_exec_time::numeric, 1), calls, round(mean_exec_time::numeric, 3),
                   regexp_replace(left(query, 110), '\\s+', ' ', 'g')
              FROM pg_stat_statements
             WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
             ORDER BY total_exec_time DESC LIMIT 14""").fetchall()
        total_db = conn.execute("""SELECT round(sum(total_exec_time)::numeric, 1) FROM pg_stat_statements
                                    WHERE toplevel AND dbid = (SELECT oid FROM pg_database
                                                               WHERE datname = current_database())""").fetchone()[0]
    secs = out["first_fire_to_empty"] or 0
    log(f"  broker fired {n} in {secs:.2f} s; top-level SQL time of this database {total_db} ms "
        f"({float(total_db or 0) / 10 / max(secs, 1e-9):.0f}% of the wall time)")
    report.append("-- pg_stat_statements during the broker's fire (total ms, calls, mean ms, query)")
    for r in rows:
        line = f"{r[0]:>10} {r[1]:>7} {r[2]:>9}  {r[3]}"
        report.append(line)
        log("  " + line)
    if exe and raw.exists():
        summary = summarize_pyspy(raw)
        report.append(summary)
        for line in summary.splitlines():
            log("  " + line)
    elif not exe:
        log("  py-spy not installed (bench/run --profile-install installs it into .venv)")
    (OUT / "profile.txt").write_text("\n\n".join(report))
    res.put("profile", n=n, seconds=secs, top_sql_ms=[[float(r[0]), r[1], r[3]] for r in rows[:8]],
            sql_total_ms=float(total_db or 0))
    log(f"  full plans and statements: {OUT / 'profile.txt'}")


def variant_brokers(url: str, specs: list[str]) -> dict:
    """PARSER:LOOP -> a broker running bench/broker_variant.py with them (cancel's A/B windows);
    cancel.APART -> one that serves HTTP with no sweeper (the main broker's fires meanwhile);
    cancel.FLOOR -> bench/shell_floor.py, the least a DELETE costs on this stack (no sweeper either)."""
    here = Path(__file__).resolve().parent
    out = {}
    for spec in specs:
        argv = [str(here / "broker_variant.py")]
        if spec == cancel.APART:
            name, env = "variant-apart", {"BENCH_SWEEPER": "off"}
        elif spec == cancel.FLOOR:
            name, env, argv = "variant-floor", {}, [str(here / "shell_floor.py")]
        else:
            parser, _, loop = spec.partition(":")
            name, env = f"variant-{parser}-{loop or 'default'}", {"BENCH_HTTP": parser, "BENCH_LOOP": loop}
        out[spec] = start_broker(url, name, argv=argv, **env)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of {','.join(SECTIONS)} (the default), or {','.join(EXTRA)}")
    ap.add_argument("--quick", action="store_true", help="small sizes everywhere (a smoke run of a minute or two)")
    ap.add_argument("--fire-n", type=int, default=50000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fire-rounds", type=int, default=5, help="rounds of the fire section (>= 5 for the verdict)")
    ap.add_argument("--fire-alt-batch", type=int, default=1024,
                    help="round 1 of the fire section also times a broker with this QUEEN_SWEEPER_BATCH (0: none)")
    ap.add_argument("--scale-n", type=int, default=150000,
                    help="due timers per scale drain (150,000: drains of 3-6 s; at 50,000 a drain took ~1 s "
                         "and the machine's noise moved the ratios by +-0.15)")
    ap.add_argument("--scale-rounds", type=int, default=5)
    ap.add_argument("--lag2-rate", type=int, default=2000)
    ap.add_argument("--lag2-seconds", type=float, default=60)
    ap.add_argument("--lag2-brokers", type=int, default=2)
    ap.add_argument("--lag2-target-ms", type=float, default=30)
    ap.add_argument("--rss-n", type=int, default=1000000, help="due plain timers the rss broker drains")
    ap.add_argument("--rss-zstd-n", type=int, default=300, help="due zstd timers among them (leased path)")
    ap.add_argument("--rss-zstd-bytes", type=int, default=1000000, help="inflated size of each zstd payload")
    ap.add_argument("--rss-batch-bytes", type=int, default=0,
                    help="QUEEN_SWEEPER_BATCH_BYTES of the rss broker (0: the default)")
    # 400 batches of 256: the 100,000 jobs of bench-peers' schedule, rounds of 1-3 s (100 batches made
    # rounds of 0.3-0.7 s, in which a client's start and a stray checkpoint weighed: run 18's ratios
    # moved by up to 0.07 between the two lengths in the same hour)
    ap.add_argument("--sched-batches", type=int, default=400)
    ap.add_argument("--sched-rounds", type=int, default=5, help="schedule section: rotating rounds (>= 5)")
    ap.add_argument("--sched-floor", action="store_true",
                    help="schedule section: a fourth side, POST through bench/shell_floor.py (the fast path's "
                         "decode, checks and statement with none of the broker's plumbing)")
    ap.add_argument("--clients", default="1,4", help="schedule section: the client counts, each its own rounds")
    ap.add_argument("--lag-rate", type=int, default=1000)
    ap.add_argument("--lag-seconds", type=float, default=60)
    ap.add_argument("--growth-sizes", default="10000,100000,1000000")
    ap.add_argument("--growth-batch", type=int, default=20000)
    ap.add_argument("--growth-lag-seconds", type=float, default=15)
    ap.add_argument("--retention-n", type=int, default=50000, help="timers fired per retention phase")
    ap.add_argument("--retention-backlog", type=int, default=400000,
                    help="expired frames retention deletes while the fire runs")
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--pg-restart-seconds", type=float, default=20)
    ap.add_argument("--pool-clients", type=int, default=48)
    ap.add_argument("--failover-seconds", type=float, default=30)
    ap.add_argument("--failover-detect-s", type=float, default=1.0,
                    help="seconds between the primary's SIGKILL and pg_ctl promote")
    ap.add_argument("--cancel-n", type=int, default=10000, help="single cancels per SQL run")
    ap.add_argument("--cancel-rounds", type=int, default=7, help="alternating rounds (>= 5)")
    ap.add_argument("--cancel-http-n", type=int, default=3000, help="HTTP DELETEs per side and round")
    ap.add_argument("--cancel-load-seconds", type=float, default=20, help="seconds per window under load")
    ap.add_argument("--cancel-load-rounds", type=int, default=5,
                    help="windows under load per client kind (http, sql, fsync), alternating")
    ap.add_argument("--cancel-load-clients", default="http,sql,fsync",
                    help="who cancels under load: http (DELETE via the broker), sql (queen.cancel_timer direct), "
                         "fsync (no cancel: write + fdatasync in the data directory, timed)")
    ap.add_argument("--cancel-load-generator", default="process", choices=("process", "thread"),
                    help="where the load generator runs: its own process, or a thread of the timing client's")
    ap.add_argument("--cancel-load-only", action="store_true", help="only the under-load windows of `cancel`")
    ap.add_argument("--cancel-load-variant", action="append", default=[], metavar="PARSER:LOOP",
                    help="also DELETE through a second broker with this HTTP parser (h11, httptools) and event "
                         "loop (asyncio, uvloop), windows alternating (bench/broker_variant.py); repeatable. "
                         "'apart': a broker with no sweeper, while the main broker's sweeper fires; 'floor': "
                         "bench/shell_floor.py, the least any shell on this stack spends on a DELETE")
    ap.add_argument("--mem-clients", type=int, default=8, help="mem: clients per kind of worst request, at once")
    ap.add_argument("--mem-size-mb", type=int, default=360, help="mem: size of the hostile bodies (MB)")
    ap.add_argument("--mem-delete-rate", type=float, default=200, help="mem: the other tenant's DELETEs per second")
    ap.add_argument("--mem-settle-s", type=float, default=30, help="mem: RSS read this long after the flood")
    ap.add_argument("--mem-unread-s", type=float, default=10, help="mem: seconds the unread pops are held")
    ap.add_argument("--conns-sockets", type=int, default=3000, help="conns: silent sockets held open")
    ap.add_argument("--conns-slow", type=int, default=1100, help="conns: never-ending bodies of one tenant")
    ap.add_argument("--conns-seconds", type=float, default=15, help="conns: seconds a phase")
    ap.add_argument("--conns-delete-rate", type=float, default=200, help="conns: the other tenant's DELETEs per second")
    ap.add_argument("--conns-cheap-clients", type=int, default=2,
                    help="conns: processes of 64 connections sending requests answered at once")
    ap.add_argument("--fairness-backlogs", default="20000,100000,1000000",
                    help="fairness: sizes of tenant A's backlog due at one instant, comma list")
    ap.add_argument("--fairness-idle-tenants", type=int, default=10000,
                    help="fairness: then the largest backlog again, with this many other tenants holding "
                         "one timer each due tomorrow (not probed since migration 019; 0: skip)")
    ap.add_argument("--pgb-rate", type=int, default=1000, help="pgbouncer: timers/s becoming due")
    ap.add_argument("--pgb-seconds", type=float, default=20, help="pgbouncer: seconds of load per round")
    ap.add_argument("--pgb-rounds", type=int, default=2, help="pgbouncer: rounds per set-up, alternating")
    ap.add_argument("--patroni-seconds", type=float, default=30, help="patroni: seconds of load per round")
    ap.add_argument("--soak-minutes", type=int, default=60, help="length of the soak section's load")
    ap.add_argument("--soak-rate", type=int, default=1000, help="schedules per second of the soak")
    ap.add_argument("--soak-setup", choices=("direct", "deployed"), default="direct",
                    help="soak: the bench cluster, or a Patroni cell behind a pgbouncer per member with a "
                         "switchover halfway")
    ap.add_argument("--fsync", default="on", choices=("on", "off"))
    args = ap.parse_args()
    stop_on_sigterm()
    if args.quick:
        args.fire_n, args.rounds, args.sched_batches = 5000, 1, 10
        args.fire_rounds, args.scale_n, args.scale_rounds, args.lag2_seconds = 2, 5000, 1, 5
        args.rss_n, args.rss_zstd_n = 50000, 20
        args.lag_seconds, args.growth_sizes, args.growth_batch, args.growth_lag_seconds = 5, "10000", 2000, 3
        args.kills, args.pg_restart_seconds, args.pool_clients = 5, 9, 16
        args.mem_clients, args.mem_size_mb, args.mem_settle_s = 2, 40, 5
        args.conns_sockets, args.conns_slow, args.conns_seconds = 1500, 600, 4
        args.pgb_seconds, args.pgb_rounds = 5, 1
        args.fairness_backlogs = "5000"
        args.fairness_idle_tenants = 100
        args.patroni_seconds = 20
        args.failover_seconds = 10
        args.retention_n, args.retention_backlog = 5000, 100000
        args.cancel_n, args.cancel_http_n, args.cancel_load_seconds = 1000, 500, 5
        args.cancel_load_rounds = 1
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    bad = only - set(SECTIONS) - set(EXTRA)
    if bad:
        ap.error(f"unknown sections {sorted(bad)}")

    res = Results()
    m = machine()
    t_start = time.monotonic()
    cluster = Cluster(fsync=args.fsync)
    broker = None
    failed = []
    try:
        cluster.setup()
        m["postgresql"] = cluster.server_version()
        m["fsync"] = args.fsync
        log(f"queen-timers bench: {m['date']}; {m['nproc']} cpus ({m['cpu']}), {m['memory_gib']} GiB; "
            f"PostgreSQL {m['postgresql']} (fsync={args.fsync}); cluster {cluster.dir} port {cluster.port}")
        res.put("machine", **m, args=vars(args))
        url = cluster.create_db("queen_bench")
        perf_sections = only & {"fire", "scale", "schedule", "lag", "lag2", "growth", "profile", "cancel"}
        if perf_sections:
            broker = start_broker(url, "perf")

        def section(name, fn, *a, **kw):
            if name not in only:
                return
            try:
                fn(*a, **kw)
            except Exception:  # one failed section must not hide the others' figures
                failed.append(name)
                log(f"  SECTION {name} FAILED:\n{traceback.format_exc()}")
                res.put(name, error=traceback.format_exc().splitlines()[-1])

        section("fire", perf.bench_fire_throughput, url, broker, res, args.fire_n, args.fire_rounds,
                args.fire_alt_batch if args.fire_alt_batch and args.fire_alt_batch != perf.BATCH else None)
        section("scale", scale.bench_scale, cluster, url, broker, res, args.scale_n, args.scale_rounds)
        section("schedule", schedule.bench_schedule, url, broker, res, args.sched_batches,
                [int(c) for c in str(args.clients).split(",") if c.strip()], args.sched_rounds,
                floor=variant_brokers(url, [cancel.FLOOR])[cancel.FLOOR] if args.sched_floor and "schedule" in only
                else None)
        section("lag", perf.bench_lag, url, broker, res, args.lag_rate, args.lag_seconds)
        section("lag2", scale.bench_lag_brokers, cluster, url, broker, res, args.lag2_rate, args.lag2_seconds,
                args.lag2_brokers, args.lag2_target_ms)
        section("profile", bench_profile, url, broker, res, args.fire_n)
        section("cancel", cancel.bench_cancel, url, broker, res, args.cancel_n, args.cancel_rounds,
                args.cancel_http_n, args.cancel_load_seconds, args.lag_rate, load_rounds=args.cancel_load_rounds,
                load_clients=tuple(c.strip() for c in args.cancel_load_clients.split(",") if c.strip()),
                generator=args.cancel_load_generator, load_only=args.cancel_load_only,
                variants=variant_brokers(url, args.cancel_load_variant) if "cancel" in only else {})
        section("growth", perf.bench_growth, url, broker, res, [int(x) for x in args.growth_sizes.split(",")],
                args.growth_batch, args.lag_rate, args.growth_lag_seconds,
                profile_cb=lambda conn, size: (OUT / f"explain-pending-{size}.txt").write_text(
                    explain_fire(conn, f"{size} pending")))
        section("retention", retention.bench_retention, url, broker, res, args.retention_n, args.retention_backlog,
                args.rounds)
        if broker:
            broker.stop()
            broker = None
        section("mem", mem.bench_mem, url, res, args.mem_clients, args.mem_size_mb, args.mem_delete_rate,
                args.mem_settle_s, unread_s=args.mem_unread_s)
        section("conns", conns.bench_conns, url, res, args.conns_sockets, args.conns_slow, args.conns_seconds,
                args.conns_delete_rate, args.conns_cheap_clients)
        section("fairness", fairness.bench_fairness, url, res,
                [int(x) for x in args.fairness_backlogs.split(",") if x.strip()], args.fairness_idle_tenants)
        section("pgbouncer", pgbouncer.bench_pgbouncer, cluster, url, res, args.pgb_rate, args.pgb_seconds,
                args.pgb_rounds)
        section("rss", scale.bench_rss, cluster, url, res, args.rss_n, args.rss_zstd_n, args.rss_zstd_bytes,
                **({"QUEEN_SWEEPER_BATCH_BYTES": args.rss_batch_bytes} if args.rss_batch_bytes else {}))
        section("kill", drills.drill_kill, cluster, res, args.kills)
        section("pool", drills.drill_pool, cluster, res, args.pool_clients)
        section("pgrestart", drills.drill_pg_restart, cluster, res, args.pg_restart_seconds)
        # its own primary + synchronous standby (scripts/pg-replica), not the bench cluster
        section("failover", failover.drill_failover, res, args.failover_seconds, args.fsync,
                args.failover_detect_s)
        # its own etcd and two Patroni members (scripts/patroni-cell)
        section("patroni", patroni.drill_patroni, res, args.patroni_seconds)
        section("soak", soak.bench_soak, cluster, url, res, args.soak_minutes, args.soak_rate, args.soak_setup)
    finally:
        if broker:
            broker.stop()
        cluster.destroy()
    total = time.monotonic() - t_start
    res.put("run", seconds=round(total), failed_sections=failed)
    log(f"\nbench done in {total:.0f} s; figures in {OUT / 'results.json'}"
        + (f"; FAILED sections: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
