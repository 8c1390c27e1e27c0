"""Section `pgbouncer`: fire lag through pgbouncer (transaction pooling) beside direct (issue 20).

One broker at a time fires the same load (perf.bench_lag: timers scheduled
ahead by SQL, --pgb-rate per second becoming due for --pgb-seconds), in
rounds that alternate between three set-ups:
  direct   QUEEN_DATABASE_URL is the cluster (the default deployment)
  pooled+direct  requests through pgbouncer (QUEEN_POOL_MODE=transaction); the
           sweeper's connection and its LISTEN on QUEEN_DIRECT_DATABASE_URL
  pooled   everything through pgbouncer, no direct URL: no LISTEN, the
           sweeper polls at QUEEN_SWEEPER_MIN_SLEEP_MS
pgbouncer is Debian's, started by scripts/pgbouncer with the common
configuration (pool 20). Printed: each round's lag p50/p99 at the frame's
commit, the medians per set-up and their ratios to direct.
"""

from __future__ import annotations

import statistics
import subprocess
import tempfile
from pathlib import Path

import psycopg

import perf
from harness import ROOT, free_port, keep_logs_and_remove, log, start_broker

SETUPS = ("direct", "pooled+direct", "pooled")


class Pgbouncer:
    """scripts/pgbouncer in a /tmp folder of its own, in front of a server's port (transaction
    pooling, pool 20, reserve 5); stop() keeps its log as bench/out/logs/<name>.log."""

    SCRIPT = str(ROOT / "scripts" / "pgbouncer")

    def __init__(self, server_port: int | str, name: str):
        self.name = name
        self.folder = Path(tempfile.mkdtemp(prefix=f"queen-bench-{name}-", dir="/tmp"))
        self.folder.chmod(0o755)
        self.port = free_port()
        subprocess.run([self.SCRIPT, "start", str(self.folder), str(server_port), str(self.port), "20", "5"],
                       check=True)

    def stop(self) -> None:
        subprocess.run([self.SCRIPT, "stop", str(self.folder)], check=False)
        keep_logs_and_remove(self.folder, {"pgbouncer.log": f"{self.name}.log"})


def bench_pgbouncer(cluster, url: str, res, rate: int, seconds: float, rounds: int) -> None:
    log(f"\n== pgbouncer: fire lag through pgbouncer (transaction pooling) beside direct, "
        f"{rate}/s for {seconds:g} s, {rounds} rounds per set-up ==")
    bouncer = Pgbouncer(cluster.port, "pgbouncer")
    dbname = psycopg.conninfo.conninfo_to_dict(url)["dbname"]
    pooled_url = f"postgresql://postgres@127.0.0.1:{bouncer.port}/{dbname}"
    version = subprocess.run(["pgbouncer", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    log(f"  {version}, pool_mode=transaction, default_pool_size=20, ignore_startup_parameters=extra_float_digits")
    envs = {
        "direct": (url, {}),
        "pooled+direct": (pooled_url, {"QUEEN_POOL_MODE": "transaction", "QUEEN_DIRECT_DATABASE_URL": url}),
        "pooled": (pooled_url, {"QUEEN_POOL_MODE": "transaction"}),
    }
    p99: dict[str, list[float]] = {s: [] for s in SETUPS}
    p50: dict[str, list[float]] = {s: [] for s in SETUPS}
    try:
        for r in range(rounds):
            order = SETUPS if r % 2 == 0 else tuple(reversed(SETUPS))
            for setup in order:
                broker_url, env = envs[setup]
                name = setup.replace("+", "-")
                b = start_broker(broker_url, f"pgb-{name}", **env)
                try:
                    log(f"  round {r + 1}, {setup}:")
                    figures = perf.bench_lag(url, b, res, rate, seconds, section=f"pgbouncer_{name}_{r + 1}",
                                             cancels=False, queue=f"pgb-{name}-{r + 1}", prefix=f"pgb{name}{r}")
                finally:
                    b.stop()
                p99[setup].append(figures["commit_p99"])
                p50[setup].append(figures["commit_p50"])
    finally:
        bouncer.stop()
    med = {s: (statistics.median(p50[s]), statistics.median(p99[s])) for s in SETUPS}
    for s in SETUPS:
        log(f"  {s:13s}: lag p50 {med[s][0]:.1f} ms, p99 {med[s][1]:.1f} ms (median of rounds; p99 per round "
            f"{', '.join(f'{v:.1f}' for v in p99[s])}); p99 / direct {med[s][1] / med['direct'][1]:.2f}")
    res.put("pgbouncer", rate=rate, seconds=seconds, rounds=rounds, version=version,
            **{f"{s.replace('+', '_')}_p50_ms": round(med[s][0], 2) for s in SETUPS},
            **{f"{s.replace('+', '_')}_p99_ms": round(med[s][1], 2) for s in SETUPS},
            **{f"{s.replace('+', '_')}_p99_rounds_ms": p99[s] for s in SETUPS})
