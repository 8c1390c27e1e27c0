"""The canonical schema (sql/schema) and the numbered migrations build the same database."""

from __future__ import annotations

import re
import subprocess
import time

import psycopg
import pytest

from conftest import create_database
from queen_timers.db import SQL_DIR
from queen_timers.migrate import MigrationError, available, migrate


# pg_dump's own comment lines and per-run \restrict keys; a function body's own `--` lines
# stay (the Dec 7 audit found the filter dropped every line starting with `--`)
DUMP_NOISE = re.compile(r"^(--$|-- (Name|Data for Name|TOC entry|Dumped (from|by)|PostgreSQL database dump)\b"
                        r"|\\(un)?restrict )")
STAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)?\+00")


def dump(url: str, *what: str) -> str:
    out = subprocess.run(["pg_dump", *(what or ("--schema-only",)), "--no-owner", "--schema=queen", url],
                         check=True, capture_output=True, text=True)
    text = "\n".join(line for line in out.stdout.splitlines() if not DUMP_NOISE.match(line))
    # a seeded row's time of creation (cell_settings.updated_at) is not part of the seed
    return STAMP.sub("<now>", text) if "--data-only" in what else text


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
    # the rows the schema seeds (cell settings, plans, ...): the same too
    data = ("--data-only", "--exclude-table=queen.schema_migrations")
    assert dump(from_schema, *data) == dump(from_migrations, *data)
    assert "COPY queen.cell_settings" in dump(from_schema, *data)


def test_the_schema_comparison_sees_a_body_comment_and_a_seeded_row(admin_dsn):
    """What test_schema_equals_migrations compares can tell these apart (it once could not)."""
    a = create_database(admin_dsn, "queen_cmp_a")
    b = create_database(admin_dsn, "queen_cmp_b")
    with psycopg.connect(b, autocommit=True) as conn:
        conn.execute("CREATE FUNCTION queen.cmp_probe() RETURNS int LANGUAGE sql AS $f$\n-- one\nSELECT 1\n$f$")
    with psycopg.connect(a, autocommit=True) as conn:
        conn.execute("CREATE FUNCTION queen.cmp_probe() RETURNS int LANGUAGE sql AS $f$\n-- two\nSELECT 1\n$f$")
    assert dump(a) != dump(b)
    with psycopg.connect(b, autocommit=True) as conn:
        conn.execute("UPDATE queen.cell_settings SET fire_paused = NOT fire_paused")
    data = ("--data-only", "--exclude-table=queen.schema_migrations")
    assert dump(a, *data) != dump(b, *data)


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


def test_upgrade_from_007_keeps_every_cursor_and_frame(admin_dsn, tmp_path):
    """A database at the released migration 007, with frames, an auto-ack cursor
    and a leased batch in flight, upgraded to the latest (008 moves the log to
    (xid, seq) positions): each group goes on exactly where it was, no frame is
    skipped or delivered twice, and frames appended after the upgrade follow."""
    url = create_database(admin_dsn, "queen_upgrade_007", schema=False)
    old = tmp_path / "to007"
    old.mkdir()
    for version, _name, path in available():
        if version <= 7:
            (old / path.name).write_bytes(path.read_bytes())
    assert migrate(url, old) == [1, 2, 3, 4, 5, 6, 7]

    push = """SELECT transaction_id FROM queen.push_messages('default',
                  ARRAY(SELECT ROW('upq', NULL, t, NULL, convert_to(t, 'UTF8'), false)::queen.push_item
                          FROM unnest(%s::text[]) t))"""
    pop = """SELECT transaction_id, partition_id, lease_id
               FROM queen.pop_messages('default', 'upq', NULL, %s, %s, %s)"""
    with psycopg.connect(url, autocommit=True) as c:
        assert len(c.execute(push, ([f"a{i}" for i in range(1, 7)],)).fetchall()) == 6
        assert [r[0] for r in c.execute(pop, ("g", 2, True)).fetchall()] == ["a1", "a2"]
        leased = c.execute(pop, ("h", 3, False)).fetchall()
        assert [r[0] for r in leased] == ["a1", "a2", "a3"]

    applied = migrate(url)
    assert applied and applied[0] == 8 and versions(url)[-1][0] == available()[-1][0]

    with psycopg.connect(url, autocommit=True) as c:
        # the auto-ack group goes on after a2
        assert [r[0] for r in c.execute(pop, ("g", 10, True)).fetchall()] == ["a3", "a4", "a5", "a6"]
        # the leased batch of h is still in flight: nothing more until it is acked
        assert c.execute(pop, ("h", 10, False)).fetchall() == []
        acks = c.execute("""SELECT bool_and(success) FROM queen.ack_messages('default',
                                ARRAY(SELECT ROW(t, p, 'completed', NULL, l::text, 'h')::queen.ack_item
                                        FROM unnest(%s::text[], %s::uuid[], %s::uuid[]) AS x(t, p, l)))""",
                         ([r[0] for r in leased], [r[1] for r in leased], [r[2] for r in leased])).fetchone()[0]
        assert acks is True
        assert [r[0] for r in c.execute(pop, ("h", 10, True)).fetchall()] == ["a4", "a5", "a6"]
        # frames appended after the upgrade come after every old one, for every group
        c.execute(push, (["b1"],))
        assert [r[0] for r in c.execute(pop, ("g", 10, True)).fetchall()] == ["b1"]
        assert [r[0] for r in c.execute(pop, ("h", 10, True)).fetchall()] == ["b1"]
        assert [r[0] for r in c.execute(pop, ("fresh", 10, True)).fetchall()] == \
            ["a1", "a2", "a3", "a4", "a5", "a6", "b1"]


def test_brokers_starting_together_on_a_fresh_database_both_start(admin_dsn):
    # Two brokers on an empty database: the second waits on the migrations' lock while
    # the first applies 001. Its catalog cache said, before the wait, that there is no
    # queen.schema_migrations, and waiting on an advisory lock does not refresh it: it ran
    # 001 again and exited on "schema already exists" (4 of 9 tries in the Dec 7 audit).
    import threading

    from queen_timers.migrate import LOCK_KEY
    url = create_database(admin_dsn, "queen_mig_race", schema=False)
    first = available()[0]
    holder = psycopg.connect(url)
    holder.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
    holder.execute(first[2].read_text())
    out: dict = {}

    def second():
        try:
            out["applied"] = migrate(url)
        except Exception as exc:  # noqa: BLE001 - the test reports it
            out["error"] = exc

    t = threading.Thread(target=second)
    t.start()
    with psycopg.connect(url, autocommit=True) as watch:  # until the second waits on the lock
        for _ in range(200):
            if watch.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                             ).fetchone()[0]:
                break
            time.sleep(0.02)
    from queen_timers.migrate import _checksum
    holder.execute("INSERT INTO queen.schema_migrations (version, name, checksum) VALUES (%s, %s, %s)",
                   (first[0], first[1], _checksum(first[2])))
    holder.commit()
    holder.close()
    t.join(60)
    assert "error" not in out, out
    assert out["applied"] == [v for v, _, _ in available()][1:]
