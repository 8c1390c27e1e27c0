"""Apply sql/migrations/NNN_name.sql in order, each once, each in its own transaction.

Safe to run from several brokers at once: an advisory lock serialises
them and applied versions are recorded in queen.schema_migrations.
Refuses to start when the database holds a version this code does not know,
or when a migration file changed after it was applied (its sha256 is kept).

    python -m queen_timers.migrate            # uses QUEEN_DATABASE_URL
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
LOCK_KEY = 7_261_000_001  # pg_advisory_lock key for migrations


class MigrationError(RuntimeError):
    pass


def available(directory: Path | None = None) -> list[tuple[int, str, Path]]:
    directory = directory or SQL_DIR / "migrations"
    found = []
    for path in sorted(directory.iterdir()):
        m = _NAME.match(path.name)
        if m:
            found.append((int(m.group(1)), m.group(2), path))
    versions = [v for v, _, _ in found]
    if versions != list(range(1, len(versions) + 1)):
        raise MigrationError(f"migrations must be numbered 001, 002, ... without gaps: {versions}")
    return found


def migrate(conninfo: str, directory: Path | None = None) -> list[int]:
    """Apply what is missing; return the versions applied now."""
    todo = available(directory)
    done: list[int] = []
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (LOCK_KEY,))
        try:
            exists = conn.execute("SELECT to_regclass('queen.schema_migrations') IS NOT NULL").fetchone()[0]
            applied: dict[int, str | None] = {}
            if exists:
                applied = dict(conn.execute("SELECT version, checksum FROM queen.schema_migrations").fetchall())
            known = {v for v, _, _ in todo}
            if set(applied) - known:
                raise MigrationError(
                    f"database has migrations {sorted(set(applied) - known)} that this code does not know; "
                    "upgrade the broker")
            for version, name, path in todo:
                text = path.read_text()
                checksum = hashlib.sha256(text.encode()).hexdigest()
                if version in applied:
                    if applied[version] not in (None, checksum):
                        raise MigrationError(
                            f"{path.name} changed after it was applied to this database; "
                            "migrations are append-only: add a new one")
                    continue
                with conn.transaction():
                    conn.execute(text)
                    conn.execute("INSERT INTO queen.schema_migrations (version, name, checksum) VALUES (%s, %s, %s)",
                                 (version, name, checksum))
                done.append(version)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (LOCK_KEY,))
    return done


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
