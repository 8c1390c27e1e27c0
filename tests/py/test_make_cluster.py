"""`make run`, `make psql` and `make stop-db` reach only this checkout's cluster (.queen/pg):
a port held by a cluster of another data directory is refused with a message naming both
data directories and QUEEN_PG_PORT. The other cluster belongs to a second "checkout" made
here (a copy of Makefile and scripts/ in a /tmp folder, its cluster started by its own
scripts on a free port); no broker is started."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import psycopg
import pytest

from conftest import ROOT, free_port

PG_CLUSTER = ROOT / "scripts" / "pg-cluster"
OURS = ROOT / ".queen" / "pg" / "data"


@pytest.fixture(scope="module")
def other_checkout():
    """(checkout folder, port): a second checkout whose own cluster runs on a free port."""
    checkout = Path(tempfile.mkdtemp(prefix="queen-other-checkout-", dir="/tmp"))
    checkout.chmod(0o755)
    shutil.copy2(ROOT / "Makefile", checkout / "Makefile")
    shutil.copytree(ROOT / "scripts", checkout / "scripts")
    port = free_port()
    subprocess.run([str(checkout / "scripts" / "pg-cluster"), "start", ".queen/pg", str(port)], check=True,
                   cwd=checkout, env={**os.environ, "QUEEN_PG_FSYNC": "off"})
    try:
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres", autocommit=True) as conn:
            conn.execute("CREATE DATABASE queen")
        yield checkout, port
    finally:
        subprocess.run([str(PG_CLUSTER), "stop", str(checkout / ".queen" / "pg")], check=False)
        shutil.rmtree(checkout, ignore_errors=True)


@pytest.fixture
def other_cluster(other_checkout):
    """(the other cluster's folder, i.e. what holds data/, port)"""
    checkout, port = other_checkout
    return checkout / ".queen" / "pg", port


def run(cmd: list, cwd: Path = ROOT, stdin: str | None = None, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("QUEEN_")}
    full.update({k: str(v) for k, v in env.items()})
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=full, capture_output=True, text=True,
                          timeout=120, input=stdin)


def assert_refused(proc: subprocess.CompletedProcess, folder: Path, port: int) -> None:
    assert proc.returncode != 0, proc
    assert f"port {port} is held by another PostgreSQL cluster (data directory {folder}/data)" in proc.stderr
    assert f"not this checkout's ({OURS})" in proc.stderr
    assert "Set QUEEN_PG_PORT to a free port" in proc.stderr


def test_check_accepts_the_cluster_of_its_own_data_directory(other_cluster):
    folder, port = other_cluster
    assert run([PG_CLUSTER, "check", folder, port]).returncode == 0
    assert run([PG_CLUSTER, "port", folder]).stdout.strip() == str(port)
    assert run([PG_CLUSTER, "check", folder, free_port()]).returncode == 3  # nothing listens there


def test_make_psql_refuses_another_checkouts_cluster(other_cluster):
    folder, port = other_cluster
    proc = run(["make", "-s", "psql"], QUEEN_PG_PORT=port)
    assert_refused(proc, folder, port)
    assert "psql: data directory" not in proc.stderr  # never reached psql


def test_make_run_refuses_before_creating_anything(other_cluster):
    folder, port = other_cluster
    existed = OURS.parent.exists()
    proc = run(["scripts/run"], QUEEN_PG_PORT=port, QUEEN_PORT=free_port())
    assert_refused(proc, folder, port)
    assert "queen-timers broker on" not in proc.stdout
    if not existed:
        assert not OURS.parent.exists(), "a refused make run must not initdb .queen/pg"


def test_start_refuses_when_its_cluster_runs_on_another_port(other_cluster):
    folder, port = other_cluster
    other_port = free_port()
    proc = run([PG_CLUSTER, "start", folder, other_port])
    assert proc.returncode == 1
    assert f"this checkout's cluster ({folder}/data) runs on port {port}, not {other_port}" in proc.stderr
    assert f"QUEEN_PG_PORT={port}" in proc.stderr


def test_the_cluster_runs_as_postgres_when_started_by_root(other_cluster):
    # initdb and postgres refuse root: scripts/pg-cluster runs them as the `postgres` system
    # user then (README), and as the caller otherwise
    folder, _ = other_cluster
    pid = int((folder / "data" / "postmaster.pid").read_text().split()[0])
    status = Path(f"/proc/{pid}/status").read_text()
    uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
    assert uid == (pwd.getpwnam("postgres").pw_uid if os.geteuid() == 0 else os.geteuid())
    assert (folder / "data").stat().st_uid == uid  # the data directory is the server's


def test_make_psql_of_the_checkout_that_owns_the_cluster_names_it(other_checkout):
    checkout, port = other_checkout
    proc = run(["make", "-s", "psql"], cwd=checkout, stdin="SELECT current_database();\n", QUEEN_PG_PORT=port)
    assert proc.returncode == 0, proc.stderr
    url = f"postgresql://postgres@127.0.0.1:{port}/queen"
    assert f"psql: data directory {checkout}/.queen/pg/data, {url}" in proc.stderr
    assert "queen" in proc.stdout


def test_make_psql_uses_queen_database_url_when_set(database_url):
    proc = run(["make", "-s", "psql"], stdin="SELECT 'reached ' || current_database();\n",
               QUEEN_DATABASE_URL=database_url)
    assert proc.returncode == 0, proc.stderr
    assert "psql: QUEEN_DATABASE_URL" in proc.stderr
    assert "reached " + psycopg.conninfo.conninfo_to_dict(database_url)["dbname"] in proc.stdout


def test_make_stop_db_names_what_it_stops_and_leaves_the_other_alone(other_cluster):
    folder, port = other_cluster
    if run([PG_CLUSTER, "port", OURS.parent]).returncode == 0:
        pytest.skip("this checkout's own cluster is running (make run); make stop-db would stop it")
    proc = run(["make", "-s", "stop-db"], QUEEN_PG_PORT=port)
    assert proc.returncode == 0, proc.stderr
    assert f"no cluster running in {OURS}" in proc.stdout
    assert f"port {port} is held by another cluster, not this checkout's: left alone" in proc.stdout
    with psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres", connect_timeout=5) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_make_stop_db_in_the_owning_checkout_stops_its_cluster(other_checkout):
    """Last: it stops the module's cluster."""
    checkout, port = other_checkout
    proc = run(["make", "-s", "stop-db"], cwd=checkout, QUEEN_PG_PORT=port)
    assert proc.returncode == 0, proc.stderr
    assert (f"stop-db: stopping the cluster in {checkout}/.queen/pg/data "
            f"(postgresql://postgres@127.0.0.1:{port}/queen)") in proc.stdout
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres", connect_timeout=5)

