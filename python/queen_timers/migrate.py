"""Apply sql/migrations/NNN_name.sql in order, each once, each in its own transaction.

Safe to run from several brokers at once, directly or through a transaction
pooler: each migration's transaction takes an advisory lock, and applied
versions are recorded in queen.schema_migrations.
Refuses to start when the database holds a version this code does not know,
or when a migration file changed after it was applied (its sha256 is kept).
status() reads what is applied without changing anything; check() says
whether the database is exactly at this code's latest migration.

    queen-timers migrate [apply|status|check]    # see cli.py
    python -m queen_timers.migrate               # apply only, uses QUEEN_DATABASE_URL
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from pathlib import Path

import psycopg

from . import db
from .config import Settings
from .db import SQL_DIR

_NAME = re.compile(r"^(\d{3})_([a-z0-9_]+)\.sql$")
LOCK_KEY = 7_261_000_001  # pg_advisory_xact_lock key for migrations


class MigrationError(RuntimeError):
    pass


def available(directory: Path | None = None) -> list[tuple[int, str, Path]]:
    directory = directory or SQL_DIR / "migrations"
    if not directory.is_dir():  # a wrong QUEEN_SQL_DIR: said, not a traceback
        raise MigrationError(f"no migrations directory at {directory} (QUEEN_SQL_DIR names the folder "
                             "holding schema/ and migrations/)")
    found = []
    for path in sorted(directory.iterdir()):
        m = _NAME.match(path.name)
        if m:
            found.append((int(m.group(1)), m.group(2), path))
    versions = [v for v, _, _ in found]
    if not versions:
        raise MigrationError(f"no migration files in {directory} (QUEEN_SQL_DIR?)")
    if versions != list(range(1, len(versions) + 1)):
        raise MigrationError(f"migrations must be numbered 001, 002, ... without gaps: {versions}")
    return found


def _checksum(path: Path) -> str:
    return hashlib.sha256(path.read_text().encode()).hexdigest()


def status(conninfo: str, directory: Path | None = None) -> list[dict]:
    """One row per migration known to the code or recorded in the database, in version order:
    {version, name, state, applied_at}. state is `applied`, `pending` (not applied yet),
    `changed` (the file differs from the one applied) or `unknown` (in the database,
    not in this code: the database is newer). Reads only."""
    known = available(directory)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        exists = conn.execute("SELECT to_regclass('queen.schema_migrations') IS NOT NULL").fetchone()[0]
        applied = {}
        if exists:
            applied = {v: (n, c, at) for v, n, c, at in conn.execute(
                "SELECT version, name, checksum, applied_at FROM queen.schema_migrations")}
    rows = []
    for version, name, path in known:
        if version not in applied:
            rows.append({"version": version, "name": name, "state": "pending", "applied_at": None})
            continue
        _, checksum, at = applied.pop(version)
        state = "applied" if checksum in (None, _checksum(path)) else "changed"
        rows.append({"version": version, "name": name, "state": state, "applied_at": at})
    for version, (name, _, at) in applied.items():
        rows.append({"version": version, "name": name, "state": "unknown", "applied_at": at})
    return sorted(rows, key=lambda r: r["version"])


def check(conninfo: str, directory: Path | None = None) -> tuple[bool, str]:
    """(True, ...) when every migration of this code is applied unchanged and the database
    holds none it does not know; otherwise (False, what is wrong). A database whose queen
    schema is the extension queen_timers is judged by the extension's version."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        version = extension_version(conn)
    if version is not None:
        try:
            return True, check_extension(version, available(directory)[-1][0])
        except MigrationError as exc:
            return False, str(exc)
    rows = status(conninfo, directory)
    problems = []
    for state, what in (("pending", "not applied"), ("changed", "changed after they were applied"),
                        ("unknown", "unknown to this code (the database is newer)")):
        names = [f"{r['version']:03d}_{r['name']}" for r in rows if r["state"] == state]
        if names:
            problems.append(f"{what}: {', '.join(names)}")
    if problems:
        return False, "; ".join(problems)
    latest = max((r["version"] for r in rows), default=0)
    return True, f"up to date at migration {latest:03d}"


EXTENSION = "queen_timers"


def extension_version(conn) -> str | None:
    """The version of the extension queen_timers installed in this database, or None when the
    queen schema (if any) was installed by the migrations or the plain install file."""
    row = conn.execute("SELECT extversion FROM pg_extension WHERE extname = %s", (EXTENSION,)).fetchone()
    return row[0] if row else None


def check_extension(version: str, latest: int) -> str:
    """The database's queen schema belongs to the extension queen_timers `version`
    (version N = migration N): the runner must not migrate it. Returns what was found when
    it is what this code needs; raises MigrationError when it is older or newer."""
    found = f"extension {EXTENSION} {version} found"
    if not version.isdigit():
        raise MigrationError(f"{found}: not a version this code knows (it needs {latest})")
    if int(version) < latest:
        raise MigrationError(f"{found}, this code needs {latest}: run "
                             f"`ALTER EXTENSION {EXTENSION} UPDATE` (after `make install-extension`); "
                             "the migrations runner does not touch a schema the extension owns")
    if int(version) > latest:
        raise MigrationError(f"{found}, newer than this code ({latest}): upgrade the broker")
    return f"{found}, up to date (the migrations runner leaves it to ALTER EXTENSION)"


def migrate(conninfo: str, directory: Path | None = None, progress=None, found=None) -> list[int]:
    """Apply what is missing; return the versions applied now.

    Each migration is one transaction that first takes the migrations' advisory
    lock (pg_advisory_xact_lock, released at its commit) and reads again whether
    another broker applied it meanwhile. Nothing spans two transactions, so it
    runs the same through a transaction pooler (pgbouncer), where a session lock
    taken in one transaction may be released on another server connection.

    progress(event, version, name), when given, is called with "start" and
    "done" around each migration applied. found(text), when given, is told which kind of
    database this is: the extension queen_timers (applied nothing; refused with
    MigrationError when its version is not this code's) or the migrations."""
    todo = available(directory)
    known = {v for v, _, _ in todo}
    done: list[int] = []
    # prepare_threshold=None: no server-side prepared statement (a pooler may change server connections)
    with psycopg.connect(conninfo, autocommit=True, prepare_threshold=None) as conn:
        version = extension_version(conn)
        if version is not None:
            said = check_extension(version, todo[-1][0])
            if found:
                found(said)
            return done
        newer = sorted(set(_applied(conn)) - known)
        if newer:
            raise MigrationError(f"database has migrations {newer} that this code does not know; "
                                 "upgrade the broker")
        for version, name, path in todo:
            text = path.read_text()
            checksum = hashlib.sha256(text.encode()).hexdigest()
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
                # A wait on an advisory lock leaves the session's catalog cache as it was
                # before: a broker that waited while another applied 001 still saw no
                # queen.schema_migrations, ran 001 again and exited on "already exists"
                # (Dec 7 audit). Taking a relation lock makes the session read the catalog
                # changes committed meanwhile (AcceptInvalidationMessages).
                conn.execute("LOCK TABLE pg_catalog.pg_namespace IN ACCESS SHARE MODE")
                applied = _applied(conn)
                if version in applied:
                    if applied[version] not in (None, checksum):
                        raise MigrationError(
                            f"{path.name} changed after it was applied to this database; "
                            "migrations are append-only: add a new one")
                    continue
                if progress:
                    progress("start", version, name)
                conn.execute(text)
                conn.execute("INSERT INTO queen.schema_migrations (version, name, checksum) VALUES (%s, %s, %s)",
                             (version, name, checksum))
            done.append(version)
            if progress:
                progress("done", version, name)
        if found:
            found(f"migrations: {len(done)} applied now, at migration {todo[-1][0]:03d}")
    return done


def _applied(conn: psycopg.Connection) -> dict[int, str | None]:
    """version -> checksum of what the database records (nothing before migration 001)."""
    if not conn.execute("SELECT to_regclass('queen.schema_migrations') IS NOT NULL").fetchone()[0]:
        return {}
    return dict(conn.execute("SELECT version, checksum FROM queen.schema_migrations").fetchall())


def main() -> int:
    url = os.environ.get("QUEEN_DATABASE_URL")
    if not url:
        print("QUEEN_DATABASE_URL is required", file=sys.stderr)
        return 2
    # the primary of a multi-host URL, with a bounded connect, like the broker's own start
    applied = migrate(db.conninfo(url, Settings(database_url=url)))
    print(f"migrations applied: {applied or 'none (up to date)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
