"""The psql walkthrough of docs/sql-walkthrough.md runs as written.

Its ```sql blocks are run in order with `psql -v ON_ERROR_STOP=1` against a
database built by scripts/install-schema (no broker, so no sweeper fires the
due timer first), and each block's output must be the ```text block that
follows it in the document.
"""

from __future__ import annotations

import re
import subprocess

import psycopg
import pytest

from conftest import ROOT, create_database

DOC = ROOT / "docs" / "sql-walkthrough.md"
DB_NAME = "queen_sql_walkthrough"


def walkthrough_blocks() -> list[tuple[str, str]]:
    """(sql, expected output) pairs of the 'psql walkthrough' section."""
    text = DOC.read_text()
    match = re.search(r"^## psql walkthrough\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, "docs/sql-walkthrough.md has no '## psql walkthrough' section"
    fences = re.findall(r"^```(sql|text)\n(.*?)^```", match.group(1), re.S | re.M)
    pairs = []
    for i, (lang, body) in enumerate(fences):
        if lang == "sql":
            assert i + 1 < len(fences) and fences[i + 1][0] == "text", "every sql block is followed by its output"
            pairs.append((body, fences[i + 1][1]))
    return pairs


def normalise(output: str) -> str:
    return "\n".join(line.rstrip() for line in output.strip().splitlines())


@pytest.fixture
def walk_db(admin_dsn):
    url = create_database(admin_dsn, DB_NAME)
    yield url
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DB_NAME}" WITH (FORCE)')


def psql(url: str, sql: str) -> str:
    out = subprocess.run(["psql", url, "-X", "-v", "ON_ERROR_STOP=1", "-f", "-"],
                         input=sql, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"psql failed:\n{out.stderr}\n--- sql ---\n{sql}"
    assert "ERROR" not in out.stderr, out.stderr
    return out.stdout


def test_walkthrough_runs_as_documented(walk_db):
    pairs = walkthrough_blocks()
    assert len(pairs) >= 5
    outputs = []
    for sql, expected in pairs:
        got = psql(walk_db, sql)
        assert normalise(got) == normalise(expected), f"output of\n{sql}\nwas\n{got}"
        outputs.append(got)
    everything = "\n".join(outputs)
    # the statuses the walkthrough is about, in the order it shows them
    statuses = re.findall(r"\b(scheduled|cancelled|absent|fired)\b", everything)
    assert statuses == ["scheduled", "scheduled", "cancelled", "absent", "fired"]
    # and the database agrees: the frame is in the log, no timer is left
    with psycopg.connect(walk_db) as conn:
        assert conn.execute("SELECT count(*) FROM queen.timers").fetchone() == (0,)
        assert conn.execute("SELECT transaction_id FROM queen.messages").fetchall() == [("trial-acme-now-v1",)]
