"""queen-timers: the command line of an operator or a DBA.

    queen-timers serve                      the broker (HTTP + sweeper); `python -m queen_timers` runs it
    queen-timers migrate [apply|status|check]
    queen-timers status                     switches, pending per queue, next due, dead letters
    queen-timers schedule QUEUE KEY ...     or --file rows.jsonl, in batches of QUEEN_TIMERS_MAX_OPS
    queen-timers cancel|peek QUEUE KEY
    queen-timers list QUEUE
    queen-timers dlq

Every subcommand but `serve` talks to PostgreSQL alone: no broker needs to run. Timer
commands call the same queen.* functions as the HTTP routes, with the same shape checks,
zstd bound and encryption (routes_timers.py, payloads.py). Exit codes: 0 done, 1 refused,
not found, not ok or failed, 2 bad arguments or bad input (nothing written).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import re
import socket
import sys
from datetime import datetime
from typing import Any, Callable, Iterable
from uuid import UUID

from . import __version__, payloads
from .config import ConfigError, Settings
from .errors import SQLSTATE_HTTP, ApiError
from .limits import INT32_MAX, INT64_MAX, INT64_MIN

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
TIMER_DLQ_GROUP = "__QUEEN_TIMERS__"
# a stop: how long past QUEEN_SHUTDOWN_TIMEOUT_MS a request in its database call may go on
# (the default statement timeout, 5 s, and a second) before uvicorn cancels it
STOP_GRACE_S = 6

# `status` reads: per-queue timer counts from queen.get_timer_stats (the
# numbers the dashboard shows; one bucket, the histogram is not printed) and
# dead letters per queue of the same tenant (a plain read; every write is a
# queen.* function call).
QUEUE_TIMERS_SQL = "SELECT * FROM queen.get_timer_stats(%s, 1, 1)"
QUEUE_DLQ_SQL = """
SELECT q.name AS queue, count(*) AS dlq,
       count(*) FILTER (WHERE d.consumer_group = %s) AS timer_dlq
  FROM queen.dead_letter_queue d
  JOIN queen.partitions p ON p.id = d.partition_id
  JOIN queen.queues q ON q.id = p.queue_id
 WHERE q.tenant = %s
 GROUP BY q.name
"""


class CliError(Exception):
    """A failure to report as {"error", "detail"} with an exit code."""

    def __init__(self, error: str, detail: str, code: int = EXIT_FAIL):
        super().__init__(f"{error}: {detail}")
        self.error = error
        self.detail = detail
        self.code = code


# ---------------------------------------------------------------------------
# output helpers
# ---------------------------------------------------------------------------

def _iso(value: datetime | None) -> str | None:
    from .routes_timers import iso
    return iso(value)


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return _iso(value)
    if isinstance(value, UUID):
        return str(value)
    if isinstance(value, (bytes, memoryview)):
        return payloads.encode_base64(bytes(value))
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def emit_json(value: Any) -> None:
    print(json.dumps(_jsonable(value), indent=2, ensure_ascii=False))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, datetime):
        return _iso(value)
    return str(value).replace("\n", "\\n")


def emit_table(headers: list[str], rows: Iterable[Iterable[Any]], out=None) -> None:
    out = out or sys.stdout
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(), file=out)
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip(), file=out)


def _printable_text(data: bytes) -> str | None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if all(c.isprintable() or c in "\n\t" for c in text) else None


class Progress:
    """A counter on stderr. Shown when stderr is a terminal, or always with --progress
    (one line per step when stderr is not a terminal); never with --no-progress."""

    def __init__(self, label: str, total: int, wanted: bool | None, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.enabled = self.tty if wanted is None else wanted
        self.label = label
        self.total = total
        self.shown = False

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        pct = 100 * done // self.total if self.total else 100
        line = f"{self.label} {done}/{self.total} ({pct}%)"
        if self.tty:
            self.stream.write("\r" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.shown = True

    def note(self, text: str) -> None:
        if self.enabled:
            self.stream.write(text + "\n")
            self.stream.flush()

    def finish(self) -> None:
        if self.enabled and self.tty and self.shown:
            self.stream.write("\n")
            self.stream.flush()


# ---------------------------------------------------------------------------
# database
# ---------------------------------------------------------------------------

def _redact(url: str) -> str:
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def database_url(args: argparse.Namespace) -> str:
    url = getattr(args, "database_url", None) or os.environ.get("QUEEN_DATABASE_URL")
    if not url:
        raise CliError("no_database_url",
                       "no database URL: pass --database-url or set QUEEN_DATABASE_URL", EXIT_USAGE)
    return url


def settings_for(args: argparse.Namespace) -> Settings:
    """The broker's settings (horizon, tenancy, max ops, encryption key) from QUEEN_*,
    so the CLI applies the same limits as a broker of the cell."""
    env = {**os.environ, "QUEEN_DATABASE_URL": database_url(args)}
    try:
        return Settings.from_env(env)
    except ConfigError as exc:
        raise CliError("bad_configuration", str(exc), EXIT_USAGE) from None


def connect(url: str):
    import psycopg
    from psycopg.rows import dict_row
    try:
        # no server-side prepared statement: a transaction pooler may be between (QUEEN_POOL_MODE)
        return psycopg.connect(url, autocommit=True, row_factory=dict_row, prepare_threshold=None,
                               application_name="queen-timers-cli", connect_timeout=10)
    except psycopg.Error as exc:
        raise CliError("timers_unavailable",
                       f"cannot connect to {_redact(url)}: {str(exc).strip()}") from None


def _from_database_error(exc: Exception) -> CliError | None:
    import psycopg
    if isinstance(exc, psycopg.Error):
        if exc.sqlstate in SQLSTATE_HTTP:
            return CliError(SQLSTATE_HTTP[exc.sqlstate][1],
                            exc.diag.message_detail or exc.diag.message_primary or "")
        if exc.sqlstate in ("3F000", "42883", "42P01"):  # no schema, function or table
            return CliError("not_migrated", "the queen schema is missing or older than this code: "
                            f"run `queen-timers migrate` ({str(exc).strip()})")
        return CliError("timers_unavailable", f"database error: {str(exc).strip()}")
    return None


# ---------------------------------------------------------------------------
# serve
# ---------------------------------------------------------------------------

def _check_request_connection(settings: Settings) -> None:
    """One connection made as the request pool makes them, before serving. The migrations
    connect without startup options; the pool sends the statement timeout as one (`options`),
    which a transaction pooler refuses: behind pgbouncer without QUEEN_POOL_MODE=transaction
    the broker started and answered 503 to every request, the cause only in its log (Dec 7
    audit). Now it does not start, and says what to set."""
    import psycopg

    from .db import connect_kwargs, conninfo
    kwargs = connect_kwargs(settings, "queen-timers-start-check")
    if "options" not in kwargs:
        return
    try:
        psycopg.connect(conninfo(settings.database_url, settings), **kwargs).close()
    except psycopg.Error as exc:
        text = str(exc).strip()
        if "unsupported startup parameter" in text:
            raise CliError("bad_configuration",
                           f"{_redact(settings.database_url)} refused the startup parameter `options` ({text}): "
                           "it is a transaction pooler (pgbouncer); set QUEEN_POOL_MODE=transaction "
                           "(docs/pgbouncer.md)") from None
        raise _at_database(settings, exc) from None


# What tells one database from another: its name, its queen schema's OID and its server's
# start (the same through a pooler, a HAProxy or a multi-host URL that reach one primary).
_IDENTITY = ("SELECT current_database(), (SELECT oid FROM pg_namespace WHERE nspname = 'queen'), "
             "pg_postmaster_start_time()")


def _check_other_urls(settings: Settings) -> None:
    """QUEEN_DIRECT_DATABASE_URL and QUEEN_READ_DATABASE_URL connected once before serving.
    A direct URL that could not connect, or named another database, started a broker that
    answered healthy while its sweeper failed every cycle or fired another database's timers;
    a read URL that could not connect, one 503 per peek and list (Dec 7 audit)."""
    import psycopg

    from .db import conninfo
    if not (settings.direct_database_url or settings.read_database_url):
        return

    def identity(url: str, variable: str):
        try:
            with psycopg.connect(conninfo(url, settings), autocommit=True,
                                 application_name="queen-timers-start-check") as conn:
                row = conn.execute(_IDENTITY).fetchone()
                version = conn.execute("SELECT max(version) FROM queen.schema_migrations").fetchone()[0] \
                    if row[1] is not None else None
                return row, version
        except psycopg.Error as exc:
            mapped = _from_database_error(exc)
            detail = mapped.detail if mapped is not None else str(exc).strip()
            raise CliError("timers_unavailable", f"{variable} {_redact(url)}: {detail}") from None

    main, _ = identity(settings.database_url, "QUEEN_DATABASE_URL")
    if settings.direct_database_url:
        direct, _ = identity(settings.direct_database_url, "QUEEN_DIRECT_DATABASE_URL")
        if direct != main:
            raise CliError("bad_configuration",
                           f"QUEEN_DIRECT_DATABASE_URL {_redact(settings.direct_database_url)} reaches database "
                           f"{direct[0]!r}, not the one QUEEN_DATABASE_URL reaches ({main[0]!r} on the same "
                           "server): the sweeper and retention would work on another database", EXIT_USAGE)
    if settings.read_database_url:
        read, version = identity(settings.read_database_url, "QUEEN_READ_DATABASE_URL")
        if read[0] != main[0] or version is None:
            raise CliError("bad_configuration",
                           f"QUEEN_READ_DATABASE_URL {_redact(settings.read_database_url)} reaches database "
                           f"{read[0]!r}{' without the queen schema' if version is None else ''}, not a copy of "
                           f"{main[0]!r}: peek and list would read another database", EXIT_USAGE)


def _check_listen(settings: Settings) -> None:
    """QUEEN_HOST resolves and QUEEN_PORT is free there, before the migrations: a bad host or a
    port in use failed after them, in uvicorn's words and exit code (3), naming neither."""
    try:
        infos = socket.getaddrinfo(settings.host, settings.port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise CliError("bad_configuration", f"QUEEN_HOST {settings.host!r} does not resolve: {exc.strerror}",
                       EXIT_USAGE) from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            raise CliError("timers_unavailable", f"cannot listen on QUEEN_HOST {settings.host} QUEEN_PORT "
                           f"{settings.port}: {exc.strerror}") from None


def _at_database(settings: Settings, exc: Exception) -> Exception:
    """A database failure at start, as its CliError naming the (redacted) URL; exc itself
    when it is not a database error (a bug: raised as it is)."""
    mapped = _from_database_error(exc)
    if mapped is None:
        return exc
    mapped.detail = f"{_redact(settings.database_url)}: {mapped.detail}"
    return mapped


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app
    from .db import conninfo
    from .migrate import migrate
    from .server import JsonErrorHttpToolsProtocol, fit_open_files

    env = dict(os.environ)
    if args.database_url:
        env["QUEEN_DATABASE_URL"] = args.database_url
    if args.host:
        env["QUEEN_HOST"] = args.host
    if args.port is not None:
        env["QUEEN_PORT"] = str(args.port)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        settings = Settings.from_env(env)
    except ConfigError as exc:
        raise CliError("bad_configuration", str(exc), EXIT_USAGE) from None
    _check_listen(settings)
    from .migrate import MigrationError
    try:
        # on the primary: the same multi-host rule and bounded connect as every broker connection
        applied = migrate(conninfo(settings.database_url, settings),
                          found=lambda said: logging.getLogger("queen_timers").info("database: %s", said))
    except MigrationError as exc:
        raise CliError("migration_refused", str(exc)) from None
    except Exception as exc:
        failure = _at_database(settings, exc)
        if failure is exc:
            raise
        raise failure from None
    if applied:
        logging.getLogger("queen_timers").info("applied migrations %s", applied)
    _check_request_connection(settings)
    _check_other_urls(settings)
    settings = fit_open_files(settings)  # QUEEN_MAX_CONNECTIONS within RLIMIT_NOFILE
    # httptools (llhttp, C) and uvloop: the request path's parsing and event loop in C
    # (bench/history/2026-12-03-cancel-issue-12.md); server.py keeps the JSON 400 and the 16 KiB head limit
    app = create_app(settings)
    # What is alive now (modules, the app) lives as long as the process: the
    # collector stops walking it (freeze), and its youngest generation runs every
    # 10,000 allocations instead of 700 (a 256-op batch makes about 1,000
    # containers, freed by reference counts). With the defaults, gc took 3.5 %
    # of the broker's CPU under bulk POSTs.
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    uvicorn.run(app, host=settings.host, port=settings.port,
                log_level="warning", access_log=False, loop="uvloop",
                http=JsonErrorHttpToolsProtocol.with_timeouts(settings.head_timeout_ms / 1000,
                                                              settings.send_timeout_ms / 1000,
                                                              settings.shutdown_timeout_ms / 1000,
                                                              settings.send_min_bytes_per_s),
                limit_concurrency=settings.max_connections,
                # the last resort of a stop: server.py ends what clients hold at
                # QUEEN_SHUTDOWN_TIMEOUT_MS; a request still in its database call
                # STOP_GRACE_S later is cancelled
                timeout_graceful_shutdown=settings.shutdown_timeout_ms / 1000 + STOP_GRACE_S,
                # nothing reads the client's address: X-Forwarded-For is not rewritten into it
                proxy_headers=False)
    return EXIT_OK


# ---------------------------------------------------------------------------
# migrate
# ---------------------------------------------------------------------------

def cmd_migrate(args: argparse.Namespace) -> int:
    from . import migrate as m

    url = database_url(args)
    try:
        if args.action == "status":
            rows = m.status(url)
            if args.json:
                emit_json(rows)
            else:
                emit_table(["version", "name", "state", "applied_at"],
                           [(f"{r['version']:03d}", r["name"], r["state"], r["applied_at"]) for r in rows])
            return EXIT_OK
        if args.action == "check":
            ok, detail = m.check(url)
            if args.json:
                emit_json({"ok": ok, "detail": detail})
            else:
                print(detail, file=sys.stdout if ok else sys.stderr)
            return EXIT_OK if ok else EXIT_FAIL
        total = sum(1 for r in m.status(url) if r["state"] == "pending")
        progress = Progress("migrations applied", total, args.progress)
        count = 0

        def step(event: str, version: int, name: str) -> None:
            nonlocal count
            if event == "start":
                progress.note(f"applying {version:03d}_{name} ...")
            else:
                count += 1
                progress.update(count)

        applied = m.migrate(url, progress=step, found=lambda said: progress.note(said))
        progress.finish()
        ok, detail = m.check(url)
        if args.json:
            emit_json({"applied": applied, "ok": ok, "detail": detail})
        else:
            names = ", ".join(f"{v:03d}" for v in applied)
            print(f"applied {names}; {detail}" if applied else detail)
        return EXIT_OK if ok else EXIT_FAIL
    except m.MigrationError as exc:
        raise CliError("migration_refused", str(exc)) from None
    except Exception as exc:
        mapped = _from_database_error(exc)
        if mapped is None:
            raise
        raise mapped from None


# ---------------------------------------------------------------------------
# status
# ---------------------------------------------------------------------------

def read_status(conn, tenant: str) -> dict:
    """The cell's switches, pending count and next due time, and the tenant's
    timers and dead letters per queue."""
    switches = conn.execute("SELECT * FROM queen.get_timer_status()").fetchone()
    next_due = conn.execute("SELECT queen.next_timer_due_ms() AS ms").fetchone()["ms"]
    queues: dict[str, dict] = {}

    def row(name: str) -> dict:
        return queues.setdefault(name, {"queue": name, "pending": 0, "due": 0, "claimed": 0, "retrying": 0,
                                        "nextDeliverAt": None, "dlq": 0, "timerDlq": 0})

    for r in conn.execute(QUEUE_TIMERS_SQL, (tenant,)).fetchall():
        q = row(r["queue"])
        q.update(pending=r["pending"], due=r["due"], claimed=r["claimed"], retrying=r["retrying"],
                 nextDeliverAt=_iso(r["next_deliver_at"]))
    for r in conn.execute(QUEUE_DLQ_SQL, (TIMER_DLQ_GROUP, tenant)).fetchall():
        row(r["queue"]).update(dlq=r["dlq"], timerDlq=r["timer_dlq"])
    dlq_total = conn.execute("SELECT queen.count_dlq(%s) AS n", (tenant,)).fetchone()["n"]
    return {
        "schedulingPaused": switches["scheduling_paused"],
        "firePaused": switches["fire_paused"],
        "pending": switches["pending"],
        "nextDueMs": next_due,
        "tenant": tenant,
        "tenantPending": sum(q["pending"] for q in queues.values()),
        "dlq": dlq_total,
        "queues": [queues[k] for k in sorted(queues)],
    }


def cmd_status(args: argparse.Namespace) -> int:
    with _db(args) as conn:
        status = _guard(lambda: read_status(conn, args.tenant))
    if args.json:
        emit_json(status)
        return EXIT_OK
    if status["firePaused"]:
        next_due = "fire paused"
    elif status["nextDueMs"] is None:
        next_due = "nothing waiting"
    elif status["nextDueMs"] == 0:
        next_due = "now"
    else:
        next_due = f"in {status['nextDueMs'] / 1000:.3f} s"
    emit_table(["what", "value"], [
        ("scheduling", "paused" if status["schedulingPaused"] else "running"),
        ("fire", "paused" if status["firePaused"] else "running"),
        ("pending", status["pending"]),
        ("next due", next_due),
        ("tenant", status["tenant"]),
        ("its pending", status["tenantPending"]),
        ("its dead letters", status["dlq"]),
    ])
    if status["queues"]:
        print()
        emit_table(["queue", "pending", "due", "claimed", "retrying", "next_deliver_at", "dlq", "timer_dlq"],
                   [(q["queue"], q["pending"], q["due"], q["claimed"], q["retrying"], q["nextDeliverAt"],
                     q["dlq"], q["timerDlq"]) for q in status["queues"]])
    return EXIT_OK


# ---------------------------------------------------------------------------
# schedule / cancel / peek / list / dlq
# ---------------------------------------------------------------------------

class _db:
    """`with _db(args) as conn`: a connection, with database errors turned into CliError."""

    def __init__(self, args: argparse.Namespace):
        self.url = database_url(args)

    def __enter__(self):
        self.conn = connect(self.url)
        return self.conn

    def __exit__(self, *exc):
        self.conn.close()
        return False


def _guard(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except CliError:
        raise
    except Exception as exc:
        mapped = _from_database_error(exc)
        if mapped is None:
            raise
        raise mapped from None


def _api_error(exc: ApiError, lines: list[int] | None = None) -> CliError:
    detail = exc.detail or exc.error
    if lines is not None:  # --file: name the line
        detail = re.sub(r"^operation (\d+): ", lambda m: f"line {lines[int(m.group(1))]}: ", detail)
    else:  # the one operation of the command line
        detail = re.sub(r"^operation 0: ", "", detail)
    code = EXIT_USAGE if exc.status == 400 else EXIT_FAIL
    return CliError(exc.error, detail, code)


def _read_ops_file(path: str) -> tuple[list[dict], list[int]]:
    """The operations of a JSON Lines file (one HTTP operation object a line; `op`
    defaults to schedule), and the line number of each."""
    try:
        handle = sys.stdin if path == "-" else open(path, encoding="utf-8")
    except OSError as exc:
        raise CliError("timers_bad_request", f"cannot read {path}: {exc.strerror}", EXIT_USAGE) from None
    ops, lines = [], []
    with handle:
        try:
            for n, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    op = json.loads(line)
                except ValueError:
                    raise CliError("timers_bad_request", f"line {n}: not valid JSON", EXIT_USAGE) from None
                if isinstance(op, dict):
                    op.setdefault("op", "schedule")
                ops.append(op)
                lines.append(n)
        except UnicodeDecodeError:
            raise CliError("timers_bad_request", f"{path} is not UTF-8 text", EXIT_USAGE) from None
    if not ops:
        raise CliError("timers_bad_request", f"{path} holds no operations", EXIT_USAGE)
    return ops, lines


def _single_op(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    if args.queue is None or args.key is None:
        parser.error("give QUEUE and KEY, or --file")
    if args.delay_ms is None:
        parser.error("--delay-ms is required")
    if args.txn is None and not args.reschedule:
        parser.error("--txn is required for schedule (a reschedule without one gets a fresh txn)")
    if args.payload is None and args.payload_base64 is None:
        parser.error("one of --payload or --payload-base64 is required")
    if args.payload is not None:
        payload = payloads.encode_base64(args.payload.encode("utf-8"))
    else:
        payload = args.payload_base64
    op = {"op": "reschedule" if args.reschedule else "schedule", "queue": args.queue,
          "timerKey": args.key, "delayMs": args.delay_ms, "payload": payload}
    if args.txn is not None:
        op["txn"] = args.txn
    if args.partition is not None:
        op["partition"] = args.partition
    if args.zstd:
        op["payloadZstd"] = True
    return op


def _verdict(r: dict) -> dict:
    return {"ok": r["ok"], "status": r["status"], "queue": r["queue"], "timerKey": r["timer_key"],
            "txn": r["txn"], "messageId": _jsonable(r["message_id"]), "deliverAt": _iso(r["deliver_at"])}


def cmd_schedule(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .routes_timers import ENCRYPTING_QUEUES_SQL, SCHEDULE_SQL, _encrypt_ops, _parse_ops, _schedule_call

    if args.file is not None:
        if args.queue is not None or args.key is not None:
            parser.error("--file takes no QUEUE KEY")
        given = [f for f in ("delay_ms", "txn", "payload", "payload_base64", "partition")
                 if getattr(args, f) is not None] + [f for f in ("zstd", "reschedule") if getattr(args, f)]
        if given:
            parser.error(f"--file takes its fields from the file, not --{given[0].replace('_', '-')}")
        raw_ops, lines = _read_ops_file(args.file)
    else:
        raw_ops, lines = [_single_op(args, parser)], None
    settings = settings_for(args)

    # Every operation is checked (shape, base64, zstd bound) before anything is sent.
    try:
        ops = _parse_ops({"operations": raw_ops}, max(len(raw_ops), 1))
    except ApiError as exc:
        raise _api_error(exc, lines) from None

    verdicts: list[dict] = []
    with _db(args) as conn:
        def encrypt() -> None:
            upserts = sorted({o["queue"] for o in ops if o["op"] != "cancel"})
            if upserts:
                encrypting = {r["name"] for r in conn.execute(ENCRYPTING_QUEUES_SQL,
                                                              (args.tenant, upserts)).fetchall()}
                _encrypt_ops(ops, encrypting, settings.encryption_key)

        try:
            _guard(encrypt)
        except ApiError as exc:
            raise _api_error(exc, lines) from None

        size = settings.timers_max_ops
        progress = Progress("operations sent", len(ops), args.progress)
        for start in range(0, len(ops), size):
            batch = ops[start:start + size]
            params = _schedule_call(batch, args.tenant, None, settings)  # the route's (the bytes inline)
            try:
                rows = _guard(lambda: conn.execute(SCHEDULE_SQL, params).fetchall())
            except CliError as exc:
                progress.finish()
                if start:
                    exc.detail += (f" (batch of operations {start + 1}-{start + len(batch)} refused; "
                                   f"the {start} operations before it were written)")
                raise
            verdicts.extend(_verdict(r) for r in rows)
            progress.update(len(verdicts))
        progress.finish()

    if args.json:
        emit_json({"results": verdicts})  # the envelope of POST /api/v1/timers
    else:
        _print_verdicts(verdicts)
    return EXIT_OK if all(v["ok"] for v in verdicts) else EXIT_FAIL


def _print_verdicts(verdicts: list[dict]) -> None:
    headers = ["status", "ok", "queue", "timer_key", "txn", "deliver_at"]
    if len(verdicts) <= 20:
        emit_table(headers, [(v["status"], v["ok"], v["queue"], v["timerKey"], v["txn"], v["deliverAt"])
                             for v in verdicts])
        return
    counts: dict[str, int] = {}
    for v in verdicts:
        counts[v["status"]] = counts.get(v["status"], 0) + 1
    print(f"{len(verdicts)} operations: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    bad = [v for v in verdicts if not v["ok"]]
    if bad:
        print()
        emit_table(headers, [(v["status"], v["ok"], v["queue"], v["timerKey"], v["txn"], v["deliverAt"])
                             for v in bad])


def cmd_cancel(args: argparse.Namespace) -> int:
    with _db(args) as conn:
        status = _guard(lambda: conn.execute("SELECT queen.cancel_timer(%s, %s, %s) AS status",
                                             (args.tenant, args.queue, args.key)).fetchone()["status"])
    answer = {"ok": status == "cancelled", "status": status, "queue": args.queue,
              "timerKey": args.key, "txn": args.txn}
    if args.json:
        emit_json(answer)
    else:
        print(f"{status}: {args.queue} {args.key}")
    return EXIT_OK if answer["ok"] else EXIT_FAIL


def cmd_peek(args: argparse.Namespace) -> int:
    with _db(args) as conn:
        r = _guard(lambda: conn.execute("SELECT * FROM queen.peek_timer(%s, %s, %s)",
                                        (args.tenant, args.queue, args.key)).fetchone())
    if r is None:
        if args.json:
            emit_json({"found": False})
        else:
            print(f"not pending: {args.queue} {args.key}", file=sys.stderr)
        return EXIT_FAIL
    from .routes_timers import peek_json

    data = bytes(r["payload"])
    view = peek_json(r)
    if args.json:
        emit_json(view)
        return EXIT_OK
    text = None if r["payload_zstd"] else _printable_text(data)
    shown = [(k, v) for k, v in view.items() if k not in ("found", "payload")]
    shown.append(("payload", text) if text is not None else ("payload (base64)", view["payload"]))
    emit_table(["field", "value"], shown)
    return EXIT_OK


def cmd_list(args: argparse.Namespace) -> int:
    from .routes_timers import list_row_json

    rows: list[dict] = []
    after, truncated = args.after, False
    with _db(args) as conn:
        while True:
            page = _guard(lambda: conn.execute("SELECT * FROM queen.list_timers(%s, %s, %s, %s::integer)",
                                               (args.tenant, args.queue, after, args.limit)).fetchall())
            rows.extend(list_row_json(r) for r in page)
            truncated = bool(page and page[0]["truncated"])
            after = page[0]["next_after"] if page else None
            if not (args.all and truncated):
                break
    answer = {"rows": rows, "truncated": truncated, "nextAfter": after if truncated else None}
    if args.json:
        emit_json(answer)
        return EXIT_OK
    emit_table(["timer_key", "partition", "deliver_at", "txn", "attempts", "claimed", "last_error"],
               [(r["timerKey"], r["partition"], r["deliverAt"], r["txn"], r["attempts"], r["claimed"],
                 r["lastError"]) for r in rows])
    if truncated:
        print(f"(more: --after {json.dumps(after)}, or --all)", file=sys.stderr)
    return EXIT_OK


DLQ_MAX_BYTES = 64 * 1024 * 1024  # a page's payload bytes: the process holds them twice (bytes, base64)


def cmd_dlq(args: argparse.Namespace) -> int:
    with _db(args) as conn:
        def read():
            # p_max_bytes: a page of 1,000 dead letters as large as a push allowed would be
            # gigabytes in this process (the HTTP route bounds it by QUEEN_POP_MAX_BYTES)
            rows = conn.execute("SELECT * FROM queen.list_dlq(%s, %s, %s, %s, %s, p_max_bytes => %s)",
                                (args.tenant, args.queue, args.group, args.limit, args.offset,
                                 args.max_bytes)).fetchall()
            total = conn.execute("SELECT queen.count_dlq(%s, %s, %s) AS n",
                                 (args.tenant, args.queue, args.group)).fetchone()["n"]
            return rows, total
        rows, total = _guard(read)
    entries = [{
        "dlqId": str(r["dlq_id"]), "id": str(r["message_id"]), "transactionId": r["transaction_id"],
        "queue": r["queue"], "partition": r["partition"], "consumerGroup": r["consumer_group"],
        "errorMessage": r["error_message"], "retryCount": r["retry_count"],
        "payloadBase64": payloads.encode_base64(bytes(r["payload"])), "isEncrypted": r["is_encrypted"],
        "payloadZstd": r["payload_zstd"], "producerSub": r["producer_sub"],
        "createdAt": _iso(r["created_at"]), "failedAt": _iso(r["failed_at"]),
    } for r in rows]
    if args.json:
        emit_json({"total": total, "messages": entries})
        return EXIT_OK
    emit_table(["dlq_id", "queue", "partition", "consumer_group", "transaction_id", "retries", "failed_at",
                "error"],
               [(e["dlqId"], e["queue"], e["partition"], e["consumerGroup"], e["transactionId"],
                 e["retryCount"], e["failedAt"], e["errorMessage"]) for e in entries])
    more = args.offset + len(entries) < total
    print(f"({len(entries)} shown of {total}{f'; more: --offset {args.offset + len(entries)}' if more else ''})",
          file=sys.stderr)
    return EXIT_OK


# ---------------------------------------------------------------------------
# the parser
# ---------------------------------------------------------------------------

def _int_at_least(minimum: int | None, maximum: int = INT64_MAX) -> Callable[[str], int]:
    """An argparse type: an integer, at least minimum (None: any) and at most maximum
    (what PostgreSQL takes: past it a bad argument was reported as a database error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if value > maximum or value < INT64_MIN:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {value}")
        return value
    return parse


_integer, _nonnegative, _positive = _int_at_least(None), _int_at_least(0, INT32_MAX), _int_at_least(1, INT32_MAX)
_positive_big = _int_at_least(1)


def build_parser() -> argparse.ArgumentParser:
    db = argparse.ArgumentParser(add_help=False)
    db.add_argument("--database-url", metavar="URL",
                    help="libpq URL of the cell's database (default: $QUEEN_DATABASE_URL)")
    out = argparse.ArgumentParser(add_help=False)
    out.add_argument("--json", action="store_true", help="print JSON (for scripts) instead of a table")
    tenant = argparse.ArgumentParser(add_help=False)
    tenant.add_argument("--tenant", default="default",
                        help="the tenant to act for: its timers, queues and dead letters "
                             "(default: %(default)s, as with QUEEN_AUTH=off)")
    progress = argparse.ArgumentParser(add_help=False)
    progress.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                          help="a progress counter on stderr (default: only when stderr is a terminal)")
    key = argparse.ArgumentParser(add_help=False)
    key.add_argument("queue", metavar="QUEUE")
    key.add_argument("key", metavar="KEY", help="the timer key")

    parser = argparse.ArgumentParser(
        prog="queen-timers",
        description="queen-timers: the broker, and the commands an operator or a DBA runs against "
                    "the cell's PostgreSQL (no broker needs to run for them).",
        epilog="Exit codes: 0 done; 1 refused, not found, not ok, or failed; 2 bad arguments or input. "
               "Every subcommand has --help.")
    parser.add_argument("--version", action="version", version=f"queen-timers {__version__}")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = subs.add_parser("serve", parents=[db], help="run a broker: HTTP + sweeper (migrates first)",
                        description="Apply missing migrations, then run one broker (HTTP and sweeper). "
                                    "Every QUEEN_* variable applies; the options override theirs.")
    p.add_argument("--host", help="bind address (default: $QUEEN_HOST or 127.0.0.1)")
    p.add_argument("--port", type=_positive, help="HTTP port (default: $QUEEN_PORT or 6632)")

    p = subs.add_parser("migrate", parents=[db, out, progress], help="apply, show or check the migrations",
                        description="apply (default): apply the migrations the database lacks, each in its own "
                                    "transaction, under an advisory lock. status: one row per migration "
                                    "(applied, pending, changed, unknown). check: exit 0 only when the database "
                                    "is exactly at this code's latest migration.")
    p.add_argument("action", nargs="?", choices=("apply", "status", "check"), default="apply")

    subs.add_parser("status", parents=[db, out, tenant],
                    help="switches, pending timers per queue, next due, dead letters",
                    description="The cell's fire and scheduling switches, pending timers and ms until the next "
                                "due timer; then the tenant's (--tenant) timers per queue as the dashboard "
                                "counts them (queen.get_timer_stats: pending, due now, claimed, retrying, next "
                                "deliver_at) and its dead letters per queue (timer_dlq: those the fire "
                                "dead-lettered).")

    p = subs.add_parser("schedule", parents=[db, out, tenant, progress],
                        help="schedule or reschedule a timer, or a JSON Lines file of operations",
                        description="Schedule one timer (QUEUE KEY --delay-ms --txn --payload), or send "
                                    "--file's operations in batches of QUEEN_TIMERS_MAX_OPS, each batch one "
                                    "queen.schedule_timers call. Checks, the zstd bound and encryption are "
                                    "the HTTP route's; every line is checked before anything is sent. "
                                    "Exit 1 when an operation answers ok: false.",
                        epilog="--file: one JSON object a line, the fields of an operation of "
                               "POST /api/v1/timers (op, queue, timerKey, delayMs, txn, payload as base64, "
                               "partition, payloadZstd); op defaults to schedule; '-' reads stdin.")
    p.add_argument("queue", metavar="QUEUE", nargs="?")
    p.add_argument("key", metavar="KEY", nargs="?", help="the timer key")
    p.add_argument("--delay-ms", type=_integer, help="ms from PostgreSQL's now() (negative: due at once)")
    p.add_argument("--txn", help="the frame's transactionId (required for schedule)")
    payload = p.add_mutually_exclusive_group()
    payload.add_argument("--payload", metavar="TEXT", help="the payload as text (stored as its UTF-8 bytes)")
    payload.add_argument("--payload-base64", metavar="B64", help="the payload bytes as standard base64")
    p.add_argument("--zstd", action="store_true",
                   help="the payload bytes are a zstd frame (HTTP payloadZstd): inflated at fire")
    p.add_argument("--partition", help="destination partition (default: Default)")
    p.add_argument("--reschedule", action="store_true", help="op reschedule (txn optional)")
    p.add_argument("--file", metavar="PATH", help="a JSON Lines file of operations ('-': stdin)")
    p.set_defaults(parser=p)

    p = subs.add_parser("cancel", parents=[db, out, tenant, key], help="cancel a timer (passes no gate)",
                        description="queen.cancel_timer: cancelled (exit 0), absent or too_late (exit 1).")
    p.add_argument("--txn", help="echoed in the answer, as DELETE ?txn=")

    subs.add_parser("peek", parents=[db, out, tenant, key], help="one pending timer, payload as stored",
                    description="queen.peek_timer. Not pending: exit 1 ({\"found\": false} with --json). "
                                "The payload prints as text when it is printable UTF-8, else as base64; "
                                "--json always gives base64.")

    p = subs.add_parser("list", parents=[db, out, tenant], help="a queue's pending timers (keyset pages)",
                        description="queen.list_timers: timers of QUEUE in byte order of the key.")
    p.add_argument("queue", metavar="QUEUE")
    p.add_argument("--after", metavar="KEY", help="exclusive cursor: start after this key")
    p.add_argument("--limit", type=_positive, default=100, help="page size, 1..1000 (default: %(default)s)")
    p.add_argument("--all", action="store_true", help="follow the cursor to the end")

    p = subs.add_parser("dlq", parents=[db, out, tenant], help="dead letters (queen.list_dlq)",
                        description="The tenant's dead letters, newest first. Timers the fire gave up on are in "
                                    f"consumer group {TIMER_DLQ_GROUP}.")
    p.add_argument("--queue", help="only this queue")
    p.add_argument("--group", help="only this consumer group")
    p.add_argument("--limit", type=_positive, default=100, help="at most this many, 1..1000 (default: %(default)s)")
    p.add_argument("--offset", type=_nonnegative, default=0)
    p.add_argument("--max-bytes", type=_positive_big, default=DLQ_MAX_BYTES,
                   help="stop the page once the payloads add up to this many bytes (the first entry always "
                        "comes; default: %(default)s)")
    return parser


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "serve": cmd_serve, "migrate": cmd_migrate, "status": cmd_status, "cancel": cmd_cancel,
    "peek": cmd_peek, "list": cmd_list, "dlq": cmd_dlq,
}


def main(argv: list[str] | None = None, *, default_command: str | None = None) -> int:
    """The console script. default_command: what an empty command line runs
    (`python -m queen_timers` runs `serve`, as it always did)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv and default_command:
        argv = [default_command]
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "schedule":
            return cmd_schedule(args, args.parser)
        return COMMANDS[args.command](args)
    except CliError as exc:
        print(f"queen-timers {args.command}: {exc.error}: {exc.detail}", file=sys.stderr)
        if getattr(args, "json", False):
            emit_json({"error": exc.error, "detail": exc.detail})
        return exc.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
