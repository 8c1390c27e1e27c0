"""The canonical schema (sql/schema) and the numbered migrations build the same database."""

from __future__ import annotations

import subprocess

import psycopg
import pytest

from conftest import create_database
from queen_timers.db import SQL_DIR
from queen_timers.migrate import MigrationError, available, migrate


def dump(url: str) -> str:
    out = subprocess.run(["pg_dump", "--schema-only", "--no-owner", "--schema=queen", url],
                         check=True, capture_output=True, text=True)
    # comments and pg_dump's per-run \restrict keys are not schema
    return "\n".join(line for line in out.stdout.splitlines()
                     if not line.startswith(("--", "\\restrict", "\\unrestrict")))


def versions(url: str) -> list[tuple[int, str]]:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT version, name FROM queen.schema_migrations ORDER BY 1").fetchall()


def test_a_migration_edited_after_it_was_applied_is_refused(admin_dsn, tmp_path):
    for path in sorted((SQL_DIR / "migrations").glob("*.sql")):
        (tmp_path / path.name).write_text(path.read_text())
    url = create_database(admin_dsn, "queen_migrate_edited", schema=False)
    migrate(url, tmp_path)
    first = sorted(tmp_path.glob("*.sql"))[0]
    first.write_text(first.read_text() + "\n-- edited in place\n")
    with pytest.raises(MigrationError, match="changed after it was applied"):
        migrate(url, tmp_path)


def test_schema_equals_migrations(admin_dsn):
    from_schema = create_database(admin_dsn, "queen_from_schema")
    from_migrations = create_database(admin_dsn, "queen_from_migrations", schema=False)
    applied = migrate(from_migrations)
    assert applied == [v for v, _, _ in available()]
    assert dump(from_schema) == dump(from_migrations)
    assert versions(from_schema) == versions(from_migrations)


def test_migrate_is_idempotent_and_refuses_unknown_versions(admin_dsn):
    url = create_database(admin_dsn, "queen_migrate_twice", schema=False)
    assert migrate(url) != []
    assert migrate(url) == []
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("INSERT INTO queen.schema_migrations (version, name) VALUES (999, 'from_the_future')")
    try:
        migrate(url)
    except RuntimeError as exc:
        assert "999" in str(exc)
    else:
        raise AssertionError("a database newer than the code must be refused")
