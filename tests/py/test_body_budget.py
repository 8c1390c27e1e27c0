"""Every legal request succeeds, and no request can exhaust the broker (issue 17).

At a reduced scale (QUEEN_TIMERS_MAX_OPS=8, so the largest legal batch is
8 payloads of 1 MiB): the worst legal batch answers 200 whatever the
statement timeout; a body past a count or nesting limit is refused while it
is still arriving; the budget of bodies in flight answers 503 with
Retry-After when it is full, keeps one tenant from starving another, and is
given back however a request ends (answered, refused, abandoned midway).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import time

import httpx
import pytest

from test_input_limits import NOTHING, assert_json_error, assert_still_healthy, read_response, written
from test_log_api import ack, pop, push
from timers_util import HINT, b64, op, post, token

MAX_OPS = 8
MiB = 1 << 20


def budget_in_use(broker) -> float:
    text = httpx.get(f"{broker.url}/metrics/prometheus", timeout=10).text
    return float(re.search(r"^queen_timers_body_budget_in_use_bytes (\S+)$", text, re.M).group(1))


def wait_budget_free(broker, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while budget_in_use(broker) != 0:
        assert time.monotonic() < deadline, f"the budget still holds {budget_in_use(broker)} bytes"
        time.sleep(0.05)


def open_post(port: int, path: str, length: int, first: bytes, headers: str = "") -> socket.socket:
    """A POST that announces `length` bytes and sends only `first`: it holds its weight."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    sock.sendall((f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {length}\r\n{headers}\r\n").encode() + first)
    return sock


def full_batch(prefix: str) -> tuple[list[dict], list[bytes]]:
    payloads = [os.urandom(MiB) for _ in range(MAX_OPS)]  # at the payload ceiling, incompressible
    return [op("schedule", f"{prefix}{i}", queue="big", payload=b64(p)) for i, p in enumerate(payloads)], payloads


@pytest.fixture
def small(spawn_broker):
    """A broker whose largest legal batch is 8 x 1 MiB; everything else at its default."""
    # a pop's bound small, so that the heaviest legal request is a log body (hold_share)
    return spawn_broker(QUEEN_TIMERS_MAX_OPS=str(MAX_OPS), QUEEN_BODY_WAIT_MS="300", QUEEN_POP_MAX_BYTES="1000000")


# ---------------------------------------------------------------------------
# 1. the worst legal batch succeeds
# ---------------------------------------------------------------------------

def test_the_full_legal_batch_succeeds_whatever_the_statement_timeout(spawn_broker, db):
    # 20 ms: below what writing 8 MiB takes (its COPY alone took 38 ms here); the batch is staged and
    # its transaction's timeout scaled. Not 2 ms: BEGIN and the SET LOCAL run under the plain setting,
    # and a loaded 2-core CI box once stalled a backend that long (a 503 in CI)
    b = spawn_broker(QUEEN_TIMERS_MAX_OPS=str(MAX_OPS), QUEEN_STATEMENT_TIMEOUT_MS="20")
    ops, payloads = full_batch("k")
    with b.client(timeout=120) as c:
        r = post(c, *ops)
    assert r.status_code == 200, r.text
    assert [v["status"] for v in r.json()["results"]] == ["scheduled"] * MAX_OPS
    stored = {row["timer_key"]: row["digest"] for row in db.execute(
        "SELECT timer_key, md5(payload) AS digest FROM queen.timers WHERE queue = 'big'").fetchall()}
    assert stored == {f"k{i}": hashlib.md5(p).hexdigest() for i, p in enumerate(payloads)}
    assert db.execute("SELECT count(*) AS n FROM queen.staged_payloads").fetchone()["n"] == 0
    usage = db.execute("SELECT billed_messages FROM queen.tenant_usage WHERE tenant = 'default'").fetchone()
    assert usage["billed_messages"] == MAX_OPS
    wait_budget_free(b)


def test_a_staged_batch_answers_as_an_inline_one_and_is_all_or_nothing(spawn_broker, db):
    staged = spawn_broker(QUEEN_TIMERS_MAX_OPS=str(MAX_OPS), QUEEN_TIMERS_STAGE_BYTES="0")
    small_ops = [op("schedule", "s1"), op("schedule", "s2"), op("cancel", "absent-one")]
    with staged.client() as c:
        first = post(c, *small_ops)
        again = post(c, *[op("reschedule", "s1"), op("cancel", "s2")])
    assert [v["status"] for v in first.json()["results"]] == ["scheduled", "scheduled", "absent"]
    assert [v["status"] for v in again.json()["results"]] == ["rescheduled", "cancelled"]
    # one payload over the ceiling: the gate refuses the whole batch, nothing is written or left staged
    ops, _ = full_batch("all-or-nothing")
    ops[-1]["payload"] = b64(os.urandom(MiB + 1))
    with staged.client(timeout=120) as c:
        r = post(c, *ops)
    assert_json_error(r, 413, "payload_too_large")
    assert db.execute("SELECT count(*) AS n FROM queen.timers WHERE queue = 'big'").fetchone()["n"] == 0
    assert db.execute("SELECT count(*) AS n FROM queen.staged_payloads").fetchone()["n"] == 0
    wait_budget_free(staged)


def test_a_refused_staged_batch_leaves_every_tenants_routes_working(spawn_broker, db):
    """A staged batch runs in a transaction; its refusal is a ROLLBACK, after which psycopg
    sends DEALLOCATE ALL on a connection where it prepared statements of its own (here the
    peeks', run six times). That dropped the statements the hot routes prepare through libpq,
    and every POST and DELETE on that connection answered 500 (found Dec 7). One pool
    connection, so that each request meets it."""
    from timers_util import JWT_SECRET
    b = spawn_broker(QUEEN_TIMERS_STAGE_BYTES="0", QUEEN_POOL_MAX="1", QUEEN_POOL_MIN="1",
                     QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET)
    acme, globex = token("read-write", tenant="acme"), token("read-write", tenant="globex")
    with b.client() as c:
        for tenant in (acme, globex):  # each hot route prepared once on the connection
            assert post(c, op("schedule", "before"), headers=tenant).status_code == 200
            assert c.delete("/api/v1/timers/reminders/before", headers=tenant).json()["status"] == "cancelled"
        for _ in range(6):
            assert c.get("/api/v1/timers/reminders/nothing", headers=acme).json()["found"] is False
        r = post(c, op("schedule", "near"), op("schedule", "far", delayMs=100 * 86400 * 1000), headers=acme)
        assert_json_error(r, 403, "timer_horizon_exceeded")
        for name, tenant in (("acme", acme), ("globex", globex)):
            r = post(c, op("schedule", f"{name}-after"), headers=tenant)
            assert r.status_code == 200 and r.json()["results"][0]["status"] == "scheduled", r.text
            r = c.delete(f"/api/v1/timers/reminders/{name}-after", headers=tenant)
            assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    assert db.execute("SELECT count(*) AS n FROM queen.timers").fetchone()["n"] == 0
    assert db.execute("SELECT count(*) AS n FROM queen.staged_payloads").fetchone()["n"] == 0
    assert "Traceback" not in b.log()


# ---------------------------------------------------------------------------
# 2. the parse stops at the excess, while the body is still arriving
# ---------------------------------------------------------------------------

def test_more_operations_than_the_cap_are_refused_before_the_body_ends(small, db):
    one = json.dumps(op("schedule", "x", payload=b64(b"y" * 20000))).encode()
    head = b'{"operations": [' + b",".join([one] * (MAX_OPS + 1)) + b","
    assert len(head) > 64 * 1024  # past the whole-body parse: the scan counts as the bytes arrive
    start = time.monotonic()
    with open_post(small.port, "/api/v1/timers", 10 * MiB, head) as sock:  # 9.8 MB never sent
        status, headers, body = read_response(sock, timeout=5)
    assert time.monotonic() - start < 2
    assert status == 400 and headers["content-type"].startswith("application/json")
    assert json.loads(body)["detail"] == f"more than {MAX_OPS} operations; at most {MAX_OPS} per call"
    assert written(db) == NOTHING
    wait_budget_free(small)
    with small.client() as c:
        assert_still_healthy(c, db)


@pytest.mark.parametrize("path, head, detail", [
    # a 360 MB array of one-character strings, cut to what the test sends
    ("/api/v1/push", b'{"items": [' + b'"a",' * 30000, "more than 10000 JSON values"),
    # an object with millions of keys
    ("/api/v1/push", b'{' + b"".join(b'"k%d": 0,' % i for i in range(12000)), "more than 10000 JSON values"),
    # nesting past the limit, after a prefix long enough to be scanned
    ("/api/v1/push", b" " * 70000 + b"[" * 200, "nests deeper than 128 levels"),
    # on the timer route, anything but operations is small or refused
    ("/api/v1/timers", b'{"operations": [], "padding": "' + b"p" * 70000, "outside the elements of 'operations'"),
], ids=["tiny-array", "many-keys", "deep", "timers-outside-operations"])
def test_a_body_past_a_json_limit_is_refused_while_it_arrives(spawn_broker, db, path, head, detail):
    b = spawn_broker(QUEEN_JSON_MAX_VALUES="10000", QUEEN_LOG_MAX_BODY_BYTES=str(4 * MiB))
    start = time.monotonic()
    with open_post(b.port, path, 4 * MiB, head) as sock:
        status, headers, body = read_response(sock, timeout=5)
    assert time.monotonic() - start < 2
    assert status == 400 and headers["content-type"].startswith("application/json"), body
    answer = json.loads(body)
    assert answer["error"] == "timers_bad_request" and detail in answer["detail"], answer
    assert written(db) == NOTHING
    wait_budget_free(b)


def test_a_small_body_counts_its_values_too(spawn_broker, db):
    b = spawn_broker(QUEEN_JSON_MAX_VALUES="100")
    with b.client() as c:
        r = c.post("/api/v1/push", content=json.dumps({"items": [{"queue": "q", "payload": list(range(200))}]}))
        assert_json_error(r, 400, "timers_bad_request")
        assert "more than 100 JSON values" in r.json()["detail"]
        assert c.post("/api/v1/push", json={"items": [{"queue": "q", "payload": list(range(50))}]}).status_code == 201


# ---------------------------------------------------------------------------
# 3. the budget: 503 with Retry-After when full, never held past a request
# ---------------------------------------------------------------------------

def test_the_budget_answers_503_with_retry_after_and_is_released_however_a_request_ends(small, db):
    holder = hold_share(small)
    try:
        with small.client() as c:
            r = post(c, op("schedule", "waits"))
            body = assert_json_error(r, 503, "timers_unavailable")
            assert r.headers["retry-after"] == "1" and "QUEEN_BODY_BUDGET_BYTES" in body["detail"], r.headers
            assert r.headers["x-queen-timers-hint"] == HINT  # the route the hint names has no body:
            # a request without a body is not held up
            assert c.delete("/api/v1/timers/reminders/nothing").json()["status"] == "absent"
            text = c.get("/metrics/prometheus").text
            assert re.search(r"^queen_timers_body_budget_refusals_total 1\.0$", text, re.M), text
    finally:
        holder.close()  # the client goes away midway: what it held comes back
    wait_budget_free(small)
    with small.client() as c:
        assert post(c, op("schedule", "after-disconnect")).status_code == 200
        wait_budget_free(small)
        # refused for its JSON, its size announced large: released
        bad = b'{"operations": [' + b"!" * 100000
        assert_json_error(c.post("/api/v1/timers", content=bad), 400, "timers_bad_request")
        wait_budget_free(small)
        # chunked, abandoned after a few chunks
    with socket.create_connection(("127.0.0.1", small.port), timeout=20) as sock:
        sock.sendall(b"POST /api/v1/push HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + b"%x\r\n%s\r\n" % (70000, b" " * 70000))
        deadline = time.monotonic() + 5
        while budget_in_use(small) == 0:
            assert time.monotonic() < deadline, "a chunked body is weighed as it arrives"
            time.sleep(0.05)
    wait_budget_free(small)
    with small.client() as c:
        assert_still_healthy(c, db)
    wait_budget_free(small)


def hold_share(broker, headers: str = "") -> socket.socket:
    """A push that announces the log routes' largest body and sends 6 bytes of it: with
    the default budget (twice the largest weight, a log body's here) it holds its tenant's
    whole share, half the budget, until the socket closes."""
    from queen_timers.bodies import LOG_WEIGHT
    from queen_timers.config import Settings
    settings = Settings.from_env({"QUEEN_DATABASE_URL": "postgresql://x", **broker.env})
    share = settings.body_budget_bytes // 2
    assert settings.log_max_body_bytes * LOG_WEIGHT == share
    sock = open_post(broker.port, "/api/v1/push", settings.log_max_body_bytes, b'{"item', headers)
    deadline = time.monotonic() + 5
    while budget_in_use(broker) != share:
        assert time.monotonic() < deadline, budget_in_use(broker)
        time.sleep(0.05)
    return sock


def test_one_tenant_holding_its_share_never_starves_another(spawn_broker, db):
    from timers_util import JWT_SECRET
    b = spawn_broker(QUEEN_TIMERS_MAX_OPS=str(MAX_OPS), QUEEN_BODY_WAIT_MS="300", QUEEN_POP_MAX_BYTES="1000000",
                     QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET)
    acme = "".join(f"{k}: {v}\r\n" for k, v in token("read-write", tenant="acme").items())
    holder = hold_share(b, acme)
    try:
        with b.client() as c:
            r = post(c, op("schedule", "acme-2"), headers=token("write-only", tenant="acme"))
            assert_json_error(r, 503, "timers_unavailable")
            # globex's largest legal batch still fits: the other half is its to use
            ops, _ = full_batch("globex")
            r = post(c, *ops, headers=token("write-only", tenant="globex"))
            assert r.status_code == 200, r.text
            assert [v["status"] for v in r.json()["results"]] == ["scheduled"] * MAX_OPS
    finally:
        holder.close()
    wait_budget_free(b)


def test_a_stream_of_small_bodies_never_keeps_a_large_legal_one_out(spawn_broker, db):
    """acme holds its half of the budget; umbrella keeps small batches in flight at
    every moment, each body sent in two parts 40 ms apart (a slow client). globex's
    largest legal body needs the other half whole: the waiters are served in arrival
    order, so umbrella's later batches queue behind it instead of taking the room as
    it frees (before, globex waited out QUEEN_BODY_WAIT_MS and got 503 while umbrella
    was served throughout)."""
    import threading

    from timers_util import JWT_SECRET
    b = spawn_broker(QUEEN_TIMERS_MAX_OPS=str(MAX_OPS), QUEEN_POP_MAX_BYTES="1000000",
                     QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET)
    acme = "".join(f"{k}: {v}\r\n" for k, v in token("read-write", tenant="acme").items())
    umbrella_head = "".join(f"{k}: {v}\r\n" for k, v in token("write-only", tenant="umbrella").items())
    stop = threading.Event()
    answers: list[int] = []

    def umbrella(n: int) -> None:
        time.sleep(n * 0.01)  # staggered: one of them holds weight at every moment
        i = 0
        while not stop.is_set():
            body = json.dumps({"operations": [op("schedule", f"u{n}-{i}")]}).encode()
            with open_post(b.port, "/api/v1/timers", len(body), body[:10], umbrella_head) as sock:
                time.sleep(0.04)
                sock.sendall(body[10:])
                answers.append(read_response(sock)[0])
            i += 1

    from queen_timers.config import Settings
    cap = Settings.from_env({"QUEEN_DATABASE_URL": "postgresql://x", **b.env}).log_max_body_bytes
    item = {"queue": "bulk", "payload": {"blob": "z" * 2000}}
    items = [item] * ((cap - 100) // (len(json.dumps(item).encode()) + 2) - 1)
    body = json.dumps({"items": items}).encode()
    body += b" " * (cap - len(body))  # the cap exactly: it weighs the other half whole

    holder = hold_share(b, acme)
    streams = [threading.Thread(target=umbrella, args=(n,)) for n in range(4)]
    try:
        for t in streams:
            t.start()
        deadline = time.monotonic() + 10
        while len(answers) < 40:
            assert time.monotonic() < deadline, answers
            time.sleep(0.01)
        with b.client(timeout=60) as c:
            r = c.post("/api/v1/push", content=body, headers=token("read-write", tenant="globex"))
        assert r.status_code == 201, r.text
        served = len(answers)
        deadline = time.monotonic() + 10
        while len(answers) < served + 40:  # umbrella goes on once globex's body is done
            assert time.monotonic() < deadline, answers[-10:]
            time.sleep(0.01)
    finally:
        stop.set()
        for t in streams:
            t.join(30)
        holder.close()
    assert set(answers) == {200}, {s: answers.count(s) for s in set(answers)}
    n = db.execute("SELECT count(*) AS n FROM queen.messages").fetchone()["n"]  # globex's: umbrella's are due in an hour
    assert n == len(items)
    wait_budget_free(b)


def test_answers_that_hold_stored_payloads_are_weighed_before_they_are_fetched(small, db):
    """A message's detail, a DLQ page and a timer's peek hold payloads several times over:
    they wait for room in the budget as a pop does (before, they were built whatever the
    budget held: 500 lookups of an 8 MB message, one tenant's share of requests, were
    13 GB of answers). Routes without payloads (a list, a cancel) never wait."""
    with small.client() as c:
        push(c, {"queue": "held", "transactionId": "m1", "payload": {"k": 1}})
        assert post(c, op("schedule", "peeked")).status_code == 200
        popped = pop(c, "held", batch=1)["messages"][0]
        partition_id = popped["partitionId"]
        assert ack(c, popped, "dlq", error="bad")["dlq"] is True
    weighed = {"detail": f"/api/v1/messages/{partition_id}/m1", "dlq": "/api/v1/dlq?queue=held",
               "peek": "/api/v1/timers/reminders/peeked"}
    holder = hold_share(small)  # the tenant's half of the budget, held
    try:
        with small.client() as c:
            for name, path in weighed.items():
                err = assert_json_error(c.get(path), 503, "timers_unavailable")
                assert "QUEEN_BODY_BUDGET_BYTES" in err["detail"], (name, err)
            assert c.get("/api/v1/timers/reminders").status_code == 200  # a list holds no payload
            assert c.delete("/api/v1/timers/reminders/absent-one").json()["status"] == "absent"
    finally:
        holder.close()
    wait_budget_free(small)
    with small.client() as c:
        assert c.get(weighed["detail"]).json()["transactionId"] == "m1"
        assert [m["transactionId"] for m in c.get(weighed["dlq"]).json()["messages"]] == ["m1"]
        assert c.get(weighed["peek"]).json()["found"] is True
    wait_budget_free(small)  # each gave back what it held


def test_a_dlq_page_holds_at_most_the_pop_bytes_bound(spawn_broker, db):
    b = spawn_broker(QUEEN_POP_MAX_BYTES="1000000")
    blob = "x" * 300_000
    with b.client(timeout=60) as c:
        push(c, *({"queue": "dead", "transactionId": f"d{i}", "payload": {"b": blob}} for i in range(5)))
        for _ in range(5):
            assert ack(c, pop(c, "dead", batch=1)["messages"][0], "dlq")["dlq"] is True
        page = c.get("/api/v1/dlq", params={"queue": "dead", "limit": 100}).json()
        # three payloads of 300 KB fit 1,000,000 bytes, a fourth would not: offset + limit is the next page
        assert len(page["messages"]) == 3 and page["total"] == 5, page["pagination"]
        assert page["pagination"] == {"limit": 3, "offset": 0}
        rest = c.get("/api/v1/dlq", params={"queue": "dead", "limit": 100, "offset": 3}).json()
        assert len(rest["messages"]) == 2 and rest["pagination"] == {"limit": 100, "offset": 3}
        seen = [m["transactionId"] for m in page["messages"] + rest["messages"]]
        assert sorted(seen) == [f"d{i}" for i in range(5)]
        # a dead letter larger than the bound still comes, alone
        one = c.get("/api/v1/dlq", params={"queue": "dead", "limit": 1}).json()
        assert len(one["messages"]) == 1 and one["pagination"] == {"limit": 1, "offset": 0}


def test_a_dead_letters_error_is_cut_and_counted_against_the_page_and_a_messages_groups_are_capped(
        spawn_broker, db):
    # an HTTP review (Dec 7): acks stored errors of 7 MiB each, and a page of three of them was
    # a 22 MB answer under a bound of 16 MiB; 10,000 acks naming new groups made a 3 MB detail
    b = spawn_broker(QUEEN_POP_MAX_BYTES="20000")
    with b.client(timeout=60) as c:
        push(c, *({"queue": "dead", "transactionId": f"d{i}", "payload": {"n": i}} for i in range(3)))
        for _ in range(3):
            assert ack(c, pop(c, "dead", batch=1)["messages"][0], "dlq", error="é" * 20_000)["dlq"] is True
        stored = db.execute("SELECT length(error_message) AS chars, octet_length(error_message) AS bytes "
                            "FROM queen.dead_letter_queue").fetchall()
        assert stored == [{"chars": 8192, "bytes": 16384}] * 3  # the first 8,192 characters, whole
        page = c.get("/api/v1/dlq", params={"queue": "dead", "limit": 100}).json()
        # one entry of 16 KB of error fits 20,000 bytes, a second would not
        assert len(page["messages"]) == 1 and page["total"] == 3, page["pagination"]
        assert page["messages"][0]["errorMessage"] == "é" * 8192
        rest = c.get("/api/v1/dlq", params={"queue": "dead", "limit": 100, "offset": 1}).json()
        assert len(rest["messages"]) == 1

        m = pop(c, "dead", batch=1, consumerGroup="g-first")["messages"][0]
        acks = [{"transactionId": m["transactionId"], "partitionId": m["partitionId"], "status": "retry",
                 "consumerGroup": f"g-{i:05d}"} for i in range(1200)]
        r = c.post("/api/v1/ack/batch", json={"acknowledgments": acks})
        assert r.status_code == 200 and all(a["success"] for a in r.json()), r.text
        detail = c.get(f"/api/v1/messages/{m['partitionId']}/{m['transactionId']}").json()
        # the first 1,000 groups by name; the counts cover every one
        assert [g["name"] for g in detail["consumerGroups"]] == ["__QUEUE_MODE__"] + [f"g-{i:05d}" for i in range(999)]
        assert detail["mode"]["busGroupsCount"] == 1201 and detail["mode"]["hasQueueMode"] is True
    wait_budget_free(b)


def test_a_push_at_the_log_routes_cap_succeeds(spawn_broker, db):
    b = spawn_broker(QUEEN_LOG_MAX_BODY_BYTES=str(2 * MiB))
    item = {"queue": "bulk", "payload": {"blob": "z" * 2000}}
    items = [item] * ((2 * MiB - 100) // len(json.dumps(item).encode()) - 1)
    body = json.dumps({"items": items}).encode()
    assert 2 * MiB - 10000 < len(body) <= 2 * MiB
    with b.client() as c:
        r = c.post("/api/v1/push", content=body)
        assert r.status_code == 201, r.text
        assert db.execute("SELECT count(*) AS n FROM queen.messages").fetchone()["n"] == len(items)
        assert_json_error(c.post("/api/v1/push", content=body + b" " * (2 * MiB)), 413, "body_too_large")
    wait_budget_free(b)


def test_a_body_that_never_finishes_is_refused_after_the_body_timeout_and_gives_its_weight_back(spawn_broker, db):
    b = spawn_broker(QUEEN_BODY_TIMEOUT_MS="1000")
    start = time.monotonic()
    with open_post(b.port, "/api/v1/push", 100_000, b'{"items": [') as sock:
        assert budget_in_use(b) > 0
        status, headers, body = read_response(sock, timeout=10)
    assert 0.9 < time.monotonic() - start < 5
    assert status == 408 and headers["content-type"].startswith("application/json")
    assert json.loads(body)["error"] == "request_timeout"
    wait_budget_free(b)
    assert written(db) == NOTHING


# ---------------------------------------------------------------------------
# connections: a head that never completes, and more connections than allowed
# ---------------------------------------------------------------------------

def test_a_request_head_that_never_completes_is_408_and_closed(spawn_broker, db):
    b = spawn_broker(QUEEN_HEAD_TIMEOUT_MS="700")
    # a head trickled in (the slowloris), and a connection that sends nothing at all
    trickle = socket.create_connection(("127.0.0.1", b.port), timeout=10)
    silent = socket.create_connection(("127.0.0.1", b.port), timeout=10)
    start = time.monotonic()
    try:
        for part in (b"POST /api/v1/timers HTTP/1.1\r\n", b"Host: x\r\n", b"X-Slow: 1\r\n"):
            trickle.sendall(part)
            time.sleep(0.2)
        status, headers, body = read_response(trickle, timeout=5)
        assert status == 408 and headers["content-type"] == "application/json", body
        assert json.loads(body)["error"] == "request_timeout"
        assert 0.6 < time.monotonic() - start < 3
        assert silent.recv(65536).startswith(b"HTTP/1.1 408 ")
    finally:
        trickle.close()
        silent.close()
    with b.client() as c:  # a head that arrives in time is served as ever
        assert_still_healthy(c, db)


def test_a_later_head_on_a_kept_alive_connection_gets_its_own_whole_timeout(spawn_broker, db):
    # the head's timer is armed lazily (server.py): armed by the first request's head, it
    # fires while the second head trickles in, and must count from that head's own start
    b = spawn_broker(QUEEN_HEAD_TIMEOUT_MS="1000")
    sock = socket.create_connection(("127.0.0.1", b.port), timeout=10)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock, timeout=5)[0] == 200
        time.sleep(0.6)  # idle, kept alive: no head open when the first timer fires at 1 s
        start = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        time.sleep(0.7)  # the first head's timer has fired by now; this head is 0.7 s old
        sock.sendall(b"Host: x\r\n\r\n")
        status, _, body = read_response(sock, timeout=5)
        assert status == 200, body  # served: 0.7 s is within this head's own 1 s
        start = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # a third head that never completes
        status, headers, body = read_response(sock, timeout=5)
        assert status == 408 and json.loads(body)["error"] == "request_timeout"
        assert 0.9 < time.monotonic() - start < 3
    finally:
        sock.close()


def test_an_idle_kept_alive_connection_is_closed_its_whole_keep_alive_after_its_last_answer(spawn_broker, db):
    # uvicorn's keep-alive timeout (5 s), armed lazily (server.py): the timer the first
    # answer armed fires while the connection has been idle only since a later one
    b = spawn_broker()
    sock = socket.create_connection(("127.0.0.1", b.port), timeout=15)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock, timeout=5)[0] == 200
        time.sleep(2.5)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock, timeout=5)[0] == 200
        last = time.monotonic()
        sock.settimeout(15)
        assert sock.recv(1) == b""  # closed by the broker, without a word
        assert 4.5 < time.monotonic() - last < 7
    finally:
        sock.close()
    # a request served longer than the keep-alive (a long poll) is not cut by the timer an
    # earlier answer armed: the connection goes on
    with b.client() as c:
        assert c.post("/api/v1/configure", json={"queue": "quiet", "options": {}}).status_code == 200
    sock = socket.create_connection(("127.0.0.1", b.port), timeout=15)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock, timeout=5)[0] == 200
        start = time.monotonic()
        sock.sendall(b"GET /api/v1/pop/queue/quiet?wait=true&timeout=6500 HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock, timeout=15)[0] == 204
        assert time.monotonic() - start > 6
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock, timeout=5)[0] == 200
    finally:
        sock.close()


# ---------------------------------------------------------------------------
# a pop's answer: bounded by bytes, weighed while it is built
# ---------------------------------------------------------------------------

def test_a_pop_hands_out_at_most_its_bytes_bound_whatever_the_batch(spawn_broker, db):
    b = spawn_broker(QUEEN_POP_MAX_BYTES="50000")
    with b.client() as c:
        blob = "z" * 19990  # stored as the JSON string: 19,992 bytes
        r = c.post("/api/v1/push", json={"items": [{"queue": "fat", "payload": blob} for _ in range(10)]})
        assert r.status_code == 201, r.text
        first = c.get("/api/v1/pop/queue/fat", params={"batch": 10000})
        assert first.status_code == 200, first.text
        assert len(first.json()["messages"]) == 3  # 0, 19,992 and 39,984 bytes before each: under 50,000
        wait_budget_free(b)
        rest = c.get("/api/v1/pop/queue/fat", params={"batch": 10000, "autoAck": "true"})
        assert rest.status_code == 204  # the partition is leased by the first pop
        # a long poll that finds nothing holds no weight while it waits
        assert c.get("/api/v1/pop/queue/empty", params={"wait": "true", "timeout": 300}).status_code == 204
        wait_budget_free(b)
