"""The queen-timers command line, run as real processes against a real database with no
broker running: help and usage errors, each subcommand's table and --json output, the
schedule -> peek -> cancel round trip, a bulk --file in batches with progress, status
numbers against the database, migrate apply/status/check."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zstandard

from conftest import ROOT, create_database, free_port, start_broker
from queen_timers import cli, payloads

KEY_HEX = "00112233445566778899aabbccddeeff" * 2
SUBCOMMANDS = ["serve", "migrate", "status", "schedule", "cancel", "peek", "list", "dlq"]


def run(*args: str, url: str | None = None, env: dict | None = None, stdin: str | None = None,
        cwd: Path = ROOT, exe: list[str] | None = None) -> subprocess.CompletedProcess:
    """`python -m queen_timers ARGS` (the same main as the console script)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("QUEEN_")}
    if url:
        full_env["QUEEN_DATABASE_URL"] = url
    full_env.update(env or {})
    return subprocess.run((exe or [sys.executable, "-m", "queen_timers"]) + list(args), env=full_env,
                          input=stdin, capture_output=True, text=True, timeout=120, cwd=cwd)


def ok_json(proc: subprocess.CompletedProcess, code: int = 0):
    assert proc.returncode == code, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(proc.stdout)


def timer_count(db, queue: str | None = None) -> int:
    if queue is None:
        return db.execute("SELECT count(*) AS n FROM queen.timers").fetchone()["n"]
    return db.execute("SELECT count(*) AS n FROM queen.timers WHERE queue = %s", (queue,)).fetchone()["n"]


# ---------------------------------------------------------------------------
# help and usage
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("command", [None] + SUBCOMMANDS)
def test_help_of_every_subcommand_exits_0(command, capsys):
    argv = ([command] if command else []) + ["--help"]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: queen-timers{' ' + command if command else ''}")
    if command is None:
        for name in SUBCOMMANDS:
            assert f"    {name} " in out


def test_python_m_queen_timers_help_starts_nothing(database_url):
    port = free_port()
    proc = run("--help", url=database_url, env={"QUEEN_PORT": str(port)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: queen-timers") and "serve" in proc.stdout
    with socket.socket() as s:  # no broker was started on QUEEN_PORT
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "queen-timers"
    assert script.exists(), "pip install (scripts/install-deps) must create the queen-timers console script"
    proc = run("status", "--help", exe=[str(script)])
    assert proc.returncode == 0 and proc.stdout.startswith("usage: queen-timers status")


@pytest.mark.parametrize("args, message", [
    (["list"], "the following arguments are required: QUEUE"),
    (["list", "q", "--limit", "0"], "must be >= 1"),
    # past what PostgreSQL takes: a usage error, not "not_migrated" nor a database error (Dec 7 audit)
    (["list", "q", "--limit", "99999999999"], "must be <= 2147483647"),
    (["dlq", "--limit", "99999999999"], "must be <= 2147483647"),
    (["dlq", "--max-bytes", "100000000000000000000000"], "must be <= 9223372036854775807"),
    (["schedule", "q", "k", "--delay-ms", "99999999999999999999", "--txn", "t", "--payload", "x"],
     "must be <= 9223372036854775807"),
    (["dlq", "--offset", "x"], "not an integer"),
    (["status", "--bogus"], "unrecognized arguments: --bogus"),
    (["migrate", "frobnicate"], "invalid choice: 'frobnicate'"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["schedule", "q", "k", "--txn", "t", "--payload", "x"], "--delay-ms is required"),
    (["schedule", "q", "k", "--delay-ms", "1", "--payload", "x"], "--txn is required"),
    (["schedule", "q", "k", "--delay-ms", "1", "--txn", "t"], "--payload or --payload-base64 is required"),
    (["schedule", "q", "k", "--delay-ms", "1", "--txn", "t", "--payload", "a", "--payload-base64", "YQ=="],
     "not allowed with argument"),
    (["schedule", "--file", "x.jsonl", "--delay-ms", "5"], "--file takes its fields from the file"),
    (["schedule", "q"], "give QUEUE and KEY, or --file"),
    (["cancel", "q"], "the following arguments are required: KEY"),
])
def test_bad_arguments_exit_2_with_a_message(args, message, database_url):
    proc = run(*args, url=database_url)
    assert proc.returncode == 2, proc
    assert message in proc.stderr
    assert proc.stderr.startswith("usage: queen-timers")


@pytest.mark.parametrize("args", [["status"], ["peek", "q", "k"], ["migrate", "check"],
                                  ["schedule", "q", "k", "--delay-ms", "1", "--txn", "t", "--payload", "x"]])
def test_missing_database_url_exits_2(args):
    proc = run(*args)
    assert proc.returncode == 2
    assert "no database URL: pass --database-url or set QUEEN_DATABASE_URL" in proc.stderr


def test_a_database_without_the_schema_says_to_migrate(admin_dsn):
    url = create_database(admin_dsn, "queen_cli_empty", schema=False)
    for args in (["status"], ["peek", "q", "k"], ["list", "q"], ["dlq"]):
        proc = run(*args, url=url)
        assert proc.returncode == 1, proc
        assert "not_migrated: the queen schema is missing or older than this code: run `queen-timers migrate`" \
            in proc.stderr


def test_unreachable_database_is_one_clear_line():
    proc = run("status", "--database-url", f"postgresql://postgres:secret@127.0.0.1:{free_port()}/nope")
    assert proc.returncode == 1
    assert "timers_unavailable: cannot connect to postgresql://postgres:***@127.0.0.1" in proc.stderr
    assert "secret" not in proc.stderr and "Traceback" not in proc.stderr



def test_serve_checks_the_direct_and_read_urls_before_serving(admin_dsn, database_url, tmp_path):
    # A direct URL that could not connect, or reached another database, started a broker
    # that said healthy while its sweeper failed every cycle or fired another database's
    # timers; an unreachable read URL answered 503 to every peek and list (Dec 7 audit).
    other = create_database(admin_dsn, "queen_cli_other")
    empty = create_database(admin_dsn, "queen_cli_empty_read", schema=False)
    dead = f"postgresql://postgres:secret@127.0.0.1:{free_port()}/nope"
    cases = [
        ({"QUEEN_DIRECT_DATABASE_URL": dead}, 1, "timers_unavailable: QUEEN_DIRECT_DATABASE_URL postgresql://postgres:***@"),
        ({"QUEEN_DIRECT_DATABASE_URL": other}, 2, "bad_configuration: QUEEN_DIRECT_DATABASE_URL"),
        ({"QUEEN_READ_DATABASE_URL": dead}, 1, "timers_unavailable: QUEEN_READ_DATABASE_URL postgresql://postgres:***@"),
        ({"QUEEN_READ_DATABASE_URL": empty}, 2, "without the queen schema"),
    ]
    for extra, code, said in cases:
        proc = run("serve", url=database_url, env={"QUEEN_PORT": str(free_port()), **extra})
        assert proc.returncode == code and said in proc.stderr, (extra, proc.returncode, proc.stderr[-1500:])
        assert "secret" not in proc.stderr and "Traceback" not in proc.stderr
    # the same database by both URLs starts, and is healthy (then stopped)
    broker = start_broker(database_url, tmp_path, QUEEN_DIRECT_DATABASE_URL=database_url,
                          QUEEN_READ_DATABASE_URL=database_url)
    broker.kill(signal.SIGTERM)



def test_serve_says_a_bad_host_a_port_in_use_and_a_wrong_sql_dir(database_url, tmp_path):
    # each failed with a traceback, or after the migrations in uvicorn's words (Dec 7 audit)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        port = busy.getsockname()[1]
        proc = run("serve", url=database_url, env={"QUEEN_PORT": str(port)})
        assert proc.returncode == 1, proc.stderr
        assert f"timers_unavailable: cannot listen on QUEEN_HOST 127.0.0.1 QUEEN_PORT {port}" in proc.stderr
    finally:
        busy.close()
    proc = run("serve", url=database_url, env={"QUEEN_HOST": "no.such.host.invalid", "QUEEN_PORT": str(free_port())})
    assert proc.returncode == 2 and "bad_configuration: QUEEN_HOST 'no.such.host.invalid'" in proc.stderr, proc.stderr
    for args in (["serve"], ["migrate", "status"]):
        proc = run(*args, url=database_url, env={"QUEEN_SQL_DIR": str(tmp_path), "QUEEN_PORT": str(free_port())})
        assert proc.returncode == 1 and f"no migrations directory at {tmp_path}/migrations" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------
# schedule / peek / cancel / list
# ---------------------------------------------------------------------------

def test_schedule_peek_cancel_round_trip(db, database_url):
    proc = run("schedule", "reminders", "trial:acme:day7", "--delay-ms", "604800000",
               "--txn", "trial-acme-day7-v1", "--payload", '{"kind":"day7"}', "--json", url=database_url)
    [verdict] = ok_json(proc)["results"]  # the envelope of POST /api/v1/timers
    assert verdict["ok"] is True and verdict["status"] == "scheduled"
    assert verdict["queue"] == "reminders" and verdict["timerKey"] == "trial:acme:day7"
    row = db.execute("SELECT * FROM queen.peek_timer('default', 'reminders', 'trial:acme:day7')").fetchone()
    assert bytes(row["payload"]) == b'{"kind":"day7"}'
    assert str(row["message_id"]) == verdict["messageId"] and row["txn"] == "trial-acme-day7-v1"

    peek = ok_json(run("peek", "reminders", "trial:acme:day7", "--json", url=database_url))
    assert peek["found"] is True and peek["messageId"] == verdict["messageId"]
    assert base64.b64decode(peek["payload"]) == b'{"kind":"day7"}'
    assert peek["deliverAt"] == verdict["deliverAt"] and peek["claimed"] is False
    assert peek["producerSub"] is None

    human = run("peek", "reminders", "trial:acme:day7", url=database_url)
    assert human.returncode == 0
    assert "trial-acme-day7-v1" in human.stdout and '{"kind":"day7"}' in human.stdout

    # a reschedule through the CLI answers rescheduled, with a new message id
    [again] = ok_json(run("schedule", "reminders", "trial:acme:day7", "--reschedule", "--delay-ms", "1000",
                          "--payload-base64", payloads.encode_base64(b"\x00\xff"), "--json", url=database_url))["results"]
    assert again["status"] == "rescheduled" and again["messageId"] != verdict["messageId"]
    human = run("peek", "reminders", "trial:acme:day7", url=database_url)
    assert "payload (base64)  AP8=" in human.stdout

    cancel = ok_json(run("cancel", "reminders", "trial:acme:day7", "--txn", "t-1", "--json", url=database_url))
    assert cancel == {"ok": True, "status": "cancelled", "queue": "reminders",
                      "timerKey": "trial:acme:day7", "txn": "t-1"}
    assert timer_count(db) == 0
    again = run("cancel", "reminders", "trial:acme:day7", url=database_url)
    assert again.returncode == 1 and again.stdout.strip() == "absent: reminders trial:acme:day7"
    assert ok_json(run("peek", "reminders", "trial:acme:day7", "--json", url=database_url), 1) == {"found": False}


def test_tenant_option_scopes_the_timer(db, database_url):
    ok_json(run("schedule", "q", "k", "--delay-ms", "60000", "--txn", "t", "--payload", "x", "--tenant", "acme",
                "--json", url=database_url))
    assert db.execute("SELECT tenant FROM queen.timers").fetchone()["tenant"] == "acme"
    assert run("peek", "q", "k", url=database_url).returncode == 1  # tenant default sees nothing
    assert run("peek", "q", "k", "--tenant", "acme", url=database_url).returncode == 0


def test_bad_payload_writes_nothing(db, database_url):
    proc = run("schedule", "q", "k", "--delay-ms", "1", "--txn", "t", "--payload-base64", "not base64!",
               "--json", url=database_url)
    assert proc.returncode == 2
    assert ok_json(proc, 2) == {"error": "timers_bad_request", "detail": "payload is not valid base64"}
    proc = run("schedule", "q", "k", "--delay-ms", "1", "--txn", "t", "--payload", "plain", "--zstd",
               url=database_url)
    assert proc.returncode == 2 and "payload is not valid zstd" in proc.stderr
    assert timer_count(db) == 0


def test_zstd_payload_is_stored_as_sent(db, database_url):
    frame = zstandard.ZstdCompressor().compress(b"hello " * 100)
    [v] = ok_json(run("schedule", "z", "k", "--delay-ms", "60000", "--txn", "t", "--zstd",
                      "--payload-base64", payloads.encode_base64(frame), "--json", url=database_url))["results"]
    assert v["status"] == "scheduled"
    row = db.execute("SELECT payload, payload_zstd FROM queen.timers").fetchone()
    assert row["payload_zstd"] is True and bytes(row["payload"]) == frame


def test_encrypting_queue_follows_the_http_rules(db, database_url):
    db.execute("INSERT INTO queen.queues (tenant, name, encryption_enabled) VALUES ('default', 'secret', true)")
    # acme's queue 'secret' is another queue, which does not encrypt: no key needed
    ok_json(run("schedule", "secret", "k", "--delay-ms", "60000", "--txn", "t", "--payload", "plain",
                "--tenant", "acme", "--json", url=database_url))
    row = db.execute("SELECT payload, encrypted FROM queen.timers WHERE tenant = 'acme'").fetchone()
    assert row["encrypted"] is False and bytes(row["payload"]) == b"plain"
    ok_json(run("cancel", "secret", "k", "--tenant", "acme", "--json", url=database_url))
    proc = run("schedule", "secret", "k", "--delay-ms", "60000", "--txn", "t", "--payload", "card 4242",
               url=database_url)
    assert proc.returncode == 1 and "feature_gated" in proc.stderr and "QUEEN_ENCRYPTION_KEY" in proc.stderr
    assert timer_count(db) == 0
    ok_json(run("schedule", "secret", "k", "--delay-ms", "60000", "--txn", "t", "--payload", "card 4242",
                "--json", url=database_url, env={"QUEEN_ENCRYPTION_KEY": KEY_HEX}))
    row = db.execute("SELECT payload, encrypted FROM queen.timers").fetchone()
    assert row["encrypted"] is True and b"card 4242" not in bytes(row["payload"])
    assert payloads.decrypt(bytes.fromhex(KEY_HEX), bytes(row["payload"])) == b"card 4242"


def test_a_gate_refusal_is_reported_and_writes_nothing(db, database_url):
    db.execute("SELECT queen.pause_scheduling()")
    proc = run("schedule", "q", "k", "--delay-ms", "1", "--txn", "t", "--payload", "x", "--json", url=database_url)
    body = ok_json(proc, 1)
    assert body["error"] == "timers_disabled" and body["detail"]
    assert "timers_disabled" in proc.stderr
    assert timer_count(db) == 0


def test_list_pages_and_all(db, database_url):
    for key in ("a", "b", "c"):
        ok_json(run("schedule", "lq", key, "--delay-ms", "60000", "--txn", f"t-{key}", "--payload", key,
                    "--json", url=database_url))
    page = ok_json(run("list", "lq", "--limit", "2", "--json", url=database_url))
    assert [r["timerKey"] for r in page["rows"]] == ["a", "b"]
    assert page["truncated"] is True and page["nextAfter"] == "b"
    rest = ok_json(run("list", "lq", "--after", "b", "--json", url=database_url))
    assert [r["timerKey"] for r in rest["rows"]] == ["c"] and rest["truncated"] is False
    everything = ok_json(run("list", "lq", "--limit", "1", "--all", "--json", url=database_url))
    assert [r["timerKey"] for r in everything["rows"]] == ["a", "b", "c"]
    assert everything["truncated"] is False and everything["nextAfter"] is None
    human = run("list", "lq", "--limit", "2", url=database_url)
    assert human.returncode == 0
    lines = human.stdout.splitlines()
    assert lines[0].split()[:3] == ["timer_key", "partition", "deliver_at"]
    assert [ln.split()[0] for ln in lines[1:]] == ["a", "b"]
    assert '--after "b"' in human.stderr


# ---------------------------------------------------------------------------
# bulk --file
# ---------------------------------------------------------------------------

def _rows_file(path: Path, n: int, queue: str = "bulk") -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"queue": queue, "timerKey": f"k{i:05d}", "delayMs": 600000, "txn": f"t{i}",
                                "payload": payloads.encode_base64(f"row {i}".encode())}) + "\n")
    return path


def test_bulk_file_in_batches_with_progress(db, database_url, tmp_path):
    rows = _rows_file(tmp_path / "rows.jsonl", 1000)
    proc = run("schedule", "--file", str(rows), "--progress", url=database_url,
               env={"QUEEN_TIMERS_MAX_OPS": "256"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "1000 operations: 1000 scheduled"
    # stderr is not a terminal: one progress line per batch of QUEEN_TIMERS_MAX_OPS
    assert proc.stderr.splitlines() == ["operations sent 256/1000 (25%)", "operations sent 512/1000 (51%)",
                                        "operations sent 768/1000 (76%)", "operations sent 1000/1000 (100%)"]
    assert timer_count(db, "bulk") == 1000
    assert bytes(db.execute("SELECT payload FROM queen.timers WHERE timer_key = 'k00999'")
                 .fetchone()["payload"]) == b"row 999"


def test_bulk_file_json_and_no_progress_when_not_a_terminal(db, database_url, tmp_path):
    rows = _rows_file(tmp_path / "rows.jsonl", 30)
    proc = run("schedule", "--file", "-", "--json", url=database_url, stdin=rows.read_text(),
               env={"QUEEN_TIMERS_MAX_OPS": "8"})
    verdicts = ok_json(proc)["results"]
    assert len(verdicts) == 30 and {v["status"] for v in verdicts} == {"scheduled"}
    assert proc.stderr == ""
    proc = run("schedule", "--file", str(rows), "--no-progress", url=database_url)
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.strip() == "30 operations: 30 rescheduled"


def test_bulk_file_with_a_bad_line_writes_nothing(db, database_url, tmp_path):
    rows = _rows_file(tmp_path / "rows.jsonl", 10)
    with open(rows, "a") as f:
        f.write(json.dumps({"queue": "bulk", "timerKey": "bad", "delayMs": 1, "txn": "t", "payload": "%%%"}) + "\n")
    proc = run("schedule", "--file", str(rows), url=database_url, env={"QUEEN_TIMERS_MAX_OPS": "4"})
    assert proc.returncode == 2
    assert "line 11: payload is not valid base64" in proc.stderr
    (tmp_path / "broken.jsonl").write_text('{"queue": "bulk", "timerKey": "x"\n')
    proc = run("schedule", "--file", str(tmp_path / "broken.jsonl"), url=database_url)
    assert proc.returncode == 2 and "line 1: not valid JSON" in proc.stderr
    proc = run("schedule", "--file", str(tmp_path / "missing.jsonl"), url=database_url)
    assert proc.returncode == 2 and "cannot read" in proc.stderr
    assert timer_count(db) == 0


def test_bulk_file_with_cancels_exits_1_when_one_is_not_ok(db, database_url, tmp_path):
    f = tmp_path / "ops.jsonl"
    f.write_text("\n".join(json.dumps(o) for o in [
        {"queue": "q", "timerKey": "a", "delayMs": 60000, "txn": "ta", "payload": "eA=="},
        {"op": "cancel", "queue": "q", "timerKey": "never"},
    ]) + "\n")
    proc = run("schedule", "--file", str(f), "--json", url=database_url)
    verdicts = ok_json(proc, 1)["results"]
    assert [v["status"] for v in verdicts] == ["scheduled", "absent"]


# ---------------------------------------------------------------------------
# status and dlq
# ---------------------------------------------------------------------------

def _dead_letter(db, queue: str, key: str, tenant: str = "default", payload: bytes = b"\x00") -> None:
    """A timer's dead letter as the fire leaves it (in its tenant's queue), made from SQL."""
    db.execute("SELECT * FROM queen.schedule_timers(%s, ARRAY[queen.make_timer_op("
               "'schedule', %s, %s, p_delay_ms => 60000, p_txn => %s, p_payload => %s)])",
               (tenant, queue, key, f"dead-{key}", payload))
    claim = db.execute("SELECT claim_id FROM queen.claim_timers('cli-test', 1, 60000, now() + interval '61 s')"
                       ).fetchone()["claim_id"]
    verdict = db.execute("SELECT queen.fail_timer(%s, %s, %s, %s, 'permanent', 'test', 1) AS v",
                         (tenant, queue, key, claim)).fetchone()["v"]
    assert verdict == "dead_lettered"


def test_status_numbers_match_the_database(db, database_url):
    _dead_letter(db, "alpha", "dead")
    _dead_letter(db, "alpha", "dead", tenant="acme")
    ok_json(run("schedule", "alpha", "due", "--delay-ms", "-1000", "--txn", "t1", "--payload", "x", "--json",
                url=database_url))
    for key in ("later-1", "later-2"):
        ok_json(run("schedule", "beta", key, "--delay-ms", "3600000", "--txn", key, "--payload", "x", "--json",
                    url=database_url))

    # another tenant's timers and dead letter, in queues of the same names
    ok_json(run("schedule", "beta", "acme-1", "--delay-ms", "7200000", "--txn", "a1", "--payload", "x",
                "--tenant", "acme", "--json", url=database_url))

    status = ok_json(run("status", "--json", url=database_url))
    assert status["schedulingPaused"] is False and status["firePaused"] is False
    assert status["pending"] == timer_count(db) == 4  # the cell's
    assert status["nextDueMs"] == 0  # alpha/due is due now
    assert status["tenant"] == "default" and status["tenantPending"] == 3
    assert status["dlq"] == db.execute("SELECT queen.count_dlq('default') AS n").fetchone()["n"] == 1
    by_queue = {q["queue"]: q for q in status["queues"]}
    assert set(by_queue) == {"alpha", "beta"}
    # the per-queue numbers are the dashboard's (queen.get_timer_stats)
    for r in db.execute("SELECT * FROM queen.get_timer_stats('default')").fetchall():
        q = by_queue[r["queue"]]
        assert (q["pending"], q["due"], q["claimed"], q["retrying"]) == (
            r["pending"], r["due"], r["claimed"], r["retrying"])
    assert by_queue["alpha"]["pending"] == timer_count(db, "alpha") == 1 and by_queue["alpha"]["due"] == 1
    assert by_queue["alpha"]["dlq"] == 1 and by_queue["alpha"]["timerDlq"] == 1
    assert by_queue["beta"]["pending"] == timer_count(db, "beta") - 1 == 2 and by_queue["beta"]["due"] == 0
    assert by_queue["beta"]["claimed"] == 0 and by_queue["beta"]["dlq"] == 0
    soonest = db.execute("SELECT min(deliver_at) AS d FROM queen.timers WHERE queue = 'beta' AND tenant = 'default'"
                         ).fetchone()["d"]
    assert by_queue["beta"]["nextDeliverAt"] == cli._iso(soonest)

    acme = ok_json(run("status", "--tenant", "acme", "--json", url=database_url))
    assert acme["pending"] == 4 and acme["tenant"] == "acme" and acme["tenantPending"] == 1 and acme["dlq"] == 1
    assert [(q["queue"], q["pending"], q["dlq"], q["timerDlq"]) for q in acme["queues"]] == [
        ("alpha", 0, 1, 1), ("beta", 1, 0, 0)]
    assert ok_json(run("status", "--tenant", "nobody", "--json", url=database_url))["queues"] == []

    human = run("status", url=database_url)
    assert human.returncode == 0
    lines = human.stdout.splitlines()
    assert re.search(r"^fire +running$", human.stdout, re.M) and re.search(r"^next due +now$", human.stdout, re.M)
    assert re.search(r"^tenant +default$", human.stdout, re.M)
    assert any(ln.split()[:4] == ["beta", "2", "0", "0"] for ln in lines)

    db.execute("SELECT queen.pause_fire()")
    db.execute("SELECT queen.pause_scheduling()")
    status = ok_json(run("status", "--json", url=database_url))
    assert status["firePaused"] is True and status["schedulingPaused"] is True and status["nextDueMs"] is None
    assert re.search(r"^fire +paused$", run("status", url=database_url).stdout, re.M)


def test_dlq_lists_dead_letters(db, database_url):
    _dead_letter(db, "alpha", "d1")
    _dead_letter(db, "beta", "d2")
    _dead_letter(db, "beta", "d3", tenant="acme")
    body = ok_json(run("dlq", "--json", url=database_url))
    assert body["total"] == 2 and len(body["messages"]) == 2
    assert {m["transactionId"] for m in body["messages"]} == {"dead-d1", "dead-d2"}
    assert {m["consumerGroup"] for m in body["messages"]} == {cli.TIMER_DLQ_GROUP}
    one = ok_json(run("dlq", "--queue", "beta", "--json", url=database_url))
    assert one["total"] == 1 and one["messages"][0]["queue"] == "beta"
    human = run("dlq", url=database_url)
    assert human.returncode == 0 and "dead-d1" in human.stdout and "(2 shown of 2)" in human.stderr
    acme = ok_json(run("dlq", "--tenant", "acme", "--json", url=database_url))
    assert acme["total"] == 1 and [m["transactionId"] for m in acme["messages"]] == ["dead-d3"]
    assert ok_json(run("dlq", "--tenant", "acme", "--queue", "alpha", "--json", url=database_url))["total"] == 0


def test_a_dlq_page_is_bounded_by_its_payload_bytes(db, database_url):
    for key in ("b1", "b2", "b3"):
        _dead_letter(db, "big", key, payload=b"x" * 1000)
    # the first entry always comes; the next would take the page past 1,500 bytes
    page = ok_json(run("dlq", "--max-bytes", "1500", "--json", url=database_url))
    assert page["total"] == 3 and len(page["messages"]) == 1
    human = run("dlq", "--max-bytes", "1500", url=database_url)
    assert "(1 shown of 3; more: --offset 1)" in human.stderr
    # each entry weighs its payload and its error text, 'test' (migration 041): 1,004 bytes
    assert len(ok_json(run("dlq", "--max-bytes", "2007", "--offset", "1", "--json", url=database_url))["messages"]) == 1
    rest = ok_json(run("dlq", "--max-bytes", "2008", "--offset", "1", "--json", url=database_url))
    assert len(rest["messages"]) == 2
    assert {m["transactionId"] for m in page["messages"] + rest["messages"]} == {"dead-b1", "dead-b2", "dead-b3"}
    assert len(ok_json(run("dlq", "--json", url=database_url))["messages"]) == 3  # 64 MiB by default
    assert run("dlq", "--max-bytes", "0", url=database_url).returncode != 0


# ---------------------------------------------------------------------------
# migrate
# ---------------------------------------------------------------------------

def test_migrate_apply_status_check(admin_dsn):
    url = create_database(admin_dsn, "queen_cli_migrate", schema=False)
    check = run("migrate", "check", url=url)
    assert check.returncode == 1 and "not applied: 001_initial" in check.stderr
    status = ok_json(run("migrate", "status", "--json", url=url))
    assert status[0] == {"version": 1, "name": "initial", "state": "pending", "applied_at": None}

    applied = run("migrate", "--progress", "--json", url=url)
    body = ok_json(applied)
    assert body["applied"][0] == 1 and body["ok"] is True
    assert "applying 001_initial ..." in applied.stderr
    assert run("migrate", "check", url=url).returncode == 0
    assert {r["state"] for r in ok_json(run("migrate", "status", "--json", url=url))} == {"applied"}
    again = run("migrate", url=url)
    assert again.returncode == 0 and again.stdout.startswith("up to date at migration")

    # a migration edited after it was applied: check fails, apply refuses
    import psycopg
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE queen.schema_migrations SET checksum = 'edited' WHERE version = 1")
        conn.execute("INSERT INTO queen.schema_migrations (version, name) VALUES (999, 'future')")
    check = run("migrate", "check", url=url)
    assert check.returncode == 1
    assert "changed after they were applied: 001_initial" in check.stderr and "999_future" in check.stderr
    states = {r["version"]: r["state"] for r in ok_json(run("migrate", "status", "--json", url=url))}
    assert states[1] == "changed" and states[999] == "unknown"
    refused = run("migrate", url=url)
    assert refused.returncode == 1 and "migration_refused" in refused.stderr


def test_a_refused_later_batch_says_what_was_written(db, database_url, tmp_path):
    db.execute("UPDATE queen.cell_settings SET max_pending_timers = 5")
    rows = _rows_file(tmp_path / "rows.jsonl", 8, queue="quota")
    proc = run("schedule", "--file", str(rows), url=database_url, env={"QUEEN_TIMERS_MAX_OPS": "4"})
    assert proc.returncode == 1
    assert "timers_quota_exceeded" in proc.stderr
    assert "batch of operations 5-8 refused; the 4 operations before it were written" in proc.stderr
    assert timer_count(db, "quota") == 4


def test_partition_option(db, database_url):
    ok_json(run("schedule", "q", "k", "--delay-ms", "60000", "--txn", "t", "--payload", "x",
                "--partition", "eu", "--json", url=database_url))
    assert ok_json(run("peek", "q", "k", "--json", url=database_url))["partition"] == "eu"


def test_serve_options_override_the_environment(db, database_url, tmp_path):
    import httpx

    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUEEN_")}
    env["QUEEN_DATABASE_URL"] = "postgresql://postgres@127.0.0.1:1/unreachable"
    proc = subprocess.Popen([sys.executable, "-m", "queen_timers", "serve", "--database-url", database_url,
                             "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_progress_on_a_terminal_is_one_updating_line(db, database_url, tmp_path):
    import pty

    rows = _rows_file(tmp_path / "rows.jsonl", 20)
    master, slave = pty.openpty()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("QUEEN_")}
        env.update(QUEEN_DATABASE_URL=database_url, QUEEN_TIMERS_MAX_OPS="10")
        proc = subprocess.run([sys.executable, "-m", "queen_timers", "schedule", "--file", str(rows)],
                              env=env, stdout=subprocess.PIPE, stderr=slave, text=True, timeout=60, cwd=ROOT)
        os.close(slave)
        slave = None
        shown = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the terminal's other side is closed and drained
                break
            if not chunk:
                break
            shown += chunk
    finally:
        if slave is not None:
            os.close(slave)
        os.close(master)
    assert proc.returncode == 0
    assert shown.decode() == "\roperations sent 10/20 (50%)\roperations sent 20/20 (100%)\r\n"


def test_a_key_repeated_anywhere_in_a_file_writes_nothing(db, database_url, tmp_path):
    rows = _rows_file(tmp_path / "rows.jsonl", 6)
    with open(rows, "a") as f:
        f.write(json.dumps({"op": "cancel", "queue": "bulk", "timerKey": "k00001"}) + "\n")
    proc = run("schedule", "--file", str(rows), url=database_url, env={"QUEEN_TIMERS_MAX_OPS": "2"})
    assert proc.returncode == 2 and "line 7: (bulk, k00001) appears more than once" in proc.stderr
    assert timer_count(db) == 0
