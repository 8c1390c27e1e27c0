"""The README's front door, as a newcomer runs it: `make run` in a checkout with no cluster
yet creates one, installs the schema and serves on QUEEN_PORT, and the README's "Try it"
block, run verbatim by bash against it, schedules, peeks, receives the frame from the log
and gets `absent` from the cancel. A second `make run` reuses the cluster (created once) and
what it holds.

The checkout is a copy of Makefile and scripts/ in a /tmp folder with this checkout's .venv
linked in (the package is installed there); its cluster and broker use free ports."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psycopg
import pytest

from conftest import ROOT, create_database, free_port
from queen_timers.config import ConfigError, Settings

README = ROOT / "README.md"


def try_it_block() -> str:
    """The bash block under the README's "### Try it"."""
    text = README.read_text()
    section = text.split("### Try it", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def json_documents(text: str) -> list:
    """The JSON answers curl printed one after the other (no newline between them)."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        doc, i = decoder.raw_decode(text, i)
        out.append(doc)
    return out


class MakeRun:
    """`make -s run` in `checkout`, its output collected, stopped with SIGTERM to its group."""

    def __init__(self, checkout: Path, pg_port: int, http_port: int, **extra: str):
        env = {k: v for k, v in os.environ.items() if not k.startswith("QUEEN_")}
        env.update(QUEEN_PG_PORT=str(pg_port), QUEEN_PORT=str(http_port), QUEEN_PG_FSYNC="off", **extra)
        self.url = f"http://127.0.0.1:{http_port}"
        self.lines: list[str] = []
        self.proc = subprocess.Popen(["make", "-s", "run"], cwd=checkout, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_healthy(self, seconds: float = 90) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "make run ended:\n" + "\n".join(self.lines)
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError("make run's broker never answered /health:\n" + "\n".join(self.lines))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._reader.join(timeout=5)


@pytest.fixture
def fresh_checkout():
    checkout = Path(tempfile.mkdtemp(prefix="queen-quick-start-", dir="/tmp"))
    checkout.chmod(0o755)  # the cluster may run as `postgres` (root): it must reach .queen/pg
    shutil.copy2(ROOT / "Makefile", checkout / "Makefile")
    shutil.copytree(ROOT / "scripts", checkout / "scripts")
    (checkout / ".venv").symlink_to(ROOT / ".venv")
    try:
        yield checkout
    finally:
        subprocess.run([str(checkout / "scripts" / "pg-cluster"), "stop", str(checkout / ".queen" / "pg")],
                       check=False, capture_output=True)
        shutil.rmtree(checkout, ignore_errors=True)


def test_make_run_then_the_readmes_try_it_block(fresh_checkout):
    checkout, pg_port, http_port = fresh_checkout, free_port(), free_port()
    assert not (checkout / ".queen").exists()
    first = MakeRun(checkout, pg_port, http_port)
    try:
        first.wait_healthy()
        db_url = f"postgresql://postgres@127.0.0.1:{pg_port}/queen"
        assert f"embedded PostgreSQL: data directory {checkout}/.queen/pg/data" in first.lines
        assert any(db_url in line and "make stop-db" in line for line in first.lines), first.lines
        assert f"queen-timers broker on http://127.0.0.1:{http_port}" in first.lines
        assert (checkout / ".queen" / "pg" / "data" / "PG_VERSION").exists()

        # the block as printed, with B pointing at this broker instead of :6632
        block = try_it_block()
        assert "B=http://localhost:6632\n" in block
        script = block.replace("B=http://localhost:6632\n", f"B=http://127.0.0.1:{http_port}\n")
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        scheduled, peeked, popped, cancelled = json_documents(done.stdout)

        result = scheduled["results"][0]
        assert (result["ok"], result["status"], result["queue"], result["timerKey"], result["txn"]) == \
            (True, "scheduled", "reminders", "trial:acme:day7", "trial-acme-day7-v1")
        assert peeked["found"] is True and peeked["claimed"] is False
        assert peeked["payload"] == "eyJraW5kIjoiZGF5NyJ9"
        assert popped["success"] is True and popped["queue"] == "reminders" and popped["partition"] == "Default"
        (frame,) = popped["messages"]
        # "The frame's messageId is the one returned at schedule time"
        assert frame["id"] == result["messageId"]
        assert frame["transactionId"] == "trial-acme-day7-v1"
        assert frame["data"] == {"kind": "day7"} and frame["payloadBase64"] == "eyJraW5kIjoiZGF5NyJ9"
        assert cancelled == {"ok": False, "status": "absent", "queue": "reminders", "timerKey": "trial:acme:day7",
                             "txn": "trial-acme-day7-v1"}
        with httpx.Client(base_url=first.url) as c:  # one more, far out, to find after the restart
            r = c.post("/api/v1/timers", json={"operations": [
                {"op": "schedule", "queue": "reminders", "timerKey": "later", "delayMs": 3_600_000, "txn": "later-v1",
                 "payload": "bGF0ZXI="}]})
            assert r.status_code == 200 and r.json()["results"][0]["status"] == "scheduled", r.text
    finally:
        first.stop()
    assert first.proc.returncode is not None

    # the second make run: the same cluster (no initdb), the same data, the same broker port
    version_mtime = (checkout / ".queen" / "pg" / "data" / "PG_VERSION").stat().st_mtime_ns
    again = MakeRun(checkout, pg_port, http_port)
    try:
        again.wait_healthy()
        assert f"embedded PostgreSQL: data directory {checkout}/.queen/pg/data" in again.lines
        assert (checkout / ".queen" / "pg" / "data" / "PG_VERSION").stat().st_mtime_ns == version_mtime
        with httpx.Client(base_url=again.url) as c:
            assert c.get("/api/v1/timers/reminders/later").json()["found"] is True
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{pg_port}/queen") as conn:
            n = conn.execute("SELECT count(*) FROM queen.messages WHERE transaction_id = 'trial-acme-day7-v1'")
            assert n.fetchone()[0] == 1
    finally:
        again.stop()


def test_make_run_with_queen_database_url_uses_that_database_and_creates_no_cluster(fresh_checkout, admin_dsn):
    """The README: "Set QUEEN_DATABASE_URL to use any other PostgreSQL instead", and make run
    says which it reaches. A database with no schema yet gets it at start; the password in
    the URL is not printed; no embedded cluster is created."""
    url = create_database(admin_dsn, "quick_start_url", schema=False)
    info = psycopg.conninfo.conninfo_to_dict(url)
    with_password = f"postgresql://{info['user']}:s3cret@{info['host']}:{info['port']}/{info['dbname']}"
    run = MakeRun(fresh_checkout, free_port(), free_port(), QUEEN_DATABASE_URL=with_password)
    try:
        run.wait_healthy()
        masked = f"postgresql://{info['user']}:***@{info['host']}:{info['port']}/{info['dbname']}"
        assert f"PostgreSQL: {masked} (QUEEN_DATABASE_URL; no embedded cluster)" in run.lines, run.lines
        assert not any("s3cret" in line for line in run.lines)
        with httpx.Client(base_url=run.url) as c:
            r = c.post("/api/v1/timers", json={"operations": [
                {"op": "schedule", "queue": "reminders", "timerKey": "elsewhere", "delayMs": 3_600_000,
                 "txn": "elsewhere-v1", "payload": "e30="}]})
            assert r.status_code == 200 and r.json()["results"][0]["status"] == "scheduled", r.text
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT count(*) FROM queen.timers WHERE timer_key = 'elsewhere'").fetchone()[0] == 1
    finally:
        run.stop()
    assert not (fresh_checkout / ".queen").exists()


def test_the_readmes_default_ports_are_the_codes(fresh_checkout):
    """The quick start promises a broker on :6632 over a cluster on QUEEN_PG_PORT 6640. The
    test above runs on free ports; this one asks the code itself, with no QUEEN_* set: the
    broker's settings, and `make psql`, which looks for this checkout's cluster on its
    default port before anything else (there is none yet, or the port is another's)."""
    assert Settings.from_env({"QUEEN_DATABASE_URL": "postgresql://x/y"}).port == 6632
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUEEN_")}
    done = subprocess.run(["make", "-s", "psql"], cwd=fresh_checkout, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0
    assert re.search(r"\b(127\.0\.0\.1:6640|port 6640)\b", done.stderr), done.stderr
    assert not (fresh_checkout / ".queen" / "pg" / "data").exists()  # looked, created nothing


def test_a_port_out_of_range_stops_the_broker_at_start():
    for bad in ("0", "65536", "http"):
        with pytest.raises(ConfigError, match="QUEEN_PORT"):
            Settings.from_env({"QUEEN_DATABASE_URL": "postgresql://x/y", "QUEEN_PORT": bad})
    assert Settings.from_env({"QUEEN_DATABASE_URL": "postgresql://x/y", "QUEEN_PORT": "65535"}).port == 65535


def test_a_horizon_past_100_years_stops_the_broker_at_start():
    # past about 2.1e14 ms a negative delay clamped at minus the horizon overflowed the
    # timestamp, an HTTP 500 on every such schedule (Dec 7 audit)
    url = {"QUEEN_DATABASE_URL": "postgresql://x/y"}
    with pytest.raises(ConfigError, match="QUEEN_TIMERS_HORIZON_MS must be <= 3155760000000"):
        Settings.from_env({**url, "QUEEN_TIMERS_HORIZON_MS": "9223372036854775807"})
    assert Settings.from_env({**url, "QUEEN_TIMERS_HORIZON_MS": "3155760000000"}).timers_horizon_ms == 3155760000000


# Past these, the broker started healthy and then every sweeper cycle failed (PostgreSQL
# integer arguments), every request did (statement_timeout), tokens long expired were
# served (leeway), or the pool crashed after the migrations (Dec 7 configuration audit).
OUT_OF_RANGE = [
    ("QUEEN_SWEEPER_LEASE_MS", "2147483648", "2147483647"),
    ("QUEEN_SWEEPER_BATCH", "2147483648", "2147483647"),
    ("QUEEN_SWEEPER_MAX_ATTEMPTS", "2147483648", "2147483647"),
    ("QUEEN_SWEEPER_BACKOFF_MS", "2147483648", "2147483647"),
    ("QUEEN_SWEEPER_BACKOFF_MAX_MS", "2147483648", "2147483647"),
    ("QUEEN_SWEEPER_BATCH_BYTES", "9223372036854775808", "9223372036854775807"),
    ("QUEEN_STATEMENT_TIMEOUT_MS", "2147483648", "2147483647"),
    ("QUEEN_TIMERS_MAX_OPS", "10001", "10000"),
    ("QUEEN_POP_MAX_BYTES", str((1 << 30) + 1), str(1 << 30)),
    ("QUEEN_JWT_LEEWAY_SECONDS", "3601", "3600"),
    ("QUEEN_POOL_MAX", "1001", "1000"),
]


@pytest.mark.parametrize("name, over, most", OUT_OF_RANGE, ids=[n for n, _, _ in OUT_OF_RANGE])
def test_a_value_past_what_it_can_be_stops_the_broker_at_start(name, over, most):
    url = {"QUEEN_DATABASE_URL": "postgresql://x/y", "QUEEN_BODY_BUDGET_BYTES": str(1 << 50),
           "QUEEN_SWEEPER_BACKOFF_MAX_MS": "2147483647"}
    with pytest.raises(ConfigError, match=f"{name} must be <= {most}"):
        Settings.from_env({**url, name: over})
    Settings.from_env({**url, name: most})


def test_inconsistent_pool_and_jwt_keys_stop_the_broker_at_start():
    url = {"QUEEN_DATABASE_URL": "postgresql://x/y"}
    with pytest.raises(ConfigError, match=r"QUEEN_POOL_MIN \(20\) must not exceed QUEEN_POOL_MAX \(10\)"):
        Settings.from_env({**url, "QUEEN_POOL_MIN": "20"})
    with pytest.raises(ConfigError, match="QUEEN_SWEEPER_MIN_SLEEP_MS must not exceed QUEEN_SWEEPER_MAX_SLEEP_MS"):
        Settings.from_env({**url, "QUEEN_SWEEPER_MIN_SLEEP_MS": "1001"})
    assert Settings.from_env({**url, "QUEEN_SWEEPER_MIN_SLEEP_MS": "1000"}).sweeper_min_sleep_ms == 1000
    # no LISTEN behind a transaction pooler without a direct URL: a minimum of 0 would poll without a pause
    pooled = {**url, "QUEEN_POOL_MODE": "transaction", "QUEEN_SWEEPER_MIN_SLEEP_MS": "0"}
    with pytest.raises(ConfigError, match="QUEEN_SWEEPER_MIN_SLEEP_MS=0 with QUEEN_POOL_MODE=transaction"):
        Settings.from_env(pooled)
    assert Settings.from_env({**pooled, "QUEEN_SWEEPER_MIN_SLEEP_MS": "1"}).sweeper_min_sleep_ms == 1
    assert Settings.from_env({**pooled, "QUEEN_DIRECT_DATABASE_URL": "postgresql://x/z"}).sweeper_min_sleep_ms == 0
    assert Settings.from_env({**url, "QUEEN_SWEEPER_MIN_SLEEP_MS": "0"}).sweeper_min_sleep_ms == 0
    jwt = {**url, "QUEEN_AUTH": "jwt"}
    with pytest.raises(ConfigError, match="not both"):
        Settings.from_env({**jwt, "QUEEN_JWT_SECRET": "s" * 32, "QUEEN_JWT_PUBLIC_KEY": "x"})
    with pytest.raises(ConfigError, match="is not a public key"):
        Settings.from_env({**jwt, "QUEEN_JWT_PUBLIC_KEY": "garbage"})
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode()
    with pytest.raises(ConfigError, match="is not a public key"):
        Settings.from_env({**jwt, "QUEEN_JWT_PUBLIC_KEY": pem})  # the private half
    public = private.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    assert Settings.from_env({**jwt, "QUEEN_JWT_PUBLIC_KEY": public}).jwt_public_key == public
    p384 = ec.generate_private_key(ec.SECP384R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    with pytest.raises(ConfigError, match="EC P-256"):
        Settings.from_env({**jwt, "QUEEN_JWT_PUBLIC_KEY": p384})


def test_integers_are_ascii_digits_and_the_backoff_pair_is_ordered():
    url = {"QUEEN_DATABASE_URL": "postgresql://x/y"}
    for raw in ("５６２９９", "1_000"):
        with pytest.raises(ConfigError, match="QUEEN_PORT must be an integer"):
            Settings.from_env({**url, "QUEEN_PORT": raw})
    assert Settings.from_env({**url, "QUEEN_PORT": "7000"}).port == 7000
    with pytest.raises(ConfigError, match=r"QUEEN_SWEEPER_BACKOFF_MS \(400000\) must not exceed"):
        Settings.from_env({**url, "QUEEN_SWEEPER_BACKOFF_MS": "400000"})
