"""Helpers and fixtures for tests/py/test_sweeper_*.py.

The sweeper tests run against a database of their own (queen_pytest_sweeper):
the brokers that other suites cache for the whole session sweep the shared
database, and would fire (and count) timers these tests count per broker.
Timers are scheduled with SQL (queen.schedule_timers), in batches of 256.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import psycopg
import pytest
import zstandard
from prometheus_client.parser import text_string_to_metric_families
from psycopg.rows import dict_row

from conftest import Broker, create_database, reset_database, start_broker

SWEEPER_DB = "queen_pytest_sweeper"
BATCH = 256

DROP_TEST_OBJECTS = """
DO $$
DECLARE t record;
BEGIN
    FOR t IN SELECT tgname FROM pg_trigger
              WHERE tgrelid = 'queen.messages'::regclass AND tgname LIKE 'sweeper_test_%'
    LOOP
        EXECUTE format('DROP TRIGGER %I ON queen.messages', t.tgname);
    END LOOP;
END
$$;
DROP FUNCTION IF EXISTS public.sweeper_test_doomed() CASCADE;
DROP FUNCTION IF EXISTS public.sweeper_test_flaky() CASCADE;
DROP SEQUENCE IF EXISTS public.sweeper_test_flaky_seq;
"""


@pytest.fixture(scope="session")
def sweeper_url(admin_dsn) -> str:
    return create_database(admin_dsn, SWEEPER_DB)


@pytest.fixture
def sdb(sweeper_url):
    """A clean sweeper database (no test triggers); an autocommit dict_row connection."""
    with psycopg.connect(sweeper_url, autocommit=True) as conn:
        conn.execute(DROP_TEST_OBJECTS)
    reset_database(sweeper_url)
    with psycopg.connect(sweeper_url, autocommit=True, row_factory=dict_row) as conn:
        yield conn
    with psycopg.connect(sweeper_url, autocommit=True) as conn:
        conn.execute(DROP_TEST_OBJECTS)


@pytest.fixture
def sweeper_broker(sdb, sweeper_url, tmp_path):
    """sweeper_broker(**QUEEN_env) -> a private broker on the sweeper database, stopped at teardown."""
    started: list[Broker] = []

    def spawn(**env) -> Broker:
        b = start_broker(sweeper_url, Path(tmp_path), **{k: str(v) for k, v in env.items()})
        started.append(b)
        return b

    yield spawn
    for b in started:
        if b.alive():
            try:
                b.proc.send_signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
        b.kill(signal.SIGTERM)


def zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


def timer(queue: str, key: str, delay_ms: int, payload: bytes, *, txn: str | None = None,
          compressed: bool = False, partition: str | None = None) -> dict:
    """One schedule operation; compressed=True stores zstd(payload) with payload_zstd set."""
    return {"queue": queue, "key": key, "delay": delay_ms, "txn": txn or f"txn-{queue}-{key}",
            "payload": zstd(payload) if compressed else payload, "zstd": compressed,
            "raw": len(payload) if compressed else None, "partition": partition}


SCHEDULE_SQL = """
SELECT * FROM queen.schedule_timers('default', (
    SELECT array_agg(ROW('schedule', u.q, u.k, u.d, u.t, u.p, u.part, u.z, false, u.r)::queen.timer_op ORDER BY u.n)
      FROM unnest(%s::text[], %s::text[], %s::bigint[], %s::text[], %s::bytea[], %s::text[], %s::boolean[],
                  %s::integer[]) WITH ORDINALITY AS u(q, k, d, t, p, part, z, r, n)))
"""


def schedule(conn, timers: list[dict]) -> list[dict]:
    """queen.schedule_timers in batches of 256; returns every verdict."""
    out: list[dict] = []
    for i in range(0, len(timers), BATCH):
        chunk = timers[i:i + BATCH]
        cols = [[t[f] for t in chunk] for f in ("queue", "key", "delay", "txn", "payload", "partition", "zstd", "raw")]
        rows = conn.execute(SCHEDULE_SQL, cols).fetchall()
        assert all(r["ok"] for r in rows), rows
        out.extend(rows)
    return out


def wait_until(predicate, timeout: float, interval: float = 0.05, message: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


def messages(conn) -> list[dict]:
    return conn.execute("""
        SELECT q.name AS queue, p.name AS partition, m.transaction_id AS txn, m.id AS message_id,
               m.payload, m.created_at
          FROM queen.messages m JOIN queen.partitions p ON p.id = m.partition_id
          JOIN queen.queues q ON q.id = p.queue_id
         ORDER BY m.seq""").fetchall()


def timer_count(conn) -> int:
    return conn.execute("SELECT count(*) AS n FROM queen.timers").fetchone()["n"]


def scrape(broker: Broker) -> tuple[httpx.Response, dict[tuple, float]]:
    """GET /metrics/prometheus -> (response, {(sample name, sorted labels): value})."""
    r = httpx.get(f"{broker.url}/metrics/prometheus", timeout=10)
    samples: dict[tuple, float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return r, samples


def sample(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
