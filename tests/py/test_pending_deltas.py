"""The delta-aggregated pending counter under concurrency, against a real PostgreSQL.

Decrements (fire, cancel, DLQ) are appended to queen.tenant_usage_deltas;
increments take the tenant's counter row (and its lock) with the quota
decision; queen.fold_pending_deltas moves deltas into the row. These tests
run schedules at the quota, cancels, fires and folds from several sessions
at once and check that the quota is never exceeded (in any committed
state a watcher sees), that the counter ends equal to the real row count,
and that a fold never loses a delta nor waits on a locked counter row.
"""

from __future__ import annotations

import random
import threading
import time

import psycopg
import pytest
from timers_util import op, post

TENANT = "acme"
QUOTA = 12

# a batch scheduling new keys (text[]) with one delay, tenancy on (the quota applies)
SCHEDULE = """
SELECT status FROM queen.schedule_timers(%s, ARRAY(
    SELECT queen.make_timer_op('schedule', 'dq', k, %s, 'txn-' || k, '\\x00'::bytea) FROM unnest(%s::text[]) k),
    p_tenancy => true)
"""


def real_count(conn) -> int:
    return conn.execute("SELECT count(*) AS n FROM queen.timers WHERE tenant = %s", (TENANT,)).fetchone()["n"]


def counter(conn) -> int:
    return conn.execute("SELECT queen.get_pending_timers(%s) AS n", (TENANT,)).fetchone()["n"]


@pytest.fixture
def unlimited(db):
    db.execute("INSERT INTO queen.plans (plan) VALUES ('unlimited')")
    db.execute("INSERT INTO queen.tenants (tenant, plan) VALUES (%s, 'unlimited')", (TENANT,))


@pytest.fixture
def quota(db):
    db.execute("INSERT INTO queen.plans (plan, max_pending_timers) VALUES ('deltas', %s)", (QUOTA,))
    db.execute("INSERT INTO queen.tenants (tenant, plan) VALUES (%s, 'deltas')", (TENANT,))
    return QUOTA


class Worker(threading.Thread):
    """Loop `step(conn)` on a connection of its own until stopped; keep the first unexpected error."""

    def __init__(self, url, step, stop: threading.Event):
        super().__init__(daemon=True)
        self.url, self.step, self.stop = url, step, stop
        self.error: BaseException | None = None
        self.count = 0

    def run(self):
        try:
            with psycopg.connect(self.url, autocommit=True) as conn:
                while not self.stop.is_set():
                    self.step(conn)
                    self.count += 1
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc


def test_schedules_at_the_quota_with_cancels_fires_and_folds_never_exceed_it(database_url, db, quota):
    stop = threading.Event()
    refusals = [0]
    scheduled = [0]
    lock = threading.Lock()
    seq = iter(range(10**9))

    def next_keys(n):
        with lock:
            return [f"k{next(seq)}" for _ in range(n)]

    def schedule(conn):
        # half the batches are due at once (the fire takes them), half wait (a cancel takes them)
        keys = next_keys(random.randint(1, 3))
        delay = -1000 if random.random() < 0.5 else 600000
        try:
            rows = conn.execute(SCHEDULE, (TENANT, delay, keys)).fetchall()
            assert [r[0] for r in rows] == ["scheduled"] * len(keys)
            with lock:
                scheduled[0] += len(keys)
        except psycopg.Error as exc:
            if exc.sqlstate != "QTQUO":
                raise
            with lock:
                refusals[0] += 1

    def cancel(conn):
        row = conn.execute("SELECT timer_key FROM queen.timers WHERE tenant = %s AND deliver_at > now() "
                           "ORDER BY random() LIMIT 1", (TENANT,)).fetchone()
        if row:
            conn.execute("SELECT queen.cancel_timer(%s, 'dq', %s)", (TENANT, row[0]))
        time.sleep(0.002)

    def fire(conn):
        conn.execute("SELECT count(*) FROM queen.fire_due_timers(5)")
        time.sleep(0.002)

    def fold(conn):
        conn.execute("SELECT queen.fold_pending_deltas(3)")
        time.sleep(0.005)

    def watch(conn):
        # every committed state: the rows never exceed the quota, and the counter
        # (base + committed deltas, one snapshot) always equals them
        row = conn.execute("SELECT (SELECT count(*) FROM queen.timers WHERE tenant = %s) AS n, "
                           "queen.get_pending_timers(%s) AS c", (TENANT, TENANT)).fetchone()
        assert row[0] <= QUOTA, f"{row[0]} pending timers, quota {QUOTA}"
        assert row[0] == row[1], f"counter {row[1]} != rows {row[0]}"

    steps = [schedule] * 4 + [cancel] * 2 + [fire, fold, fold, watch]
    workers = [Worker(database_url, s, stop) for s in steps]
    for w in workers:
        w.start()
    time.sleep(6)
    stop.set()
    for w in workers:
        w.join(timeout=60)
        assert not w.is_alive()
    for w in workers:
        if w.error:
            raise w.error
    assert refusals[0] > 0, "the schedules never reached the quota: the test proves nothing"
    assert scheduled[0] > QUOTA
    assert all(w.count > 0 for w in workers)
    assert real_count(db) <= QUOTA
    assert counter(db) == real_count(db)
    db.execute("SELECT queen.fold_pending_deltas(100000)")
    assert db.execute("SELECT count(*) AS n FROM queen.tenant_usage_deltas").fetchone()["n"] == 0
    base = db.execute("SELECT pending_timers FROM queen.tenant_usage WHERE tenant = %s", (TENANT,)).fetchone()
    assert base["pending_timers"] == real_count(db)


def test_a_fold_racing_with_cancels_loses_no_delta(database_url, db, unlimited):
    n = 400
    keys = [f"c{i}" for i in range(n)]
    # a bystander keeps the count above 0, so no clamp at 0 can hide a delta counted twice
    db.execute(SCHEDULE, (TENANT, 600000, ["bystander"]))
    for i in range(0, n, 100):
        db.execute(SCHEDULE, (TENANT, 600000, keys[i:i + 100]))
    assert counter(db) == n + 1
    stop = threading.Event()
    shares = [keys[i::3] for i in range(3)]

    def canceller(share):
        it = iter(share)

        def step(conn):
            k = next(it, None)
            if k is None:
                time.sleep(0.01)
                return
            assert conn.execute("SELECT queen.cancel_timer(%s, 'dq', %s)", (TENANT, k)).fetchone()[0] == "cancelled"
        return step

    def fold(conn):
        conn.execute("SELECT queen.fold_pending_deltas(7)")

    cancellers = [Worker(database_url, canceller(s), stop) for s in shares]
    folders = [Worker(database_url, fold, stop) for _ in range(2)]
    for w in cancellers + folders:
        w.start()
    deadline = time.monotonic() + 60
    while real_count(db) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    for w in cancellers + folders:
        w.join(timeout=60)
        if w.error:
            raise w.error
    assert real_count(db) == 1
    assert all(w.count > 0 for w in folders)
    folded_before_end = n - db.execute("SELECT count(*) AS n FROM queen.tenant_usage_deltas").fetchone()["n"]
    assert folded_before_end > 0, "the folds never raced the cancels"
    assert counter(db) == 1
    db.execute("SELECT queen.fold_pending_deltas(100000)")
    row = db.execute("SELECT pending_timers FROM queen.tenant_usage WHERE tenant = %s", (TENANT,)).fetchone()
    assert row["pending_timers"] == 1  # exactly n decrements folded: none lost, none twice


def test_a_fold_skips_a_locked_counter_row_and_an_uncommitted_delta(database_url, db, unlimited):
    db.execute(SCHEDULE, (TENANT, 600000, ["a", "b", "c", "bystander"]))
    db.execute("SELECT queen.cancel_timer(%s, 'dq', 'a')", (TENANT,))
    with psycopg.connect(database_url) as holder, psycopg.connect(database_url) as canceller, \
            psycopg.connect(database_url, autocommit=True) as folder:
        # a schedule batch deciding its quota holds the counter row
        holder.execute("SELECT 1 FROM queen.tenant_usage WHERE tenant = %s FOR UPDATE", (TENANT,))
        folder.execute("SET lock_timeout = '2s'")
        t0 = time.monotonic()
        assert folder.execute("SELECT queen.fold_pending_deltas()").fetchone()[0] == 0
        assert time.monotonic() - t0 < 1.5, "the fold waited on the locked counter row"
        holder.rollback()
        # a cancel not yet committed: its delta is invisible to the fold and stays
        assert canceller.execute("SELECT queen.cancel_timer(%s, 'dq', 'b')", (TENANT,)).fetchone()[0] == "cancelled"
        assert folder.execute("SELECT queen.fold_pending_deltas()").fetchone()[0] == 1
        canceller.commit()
    assert counter(db) == 2
    assert db.execute("SELECT count(*) AS n FROM queen.tenant_usage_deltas").fetchone()["n"] == 1
    assert db.execute("SELECT queen.fold_pending_deltas()").fetchone()["fold_pending_deltas"] == 1
    base = db.execute("SELECT pending_timers FROM queen.tenant_usage WHERE tenant = %s", (TENANT,)).fetchone()
    assert base["pending_timers"] == 2 == real_count(db)


def test_the_brokers_sweeper_folds_the_deltas(client, db):
    """Cancels over HTTP and fires by the broker's own sweeper leave deltas; the sweeper folds
    them into the counter row within seconds, and every reader agrees with the rows."""
    keys = [f"f{i}" for i in range(6)]
    fold_series = ("queen_timers_deltas_folded_total", "queen_timers_fold_failures_total")
    folded_before, failures_before = _series(client, *fold_series)
    assert post(client, *[op("schedule", k) for k in keys], op("schedule", "due", delayMs=-1000)).status_code == 200
    for k in keys[:4]:
        assert client.delete(f"/api/v1/timers/reminders/{k}").json()["status"] == "cancelled"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = db.execute("SELECT count(*) AS n FROM queen.tenant_usage_deltas").fetchone()["n"]
        fired = db.execute("SELECT count(*) AS n FROM queen.timers WHERE timer_key = 'due'").fetchone()["n"] == 0
        if left == 0 and fired:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the sweeper never folded the deltas (or never fired the due timer)")
    base = db.execute("SELECT pending_timers FROM queen.tenant_usage WHERE tenant = 'default'").fetchone()
    assert base["pending_timers"] == 2 == db.execute("SELECT count(*) AS n FROM queen.timers").fetchone()["n"]
    assert db.execute("SELECT pending FROM queen.get_timer_status()").fetchone()["pending"] == 2
    # 4 cancels and 1 fire batch: 5 delta rows, each folded once, by this broker (the only one running)
    folded, failures = _series(client, *fold_series)
    assert (folded - folded_before, failures - failures_before) == (5, 0)


def _series(client, *names: str) -> list[float]:
    """The values of label-free series of the broker's Prometheus page (the broker is shared by
    tests, so callers compare before and after)."""
    values = {}
    for line in client.get("/metrics/prometheus").text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            values[name] = float(value)
    assert set(values) == set(names), values
    return [values[n] for n in names]
