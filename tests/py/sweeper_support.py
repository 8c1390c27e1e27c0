"""Helpers and fixtures for tests/py/test_sweeper_*.py.

The sweeper tests use the shared test database (conftest's `db`) and private
brokers (`spawn_broker`): asking for one stops every shared broker, so no
other broker fires or counts the timers these tests count per broker.
Timers are scheduled with SQL (queen.schedule_timers), in batches of 256.
The `sdb` fixture also drops the test triggers these tests install on
queen.messages, which emptying the tables does not.
"""

from __future__ import annotations

import time

import httpx
import pytest
import zstandard
from prometheus_client.parser import text_string_to_metric_families

from conftest import Broker

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


@pytest.fixture
def sweeper_url(database_url) -> str:
    return database_url


@pytest.fixture
def sdb(db):
    """A clean database with no test triggers; an autocommit dict_row connection."""
    db.execute(DROP_TEST_OBJECTS)
    yield db
    db.execute(DROP_TEST_OBJECTS)


@pytest.fixture
def sweeper_broker(sdb, spawn_broker):
    """sweeper_broker(**QUEEN_env) -> a private broker, stopped (even if SIGSTOPped) at teardown."""
    return lambda **env: spawn_broker(**{k: str(v) for k, v in env.items()})


def zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


def timer(queue: str, key: str, delay_ms: int, payload: bytes, *, txn: str | None = None,
          compressed: bool = False, partition: str | None = None) -> dict:
    """One schedule operation; compressed=True stores zstd(payload) with payload_zstd set."""
    return {"queue": queue, "key": key, "delay": delay_ms, "txn": txn or f"txn-{queue}-{key}",
            "payload": zstd(payload) if compressed else payload, "zstd": compressed,
            "raw": len(payload) if compressed else None, "partition": partition}


SCHEDULE_SQL = """
SELECT * FROM queen.schedule_timers(%s, (
    SELECT array_agg(ROW('schedule', u.q, u.k, u.d, u.t, u.p, u.part, u.z, false, u.r)::queen.timer_op ORDER BY u.n)
      FROM unnest(%s::text[], %s::text[], %s::bigint[], %s::text[], %s::bytea[], %s::text[], %s::boolean[],
                  %s::integer[]) WITH ORDINALITY AS u(q, k, d, t, p, part, z, r, n)))
"""


def schedule(conn, timers: list[dict], tenant: str = "default") -> list[dict]:
    """queen.schedule_timers for tenant in batches of 256; returns every verdict."""
    out: list[dict] = []
    for i in range(0, len(timers), BATCH):
        chunk = timers[i:i + BATCH]
        cols = [[t[f] for t in chunk] for f in ("queue", "key", "delay", "txn", "payload", "partition", "zstd", "raw")]
        rows = conn.execute(SCHEDULE_SQL, [tenant, *cols]).fetchall()
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
