"""The built wheel carries sql/ inside the package: installed in a fresh venv (its
dependencies from the package index, nothing from this checkout), `queen-timers migrate`
run from a folder outside the checkout builds a fresh database, and status/check agree."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, create_database

# what a build needs: the package, its SQL, and the build files; nothing else of the checkout
BUILD_INPUTS = ["pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "python", "sql"]


def _env() -> dict:
    return {k: v for k, v in os.environ.items()
            if not k.startswith("QUEEN_") and k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def _run(cmd: list, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_migrates_from_anywhere(admin_dsn, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(ROOT / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--disable-pip-version-check",
          str(src), "-w", str(tmp_path / "dist")], cwd=tmp_path)
    [wheel] = (tmp_path / "dist").glob("queen_timers-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    migrations = sorted(p.name for p in (ROOT / "sql" / "migrations").glob("*.sql"))
    schema = sorted(p.name for p in (ROOT / "sql" / "schema").glob("*.sql"))
    for name in migrations:
        assert f"queen_timers/sql/migrations/{name}" in names
    for name in schema:
        assert f"queen_timers/sql/schema/{name}" in names
    for path in (ROOT / "python" / "queen_timers" / "dashboard").iterdir():  # package data beside the SQL
        assert f"queen_timers/dashboard/{path.name}" in names
    entry_points = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert entry_points and "queen-timers = queen_timers.cli:main" in \
        zipfile.ZipFile(wheel).read(entry_points[0]).decode()

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=tmp_path)
    _run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check", wheel],
         cwd=tmp_path)
    script = venv / "bin" / "queen-timers"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    # the installed package reads its own copy of the SQL, not this checkout's
    where = _run([venv / "bin" / "python", "-c", "from queen_timers.db import SQL_DIR; print(SQL_DIR)"],
                 cwd=elsewhere).stdout.strip()
    assert where.startswith(str(venv)) and not where.startswith(str(ROOT)), where

    url = create_database(admin_dsn, "queen_cli_wheel", schema=False)
    applied = json.loads(_run([script, "migrate", "--database-url", url, "--json"], cwd=elsewhere).stdout)
    assert applied["applied"] == list(range(1, len(migrations) + 1)) and applied["ok"] is True
    check = _run([script, "migrate", "check", "--database-url", url], cwd=elsewhere)
    assert check.stdout.startswith("up to date at migration")
    status = json.loads(_run([script, "migrate", "status", "--database-url", url, "--json"], cwd=elsewhere).stdout)
    assert [r["state"] for r in status] == ["applied"] * len(migrations)
    # and the installed CLI drives the schema it built, with no broker
    _run([script, "schedule", "q", "k", "--delay-ms", "60000", "--txn", "t", "--payload", "x",
          "--database-url", url], cwd=elsewhere)
    assert json.loads(_run([script, "status", "--json", "--database-url", url], cwd=elsewhere).stdout)["pending"] == 1
