"""pytest fixtures: a real PostgreSQL, real brokers over real HTTP.

- The cluster is the one `make test` started (QUEEN_TEST_ADMIN_DSN), or a
  throwaway one started here when pytest runs on its own.
- One database, built from the canonical schema, shared by the session;
  the `db` fixture empties it before each test (a clean database per test).
- Brokers are real `python -m queen_timers` processes. `broker` is the
  default one (auth off); `broker_factory(**env)` starts (and caches) one
  per distinct environment; `spawn_broker(**env)` starts a private one the
  test may kill.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest
from psycopg.rows import dict_row

ROOT = Path(__file__).resolve().parents[2]
TEST_DB = "queen_pytest"


def free_port() -> int:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "free-port")],
                         check=True, capture_output=True, text=True)
    return int(out.stdout)


def with_db(dsn: str, dbname: str) -> str:
    return psycopg.conninfo.make_conninfo(dsn, dbname=dbname)


@pytest.fixture(scope="session")
def admin_dsn(tmp_path_factory):
    dsn = os.environ.get("QUEEN_TEST_ADMIN_DSN")
    if dsn:
        yield dsn
        return
    folder = Path(tempfile.mkdtemp(prefix="queen-pytest-", dir="/tmp"))
    folder.chmod(0o755)
    port = free_port()
    subprocess.run([str(ROOT / "scripts" / "pg-cluster"), "start", str(folder), str(port)],
                   check=True, env={**os.environ, "QUEEN_PG_FSYNC": "off"})
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([str(ROOT / "scripts" / "pg-cluster"), "stop", str(folder)], check=False)


def create_database(admin_dsn: str, name: str, *, schema: bool = True) -> str:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    url = with_db(admin_dsn, name)
    if schema:
        subprocess.run([str(ROOT / "scripts" / "install-schema"), url], check=True)
    return url


@pytest.fixture(scope="session")
def database_url(admin_dsn) -> str:
    return create_database(admin_dsn, TEST_DB)


RESET_SQL = """
DO $$
DECLARE v_tables text;
BEGIN
    SELECT string_agg(format('%I.%I', schemaname, tablename), ', ') INTO v_tables
      FROM pg_tables
     WHERE schemaname = 'queen' AND tablename NOT IN ('schema_migrations', 'cell_settings');
    EXECUTE 'TRUNCATE ' || v_tables || ' RESTART IDENTITY';
    DELETE FROM queen.cell_settings;
    INSERT INTO queen.cell_settings DEFAULT VALUES;
END
$$;
"""


def reset_database(url: str) -> None:
    for attempt in range(5):
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("SET lock_timeout = '5s'")
                conn.execute(RESET_SQL)
            return
        except (psycopg.errors.DeadlockDetected, psycopg.errors.LockNotAvailable):
            if attempt == 4:
                raise
            time.sleep(0.2)


@pytest.fixture
def db(database_url):
    """A clean database; yields an autocommit connection with dict rows."""
    reset_database(database_url)
    with psycopg.connect(database_url, autocommit=True, row_factory=dict_row) as conn:
        yield conn


@dataclass
class Broker:
    url: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    env: dict

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 30), **kwargs)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            self.proc.send_signal(sig)
            if sig != signal.SIGKILL:
                self.proc.send_signal(signal.SIGCONT)  # a test may have left it stopped (SIGSTOP)
            self.proc.wait(timeout=30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_broker(database_url: str, log_dir: Path, preexec_fn=None, **env: str) -> Broker:
    port = free_port()
    full_env = {
        **os.environ,
        "QUEEN_DATABASE_URL": database_url,
        "QUEEN_PORT": str(port),
        "QUEEN_HOST": "127.0.0.1",
        "PYTHONUNBUFFERED": "1",
        **{k: str(v) for k, v in env.items()},
    }
    log_path = log_dir / f"broker-{port}.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "queen_timers"], env=full_env,
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, preexec_fn=preexec_fn)
    broker = Broker(url=f"http://127.0.0.1:{port}", port=port, proc=proc, log_path=log_path, env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not broker.alive():
            raise RuntimeError(f"broker exited with {proc.returncode}:\n{broker.log()}")
        try:
            if httpx.get(f"{broker.url}/health", timeout=1).status_code == 200:
                return broker
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    broker.kill()
    raise RuntimeError(f"broker did not become healthy:\n{broker.log()}")


class BrokerCache:
    """Brokers shared across tests, one per distinct environment.

    Every broker sweeps the one test database, so a broker left running from
    an earlier test would fire the timers of the current one. Only the
    brokers the current test asked for run during it: asking for one stops
    the others, and a test that asks for none gets none (see _quiet_brokers).
    """

    def __init__(self, database_url: str, log_dir: Path):
        self.database_url = database_url
        self.log_dir = log_dir
        self.brokers: dict[tuple, Broker] = {}
        self.in_use: set[tuple] = set()

    def get(self, **env) -> Broker:
        key = tuple(sorted((k, str(v)) for k, v in env.items()))
        self.in_use.add(key)
        self.stop(keep=self.in_use)
        broker = self.brokers.get(key)
        if broker is None or not broker.alive():
            broker = self.brokers[key] = start_broker(self.database_url, self.log_dir, **env)
        return broker

    def stop(self, keep: set[tuple] = frozenset()) -> None:
        for key in [k for k in self.brokers if k not in keep]:
            self.brokers.pop(key).kill(signal.SIGTERM)


@pytest.fixture(scope="session")
def _broker_cache(database_url, tmp_path_factory):
    cache = BrokerCache(database_url, tmp_path_factory.mktemp("brokers"))
    yield cache
    cache.stop()


@pytest.fixture(autouse=True)
def _quiet_brokers(request):
    """Start each test with no shared broker it did not ask for."""
    if "db" in request.fixturenames:
        cache = request.getfixturevalue("_broker_cache")
        cache.in_use = set()
        if not {"broker", "client", "broker_factory"} & set(request.fixturenames):
            cache.stop()
    yield


@pytest.fixture
def broker_factory(db, _broker_cache):
    """broker_factory(**QUEEN_env) -> a shared broker with that environment, over a clean db."""
    return _broker_cache.get


@pytest.fixture
def broker(broker_factory) -> Broker:
    return broker_factory()


@pytest.fixture
def client(broker):
    with broker.client() as c:
        yield c


@pytest.fixture
def jwt_client(broker_factory):
    """A client of the broker with QUEEN_AUTH=jwt and timers_util's secret."""
    from timers_util import JWT_SECRET
    b = broker_factory(QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET)
    with b.client() as c:
        yield c


@pytest.fixture
def spawn_broker(db, database_url, tmp_path, _broker_cache):
    """spawn_broker(**env) -> a private broker, stopped (or already killed) at teardown."""
    started: list[Broker] = []
    _broker_cache.stop(keep=_broker_cache.in_use)

    def spawn(preexec_fn=None, **env) -> Broker:
        b = start_broker(database_url, tmp_path, preexec_fn=preexec_fn, **env)
        started.append(b)
        return b

    yield spawn
    for b in started:
        b.kill(signal.SIGTERM)
