"""503 timers_unavailable: the database cannot answer (pool exhausted, statement timeout,
unreachable). Not the caller's fault: Retry-After, and on POST the hint header."""

from __future__ import annotations

import socket
import threading
import time

import psycopg

from timers_util import HINT, assert_error, op, post, rows


def unavailable(r, *, hint: bool) -> None:
    assert_error(r, 503, "timers_unavailable")
    assert int(r.headers["Retry-After"]) >= 1
    assert (r.headers.get("x-queen-timers-hint") == HINT) is hint


class RowLock:
    """Hold the row lock of one timer in a transaction of the test's own."""

    def __init__(self, url: str, key: str):
        self.conn = psycopg.connect(url)
        got = self.conn.execute("SELECT 1 FROM queen.timers WHERE timer_key = %s FOR UPDATE", (key,)).fetchall()
        assert got, "no such timer to lock"

    def release(self) -> None:
        self.conn.rollback()
        self.conn.close()


def wait_for_lock_waiter(db, timeout: float = 20.0) -> None:
    """Until a broker request connection is blocked on a lock (an event, not a duration)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = db.execute("SELECT count(*) AS n FROM pg_stat_activity"
                       " WHERE application_name LIKE 'queen-broker:%%' AND wait_event_type = 'Lock'"
                       ).fetchone()["n"]
        if n:
            return
        time.sleep(0.02)
    raise AssertionError("no broker request got blocked on the row lock")


def test_pool_exhausted_is_503(broker_factory, db, database_url):
    b = broker_factory(QUEEN_POOL_MAX="1", QUEEN_POOL_TIMEOUT_MS="200", QUEEN_STATEMENT_TIMEOUT_MS="60000")
    with b.client() as c:
        assert post(c, op("schedule", "k"), op("schedule", "other")).status_code == 200
        lock = RowLock(database_url, "k")
        blocked: dict = {}
        t = threading.Thread(target=lambda: blocked.setdefault(
            "r", c.delete("/api/v1/timers/reminders/k")), daemon=True)
        try:
            t.start()
            wait_for_lock_waiter(db)  # the pool's only connection is now busy
            with b.client() as c2:
                unavailable(post(c2, op("schedule", "new")), hint=True)
                unavailable(c2.delete("/api/v1/timers/reminders/other"), hint=False)
                unavailable(c2.get("/api/v1/timers/reminders/other"), hint=False)
                unavailable(c2.get("/api/v1/timers/reminders"), hint=False)
        finally:
            lock.release()
            t.join(30)
        assert blocked["r"].status_code == 200 and blocked["r"].json()["status"] == "cancelled"
        assert [r["timer_key"] for r in rows(db)] == ["other"]
        assert c.delete("/api/v1/timers/reminders/other").json()["status"] == "cancelled"


def test_statement_timeout_is_503(broker_factory, db, database_url):
    b = broker_factory(QUEEN_STATEMENT_TIMEOUT_MS="300")
    with b.client() as c:
        assert post(c, op("schedule", "k")).status_code == 200
        lock = RowLock(database_url, "k")
        try:
            unavailable(c.delete("/api/v1/timers/reminders/k"), hint=False)
            unavailable(post(c, op("reschedule", "k"), op("schedule", "new")), hint=True)
        finally:
            lock.release()
        assert [r["timer_key"] for r in rows(db)] == ["k"]  # the refused batch wrote nothing
        assert c.delete("/api/v1/timers/reminders/k").json()["status"] == "cancelled"


class Proxy:
    """A TCP proxy to PostgreSQL that the test can cut: the database becomes unreachable."""

    def __init__(self, host: str, port: int):
        self.upstream = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        self.open = True
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while self.open:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            if not self.open:
                down.close()
                return
            up = socket.create_connection(self.upstream)
            self.sockets += [down, up]
            for a, z in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, z), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        self.open = False
        self.listener.close()
        for s in self.sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def test_database_unreachable_is_503(spawn_broker, db, database_url):
    info = psycopg.conninfo.conninfo_to_dict(database_url)
    proxy = Proxy(info.get("host", "127.0.0.1"), int(info["port"]))
    via_proxy = psycopg.conninfo.make_conninfo(database_url, host="127.0.0.1", port=proxy.port)
    b = spawn_broker(QUEEN_DATABASE_URL=via_proxy, QUEEN_POOL_TIMEOUT_MS="500")
    try:
        with b.client() as c:
            assert post(c, op("schedule", "k")).status_code == 200
            proxy.cut()
            unavailable(c.delete("/api/v1/timers/reminders/k"), hint=False)
            unavailable(post(c, op("schedule", "new")), hint=True)
            unavailable(c.get("/api/v1/timers/reminders/k"), hint=False)
            assert c.get("/health").status_code == 503
    finally:
        proxy.cut()
    assert [r["timer_key"] for r in rows(db)] == ["k"]
