"""The sweeper: the fire loop that runs inside every broker.

Each cycle:
  1. fast path: queen.fire_due_timers(batch) on the sweeper's own connection
     (claim-and-fire in one transaction; the row lock is the claim), without
     its subtransaction: a duplicate txn fails the call, which is made again
     with the redo path;
  2. leased path: queen.claim_timers (at most QUEEN_SWEEPER_BATCH rows and
     QUEEN_SWEEPER_BATCH_BYTES stored bytes) -> inflate zstd payloads (bounded) ->
     queen.inflate_timers(claim_id, frames), called again whenever the inflated
     frames held reach QUEEN_SWEEPER_BATCH_BYTES: the rows now hold the bytes to
     fire, and the next cycle's fast path fires them with the plain rows of their
     partitions, in expiry order (migration 036);
  3. when a batch raises, isolate: fire the claimed rows one by one and call
     queen.fail_timer for the ones that fail, classified by SQLSTATE
     (transient: back off, no attempt spent; permanent/config: spend one);
  4. about once a second, queen.fold_pending_deltas: the pending-counter
     decrements (fire, cancel, DLQ) appended since are folded into the tenants'
     counter rows, so the delta table stays small (any number of brokers may
     fold at once: it skips what another holds and never waits);
  5. sleep: not at all after a full batch, otherwise until the next due timer
     as PostgreSQL computes it (queen.next_timer_due_ms), clamped to
     [QUEEN_SWEEPER_MIN_SLEEP_MS, QUEEN_SWEEPER_MAX_SLEEP_MS], and woken early by
     NOTIFY queen_timers when a timer is scheduled before the planned wake-up.

Any number of brokers may run this loop against one database: the claims
(SKIP LOCKED and leases) make it safe. Only an operator stops the fire
(queen.pause_fire); no automatic rung does. Python computes no stored instant.
"""

from __future__ import annotations

import asyncio
import logging
import time

import psycopg

from . import db, payloads
from .config import Settings
from .errors import classify_failure, is_read_only
from .metrics import Metrics, lag_summary_sql

log = logging.getLogger("queen_timers.sweeper")

# The fire functions answer one queen.fire_result row per timer; the sweeper
# needs only the counts and the lag histogram, so PostgreSQL folds them into one
# row (building a Python row per timer was ~40% of the broker's time, and one
# histogram observe() per timer ~15% after that): lag_summary_sql.
# The fair share's turn (the last tenant probed, queen.find_due_tenants) is the
# sweeper's, not the session's: behind a transaction pooler each call may run on
# another server connection, whose turn is another caller's. Each call passes it
# (p_turn) and reads the new one back in the same statement (migration 023).
TURN = "current_setting('queen.fire_turn', true) AS turn"
# No subtransaction on the common path: a txn already in its partition fails
# the call (autocommit: it rolls back whole) and the batch is fired again
# through the redo path, which answers 'duplicate' (FIRE_DUE_REDO).
FIRE_DUE = lag_summary_sql("SELECT * FROM queen.fire_due_timers(%s, p_redo_duplicates => false, p_turn => %s)",
                           TURN)
FIRE_DUE_REDO = lag_summary_sql("SELECT * FROM queen.fire_due_timers(%s, p_turn => %s)", TURN)
BLOCKED_ERROR = ("a frame of this tenant waited past 50 ms on another transaction of the tenant "
                 "(a queue, partition or txn it was writing) in this pass")
CLAIM = (f"SELECT c.*, {TURN} FROM queen.claim_timers(%s, %s, %s, p_zstd_only => %s, p_max_bytes => %s,"
         " p_turn => %s) c")
# the frames travel as four parallel arrays (no composite type to register on the connection)
FRAMES = """(SELECT array_agg(ROW(f.tenant, f.queue, f.timer_key, f.payload)::queen.fire_frame)
           FROM unnest(%s::text[], %s::text[], %s::text[], %s::bytea[]) AS f(tenant, queue, timer_key, payload))"""
FIRE = lag_summary_sql(f"SELECT * FROM queen.fire_timers(%s, {FRAMES})")
# The leased path's end (migration 036): the inflated bytes go into their rows, and the
# fast path fires them with the plain rows of their partitions, in expiry order (fired
# apart, a cycle's zstd frames went after all its plain ones). Its outcomes are
# 'inflated' or 'lost'.
INFLATE = lag_summary_sql(f"SELECT * FROM queen.inflate_timers(%s, {FRAMES})")
FAIL = "SELECT queen.fail_timer(%s, %s, %s, %s, %s, %s, %s, %s, %s) AS verdict"
FOLD = "SELECT queen.fold_pending_deltas(%s) AS n"
FOLD_EVERY_S = 1.0  # at most this often per broker
FOLD_LIMIT = 10000  # delta rows per call; another call follows at once while a call comes back full
FOLD_CALLS_MAX = 10  # calls per cycle, so a huge backlog cannot starve the fire
NEXT_DUE = "SELECT queen.next_timer_due_ms() AS ms, extract(epoch FROM clock_timestamp())::float8 AS db_now"

FAIL_KEYS = ("tenant", "queue", "timer_key", "claim_id")  # what _fail needs of a claimed row
LEASED_SKIPS_MAX = 3  # full fast cycles in a row that may skip an idle leased path
RECONNECT_MIN_S = 0.1
RECONNECT_MAX_S = 5.0
ERROR_TEXT_MAX = 2000


class FrameError(Exception):
    """The broker cannot build this timer's frame; carries the failure class."""

    def __init__(self, cls: str, message: str):
        super().__init__(message)
        self.cls = cls


def _connection_broken(conn: psycopg.AsyncConnection | None) -> bool:
    return conn is None or conn.closed or conn.broken


def _lost_primary(conn: psycopg.AsyncConnection | None, exc: BaseException) -> bool:
    """The failure is the connection's, not the batch's: the connection broke, or its
    server turned read-only (a standby after a switchover, a fenced primary). The loop
    drops both connections and reconnects; no row is blamed, no attempt is spent."""
    return _connection_broken(conn) or is_read_only(exc)


def _error_text(exc: BaseException) -> str:
    sqlstate = getattr(exc, "sqlstate", None)
    text = f"{type(exc).__name__}: {exc}".strip()
    if sqlstate:
        text = f"[{sqlstate}] {text}"
    return text[:ERROR_TEXT_MAX]


async def stop_loop_task(task: asyncio.Task | None, sleeping: bool, grace_s: float = 5) -> None:
    """Stop a broker's background loop whose stop flag is already set: cancel it at
    once when it sleeps, else let the cycle in flight finish its transaction (up to
    grace_s), then cancel it. Never raises: the loop's own errors are its to log."""
    if task is None:
        return
    if sleeping:
        task.cancel()
    try:
        await asyncio.wait_for(asyncio.shield(task), timeout=grace_s)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
    except Exception:
        pass


class Sweeper:
    def __init__(self, settings: Settings, metrics: Metrics | None = None):
        self.settings = settings
        self.metrics = metrics or Metrics()
        self._conn: psycopg.AsyncConnection | None = None
        self._listen: psycopg.AsyncConnection | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._sleeping = False
        self._leased_idle = False
        self._leased_skips = 0
        self._next_fold = 0.0
        self._turn = ""  # the fair share's turn ('': from the first tenant), see TURN
        self.cycles = 0

    # ------------------------------------------------------------------
    # lifecycle

    async def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.create_task(self._run(), name="queen-sweeper")

    async def stop(self) -> None:
        task, self._task = self._task, None
        self._stopping = True
        await stop_loop_task(task, self._sleeping)
        await self._close()

    async def _close(self) -> None:
        for conn in (self._conn, self._listen):
            if conn is not None:
                try:
                    await conn.close()
                except Exception:  # closing a broken connection may itself fail; nothing to do
                    pass
        self._conn = self._listen = None

    async def _connect(self) -> None:
        if _connection_broken(self._conn):
            # QUEEN_DIRECT_DATABASE_URL, when set: the fire's one connection needs no pooler
            self._conn = await db.connect(self.settings, "sweeper", self.settings.direct_database_url)
        url = self.settings.listen_url
        if _connection_broken(self._listen) and url is not None:
            self._listen = None
            try:
                listen = await db.connect(self.settings, "sweeper-listen", url)
                await listen.execute("LISTEN queen_timers")
                self._listen = listen
            except psycopg.Error as exc:
                # without LISTEN the sweeper still fires, just on its own schedule
                log.warning("sweeper %s: LISTEN queen_timers failed (%s); polling only",
                            self.settings.broker_id, _error_text(exc))

    # ------------------------------------------------------------------
    # the loop

    async def _run(self) -> None:
        delay = RECONNECT_MIN_S
        down_since: float | None = None
        while not self._stopping:
            try:
                await self._connect()
                if down_since is not None:
                    log.info("sweeper %s: database reachable again", self.settings.broker_id)
                    down_since = None
                full = await self.cycle()
                delay = RECONNECT_MIN_S
                if self._stopping:
                    break
                if full:
                    await asyncio.sleep(0)  # let the HTTP side breathe between full batches
                    continue
                await self._sleep()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the loop must survive anything: log, reconnect, back off
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning("sweeper %s: cycle failed (%s); retrying with backoff",
                                self.settings.broker_id, _error_text(exc))
                else:
                    log.debug("sweeper %s: still failing (%s)", self.settings.broker_id, _error_text(exc))
                if _lost_primary(self._conn, exc) or isinstance(exc, psycopg.OperationalError):
                    await self._close()
                if self._stopping:
                    break
                self._sleeping = True
                try:
                    await asyncio.sleep(delay)
                finally:
                    self._sleeping = False
                delay = min(delay * 2, RECONNECT_MAX_S)

    async def cycle(self) -> bool:
        """One pass of both fire paths. True when a batch came back full (loop again at once)."""
        self.cycles += 1
        batch = self.settings.sweeper_batch
        isolate = False
        fast = 0
        try:
            try:
                summary = (await self._fetch(FIRE_DUE, (batch, self._turn)))[0]
            except (psycopg.errors.UniqueViolation, psycopg.errors.LockNotAvailable):
                # a duplicate, or a frame that waited 50 ms on its own tenant's transaction:
                # the redo path answers the one and fires tenant by tenant for the other
                summary = (await self._fetch(FIRE_DUE_REDO, (batch, self._turn)))[0]
            self._turn = summary["turn"]
            fast = self.metrics.observe_fires(summary)
        except Exception as exc:
            if _lost_primary(self._conn, exc):
                raise
            # one poison row fails the whole batch: fire them one by one below
            log.warning("sweeper %s: fire_due_timers failed (%s, %s); isolating row by row",
                        self.settings.broker_id, classify_failure(exc), _error_text(exc))
            isolate = True
        if time.monotonic() >= self._next_fold:
            await self._fold()
        if fast >= batch and not isolate and self._leased_idle and self._leased_skips < LEASED_SKIPS_MAX:
            # a backlog of plain timers and no zstd one last time: spare the claim round
            # trip for a few full cycles (a zstd timer waits at most that many batches)
            self._leased_skips += 1
            return True
        self._leased_skips = 0
        claimed, full = await self._leased(batch, isolate=isolate)
        self._leased_idle = claimed == 0
        return fast >= batch or full

    async def _leased(self, batch: int, *, isolate: bool) -> tuple[int, bool]:
        """Claim with a lease, build the frames, fire. Returns how many rows were claimed,
        and whether the claim was cut by QUEEN_SWEEPER_BATCH or QUEEN_SWEEPER_BATCH_BYTES
        (more may be due: loop again at once).

        Normally only zstd rows are claimed (the fast path took the others); when
        isolating a failed fast batch, every due row is, to be fired one by one.
        Memory: the claimed rows hold at most QUEEN_SWEEPER_BATCH_BYTES of stored
        payload (plus one row; twice that behind a backlog, when the claim adds the
        other tenants' shares under a second bound), and the inflated frames are fired whenever they reach
        that many bytes, so a batch of 1 MiB payloads never sits in memory at once."""
        s = self.settings
        max_bytes = s.sweeper_batch_bytes
        rows = await self._fetch(CLAIM, (s.broker_id, batch, s.sweeper_lease_ms, not isolate, max_bytes, self._turn))
        if not rows:
            return 0, False
        self._turn = rows[0]["turn"]
        full = len(rows) >= batch or sum(len(r["payload"]) for r in rows) >= max_bytes
        claim_id = rows[0]["claim_id"]
        blocked: set[str] = set()
        chunk: list[tuple[dict, tuple]] = []
        held = inflated = 0
        for i, row in enumerate(rows):
            rows[i] = None  # the stored bytes go as soon as the frame is built
            try:
                frame = self._frame(row)
            except FrameError as exc:
                await self._fail(row, exc.cls, str(exc))
                continue
            item = ({k: row[k] for k in FAIL_KEYS}, frame)  # not the stored payload
            if isolate:  # isolating a failed fast batch: every row on its own
                await self._fire_frames_one_by_one(claim_id, [item], blocked)
                continue
            chunk.append(item)
            held += len(frame[3]) if frame[3] is not None else 0
            if held >= max_bytes:
                inflated += await self._inflate_chunk(claim_id, chunk)
                chunk, held = [], 0
        if chunk:
            inflated += await self._inflate_chunk(claim_id, chunk)
        # rows inflated are due rows of the fast path now: the next cycle comes at once
        return len(rows), full or inflated > 0

    async def _inflate_chunk(self, claim_id, chunk: list[tuple[dict, tuple]]) -> int:
        """inflate_timers for one chunk of built frames (how many it inflated); when it raises,
        the chunk's rows are fired one by one instead (fire_timers), as before migration 036."""
        try:
            summary = await self._fire(claim_id, [f for _, f in chunk], INFLATE)
            self.metrics.observe_fires(summary)  # its 'lost' ones
            return summary["n"] - summary["lost"]
        except Exception as exc:
            if _lost_primary(self._conn, exc):
                raise
            log.warning("sweeper %s: inflate_timers batch of %d failed (%s); firing row by row",
                        self.settings.broker_id, len(chunk), _error_text(exc))
        await self._fire_frames_one_by_one(claim_id, chunk)
        return 0

    async def _fire_frames_one_by_one(self, claim_id, frames: list[tuple[dict, tuple]],
                                      blocked: set[str] | None = None) -> None:
        """Each frame in its own fire_timers call; a failure is that row's (backoff or DLQ).
        `blocked`: tenants whose frame waited past fire_timers' lock_timeout in this pass
        (their own transaction holds what the frame needs); their other rows back off at
        once instead of each waiting 50 ms again."""
        blocked = set() if blocked is None else blocked
        for row, frame in frames:
            if row["tenant"] in blocked:
                await self._fail(row, "transient", BLOCKED_ERROR)
                continue
            try:
                summary = await self._fire(claim_id, [frame])
            except Exception as exc:
                if _lost_primary(self._conn, exc):
                    raise
                if isinstance(exc, psycopg.errors.LockNotAvailable):
                    blocked.add(row["tenant"])
                await self._fail(row, classify_failure(exc), _error_text(exc))
                continue
            self.metrics.observe_fires(summary)

    async def _fold(self) -> None:
        """Fold pending-counter deltas into the counter rows (bounded; a failure is logged and counted)."""
        self._next_fold = time.monotonic() + FOLD_EVERY_S
        try:
            for _ in range(FOLD_CALLS_MAX):
                n = (await self._fetch(FOLD, (FOLD_LIMIT,)))[0]["n"]
                self.metrics.deltas_folded.inc(n)
                if n < FOLD_LIMIT:
                    break
        except Exception as exc:
            self.metrics.fold_failures.inc()
            if _lost_primary(self._conn, exc) or _connection_broken(self._conn):
                raise
            log.warning("sweeper %s: fold_pending_deltas failed (%s); next try in %.0f s",
                        self.settings.broker_id, _error_text(exc), FOLD_EVERY_S)

    def _frame(self, row: dict) -> tuple:
        """The queen.fire_frame for a claimed row: payload NULL = the stored bytes."""
        key = (row["tenant"], row["queue"], row["timer_key"])
        if not row["payload_zstd"]:
            return (*key, None)
        stored = bytes(row["payload"])
        if row["encrypted"]:
            # encryption happens at schedule; a zstd payload sealed in an envelope
            # must be opened, inflated and sealed again
            enc_key = self.settings.encryption_key
            if enc_key is None:
                raise FrameError("config", "timer payload is encrypted zstd but QUEEN_ENCRYPTION_KEY is not set")
            try:
                stored = payloads.decrypt(enc_key, stored)
            except payloads.PayloadError as exc:
                raise FrameError("config", f"cannot open the encrypted payload: {exc}") from None
        try:
            data, over = payloads.inflate(stored, payloads.ABSOLUTE_CEILING)
        except payloads.PayloadError as exc:
            raise FrameError("permanent", str(exc)) from None
        if over:
            raise FrameError("permanent",
                             f"payload inflates beyond {payloads.ABSOLUTE_CEILING} bytes; refusing to fire it")
        if row["encrypted"]:
            data = payloads.encrypt(self.settings.encryption_key, data)
        return (*key, data)

    async def _fail(self, row: dict, cls: str, error: str) -> None:
        s = self.settings
        res = await self._fetch(FAIL, (row["tenant"], row["queue"], row["timer_key"], row["claim_id"], cls,
                                       error, s.sweeper_max_attempts, s.sweeper_backoff_ms,
                                       s.sweeper_backoff_max_ms))
        verdict = res[0]["verdict"]
        self.metrics.observe_failure(cls, verdict)
        log_fn = log.warning if verdict == "dead_lettered" else log.info
        log_fn("sweeper %s: timer %s/%s failed (%s): %s -> %s", s.broker_id, row["queue"], row["timer_key"],
               cls, error, verdict)

    async def _fire(self, claim_id, frames: list[tuple], sql: str = FIRE) -> dict:
        cols = list(zip(*frames))
        rows = await self._fetch(sql, (claim_id, list(cols[0]), list(cols[1]), list(cols[2]), list(cols[3])))
        return rows[0]

    async def _fetch(self, sql: str, params: tuple) -> list[dict]:
        assert self._conn is not None
        return await db.fetch_bounded(self._conn, self.settings, sql, params)

    # ------------------------------------------------------------------
    # the adaptive sleep

    async def _sleep(self) -> None:
        s = self.settings
        row = (await self._fetch(NEXT_DUE, ()))[0]
        local_at = time.monotonic()
        due_ms = row["ms"]
        wait_ms = s.sweeper_max_sleep_ms if due_ms is None else due_ms
        wait_ms = min(max(wait_ms, s.sweeper_min_sleep_ms), s.sweeper_max_sleep_ms)
        if s.listen_url is None:
            # behind a transaction pooler with no direct URL no NOTIFY can wake it:
            # poll at the minimum sleep (a timer fires up to that much late)
            wait_ms = s.sweeper_min_sleep_ms
        deadline = local_at + wait_ms / 1000
        self._sleeping = True
        try:
            await self._wait_until(deadline, row["db_now"], local_at)
        finally:
            self._sleeping = False

    async def _wait_until(self, deadline: float, db_now: float, local_at: float) -> None:
        """Sleep until deadline (monotonic), or earlier when a NOTIFY names an earlier due time.

        The NOTIFY payload is PostgreSQL's epoch of the soonest deliver_at; it is compared with
        PostgreSQL's own clock as read before the sleep, plus the time elapsed since.
        """
        min_s = self.settings.sweeper_min_sleep_ms / 1000
        while not self._stopping:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            if self._listen is None or _connection_broken(self._listen):
                await asyncio.sleep(remaining)
                return
            try:
                async for note in self._listen.notifies(timeout=remaining, stop_after=1):
                    try:
                        due_epoch = float(note.payload)
                    except ValueError:
                        due_epoch = db_now  # unknown payload: treat as due now
                    due_in = due_epoch - db_now  # seconds after the moment next_timer_due_ms was read
                    # never sooner than the minimum sleep after the sleep began
                    wake = local_at + max(due_in, min_s)
                    if wake < deadline:
                        deadline = wake
            except psycopg.Error as exc:
                log.warning("sweeper %s: LISTEN connection lost (%s)", self.settings.broker_id, _error_text(exc))
                listen, self._listen = self._listen, None
                try:
                    await listen.close()
                except Exception:
                    pass
