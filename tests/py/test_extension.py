"""The schema as the PostgreSQL extension queen_timers (extension/, `make extension`): version N
is migration N. scripts/test installs it (`make install-extension`) and runs the pgTAP suite on a
database made by CREATE EXTENSION; here: an update equals a fresh install equals the canonical
schema, the plain psql install file too, and the broker says which kind of database it found
and leaves an extension's schema to ALTER EXTENSION."""

from __future__ import annotations

import signal
import subprocess
import sys

import psycopg

from conftest import ROOT, create_database, start_broker
from queen_timers.migrate import available, migrate
from test_migrations import dump, versions

LATEST = available()[-1][0]


def extension_database(admin_dsn: str, name: str, version: int | None = None) -> str:
    url = create_database(admin_dsn, name, schema=False)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION queen_timers" + (f" VERSION '{version}'" if version else ""))
    return url


def ext_state(url: str) -> tuple[str, list[str]]:
    """The extension's version and the tables it marks for pg_dump's data."""
    with psycopg.connect(url) as conn:
        return conn.execute("""
            SELECT e.extversion, ARRAY(SELECT c::regclass::text FROM unnest(e.extconfig) c ORDER BY 1)
              FROM pg_extension e WHERE e.extname = 'queen_timers'""").fetchone()


def detach(url: str) -> None:
    """Make the extension's members plain objects (catalog surgery in a throwaway database)
    so that pg_dump prints them and the schemas can be compared line by line."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("""
            DELETE FROM pg_depend WHERE deptype = 'e'
               AND refobjid = (SELECT oid FROM pg_extension WHERE extname = 'queen_timers')""")
        conn.execute("DELETE FROM pg_extension WHERE extname = 'queen_timers'")


def test_generated_files_are_current(tmp_path):
    subprocess.run([str(ROOT / "scripts" / "make-extension"), str(tmp_path)], check=True)
    made = {p.name: p.read_text() for p in tmp_path.iterdir()}
    kept = {p.name: p.read_text() for p in (ROOT / "extension").iterdir()}
    assert made == kept, "extension/ is stale: run `make extension`"
    assert f"default_version = '{LATEST}'" in made["queen_timers.control"]
    assert {f"queen_timers--{v - 1}--{v}.sql" for v in range(2, LATEST + 1)} <= set(made)


def test_update_from_the_previous_release_equals_a_fresh_install(admin_dsn):
    fresh = extension_database(admin_dsn, "queen_ext_fresh")
    updated = extension_database(admin_dsn, "queen_ext_updated", LATEST - 1)
    assert ext_state(updated)[0] == str(LATEST - 1)
    with psycopg.connect(updated, autocommit=True) as conn:
        conn.execute("ALTER EXTENSION queen_timers UPDATE")
    assert ext_state(fresh) == ext_state(updated)
    version, config = ext_state(fresh)
    assert version == str(LATEST)
    assert "queen.timers" in config and "queen.schema_migrations" not in config
    assert versions(fresh) == versions(updated) == [(v, n) for v, n, _ in available()]
    canonical = create_database(admin_dsn, "queen_ext_canonical")
    detach(fresh)
    detach(updated)
    assert dump(fresh) == dump(updated) == dump(canonical)


def test_an_extension_database_is_not_migrated_and_an_old_one_is_refused(admin_dsn, tmp_path):
    url = extension_database(admin_dsn, "queen_ext_serve")
    said = []
    assert migrate(url, found=said.append) == []
    assert said == [f"extension queen_timers {LATEST} found, up to date "
                    "(the migrations runner leaves it to ALTER EXTENSION)"]
    broker = start_broker(url, tmp_path)
    try:
        assert f"database: extension queen_timers {LATEST} found" in broker.log()
    finally:
        broker.kill(signal.SIGTERM)

    old = extension_database(admin_dsn, "queen_ext_old", LATEST - 1)
    proc = subprocess.run([sys.executable, "-m", "queen_timers", "serve", "--database-url", old],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode != 0
    assert f"extension queen_timers {LATEST - 1} found, this code needs {LATEST}" in proc.stderr
    assert "ALTER EXTENSION queen_timers UPDATE" in proc.stderr
    assert ext_state(old)[0] == str(LATEST - 1)            # the runner did not touch it
    assert len(versions(old)) == LATEST - 1
    check = subprocess.run([sys.executable, "-m", "queen_timers", "migrate", "check", "--database-url", old],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert check.returncode != 0 and f"this code needs {LATEST}" in check.stderr


def test_plain_install_file_equals_the_canonical_schema(admin_dsn):
    plain = create_database(admin_dsn, "queen_ext_plain", schema=False)
    subprocess.run(["psql", plain, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-f",
                    str(ROOT / "extension" / "queen_timers-install.sql")], check=True, capture_output=True)
    canonical = create_database(admin_dsn, "queen_ext_canonical2")
    assert dump(plain) == dump(canonical)
    said = []
    assert migrate(plain, found=said.append) == []         # the runner takes it over as its own
    assert said == [f"migrations: 0 applied now, at migration {LATEST:03d}"]
