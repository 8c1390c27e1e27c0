"""Cancel section: queen.cancel_timer against a bare DELETE by key, the HTTP
DELETE route with 1 and 4 clients, and the HTTP DELETE under fire load.

The DELETE at one client is timed beside cancel_timer in SQL in the same
seconds: the two (with cancel_timer under synchronous_commit off, and each
variant broker) interleaved in blocks of 200 calls (delete_blocks), because
this machine's WAL flush switches between about 0.05 and 0.25 ms within tens
of milliseconds and a run of each side in turn compared two mixes of the two
modes (run 21's per-round ratios: 0.62 to 2.9). The section prints the ratio
of the p50s, the flush's part (synchronous_commit off), and each side's blocks
split by their flush mode (flush_modes): how many were slow, and the ratio with
both sides in their fast mode.

Under load (issue 12's "p99 <= 5 ms at 200 cancels/s while 1,000 timers/s
fire"): rounds of windows, each printed, then the median of the per-window
p99s. The load generator runs in a process of its own (not a thread of the
timing client); beside the HTTP windows, the same cancels straight to
PostgreSQL (`sql`, the floor the HTTP path stands on) and the disk alone
(`fsync`: a commit's fdatasync at the same times, with nothing else) run by
default, rotating order, and the DELETE through a broker with another HTTP
parser or loop (`--cancel-load-variant`, bench/broker_variant.py) can.

Fairness of the SQL comparison (issue 12):
- one client connection for both sides (same settings), statements prepared
  on both sides (psycopg prepare=True), N keys a side re-seeded before
  every round (same rows, same pages: VACUUM ANALYZE + CHECKPOINT after the
  seed), the two sides interleaved in blocks of 200 calls within a round,
  alternating which goes first (sql_pair: the disk's bursts of slow commits
  fall on both), median of rounds;
- the broker is stopped (SIGSTOP) during the SQL rounds, so that its
  sweeper takes no part; pg_stat_statements tracks top-level statements
  only on the timing connection (the extension's default; the bench's
  cluster tracks nested ones too, for the profile, which would bill every
  nested statement of the function for the profiler's own bookkeeping).
  The profile is a separate, untimed pass with nested tracking on.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import queue
import signal
import socket
import statistics
import threading
import time

import psycopg
import uvloop
from psycopg.types.composite import CompositeInfo, register_composite

from harness import OUT, Broker, connect, explain_rolled_back, load_timers, log, pct

TARGET_CANCEL_VS_BARE = 0.9    # queen.cancel_timer / a bare DELETE, cancels/s (issue 19; 0.8 in issue 12)
TARGET_DELETE_VS_SQL_P50 = 1.6  # HTTP DELETE p50 at one client / cancel_timer p50 in SQL (issue 19)

QUEUE = "bench-cancel"
TENANT = "default"  # the broker's tenant when auth is off

CANCEL_SQL = "SELECT queen.cancel_timer(%s, %s, %s)"
BARE_SQL = ("DELETE FROM queen.timers WHERE (tenant, queue, timer_key) = (%s, %s, %s) "
            "RETURNING timer_key")


def _key(i: int, prefix: str = "c") -> str:
    return f"{prefix}-{i}"


def seed(conn, n: int, queue: str = QUEUE, prefixes: tuple[str, ...] = ("c",)) -> None:
    """The same n pending timers per prefix (keys c-1..c-n, deliver in 30 days)
    and a counter that matches the table; same pages for every run."""
    conn.execute("DELETE FROM queen.timers WHERE queue = %s", (queue,))
    for prefix in prefixes:
        load_timers(conn, queue=queue, n=n, prefix=prefix, expected=False,
                    deliver_sql="now() + interval '30 days'")
    conn.execute("DELETE FROM queen.tenant_usage_deltas WHERE tenant = %s", (TENANT,))
    conn.execute("""UPDATE queen.tenant_usage
                       SET pending_timers = (SELECT count(*) FROM queen.timers WHERE tenant = %(t)s)
                     WHERE tenant = %(t)s""", {"t": TENANT})
    conn.execute("VACUUM ANALYZE queen.timers")
    conn.execute("VACUUM ANALYZE queen.tenant_usage")
    conn.execute("VACUUM ANALYZE queen.tenant_usage_deltas")
    conn.execute("CHECKPOINT")


def counter(conn) -> int:
    return conn.execute("SELECT queen.get_pending_timers(%s)", (TENANT,)).fetchone()[0]


def left(conn, queue: str = QUEUE, prefix: str | None = None) -> int:
    return conn.execute("SELECT count(*) FROM queen.timers WHERE queue = %s AND (%s::text IS NULL OR "
                        "timer_key LIKE %s::text || '-%%')", (queue, prefix, prefix)).fetchone()[0]


def _summary(lat: list[float], secs: float) -> dict:
    return {"per_s": len(lat) / secs if secs else 0.0, "p50_ms": pct(lat, 50) * 1000, "p99_ms": pct(lat, 99) * 1000,
            "max_ms": max(lat) * 1000}


def _cancels(client, method: str, keys, lat: list[float]) -> int:
    """One single cancel per key on `client` by `method` (queen.cancel_timer or the
    bare DELETE), each call's seconds appended to lat; returns how many hit."""
    sql = CANCEL_SQL if method == "cancel_timer" else BARE_SQL
    hits = 0
    for key in keys:
        t = time.perf_counter()
        row = client.execute(sql, (TENANT, QUEUE, key), prepare=True).fetchone()
        lat.append(time.perf_counter() - t)
        hits += row is not None and (method != "cancel_timer" or row[0] == "cancelled")
    return hits


def _server_us(admin, method: str, n: int) -> float | None:
    """The server's own time per call of `method` since the last reset (top-level
    statement, pg_stat_statements), in microseconds."""
    server = admin.execute("""SELECT mean_exec_time FROM pg_stat_statements
                               WHERE calls >= %s AND query LIKE %s""",
                           (n, "SELECT queen.cancel_timer(%" if method == "cancel_timer"
                            else "DELETE FROM queen.timers WHERE (tenant, queue, timer_key)%")).fetchone()
    return server[0] * 1000 if server else None


def sql_run(client, admin, method: str, n: int) -> dict:
    """n single cancels by key from one client: queen.cancel_timer or the bare DELETE."""
    seed(admin, n)
    before = counter(admin)
    admin.execute("SELECT pg_stat_statements_reset()")
    lat: list[float] = []
    t0 = time.perf_counter()
    hits = _cancels(client, method, (_key(i) for i in range(1, n + 1)), lat)
    out = _summary(lat, time.perf_counter() - t0)
    out.update(hits=hits, left=left(admin), counter_drop=before - counter(admin),
               server_us=_server_us(admin, method, n))
    return out


def interleave(names: list[str], n: int, block: int, run, rotate: bool = False):
    """The block loop of every interleaved one-client comparison (sql_pair,
    delete_blocks, peers.cancel_interleaved): n calls a side in blocks of `block`,
    the order of the sides alternating (forward, then backward) or, with `rotate`,
    rotating by one from block to block. `run(name, start, count)` makes one side's
    calls start .. start + count - 1 (0-based) and returns (latencies in seconds,
    the block's seconds), or None when that side has left. Returns each side's
    latencies, each block's p50 in ms, and the seconds its own blocks took."""
    lat: dict[str, list[float]] = {name: [] for name in names}
    blocks: dict[str, list[float]] = {name: [] for name in names}
    busy = dict.fromkeys(names, 0.0)
    for bi, start in enumerate(range(0, n, block)):
        k = bi % len(names)
        order = names[k:] + names[:k] if rotate else (names if bi % 2 == 0 else names[::-1])
        for name in order:
            got = run(name, start, min(block, n - start))
            if got is None:
                continue
            mine, secs = got
            lat[name] += mine
            busy[name] += secs
            blocks[name].append(pct(mine, 50) * 1000)
    return lat, blocks, busy


# The two sides of the SQL comparison, interleaved in blocks on one connection.
# This machine's disk stalls in bursts: a run of 1,500 consecutive commits that
# wait 0.5-1.5 ms each instead of 0.1 (seen in a probe, 09:20 on Dec 6). In
# rounds of 10,000 calls a side, such a burst lands on one side of a round and
# moves the round's ratio from 1.4 to 0.45, whichever side is faster. In blocks
# of BLOCK calls, alternating which side goes first, both sides share every
# minute of the disk.
PAIR = ("cancel_timer", "bare_delete")
PREFIX = {"cancel_timer": "c", "bare_delete": "b"}
BLOCK = 200


def sql_pair(client, admin, n: int, block: int = BLOCK) -> dict[str, dict]:
    """n single cancels by key from one client on each side, queen.cancel_timer
    and the bare DELETE, interleaved in blocks of `block` calls on the same
    table (keys c-i and b-i seeded together); each side's rate is its calls
    over the time its own blocks took."""
    seed(admin, n, prefixes=tuple(PREFIX[m] for m in PAIR))
    before = counter(admin)
    admin.execute("SELECT pg_stat_statements_reset()")
    hits = dict.fromkeys(PAIR, 0)

    def run(method, start, count):
        mine: list[float] = []
        t0 = time.perf_counter()
        keys = (_key(i, PREFIX[method]) for i in range(start + 1, start + count + 1))
        hits[method] += _cancels(client, method, keys, mine)
        return mine, time.perf_counter() - t0

    lat, _, busy = interleave(list(PAIR), n, block, run)
    drop = before - counter(admin)
    out = {}
    for method in PAIR:
        o = _summary(lat[method], busy[method])
        o.update(hits=hits[method], left=left(admin, prefix=PREFIX[method]),
                 counter_drop=drop if method == "cancel_timer" else 0,
                 server_us=_server_us(admin, method, n))
        out[method] = o
    return out


# -------------------------------------------------------------------------
# HTTP
# -------------------------------------------------------------------------

def content_length(head: bytes) -> int:
    """A response head's Content-Length (0 without one)."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


class RawHttp:
    """One keep-alive HTTP/1.1 connection on asyncio streams: a request line, the
    response head, Content-Length bytes of body. The bench's client must cost
    little beside the broker it measures: httpx spends about 2 ms of CPU per
    request on a 2-core machine, more than the broker does, and would be what
    the figures measure."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> "RawHttp":
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def request(self, method: str, path: str, headers: str = "") -> tuple[int, bytes]:
        """headers: more header lines, each ending in CRLF."""
        self.writer.write(f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n{headers}\r\n".encode())
        head = await self.reader.readuntil(b"\r\n\r\n")
        return int(head[9:12]), await self.reader.readexactly(content_length(head))

    def close(self) -> None:
        if self.writer:
            self.writer.close()


class BlockingHttp:
    """One keep-alive HTTP/1.1 connection on a blocking socket: the client of the
    one-client DELETE figures, as lean as the SQL side's (one blocking libpq
    connection), so that the DELETE's ratio to SQL charges the broker with none of
    the client's own event loop. RawHttp's asyncio streams cost up to 37 us of p50
    in an A/B (0.229 against 0.192 ms, 9 rounds, Dec 6) and 5 us in make bench run
    15, which prints both."""

    def __init__(self, host: str, port: int):
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.host = host.encode()
        self.buf = b""

    def request(self, method: str, path: str, headers: bytes = b"") -> tuple[int, bytes]:
        """`headers`: more header lines, each ending with CRLF."""
        self.sock.sendall(b"%s %s HTTP/1.1\r\nHost: %s\r\n%s\r\n"
                          % (method.encode(), path.encode(), self.host, headers))
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            self._recv()
        head, body = self.buf[:end], self.buf[end + 4:]
        length = content_length(head)
        while len(body) < length:
            self.buf = body
            self._recv()
            body = self.buf
        self.buf = body[length:]
        return int(head[9:12]), body[:length]

    def _recv(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buf += chunk

    def close(self) -> None:
        self.sock.close()


def _verdict(status: int, body: bytes) -> str:
    if status == 200:
        try:
            return json.loads(body).get("status")
        except ValueError:
            pass
    return body[:60].decode(errors="replace")


async def _http_cancels(broker: Broker, keys: list[str], clients: int) -> tuple[float, list[float], dict]:
    it = iter(keys)
    lat: list[float] = []
    outcomes: dict = {}

    async def worker(c: RawHttp):
        for key in it:
            t = time.perf_counter()
            status, body = await c.request("DELETE", f"/api/v1/timers/{QUEUE}/{key}")
            lat.append(time.perf_counter() - t)
            k = (status, _verdict(status, body))
            outcomes[k] = outcomes.get(k, 0) + 1

    conns = [await RawHttp("127.0.0.1", broker.port).open() for _ in range(clients)]
    try:
        for c in conns:  # every connection open and served once before the clock starts
            await c.request("GET", "/health")
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in conns))
        return time.perf_counter() - t0, lat, outcomes
    finally:
        for c in conns:
            c.close()


def _deletes(c: "BlockingHttp", keys, lat: list[float], outcomes: dict) -> None:
    """One DELETE per key on `c`, each call's seconds appended to lat and its (status,
    verdict) counted in outcomes: the HTTP twin of _cancels."""
    for key in keys:
        t = time.perf_counter()
        status, body = c.request("DELETE", f"/api/v1/timers/{QUEUE}/{key}")
        lat.append(time.perf_counter() - t)
        k = (status, _verdict(status, body))
        outcomes[k] = outcomes.get(k, 0) + 1


def _blocking_cancels(broker: Broker, keys: list[str]) -> tuple[float, list[float], dict]:
    lat: list[float] = []
    outcomes: dict = {}
    c = BlockingHttp("127.0.0.1", broker.port)
    try:
        c.request("GET", "/health")  # open and served once before the clock starts
        t0 = time.perf_counter()
        _deletes(c, keys, lat, outcomes)
        return time.perf_counter() - t0, lat, outcomes
    finally:
        c.close()


def http_run(broker: Broker, admin, clients: int, n: int, blocking: bool | None = None) -> dict:
    """n DELETEs from `clients` keep-alive connections: one blocking socket (the
    default at one client, as the SQL side's one blocking connection) or asyncio
    streams on uvloop (several clients, or blocking=False)."""
    seed(admin, n)
    before = counter(admin)
    keys = [_key(i) for i in range(1, n + 1)]
    if blocking is None:
        blocking = clients == 1
    if blocking:
        assert clients == 1, "one blocking socket is one client"
        secs, lat, outcomes = _blocking_cancels(broker, keys)
    else:
        # uvloop: the client's own event loop costs little beside the one call of the SQL side
        secs, lat, outcomes = uvloop.run(_http_cancels(broker, keys, clients))
    out = _summary(lat, secs)
    out.update(outcomes={f"{k[0]} {k[1]}": v for k, v in outcomes.items()}, left=left(admin),
               counter_drop=before - counter(admin))
    return out


UNFLUSHED = "sql unflushed"  # delete_blocks' side: cancel_timer with synchronous_commit off


def delete_blocks(sides: dict[str, Broker | None], client, unflushed, admin, n: int,
                  brokers: list[Broker], main: Broker | None, block: int = BLOCK) -> tuple[dict[str, dict], int]:
    """The one-client DELETE figures: n calls a side, the sides interleaved in blocks of
    `block` calls, rotating which goes first (as sql_pair), so that every side shares
    every second of the disk. A side is a broker (DELETEs from one blocking keep-alive
    socket, every other broker stopped meanwhile), None (cancel_timer in SQL on
    `client`, every broker stopped), or UNFLUSHED (the same on `unflushed`, a session
    with synchronous_commit off: the chain without the WAL flush's wait, which shows
    what the disk added in that run). Afterwards `main` runs and the other brokers
    stay stopped. This machine's WAL flush runs in two modes, about
    0.05 or 0.25 ms, that switch within tens of milliseconds (probe of Dec 7: with
    synchronous_commit off the SQL p50 stays at 0.06 ms in every block of 200); runs of
    3,000 calls a side one after the other land in different mixes of the two, and the
    p50 of a mix jumps from one mode to the other (run 21's per-round ratios ran from
    0.62 to 2.9). Each side's p50 is over all its calls; block_p50s keeps each block's.
    Returns the sides' figures and how far the pending counter dropped (n a side)."""
    names = list(sides)
    prefix = {name: f"k{i}" for i, name in enumerate(names)}
    seed(admin, n, prefixes=tuple(prefix.values()))
    before = counter(admin)
    socks = {name: BlockingHttp("127.0.0.1", b.port) for name, b in sides.items() if isinstance(b, Broker)}
    outcomes: dict[str, dict] = {name: {} for name in names}

    def run(name, start, count):
        target = sides[name]
        for b in brokers:
            b.proc.send_signal(signal.SIGCONT if b is target else signal.SIGSTOP)
        keys = [_key(i, prefix[name]) for i in range(start + 1, start + count + 1)]
        mine: list[float] = []
        t0 = time.perf_counter()
        if isinstance(target, Broker):
            _deletes(socks[name], keys, mine, outcomes[name])
        else:
            hits = _cancels(unflushed if name == UNFLUSHED else client, "cancel_timer", keys, mine)
            outcomes[name]["cancelled"] = outcomes[name].get("cancelled", 0) + hits
        return mine, time.perf_counter() - t0

    try:
        for name, c in socks.items():  # every socket open and served once before the clock starts
            for b in brokers:
                b.proc.send_signal(signal.SIGCONT if b is sides[name] else signal.SIGSTOP)
            c.request("GET", "/health")
        lat, blocks, busy = interleave(names, n, block, run)
    finally:
        for b in brokers:
            b.proc.send_signal(signal.SIGCONT if b is main else signal.SIGSTOP)
        for c in socks.values():
            c.close()
    out = {}
    for name in names:
        o = _summary(lat[name], busy[name])
        o.update(outcomes={(" ".join(map(str, k)) if isinstance(k, tuple) else k): v
                           for k, v in outcomes[name].items()},
                 left=left(admin, prefix=prefix[name]),
                 block_p50s=[round(x, 3) for x in blocks[name]])
        out[name] = o
    return out, before - counter(admin)


SLOW_STEP_MS = 0.1  # a block this far past its side's fastest block is in the flush's slow mode


def flush_modes(runs: dict[str, list[dict]], sides: list[str]) -> dict[str, dict]:
    """Each one-client side's blocks (delete_blocks) split by the mode its WAL flushes were
    in, told by the block's own p50: slow when it is more than SLOW_STEP_MS past the side's
    fastest block (the two modes are about 0.2 ms apart on this machine; anchored on the
    fastest block, not a quantile, since a side can be slow in most of its blocks). A
    side's mode does not follow the blocks beside it: in make bench run 22 the SQL blocks of
    a round were fast while the DELETE's between them were slow. A side never fast in a
    run has its slow level reported as its fast one. Per side: its blocks, how many were
    slow, and the median block p50 in each mode."""
    out = {}
    for side in sides:
        blocks = [b for run in runs[side] for b in run["block_p50s"]]
        base = min(blocks)
        slow = [b for b in blocks if b > base + SLOW_STEP_MS]
        fast = [b for b in blocks if b <= base + SLOW_STEP_MS]
        out[side] = {"blocks": len(blocks), "slow_blocks": len(slow),
                     "fast_p50_ms": round(statistics.median(fast), 3),
                     "slow_p50_ms": round(statistics.median(slow), 3) if slow else None}
    return out


# -------------------------------------------------------------------------
# Profile (untimed): pg_stat_statements with nested statements, auto_explain
# -------------------------------------------------------------------------

def explain_cancel(conn, key: str) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of every statement queen.cancel_timer runs for one key
    (auto_explain, nested statements), rolled back."""
    status, _secs, notices = explain_rolled_back(
        conn, lambda c: c.execute(CANCEL_SQL, (TENANT, QUEUE, key)).fetchone()[0])
    return f"-- queen.cancel_timer('{TENANT}', '{QUEUE}', '{key}') -> {status}\n" + "\n\n".join(notices)


def profile(url: str, admin, n: int) -> list[str]:
    report = []
    seed(admin, n)
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("SET pg_stat_statements.track = 'all'")
        for i in range(1, 6):  # past the plan cache's custom plans
            c.execute(CANCEL_SQL, (TENANT, QUEUE, _key(i)), prepare=True).fetchone()
        report.append(explain_cancel(c, _key(n)))
        report.append(explain_cancel(c, "no-such-key"))
        admin.execute("SELECT pg_stat_statements_reset()")
        for i in range(6, n):
            c.execute(CANCEL_SQL, (TENANT, QUEUE, _key(i)), prepare=True).fetchone()
        c.execute(BARE_SQL, (TENANT, QUEUE, _key(n)), prepare=True).fetchone()
        for _ in range(3):  # absent verdicts: the path a miss takes
            c.execute(CANCEL_SQL, (TENANT, QUEUE, "no-such-key"), prepare=True).fetchone()
    rows = admin.execute("""
        SELECT toplevel, calls, round((mean_exec_time * 1000)::numeric, 1),
               round(total_exec_time::numeric, 1), regexp_replace(left(query, 100), '\\s+', ' ', 'g')
          FROM pg_stat_statements
         WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND calls >= 3
           AND (query ILIKE '%%cancel_timer%%' OR query ILIKE '%%queen.timers%%'
                OR query ILIKE '%%tenant_usage%%' OR query ILIKE '%%delete_unclaimed%%')
         ORDER BY toplevel DESC, total_exec_time DESC LIMIT 12""").fetchall()
    lines = ["-- pg_stat_statements, nested statements tracked (top, calls, mean us, total ms, query)"]
    for r in rows:
        lines.append(f"  {'top ' if r[0] else '    '}{r[1]:>7} {r[2]:>9} {r[3]:>9}  {r[4]}")
    report.insert(0, "\n".join(lines))
    return report


# -------------------------------------------------------------------------
# Under load: HTTP DELETE at a steady rate while timers fire continuously
# -------------------------------------------------------------------------

def _scheduler(url: str, stop, ready, go, seconds: float, fire_rate: int, cancel_rate: int, tick: float,
               fire_delay_ms: int, cancel_delay_ms: int, run: str) -> None:
    """The load generator. Connects, puts "ready" on `ready`, takes t0 (monotonic:
    one clock for every process of the machine) from `go`, then every tick:
    fire_rate*tick timers due fire_delay_ms later (they fire) and cancel_rate*tick
    timers due cancel_delay_ms later (the cancel targets), one
    queen.schedule_timers call. Puts its stats on `ready` when done.

    It runs in a process of its own by default (`--cancel-load-generator
    process`): as a thread of the bench's process it shares the GIL with the
    asyncio client that timestamps the DELETEs, and building each batch's 60
    composites in Python delays that client's event loop (measured in
    bench/RESULTS.md)."""
    per_fire = round(fire_rate * tick)
    per_cancel = round(cancel_rate * tick)
    stats: dict = {"scheduled": 0, "late_ticks": 0, "batches": 0}
    with psycopg.connect(url, autocommit=True) as conn:
        info = CompositeInfo.fetch(conn, "queen.timer_op")
        register_composite(info, conn)
        T = info.python_type
        payload = b'{"kind":"cancel-load"}'
        ready.put("ready")
        t0 = ready_get(go)
        b = 0
        while not stop.is_set():
            when = t0 + b * tick
            if when - t0 >= seconds:
                break
            now = time.monotonic()
            if when > now:
                time.sleep(when - now)
            elif now - when > 1.0:
                stats["late_ticks"] += 1
            ops = [T("schedule", QUEUE + "-load", f"lf{run}-{b}-{i}", fire_delay_ms, f"lf{run}-{b}-{i}", payload,
                     None, False, False, None) for i in range(per_fire)]
            ops += [T("schedule", QUEUE + "-load", f"lc{run}-{b}-{i}", cancel_delay_ms, f"lc{run}-{b}-{i}", payload,
                      None, False, False, None) for i in range(per_cancel)]
            conn.execute("SELECT count(*) FROM queen.schedule_timers(%s, %s::queen.timer_op[], NULL, NULL, false)",
                         (TENANT, ops)).fetchone()
            stats["scheduled"] += len(ops)
            b += 1
        stats["batches"] = b
    ready.put(stats)


def ready_get(q, timeout: float = 60):
    """The next item of a queue.Queue or a multiprocessing queue."""
    return q.get(timeout=timeout)


async def _paced(targets: list[tuple[float, str]], open_conn, send) -> list[tuple[int, float, str]]:
    """Open loop: each cancel is sent at its own time on an idle connection (a new
    one when none is idle), whatever the others are doing. `open_conn()` opens a
    connection, `send(conn, key)` returns (status, verdict)."""
    out: list[tuple[int, float, str]] = []
    idle: list = []
    opened: list = []
    for _ in range(4):
        c = await open_conn()
        opened.append(c)
        idle.append(c)

    async def one(at: float, key: str):
        delay = at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        t = time.perf_counter()
        while idle and getattr(idle[-1], "stale", lambda: False)():  # closed by the server while idle
            idle.pop()
        c = idle.pop() if idle else None
        reused = c is not None
        for attempt in (0, 1):
            try:
                if c is None:
                    c = await open_conn()
                    opened.append(c)
                status, verdict = await send(c, key)
                out.append((status, time.perf_counter() - t, verdict))
                idle.append(c)
                return
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                if attempt == 0 and reused:
                    c = None  # a kept-alive connection the server closed: once more on a new one
                    continue
                out.append((-1, time.perf_counter() - t, type(exc).__name__))
                return

    try:
        await asyncio.gather(*(one(at, key) for at, key in targets))
    finally:
        for c in opened:
            res = c.close()
            if asyncio.iscoroutine(res):
                await res
    return out


class _IdleHttp(RawHttp):
    def stale(self) -> bool:  # the server closed it while idle (keep-alive timeout)
        return self.reader.at_eof()


async def _paced_cancels(broker: Broker, targets: list[tuple[float, str]]) -> list[tuple[int, float, str]]:
    """HTTP DELETE /api/v1/timers/:queue/:key, paced (see _paced)."""
    async def open_conn():
        c = await _IdleHttp("127.0.0.1", broker.port).open()
        await c.request("GET", "/health")
        return c

    async def send(c, key):
        status, body = await c.request("DELETE", f"/api/v1/timers/{QUEUE}-load/{key}")
        return status, _verdict(status, body)

    return await _paced(targets, open_conn, send)


async def _paced_sql_cancels(url: str, targets: list[tuple[float, str]]) -> list[tuple[int, float, str]]:
    """The baseline: the same paced cancels as `SELECT queen.cancel_timer(...)` straight
    to PostgreSQL (asyncio psycopg, autocommit, prepared), timed by the same client.
    Status 200 stands for "the statement answered"."""
    async def open_conn():
        c = await psycopg.AsyncConnection.connect(url, autocommit=True)
        await c.execute("SELECT 1")
        return c

    async def send(c, key):
        cur = await c.execute(CANCEL_SQL, (TENANT, QUEUE + "-load", key), prepare=True)
        return 200, (await cur.fetchone())[0]

    return await _paced(targets, open_conn, send)


def _paced_fsyncs(path: str, targets: list[tuple[float, str]]) -> list[tuple[int, float, str]]:
    """The storage alone: at each target's time, write 8 KiB (a WAL page) to a file in
    the cluster's data directory and fdatasync it (what a commit's WAL flush costs
    the disk, with the same load on it), timed. Status 200 stands for "done"."""
    out: list[tuple[int, float, str]] = []
    page = b"\0" * 8192
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for i, (at, _key) in enumerate(targets):
            delay = at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            t = time.perf_counter()
            os.pwrite(fd, page, (i % 2048) * 8192)  # a 16 MiB file, like a WAL segment
            os.fdatasync(fd)
            out.append((200, time.perf_counter() - t, "fdatasync"))
    finally:
        os.close(fd)
        os.unlink(path)
    return out


def under_load(url: str, broker: Broker, admin, seconds: float, fire_rate: int, cancel_rate: int,
               client: str = "http", generator: str = "process") -> dict:
    """One window: the load (fire_rate timers/s scheduled 1 s ahead, so they fire
    continuously, and cancel_rate/s cancel targets) while cancel_rate cancels/s are
    paced by `client` ("http": DELETE through the broker; "sql": queen.cancel_timer
    on direct connections; "fsync": no cancel, a timed 8 KiB write + fdatasync in the
    data directory at the same times, the disk's share of a commit; the targets then
    fire, as nothing cancels them). `generator` ("process" or "thread") is where the load
    generator runs."""
    tick = 0.05
    fire_delay_ms, cancel_delay_ms, cancel_after = 1000, 2500, 1.25
    q = QUEUE + "-load"
    admin.execute("SELECT queen.resume_fire()")  # whatever an earlier section left
    admin.execute("DELETE FROM queen.timers WHERE queue = %s", (q,))
    admin.execute("SELECT queen.ensure_partition(%s, %s, 'Default')", (TENANT, q))
    per_cancel = round(cancel_rate * tick)
    n_ticks = int(seconds / tick)
    run = f"{int(time.time() * 1000)}"  # keys and txns of this run only (a txn fires once per partition)
    args = (seconds, fire_rate, cancel_rate, tick, fire_delay_ms, cancel_delay_ms, run)
    if generator == "process":
        ctx = multiprocessing.get_context("spawn")
        stop, ready, go = ctx.Event(), ctx.Queue(), ctx.Queue()
        worker = ctx.Process(target=_scheduler, args=(url, stop, ready, go, *args), daemon=True)
    else:
        stop, ready, go = threading.Event(), queue.Queue(), queue.Queue()
        worker = threading.Thread(target=_scheduler, args=(url, stop, ready, go, *args), daemon=True)
    worker.start()
    if ready_get(ready) != "ready":
        raise RuntimeError("the load generator did not start")
    t0 = time.monotonic() + 0.5
    go.put(t0)
    # each cancel target is cancelled cancel_after s after its batch, evenly spread within the tick
    targets = [(t0 + b * tick + cancel_after + i * tick / per_cancel, f"lc{run}-{b}-{i}")
               for b in range(n_ticks) for i in range(per_cancel)]
    t_db0 = admin.execute("SELECT clock_timestamp()").fetchone()[0]
    admin.execute("SELECT pg_stat_statements_reset()")
    admin.execute("SELECT pg_stat_reset_shared('wal')")
    try:
        if client == "http":
            rows = uvloop.run(_paced_cancels(broker, targets))
        elif client == "sql":
            rows = uvloop.run(_paced_sql_cancels(url, targets))
        elif client == "fsync":
            data_dir = admin.execute("SHOW data_directory").fetchone()[0]
            rows = _paced_fsyncs(os.path.join(data_dir, "bench-fsync-probe"), targets)
        else:
            raise ValueError(f"unknown client {client!r}")
    finally:
        stop.set()
        try:
            stats = ready_get(ready)
        except Exception:  # queue.Empty: the generator died; its figures are missing
            stats = {}
        worker.join(60)
    wal = admin.execute("""SELECT wal_sync, wal_sync_time, wal_write, wal_records
                             FROM pg_stat_wal""").fetchone()
    # let the last fire timers go out, then count what fired during the window
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and admin.execute(
            "SELECT EXISTS (SELECT 1 FROM queen.timers WHERE queue = %s AND timer_key LIKE 'lf%%')", (q,)).fetchone()[0]:
        time.sleep(0.1)
    fired, span, targets_fired = admin.execute("""
        SELECT count(*) FILTER (WHERE m.transaction_id LIKE 'lf' || %s || '-%%'),
               extract(epoch FROM max(m.created_at) - min(m.created_at))::float8,
               count(*) FILTER (WHERE m.transaction_id LIKE 'lc' || %s || '-%%')
          FROM queen.messages m JOIN queen.partitions p ON p.id = m.partition_id
          JOIN queen.queues qq ON qq.id = p.queue_id
         WHERE qq.name = %s AND m.created_at >= %s""", (run, run, q, t_db0)).fetchone()
    lat = [r[1] for r in rows if r[0] == 200]
    outcomes: dict = {}
    for r in rows:
        k = f"{r[0]} {r[2]}"
        outcomes[k] = outcomes.get(k, 0) + 1
    # where a cancel's time went on the server during the window (the broker's statements)
    sql = admin.execute("""
        SELECT calls, round(mean_exec_time::numeric, 3), round(max_exec_time::numeric, 2),
               regexp_replace(left(query, 80), '\\s+', ' ', 'g')
          FROM pg_stat_statements
         WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND toplevel
           AND (query ILIKE '%%cancel_timer%%' OR query ILIKE '%%fold_pending_deltas%%'
                OR query ILIKE '%%schedule_timers(%%' OR query ILIKE '%%fire_due_timers%%')
         ORDER BY total_exec_time DESC LIMIT 8""").fetchall()
    admin.execute("DELETE FROM queen.timers WHERE queue = %s", (q,))
    return {"client": client, "generator": generator,
            "server_sql": [[r[0], float(r[1]), float(r[2]), r[3]] for r in sql], "seconds": seconds,
            "cancels": len(rows), "cancel_rate": cancel_rate, "fire_rate": fire_rate,
            "scheduled": stats.get("scheduled", 0), "late_ticks": stats.get("late_ticks", 0),
            "fired": fired, "fired_per_s": fired / span if span else None,
            "wal_syncs": wal[0], "wal_sync_ms_mean": (wal[1] / wal[0]) if wal[0] else None,
            "p50_ms": pct(lat, 50) * 1000 if lat else None, "p99_ms": pct(lat, 99) * 1000 if lat else None,
            "max_ms": max(lat) * 1000 if lat else None, "outcomes": outcomes, "targets_fired": targets_fired}


APART = "apart"  # bench.variant_brokers: a broker that serves HTTP and runs no sweeper
FLOOR = "floor"  # bench.variant_brokers: bench/shell_floor.py, a DELETE at the least this stack costs
NO_SWEEPER = (APART, FLOOR)  # variants during whose windows the main broker stays up and fires


def bench_under_load(url: str, broker: Broker, res, admin, rounds: int, seconds: float, fire_rate: int,
                     cancel_rate: int, clients: list[str], generator: str,
                     variants: dict[str, Broker] | None = None) -> None:
    """`rounds` windows per client kind, alternating their order each round; each
    window printed, then the median of the per-window p99s. `variants` (name ->
    another broker on the same database) adds an "http:NAME" client kind: DELETE
    through that broker, with every other broker stopped (SIGSTOP) meanwhile, so
    that only the measured broker's sweeper fires; but for APART (a broker with no
    sweeper) and FLOOR (bench/shell_floor.py) the main broker fires meanwhile."""
    admin.execute("ALTER SYSTEM SET track_wal_io_timing = on")  # pg_stat_wal.wal_sync_time: the commits' fsync
    admin.execute("SELECT pg_reload_conf()")
    variants = variants or {}
    brokers = {"http": broker, **{f"http:{k}": b for k, b in variants.items()}}
    kinds = [*clients, *(f"http:{k}" for k in variants)]
    log(f"\n== cancel under load: {cancel_rate} cancels/s while {fire_rate} timers/s are scheduled and fire, "
        f"{seconds:g} s windows, {rounds} rounds of {' + '.join(kinds)} (order rotating), load generator in a "
        f"{generator} ==")
    runs: dict[str, list[dict]] = {c: [] for c in kinds}
    for b in variants.values():
        b.proc.send_signal(signal.SIGSTOP)
    for r in range(rounds):
        for c in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            active = brokers.get(c, broker)
            # APART and FLOOR run no sweeper: the main broker stays up and fires while they serve
            main_stops = active is not broker and c.partition(":")[2] not in NO_SWEEPER
            if active is not broker:
                if main_stops:
                    broker.proc.send_signal(signal.SIGSTOP)
                active.proc.send_signal(signal.SIGCONT)
            try:
                out = under_load(url, active, admin, seconds, fire_rate, cancel_rate,
                                 client="http" if c.startswith("http") else c, generator=generator)
            finally:
                if active is not broker:
                    active.proc.send_signal(signal.SIGSTOP)
                    if main_stops:
                        broker.proc.send_signal(signal.SIGCONT)
            runs[c].append(out)
            cancel_row = next((x for x in out["server_sql"] if "cancel_timer" in x[3]), None)
            load = os.getloadavg()[0]
            log(f"  round {r + 1} {c:4s}: n {out['cancels']}  p50 {out['p50_ms'] or 0:.2f} ms  "
                f"p99 {out['p99_ms'] or 0:.2f} ms  max {out['max_ms'] or 0:.2f} ms  {out['outcomes']}; "
                f"server cancel_timer {cancel_row[1] if cancel_row else 0:.3f} ms mean, "
                f"{cancel_row[2] if cancel_row else 0:.2f} max; WAL fsync {out['wal_syncs']} x "
                f"{out['wal_sync_ms_mean'] or 0:.3f} ms; fired {out['fired']} ({out['fired_per_s'] or 0:.0f}/s), "
                f"late ticks {out['late_ticks']}, targets fired {out['targets_fired']}; load {load:.2f}")
    for b in variants.values():
        b.proc.send_signal(signal.SIGCONT)
    med = {}
    for c, v in runs.items():
        p99s = [x["p99_ms"] or 0 for x in v]
        med[c] = {"p50_ms": statistics.median(x["p50_ms"] or 0 for x in v), "p99_ms": statistics.median(p99s),
                  "max_ms": statistics.median(x["max_ms"] or 0 for x in v),
                  "wal_sync_ms": statistics.median(x["wal_sync_ms_mean"] or 0 for x in v)}
        target = {"sql": "  (baseline: no HTTP)", "fsync": "  (the disk alone)"}.get(c, "  (target p99 <= 5 ms)")
        log(f"  median {c:4s}: p50 {med[c]['p50_ms']:.2f} ms  p99 {med[c]['p99_ms']:.2f} ms (per run "
            f"{', '.join(f'{x:.2f}' for x in p99s)})  max {med[c]['max_ms']:.2f} ms  WAL fsync "
            f"{med[c]['wal_sync_ms']:.3f} ms mean{target}")
    if "http" in med and "fsync" in med:
        # a DELETE commits: one WAL fdatasync at least. Where the disk alone passes 5 ms at p99
        # in a window, no cancel (HTTP or SQL) can meet the target in it
        within = sum((x["p99_ms"] or 0) <= 5 for x in runs["fsync"])
        log(f"  reading: DELETE p99 {med['http']['p99_ms']:.2f} ms"
            + (f", the SQL baseline {med['sql']['p99_ms']:.2f} ms" if "sql" in med else "")
            + f", the disk alone {med['fsync']['p99_ms']:.2f} ms; the disk's own p99 was within 5 ms in "
              f"{within} of {len(runs['fsync'])} windows")
    last = runs[clients[0]][-1]
    log("  server side during the last window (calls, mean ms, max ms, statement):")
    for x in last["server_sql"]:
        log(f"    {x[0]:>6} {x[1]:>8.3f} {x[2]:>8.2f}  {x[3]}")
    res.put("cancel_load", rounds=rounds, seconds=seconds, generator=generator,
            median={c: {k: round(x, 3) for k, x in v.items()} for c, v in med.items()},
            runs={c: [{k: (round(x, 3) if isinstance(x, float) else x) for k, x in o.items()} for o in v]
                  for c, v in runs.items()})


# -------------------------------------------------------------------------
# The section
# -------------------------------------------------------------------------

def bench_cancel(url: str, broker: Broker, res, n: int, rounds: int, http_n: int, load_seconds: float,
                 fire_rate: int = 1000, cancel_rate: int = 200, load_rounds: int = 5,
                 load_clients: tuple[str, ...] = ("http", "sql", "fsync"), generator: str = "process",
                 load_only: bool = False, variants: dict[str, Broker] | None = None) -> None:
    try:
        _bench_cancel(url, broker, res, n, rounds, http_n, load_seconds, fire_rate, cancel_rate, load_rounds,
                      load_clients, generator, load_only, variants or {})
    finally:
        for b in (variants or {}).values():
            b.proc.send_signal(signal.SIGCONT)
            b.stop()


def _bench_cancel(url, broker, res, n, rounds, http_n, load_seconds, fire_rate, cancel_rate, load_rounds,
                  load_clients, generator, load_only, variants) -> None:
    if load_only:
        with connect(url) as admin:
            bench_under_load(url, broker, res, admin, load_rounds, load_seconds, fire_rate, cancel_rate,
                             list(load_clients), generator, variants)
        return
    log(f"\n== cancel: {n} single cancels by key from one client, queen.cancel_timer vs a bare DELETE, "
        f"{rounds} rounds, each the two sides interleaved in blocks of {BLOCK} ==")
    sql_runs: dict[str, list[dict]] = {"cancel_timer": [], "bare_delete": []}
    with connect(url) as admin, psycopg.connect(url, autocommit=True) as client:
        client.execute("SET pg_stat_statements.track = 'top'")
        for b in (broker, *variants.values()):  # no broker's sweeper takes part in the SQL rounds
            b.proc.send_signal(signal.SIGSTOP)
        try:
            for r in range(rounds):
                outs = sql_pair(client, admin, n)
                for method, out in outs.items():
                    sql_runs[method].append(out)
                    log(f"  round {r + 1} {method:12s}: {out['per_s']:7.0f} cancels/s  p50 {out['p50_ms']:.3f} ms  "
                        f"p99 {out['p99_ms']:.3f} ms  server {out['server_us'] or 0:.1f} us/call  "
                        f"(hits {out['hits']}, left {out['left']}, counter -{out['counter_drop']})")
        finally:
            broker.proc.send_signal(signal.SIGCONT)
        med = {m: {k: statistics.median(x[k] or 0 for x in v) for k in ("per_s", "p50_ms", "p99_ms", "server_us")}
               for m, v in sql_runs.items()}
        ratios = [a["per_s"] / b["per_s"] for a, b in zip(sql_runs["cancel_timer"], sql_runs["bare_delete"])]
        for m, v in med.items():
            log(f"  median {m:12s}: {v['per_s']:7.0f} cancels/s  p50 {v['p50_ms']:.3f} ms  p99 {v['p99_ms']:.3f} ms  "
                f"server {v['server_us']:.1f} us/call")
        ratio = med["cancel_timer"]["per_s"] / med["bare_delete"]["per_s"]
        p50_ratio = med["bare_delete"]["p50_ms"] / med["cancel_timer"]["p50_ms"]
        log(f"  ratio cancel_timer / bare delete: {ratio:.2f} (medians; per-round "
            f"{', '.join(f'{x:.2f}' for x in ratios)}; median of per-round ratios {statistics.median(ratios):.2f}) "
            f"(target >= {TARGET_CANCEL_VS_BARE}) {'met' if ratio >= TARGET_CANCEL_VS_BARE else 'MISSED'}")
        log(f"  same ratio by p50 latency (bare p50 / cancel_timer p50): {p50_ratio:.2f}; server time per call "
            f"{med['cancel_timer']['server_us']:.1f} vs {med['bare_delete']['server_us']:.1f} us")
        bad = [x for x in sql_runs["cancel_timer"] if x["hits"] != n or x["counter_drop"] != n or x["left"]]
        if bad:
            log(f"  WARNING: {len(bad)} cancel_timer runs did not cancel all {n} (or the counter moved otherwise)")
        res.put("cancel_sql", n=n, rounds=rounds,
                median={m: {k: round(x, 3) for k, x in v.items()} for m, v in med.items()},
                runs={m: [{k: (round(x, 3) if isinstance(x, float) else x) for k, x in o.items()} for o in v]
                      for m, v in sql_runs.items()},
                ratio_medians=round(ratio, 3), ratio_per_round=[round(x, 3) for x in ratios],
                ratio_p50=round(p50_ratio, 3))

        log(f"\n== cancel over HTTP: DELETE /api/v1/timers/:queue/:key, {http_n} per side and round, {rounds} "
            f"rounds: at 1 client (a blocking socket) interleaved in blocks of {BLOCK} with cancel_timer in SQL, "
            f"the same with synchronous_commit off{' and each variant broker' if variants else ''}; then 4 clients "
            f"and 1 client on asyncio streams (the client of runs 1-14), one run each ==")
        # The one-client sides share the disk block by block (delete_blocks): the DELETE's
        # baseline is cancel_timer in SQL in the same seconds, not the SQL section's minutes
        # earlier nor a run of its own beside (this machine's WAL flush switches modes within
        # tens of milliseconds). Every broker not timed is stopped, as during the SQL rounds.
        blocked: dict[str, Broker | None] = {"1": broker, "sql": None, UNFLUSHED: None}
        blocked.update({f"1 {name}": b for name, b in variants.items()})
        runs_of: list[tuple[str, int]] = [("4", 4), ("1 asyncio", 1)]
        all_brokers = [broker, *variants.values()]
        unflushed = psycopg.connect(url, autocommit=True)
        unflushed.execute("SET synchronous_commit = off")
        unflushed.execute("SET pg_stat_statements.track = 'top'")
        http_runs: dict[str, list[dict]] = {k: [] for k in [*blocked, *(label for label, _ in runs_of)]}
        try:
            for r in range(rounds):
                steps = ["blocks", *runs_of]
                for step in (steps if r % 2 == 0 else steps[::-1]):
                    if step == "blocks":
                        outs, drop = delete_blocks(blocked, client, unflushed, admin, http_n, all_brokers, broker)
                        for label, out in outs.items():
                            http_runs[label].append(out)
                        modes = flush_modes({label: [out] for label, out in outs.items()}, list(outs))
                        log(f"  round {r + 1} 1 client, blocks of {BLOCK}: "
                            + "  ".join(f"{'DELETE' if label == '1' else label} p50 {out['p50_ms']:.3f} ms "
                                        f"({modes[label]['slow_blocks']} of {modes[label]['blocks']} blocks slow)"
                                        for label, out in outs.items()))
                        bad = {label: out for label, out in outs.items()
                               if out["left"] or sum(out["outcomes"].values()) != http_n
                               or set(out["outcomes"]) - {"200 cancelled", "cancelled"}}
                        if bad or drop != http_n * len(outs):
                            log(f"  WARNING: not every key cancelled once: {bad or ''} counter -{drop}")
                        continue
                    label, clients = step
                    for b in all_brokers:
                        b.proc.send_signal(signal.SIGCONT if b is broker else signal.SIGSTOP)
                    out = http_run(broker, admin, clients, http_n, blocking=False)
                    http_runs[label].append(out)
                    log(f"  round {r + 1} {label} client{'s' if clients > 1 else ''}: {out['per_s']:6.0f} "
                        f"cancels/s  p50 {out['p50_ms']:.2f} ms  p99 {out['p99_ms']:.2f} ms  {out['outcomes']}")
        finally:
            unflushed.close()
        hmed = {c: {k: statistics.median(x[k] for x in v) for k in ("per_s", "p50_ms", "p99_ms")}
                for c, v in http_runs.items()}
        for c, v in hmed.items():
            name = {"sql": "cancel_timer SQL", UNFLUSHED: "cancel_timer SQL, synchronous_commit off"}.get(
                c, f"{c} client{'s' if c.startswith('4') else ''}")
            log(f"  median {name}: {v['per_s']:6.0f} cancels/s  p50 {v['p50_ms']:.3f} ms  p99 {v['p99_ms']:.2f} ms")
        # the shell's cost: DELETE's p50 at one client against cancel_timer's in SQL, both
        # from the blocks above (the SQL section's p50, minutes earlier, printed beside it)
        shell = hmed["1"]["p50_ms"] / hmed["sql"]["p50_ms"]
        per_round = [h["p50_ms"] / q["p50_ms"] for h, q in zip(http_runs["1"], http_runs["sql"])]
        log(f"  ratio DELETE p50 (1 client) / cancel_timer p50 (SQL): {shell:.2f} "
            f"({hmed['1']['p50_ms']:.3f} vs {hmed['sql']['p50_ms']:.3f} ms; per round "
            f"{', '.join(f'{x:.2f}' for x in per_round)}; against the SQL section's "
            f"{med['cancel_timer']['p50_ms']:.3f} ms: {hmed['1']['p50_ms'] / med['cancel_timer']['p50_ms']:.2f}) "
            f"(target <= {TARGET_DELETE_VS_SQL_P50}) {'met' if shell <= TARGET_DELETE_VS_SQL_P50 else 'MISSED'}")
        log(f"  the WAL flush's part: cancel_timer p50 {hmed['sql']['p50_ms']:.3f} ms, "
            f"{hmed[UNFLUSHED]['p50_ms']:.3f} ms with synchronous_commit off; the shell's own: DELETE p50 - SQL p50 "
            f"= {(hmed['1']['p50_ms'] - hmed['sql']['p50_ms']) * 1000:.0f} us")
        by_mode = flush_modes(http_runs, list(blocked))
        log(f"  by the WAL flush's mode, each side's blocks of {BLOCK} told by their own p50 (slow: more than "
            f"{SLOW_STEP_MS} ms past the side's fastest block): "
            + "; ".join(f"{label if label != '1' else 'DELETE'} {v['slow_blocks']} of {v['blocks']} slow, fast "
                        f"{v['fast_p50_ms']:.3f} / slow {v['slow_p50_ms'] or 0:.3f} ms"
                        for label, v in by_mode.items()))
        fast_ratio = by_mode["1"]["fast_p50_ms"] / by_mode["sql"]["fast_p50_ms"]
        log(f"  DELETE / cancel_timer in SQL with both in their fast mode: {fast_ratio:.2f}; the share of blocks in "
            f"the slow mode: DELETE {by_mode['1']['slow_blocks'] / by_mode['1']['blocks']:.0%}, SQL "
            f"{by_mode['sql']['slow_blocks'] / by_mode['sql']['blocks']:.0%}")
        old_client = hmed["1 asyncio"]["p50_ms"] / hmed["sql"]["p50_ms"]
        log(f"  the same with the asyncio-streams client of runs 1-14 (a run of its own, not in the blocks): "
            f"{old_client:.2f} ({hmed['1 asyncio']['p50_ms']:.3f} ms)")
        for name in variants:  # each variant's DELETE beside the same SQL blocks and the broker's
            v = http_runs[f"1 {name}"]
            vs_sql = [h["p50_ms"] / q["p50_ms"] for h, q in zip(v, http_runs["sql"])]
            broker_vs = [b["p50_ms"] / h["p50_ms"] for b, h in zip(http_runs["1"], v)]
            log(f"  ratio DELETE p50 via {name} / cancel_timer p50 (SQL): "
                f"{hmed[f'1 {name}']['p50_ms'] / hmed['sql']['p50_ms']:.2f} (per round "
                f"{', '.join(f'{x:.2f}' for x in vs_sql)}); the broker's DELETE p50 / {name}'s: "
                f"{hmed['1']['p50_ms'] / hmed[f'1 {name}']['p50_ms']:.2f} (per round "
                f"{', '.join(f'{x:.2f}' for x in broker_vs)})")
        res.put("cancel_http", n=http_n, rounds=rounds, ratio_p50_vs_sql=round(shell, 3),
                ratio_p50_vs_sql_asyncio_client=round(old_client, 3),
                ratio_p50_per_round=[round(x, 3) for x in per_round], ratio_p50_fast_modes=round(fast_ratio, 3),
                blocks_by_flush_mode=by_mode,
                median={f"{c}_clients": {k: round(x, 3) for k, x in v.items()} for c, v in hmed.items()},
                runs={f"{c}_clients": [{k: (round(x, 3) if isinstance(x, float) else x) for k, x in o.items()}
                                       for o in v] for c, v in http_runs.items()})

        log("  profile (untimed): pg_stat_statements with nested statements, auto_explain")
        report = profile(url, admin, min(n, 2000))
        for line in report[0].splitlines():
            log("  " + line)
        (OUT / "cancel-profile.txt").write_text("\n\n".join(report))
        log(f"  plans: {OUT / 'cancel-profile.txt'}")
        admin.execute("DELETE FROM queen.timers WHERE queue = %s", (QUEUE,))

        bench_under_load(url, broker, res, admin, load_rounds, load_seconds, fire_rate, cancel_rate,
                         list(load_clients), generator, variants)
