"""Prometheus metrics of one broker, in a registry of its own (one per app).

Every instant behind a metric comes from PostgreSQL: the fire lag is
fired_at - deliver_at as queen.fire_* returned them. The pending gauge is
read from SQL at scrape time (queen.get_timer_status), so it is the cell's
number, the same on every broker.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# The classic text exposition format every Prometheus scrapes (generate_latest writes it).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

FAILURE_CLASSES = ("transient", "permanent", "config")
RETENTION_KINDS = ("pending", "completed", "dlq")

# deliverAt is a floor; a healthy timer lands within ~10 ms of the minimum sleep,
# a wake-up problem shows up around QUEEN_SWEEPER_MAX_SLEEP_MS (1 s by default).
LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def lag_summary_sql(fire: str, extra: str = "") -> str:
    """One row summing a fire call's queen.fire_result rows: counts by outcome, and the fire
    lags of the fired ones (fired_at - deliver_at, floored at 0) as a histogram: their sum
    and, per LAG_BUCKETS bound, how many are <= it. PostgreSQL does the per-timer work, so
    the broker adds 14 numbers per call instead of observing every timer (sweeper.FIRE_DUE, FIRE).
    The lag is computed once per row (OFFSET 0 keeps the subquery from being flattened into
    every FILTER) and in float8 (date_part; extract() would compute it in numeric).
    extra: one more output column (`expr AS name`), computed once the call has run."""
    les = ",\n             ".join(f"count(*) FILTER (WHERE r.outcome = 'fired' AND r.lag <= {b!r})"
                                   for b in LAG_BUCKETS)
    return f"""
SELECT {extra + ", " if extra else ""}count(*) AS n,
       count(*) FILTER (WHERE r.outcome = 'fired') AS fired,
       count(*) FILTER (WHERE r.outcome = 'duplicate') AS duplicate,
       count(*) FILTER (WHERE r.outcome = 'lost') AS lost,
       coalesce(sum(r.lag) FILTER (WHERE r.outcome = 'fired'), 0) AS lag_sum,
       ARRAY[{les}] AS lag_le
  FROM (SELECT f.outcome, greatest(date_part('epoch', f.fired_at - f.deliver_at), 0) AS lag
          FROM ({fire}) f
        OFFSET 0) r
"""


class BulkHistogram(Collector):
    """A label-free Prometheus histogram fed whole batches at a time (add): the exposition
    is the one prometheus_client's Histogram writes (_bucket{le=...}, _count, _sum)."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry):
        self.name, self.documentation, self.buckets = name, documentation, buckets
        self._le = [0] * len(buckets)  # cumulative: observations <= each bound
        self._count = 0
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def add(self, le_counts: list[int], count: int, total: float) -> None:
        """count observations summing to total, of which le_counts[i] are <= buckets[i]."""
        with self._lock:
            for i, c in enumerate(le_counts):
                self._le[i] += c
            self._count += count
            self._sum += total

    def describe(self):
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self):
        with self._lock:
            le, count, total = list(self._le), self._count, self._sum
        yield HistogramMetricFamily(
            self.name, self.documentation,
            buckets=[(floatToGoString(b), c) for b, c in zip(self.buckets, le)] + [("+Inf", count)],
            sum_value=total)


class LoopCounter(Collector):
    """A label-free Prometheus counter counted on the event loop's thread alone: a plain
    int, without prometheus_client's lock (a Counter's inc took 1-2 us of a DELETE's
    broker CPU on the direct lane). Exposed as a Counter is (`<name>_total`)."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self.value = 0
        registry.register(self)

    def inc(self) -> None:
        self.value += 1

    def describe(self):
        return [CounterMetricFamily(self.name, self.documentation)]

    def collect(self):
        yield CounterMetricFamily(self.name, self.documentation, value=self.value)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.fire_lag = BulkHistogram(
            "queen_timers_fire_lag_seconds",
            "How late a timer's frame entered the log: fired_at - deliver_at, both from PostgreSQL",
            LAG_BUCKETS, r)
        self.fired = Counter(
            "queen_timers_fired",
            "Timers fired by this broker: 'fired' appended a frame, 'duplicate' found the txn already in the partition",
            ["outcome"], registry=r)
        self.fire_failures = Counter(
            "queen_timers_fire_failures",
            "Failed fires of one timer by failure class (transient costs no attempt)",
            ["class"], registry=r)
        self.dlq_moves = Counter(
            "queen_timers_dlq_moves",
            "Timers moved to their queue's DLQ (group __QUEEN_TIMERS__) after the last attempt",
            registry=r)
        self.claims_lost = Counter(
            "queen_timers_claims_lost",
            "Claims this broker no longer held when it fired or failed (lease expired and taken over)",
            registry=r)
        self.deltas_folded = Counter(
            "queen_timers_deltas_folded",
            "Pending-counter delta rows this broker folded into the tenants' counter rows (queen.fold_pending_deltas)",
            registry=r)
        self.fold_failures = Counter(
            "queen_timers_fold_failures",
            "Calls of queen.fold_pending_deltas by this broker that failed (retried about a second later)",
            registry=r)
        self.retention_deleted = Counter(
            "queen_timers_retention_deleted",
            "Rows deleted by this broker's log retention (queen.apply_retention): 'pending' frames some group had "
            "not consumed, 'completed' frames every group had consumed, 'dlq' dead letters",
            ["kind"], registry=r)
        self.body_budget_in_use = Gauge(
            "queen_timers_body_budget_in_use_bytes",
            "Weight of the request bodies in flight on this broker (at most QUEEN_BODY_BUDGET_BYTES)",
            registry=r)
        self.body_budget_waiting = Gauge(
            "queen_timers_body_budget_waiting",
            "Requests waiting, in arrival order, for room in the body budget (QUEEN_BODY_WAIT_MS at most)",
            registry=r)
        self.turns_waiting = Gauge(
            "queen_timers_requests_waiting_turn",
            "Requests waiting for their tenant's next turn to start (turns.py: at most 4 of a tenant "
            "start per iteration of the event loop under QUEEN_AUTH=jwt)",
            registry=r)
        self.body_budget_refusals = Counter(
            "queen_timers_body_budget_refusals",
            "Requests answered 503 because the body budget had no room within QUEEN_BODY_WAIT_MS",
            registry=r)
        self.http_direct = LoopCounter(
            "queen_timers_http_direct_requests",
            "DELETE requests on the timer key route served by the HTTP server's direct lane (server.py) "
            "rather than by uvicorn's request cycle",
            r)
        self.http_send_timeouts = Counter(
            "queen_timers_http_send_timeouts",
            "Connections reset because their client took none of an answer for QUEEN_SEND_TIMEOUT_MS, "
            "or took it slower than QUEEN_SEND_MIN_BYTES_PER_S",
            registry=r)
        self.database_deadlines = Counter(
            "queen_timers_database_deadlines",
            "Request connections closed because a statement had no answer by the statement timeout plus "
            "QUEEN_DEADLINE_GRACE_MS (a hung server, or a commit waiting for a synchronous standby)",
            registry=r)
        self.http_reclaimed = Counter(
            "queen_timers_http_connections_reclaimed",
            "Idle connections closed to admit a new one past QUEEN_MAX_CONNECTIONS (server.py)",
            registry=r)
        self.pending = Gauge(
            "queen_timers_pending", "Pending timers in the cell (read from PostgreSQL at scrape)", registry=r)
        self.fire_paused = Gauge(
            "queen_timers_fire_paused", "1 when an operator paused the fire (queen.pause_fire)", registry=r)
        self.scheduling_paused = Gauge(
            "queen_timers_scheduling_paused", "1 when an operator paused scheduling (queen.pause_scheduling)",
            registry=r)
        # every labelled series exists from the start, at 0
        for outcome in ("fired", "duplicate"):
            self.fired.labels(outcome=outcome)
        for cls in FAILURE_CLASSES:
            self.fire_failures.labels(**{"class": cls})
        for kind in RETENTION_KINDS:
            self.retention_deleted.labels(kind=kind)

    def observe_fires(self, summary: dict) -> int:
        """Count one fire call's results, folded by PostgreSQL into
        {n, fired, duplicate, lost, lag_sum, lag_le} (lag_summary_sql). Returns n."""
        if summary["fired"]:
            self.fired.labels(outcome="fired").inc(summary["fired"])
            self.fire_lag.add(summary["lag_le"], summary["fired"], summary["lag_sum"])
        if summary["duplicate"]:
            self.fired.labels(outcome="duplicate").inc(summary["duplicate"])
        if summary["lost"]:
            self.claims_lost.inc(summary["lost"])
        return summary["n"]

    def observe_failure(self, cls: str, verdict: str) -> None:
        """Count one queen.fail_timer call and its verdict (backoff | dead_lettered | lost)."""
        self.fire_failures.labels(**{"class": cls}).inc()
        if verdict == "dead_lettered":
            self.dlq_moves.inc()
        elif verdict == "lost":
            self.claims_lost.inc()

    def observe_retention(self, row: dict) -> int:
        """Count one queen.apply_retention call's deletes; returns the rows deleted."""
        total = 0
        for kind in RETENTION_KINDS:
            n = row[f"{kind}_deleted"]
            if n:
                self.retention_deleted.labels(kind=kind).inc(n)
                total += n
        return total

    def set_status(self, status: dict) -> None:
        self.pending.set(status["pending"])
        self.fire_paused.set(1 if status["fire_paused"] else 0)
        self.scheduling_paused.set(1 if status["scheduling_paused"] else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
