"""A cell on a primary and a synchronous hot standby (scripts/pg-replica).

- the broker's multi-host URL picks the primary (target_session_attrs=read-write);
- QUEEN_READ_DATABASE_URL serves peek and list from the standby (paused
  replay shows the read went there) while POST and DELETE go to the primary;
- a primary fenced read-only: its pooled and sweeper connections are
  discarded, requests answer 503 + Retry-After, no fire attempt is spent;
- SIGKILL of the primary's postmaster under HTTP load, then pg_ctl promote:
  both brokers reconnect on their own, every schedule answered 200 fires once
  or is still pending, no frame is lost or duplicated (bench/failover.py is
  the long version of this drill).

The tests share one primary/standby pair; the promotion test kills the
primary and runs last (it is last in the file).
"""

from __future__ import annotations

import asyncio
import base64
import os
import random
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest
from psycopg.rows import dict_row

from conftest import ROOT, free_port, start_broker
from psycopg.conninfo import conninfo_to_dict

from queen_timers.config import ConfigError, Settings
from queen_timers.db import conninfo

pytestmark = pytest.mark.slow

REPLICA = str(ROOT / "scripts" / "pg-replica")
DB = "queen_failover"
PAYLOAD = base64.b64encode(b'{"kind":"failover"}').decode()


@dataclass
class Pair:
    dir: Path
    primary_port: int
    standby_port: int

    def url(self, port: int, **params) -> str:
        extra = "".join(f"&{k}={v}" for k, v in params.items())
        return f"postgresql://postgres@127.0.0.1:{port}/{DB}?connect_timeout=2{extra}"

    @property
    def primary(self) -> str:
        return self.url(self.primary_port)

    @property
    def standby(self) -> str:
        return self.url(self.standby_port)

    @property
    def multi(self) -> str:
        """Both hosts, the standby listed FIRST: only target_session_attrs keeps writes off it."""
        return (f"postgresql://postgres@127.0.0.1:{self.standby_port},127.0.0.1:{self.primary_port}/{DB}"
                "?target_session_attrs=read-write&connect_timeout=2")

    def run(self, *args: str) -> None:
        subprocess.run([REPLICA, args[0], str(self.dir), *args[1:]], check=True, timeout=120)


@pytest.fixture(scope="module")
def pair():
    folder = Path(tempfile.mkdtemp(prefix="queen-failover-", dir="/tmp"))
    folder.chmod(0o755)
    p = Pair(folder, free_port(), free_port())
    subprocess.run([REPLICA, "start", str(folder), str(p.primary_port), str(p.standby_port)], check=True,
                   timeout=180, env={**os.environ, "QUEEN_PG_FSYNC": "off"})
    try:
        admin = f"postgresql://postgres@127.0.0.1:{p.primary_port}/postgres"
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {DB}")
        subprocess.run([str(ROOT / "scripts" / "install-schema"), p.primary], check=True)
        yield p
    finally:
        p.run("stop")
        shutil.rmtree(folder, ignore_errors=True)


def connect(url: str) -> psycopg.Connection:
    return psycopg.connect(url, autocommit=True, row_factory=dict_row)


def wait_until(pred, timeout: float, interval: float = 0.1, message: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(interval)
    assert pred(), f"timed out after {timeout} s waiting for {message}"


def fresh_setting(url: str, name: str) -> str:
    """The setting as a new session of the server sees it."""
    with connect(url) as conn:
        return conn.execute("SELECT current_setting(%s) AS v", (name,)).fetchone()["v"]


def replayed(standby: psycopg.Connection, primary: psycopg.Connection) -> bool:
    lsn = primary.execute("SELECT pg_current_wal_lsn() AS l").fetchone()["l"]
    return standby.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn AS ok", (lsn,)).fetchone()["ok"]


def schedule_op(key: str, delay_ms: int = 3_600_000, queue: str = "fo") -> dict:
    return {"op": "schedule", "queue": queue, "timerKey": key, "delayMs": delay_ms, "txn": key, "payload": PAYLOAD}


def post(c: httpx.Client, *ops) -> httpx.Response:
    return c.post("/api/v1/timers", json={"operations": list(ops)})


def assert_503(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert r.headers.get("retry-after"), r.headers
    assert r.json()["error"] == "timers_unavailable"


# ---------------------------------------------------------------------------


def test_urls_are_checked_at_start():
    s = Settings.from_env({"QUEEN_DATABASE_URL": "host=a,b port=5432,5433 dbname=q target_session_attrs=read-write",
                           "QUEEN_READ_DATABASE_URL": "postgresql://h1:1,h2:2/q?target_session_attrs=prefer-standby"})
    assert s.read_database_url.startswith("postgresql://h1:1,h2:2")
    assert Settings.from_env({"QUEEN_DATABASE_URL": "postgresql://x/q"}).read_database_url is None
    with pytest.raises(ConfigError, match="QUEEN_READ_DATABASE_URL"):
        Settings.from_env({"QUEEN_DATABASE_URL": "postgresql://x/q", "QUEEN_READ_DATABASE_URL": "host=a port"})
    with pytest.raises(ConfigError, match="QUEEN_CONNECT_TIMEOUT_S"):
        Settings.from_env({"QUEEN_DATABASE_URL": "postgresql://x/q", "QUEEN_CONNECT_TIMEOUT_S": "0"})


def test_broker_defaults_fill_only_what_the_url_leaves_unset(monkeypatch):
    for var in ("PGTARGETSESSIONATTRS", "PGCONNECT_TIMEOUT", "PGTCPUSERTIMEOUT", "PGKEEPALIVES"):
        monkeypatch.delenv(var, raising=False)
    s = Settings.from_env({"QUEEN_DATABASE_URL": "postgresql://h1:1,h2:2/q", "QUEEN_CONNECT_TIMEOUT_S": "3"})
    got = conninfo_to_dict(conninfo(s.database_url, s))
    assert got["host"] == "h1,h2" and got["port"] == "1,2"
    assert got["target_session_attrs"] == "read-write" and got["connect_timeout"] == "3"
    assert got["keepalives"] == "1" and got["tcp_user_timeout"] == "10000"
    # the URL wins; the read pool gets no read-write rule
    mine = conninfo_to_dict(conninfo("host=a,b target_session_attrs=any connect_timeout=9 tcp_user_timeout=1", s))
    assert (mine["target_session_attrs"], mine["connect_timeout"], mine["tcp_user_timeout"]) == ("any", "9", "1")
    assert "target_session_attrs" not in conninfo_to_dict(conninfo("host=a,b", s, writable=False))


def test_pooled_connections_whose_backend_died_are_replaced_not_served(db, spawn_broker):
    """The pool's checkout check notices a connection whose server end is gone (here the
    backends are terminated; after a failover they are the old primary's) without a round
    trip, and hands the request a fresh one: 200, not 503."""
    b = spawn_broker(QUEEN_BROKER_ID="checked", QUEEN_POOL_MIN="3")
    mine = "SELECT pid FROM pg_stat_activity WHERE application_name = 'queen-broker:checked'"
    with b.client() as c:
        assert post(c, schedule_op("c0")).status_code == 200
        wait_until(lambda: len(db.execute(mine).fetchall()) >= 3, 10, message="the pool to fill")
        before = {r["pid"] for r in db.execute(mine)}
        db.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                   " WHERE application_name = 'queen-broker:checked'")
        time.sleep(0.3)
        for n in range(5):
            r = post(c, schedule_op(f"c{n + 1}"))
            assert r.status_code == 200, r.text
        after = {r["pid"] for r in db.execute(mine)}
        assert after and not (after & before)


def test_peek_and_list_read_the_standby_verdicts_go_to_the_primary(pair, tmp_path):
    # the primary listed first: libpq's prefer-standby still picks the standby for reads
    reads = (f"postgresql://postgres@127.0.0.1:{pair.primary_port},127.0.0.1:{pair.standby_port}/{DB}"
             "?target_session_attrs=prefer-standby")
    b = start_broker(pair.multi, tmp_path, QUEEN_BROKER_ID="reads", QUEEN_READ_DATABASE_URL=reads)
    try:
        with connect(pair.primary) as prim, connect(pair.standby) as stby, b.client() as c:
            r = post(c, schedule_op("r1"))
            assert r.status_code == 200 and r.json()["results"][0]["status"] == "scheduled", r.text
            wait_until(lambda: replayed(stby, prim), 10, message="the standby to replay r1")
            assert c.get("/api/v1/timers/fo/r1").json()["found"] is True
            # the read pool's sessions are on the standby; nothing of the broker's writes is
            apps = {r["application_name"] for r in stby.execute(
                "SELECT application_name FROM pg_stat_activity WHERE application_name LIKE '%:reads'")}
            assert apps == {"queen-broker-read:reads"}, apps

            stby.execute("SELECT pg_wal_replay_pause()")
            wait_until(lambda: stby.execute("SELECT pg_get_wal_replay_pause_state() AS s").fetchone()["s"]
                       == "paused", 10, message="replay paused")
            try:
                # POST commits on the primary (synchronous_commit=on waits for the standby's flush,
                # not its replay); the standby cannot show it yet
                r = post(c, schedule_op("r2"))
                assert r.status_code == 200 and r.json()["results"][0]["status"] == "scheduled", r.text
                assert prim.execute("SELECT count(*) AS n FROM queen.timers WHERE timer_key = 'r2'"
                                    ).fetchone()["n"] == 1
                assert c.get("/api/v1/timers/fo/r2").json() == {"found": False}
                assert [x["timerKey"] for x in c.get("/api/v1/timers/fo").json()["rows"]] == ["r1"]
                # DELETE is a verdict: the primary answers it, though the standby still shows r1
                d = c.delete("/api/v1/timers/fo/r1")
                assert d.status_code == 200 and d.json()["status"] == "cancelled", d.text
                assert prim.execute("SELECT count(*) AS n FROM queen.timers WHERE timer_key = 'r1'"
                                    ).fetchone()["n"] == 0
                assert c.get("/api/v1/timers/fo/r1").json()["found"] is True
            finally:
                stby.execute("SELECT pg_wal_replay_resume()")
            wait_until(lambda: replayed(stby, prim), 10, message="the standby to catch up")
            assert c.get("/api/v1/timers/fo/r1").json() == {"found": False}
            assert c.get("/api/v1/timers/fo/r2").json()["found"] is True
            assert [x["timerKey"] for x in c.get("/api/v1/timers/fo").json()["rows"]] == ["r2"]
            prim.execute("DELETE FROM queen.timers")
    finally:
        b.kill()


def test_a_connection_that_lands_on_the_standby_is_refused(pair):
    """target_session_attrs=any lets libpq stop at the standby: the sweeper's connect and the
    primary pool refuse it (in_hot_standby), closing the connection; the read pool takes it."""
    from psycopg_pool import PoolTimeout

    from queen_timers.db import connect as sweeper_connect, make_pool
    from queen_timers.errors import ReadOnlyServer

    url = pair.url(pair.standby_port, target_session_attrs="any")
    s = Settings(database_url=url, read_database_url=url, broker_id="lands", pool_timeout_ms=1500)

    async def go():
        with pytest.raises(ReadOnlyServer):
            await sweeper_connect(s, "sweeper")
        pool = make_pool(s)
        await pool.open(wait=False)
        try:
            with pytest.raises(PoolTimeout):
                async with pool.connection():
                    pass
            # each one it met was discarded, paced (not a connection storm on the standby)
            stats = pool.get_stats()
            assert 1 <= stats.get("returns_bad", 0) <= 20, stats
        finally:
            await pool.close()
        reads = make_pool(s, read=True)
        await reads.open(wait=False)
        try:
            async with reads.connection() as conn:
                cur = await conn.execute("SELECT pg_is_in_recovery() AS r")
                assert (await cur.fetchone())["r"] is True
        finally:
            await reads.close()

    asyncio.run(go())
    with connect(pair.standby) as stby:  # the sweeper closed what it refused
        wait_until(lambda: stby.execute("SELECT count(*) AS n FROM pg_stat_activity"
                                        " WHERE application_name = 'queen-sweeper:lands'").fetchone()["n"] == 0,
                   10, message="the refused connection's backend to exit")


def test_fenced_primary_connections_are_discarded_not_reused(pair, tmp_path):
    """A primary turned read-only under the broker (default_transaction_read_only, as a
    switchover fences the old primary): 503 + Retry-After, the broker's connections to it
    are dropped, the sweeper spends no attempt, and all recovers when it takes writes again."""
    b = start_broker(pair.multi, tmp_path, QUEEN_BROKER_ID="fence", QUEEN_POOL_TIMEOUT_MS=1000)
    mine = "SELECT count(*) AS n FROM pg_stat_activity WHERE application_name LIKE 'queen-%:fence'"
    try:
        with connect(pair.primary) as prim, b.client() as c:
            assert post(c, schedule_op("f0")).status_code == 200
            assert prim.execute(mine).fetchone()["n"] >= 3  # pool + sweeper + LISTEN
            r = post(c, schedule_op("f1", delay_ms=1500))
            assert r.status_code == 200, r.text
            prim.execute("ALTER SYSTEM SET default_transaction_read_only = on")
            prim.execute("SELECT pg_reload_conf()")
            prim.execute("SET default_transaction_read_only = off")  # this admin session only
            # pg_reload_conf only signals the postmaster, which rereads the file and then
            # signals every backend: once a new session sees the setting, the broker's
            # backends have been signalled too (else the next POST could still write)
            wait_until(lambda: fresh_setting(pair.primary, "default_transaction_read_only") == "on", 10, 0.05,
                       "the primary to reload its configuration")
            try:
                # the first request may meet the pooled connection (25006); each answers 503
                for _ in range(3):
                    assert_503(post(c, schedule_op("f2")))
                h = c.get("/health")
                assert h.status_code == 503 and h.json()["database"] == "disconnected", h.text
                # no connection of this broker stays on the read-only server (and libpq's
                # target_session_attrs=read-write refuses new ones)
                wait_until(lambda: prim.execute(mine).fetchone()["n"] == 0, 15, 0.2,
                           "the broker's connections to the fenced primary to close")
                time.sleep(2.5)  # f1 is due meanwhile; the sweeper cannot fire it
                t = prim.execute("SELECT attempts, last_error FROM queen.timers WHERE timer_key = 'f1'").fetchone()
                assert t == {"attempts": 0, "last_error": None}
            finally:
                prim.execute("ALTER SYSTEM RESET default_transaction_read_only")
                prim.execute("SELECT pg_reload_conf()")
            wait_until(lambda: post(c, schedule_op("f3")).status_code == 200, 20, 0.3, "writes to come back")
            wait_until(lambda: prim.execute("SELECT count(*) AS n FROM queen.messages WHERE transaction_id = 'f1'"
                                            ).fetchone()["n"] == 1, 20, 0.2, "f1 to fire after the fence")
            assert prim.execute("SELECT count(*) AS n FROM queen.dead_letter_queue").fetchone()["n"] == 0
            assert "25006" in b.log() or "read-only" in b.log()
            prim.execute("DELETE FROM queen.timers")
    finally:
        b.kill()


class Relay:
    """A TCP relay to a PostgreSQL port that can be pointed at another one, dropping every
    connection it carries: to pgbouncer, the server behind it restarted as another."""

    def __init__(self, port: int):
        self.target = port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.carried: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            self.carried += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def point_at(self, port: int) -> None:
        self.target = port
        carried, self.carried = self.carried, []
        for s in carried:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.point_at(self.target)
        self.server.close()


def test_a_switchover_under_a_pgbouncer_per_member_moves_the_broker_to_the_new_primary(pair, tmp_path):
    """A pgbouncer per member (transaction pooling), the brokers on both. A pgbouncer replays
    to new clients the server parameters of the server it first met: after a switchover the
    old primary's pgbouncer still says in_hot_standby=off, the new primary's still says on,
    and libpq's target_session_attrs=read-write takes the first and refuses the second: every
    POST was a 500 for good (the soak's switchover, bench/history/2026-12-04-deployed-soak.md).
    Now a failed statement's connection is dropped when its server takes no writes (503 with
    Retry-After), and a new connection asks each pgbouncer's server (db.WritableBehindPooler).
    Relays under the two pgbouncers swap their members, as a switchover does."""
    script = str(ROOT / "scripts" / "pgbouncer")
    relays = [Relay(pair.primary_port), Relay(pair.standby_port)]
    folders = [Path(tempfile.mkdtemp(prefix="queen-pgb-", dir="/tmp")) for _ in range(2)]
    ports = [free_port(), free_port()]
    for folder, port, relay in zip(folders, ports, relays):
        folder.chmod(0o755)
        subprocess.run([script, "start", str(folder), str(relay.port), str(port), "4", "2"], check=True)
    url = (f"postgresql://postgres@127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}/{DB}"
           "?target_session_attrs=read-write&connect_timeout=2")
    b = start_broker(url, tmp_path, QUEEN_POOL_MODE="transaction", QUEEN_BROKER_ID="bouncers",
                     QUEEN_POOL_TIMEOUT_MS=1000)
    try:
        with connect(pair.url(ports[1])) as second:  # the second pgbouncer meets its member (a standby)
            assert second.execute("SELECT pg_is_in_recovery() AS r").fetchone()["r"]
        with b.client() as c:
            for i in range(5):  # the pool's connections: all through the first pgbouncer
                assert post(c, schedule_op(f"pgb{i}")).status_code == 200
            # the switchover: the first pgbouncer's member is now the standby, the second's the primary
            relays[0].point_at(pair.standby_port)
            relays[1].point_at(pair.primary_port)
            failed = 0
            for i in range(60):
                r = post(c, schedule_op(f"pgs{i}"))
                if r.status_code == 200:
                    break
                assert_503(r)  # never a 500: the request can be retried
                failed += 1
                time.sleep(0.1)
            assert r.status_code == 200, f"no write came through after {failed} tries: {r.text}"
            for i in range(20):  # and it stays so: no connection goes back to the standby
                assert post(c, schedule_op(f"pgt{i}")).status_code == 200
            # DELETE (the direct lane) and the log routes meet no standby either
            assert c.delete("/api/v1/timers/fo/pgt0").json()["status"] == "cancelled"
            assert c.post("/api/v1/push", json={"items": [{"queue": "fo-log", "payload": {"a": 1}}]}).status_code == 201
        # no request met the JSON 500's path (the sweeper's own connection may well have been
        # cut by the swap: psycopg says "closed the connection unexpectedly", and it reconnects)
        log = b.log()
        assert not any(s in log for s in ("unexpected error", "unexpected database error", "Traceback")), log[-3000:]
        with connect(pair.primary) as prim:
            prim.execute("DELETE FROM queen.timers")
    finally:
        b.kill()
        for folder in folders:
            subprocess.run([script, "stop", str(folder)], check=False)
            shutil.rmtree(folder, ignore_errors=True)
        for relay in relays:
            relay.close()


def test_a_silent_host_costs_one_connect_timeout(pair, tmp_path):
    """A host that accepts TCP and never answers (a hung machine) listed first: the
    broker's connect gives up on it after connect_timeout and uses the next host."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # the kernel completes handshakes; nobody ever reads or answers
    try:
        url = (f"host=127.0.0.1,127.0.0.1 port={silent.getsockname()[1]},{pair.primary_port} dbname={DB} "
               "user=postgres connect_timeout=2")
        t0 = time.monotonic()
        b = start_broker(url, tmp_path, QUEEN_BROKER_ID="silent")
        try:
            assert time.monotonic() - t0 < 25
            with b.client() as c:
                r = post(c, schedule_op("s1"))
                assert r.status_code == 200, r.text
        finally:
            b.kill()
        with connect(pair.primary) as prim:
            prim.execute("DELETE FROM queen.timers")
    finally:
        silent.close()


async def _load(pair: Pair, urls: list[str], seconds: float, prefix: str) -> dict:
    """Four clients POSTing batches of 8 schedules (due in 0..1500 ms) round-robin over the brokers."""
    accepted: list[str] = []
    unknown: list[str] = []
    codes: dict = {}
    bad_503 = 0
    seq = 0
    t_end = time.monotonic() + seconds
    marks: dict = {}

    async def worker(w: int):
        nonlocal seq, bad_503
        async with httpx.AsyncClient(timeout=15) as c:
            n = 0
            while time.monotonic() < t_end:
                n += 1
                ops = []
                for _ in range(8):
                    seq += 1
                    ops.append(schedule_op(f"{prefix}-{seq}", random.randint(0, 1500), queue="load"))
                try:
                    r = await c.post(urls[(w + n) % len(urls)] + "/api/v1/timers", json={"operations": ops})
                except httpx.HTTPError as exc:
                    codes[type(exc).__name__] = codes.get(type(exc).__name__, 0) + 1
                    unknown.extend(o["txn"] for o in ops)
                    continue
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
                if r.status_code == 200:
                    accepted.extend(v["txn"] for v in r.json()["results"] if v["ok"])
                    if "promoted" in marks and "after" not in marks:
                        marks["after"] = time.monotonic()  # first 200 after the promotion
                else:
                    # a 503 may come from a commit whose answer was lost with the primary:
                    # its outcome is unknown (a client retries it with the same txn)
                    unknown.extend(o["txn"] for o in ops)
                    if r.status_code != 503 or not r.headers.get("retry-after") \
                            or r.json().get("error") != "timers_unavailable":
                        bad_503 += 1
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.02)

    def kill_and_promote() -> None:
        marks["kill_wall"] = time.time()
        marks["killed"] = time.monotonic()
        pair.run("kill-primary")
        time.sleep(0.5)  # the time a failover manager takes to decide, shortened
        marks["promote_wall"] = time.time()
        pair.run("promote")
        marks["promoted"] = time.monotonic()

    async def killer():
        await asyncio.sleep(seconds / 3)
        await asyncio.to_thread(kill_and_promote)

    await asyncio.gather(killer(), *(worker(w) for w in range(4)))
    return {"accepted": accepted, "unknown": unknown, "codes": codes, "bad_503": bad_503, "marks": marks}


def test_primary_killed_under_load_then_standby_promoted(pair, tmp_path):
    env = {"QUEEN_SWEEPER_LEASE_MS": "2000", "QUEEN_POOL_TIMEOUT_MS": "1000"}
    a = start_broker(pair.multi, tmp_path, QUEEN_BROKER_ID="fo-a", **env)
    b = start_broker(pair.multi, tmp_path, QUEEN_BROKER_ID="fo-b", **env)
    try:
        out = asyncio.run(_load(pair, [a.url, b.url], 9.0, "L"))
        marks = out["marks"]
        assert out["bad_503"] == 0, out["codes"]
        # nothing hung: every request got an HTTP answer (no timeouts, no resets)
        assert all(isinstance(k, int) for k in out["codes"]), out["codes"]
        assert out["codes"].get(200, 0) > 0 and "after" in marks, out["codes"]
        assert len(out["accepted"]) > 50, out["codes"]
        with connect(pair.standby) as new:  # the promoted standby is the primary now
            assert new.execute("SELECT pg_is_in_recovery() AS r").fetchone()["r"] is False
            wait_until(lambda: new.execute("SELECT count(*) AS n FROM queen.timers").fetchone()["n"] == 0,
                       30, 0.25, "every pending timer to fire on the new primary")
            fired = {r["txn"]: r["n"] for r in new.execute(
                "SELECT transaction_id AS txn, count(*) AS n FROM queen.messages"
                " WHERE transaction_id LIKE 'L-%' GROUP BY 1")}
            accepted = set(out["accepted"])
            missing = [t for t in accepted if fired.get(t) != 1]
            assert missing == [], (len(missing), missing[:5])  # each accepted schedule fired once
            assert all(n == 1 for n in fired.values())  # no frame twice
            strangers = set(fired) - accepted - set(out["unknown"])
            assert strangers == set(), list(strangers)[:5]  # no frame for a txn nobody sent
            # the first frame fired by the new primary (a fire transaction there starts after
            # `pg_ctl promote` was called; the old primary's orphaned backends may still
            # commit for a few ms after its postmaster's SIGKILL)
            first_fire = new.execute("""SELECT extract(epoch FROM min(created_at))::float8 AS t FROM queen.messages
                                         WHERE created_at > to_timestamp(%s)""", (marks["promote_wall"],)).fetchone()["t"]
            assert first_fire is not None  # timers fired after the promotion
            # both brokers' sweepers (fire and LISTEN) are on the new primary
            apps = {r["a"] for r in new.execute(
                "SELECT application_name AS a FROM pg_stat_activity WHERE application_name LIKE 'queen-sweeper%'")}
            assert apps >= {"queen-sweeper:fo-a", "queen-sweeper-listen:fo-a",
                            "queen-sweeper:fo-b", "queen-sweeper-listen:fo-b"}, apps
        for x in (a, b):
            assert x.alive()
            assert httpx.get(x.url + "/health", timeout=5).status_code == 200
        print(f"\nfailover: {out['codes']}; kill -> first fire after the promotion {first_fire - marks['kill_wall']:.2f} s; "
              f"kill -> first 200 {marks['after'] - marks['killed']:.2f} s; accepted {len(accepted)}")
    finally:
        a.kill()
        b.kill()
