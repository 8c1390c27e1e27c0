"""`make run`, `make psql` and `make stop-db` reach only this checkout's cluster (.queen/pg):
a port held by a cluster of another data directory is refused with a message naming both
data directories and QUEEN_PG_PORT. The other cluster is a throwaway one started here, in
another folder, on a free port; no broker is started."""

from __future__ import annotations

import os
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
def other_cluster():
    folder = Path(tempfile.mkdtemp(prefix="queen-other-checkout-", dir="/tmp"))
    folder.chmod(0o755)
    port = free_port()
    subprocess.run([str(PG_CLUSTER), "start", str(folder), str(port)], check=True,
                   env={**os.environ, "QUEEN_PG_FSYNC": "off"})
    try:
        yield folder, port
    finally:
        subprocess.run([str(PG_CLUSTER), "stop", str(folder)], check=False)
        shutil.rmtree(folder, ignore_errors=True)


def run(cmd: list, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("QUEEN_")}
    full.update({k: str(v) for k, v in env.items()})
    return subprocess.run([str(c) for c in cmd], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=120)


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
