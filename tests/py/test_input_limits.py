"""Bounds on input (issue 8): body size, JSON depth, and the JSON shape of
every refusal, including unknown routes, wrong methods and unexpected errors.

Every refusal here is a JSON 4xx (or the documented 500), writes nothing,
and leaves the broker answering the next ordinary call.
"""

from __future__ import annotations

import json
import secrets
import socket
import time

import psycopg
import pytest

from conftest import create_database
from timers_util import assert_error, b64, op, post

CAP = 64 * 1024

# every route that reads a body, with a small valid body for it
BODY_ROUTES = [
    "/api/v1/timers",
    "/api/v1/push",
    "/api/v1/configure",
    "/api/v1/ack",
    "/api/v1/ack/batch",
    "/api/v1/system/timers/scheduling",
    "/api/v1/system/timers/fire",
]

WRITTEN_SQL = """
SELECT (SELECT count(*) FROM queen.timers) AS timers,
       (SELECT count(*) FROM queen.messages) AS messages,
       (SELECT count(*) FROM queen.queues) AS queues,
       (SELECT count(*) FROM queen.partitions) AS partitions,
       (SELECT scheduling_paused OR fire_paused FROM queen.cell_settings WHERE id) AS paused
"""


def verdicts(answer) -> list[dict]:
    """The per-operation verdicts of a POST /api/v1/timers answer (a bare
    array, or the {"results": [...]} envelope another branch introduces)."""
    return answer["results"] if isinstance(answer, dict) else answer


def written(db) -> dict:
    return db.execute(WRITTEN_SQL).fetchone()


NOTHING = {"timers": 0, "messages": 0, "queues": 0, "partitions": 0, "paused": False}


def assert_json_error(response, status: int, slug: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = assert_error(response, status, slug)
    assert isinstance(body.get("detail"), str) and body["detail"], body
    return body


def assert_still_healthy(c, db, key: str = "healthy-after") -> None:
    assert c.get("/health").status_code == 200
    r = post(c, op("schedule", key))
    assert r.status_code == 200, r.text
    assert db.execute("SELECT count(*) AS n FROM queen.timers WHERE timer_key = %s",
                      (key,)).fetchone()["n"] == 1


# ---------------------------------------------------------------------------
# raw HTTP: a Content-Length the client never sends, a chunked stream
# ---------------------------------------------------------------------------

def read_response(sock: socket.socket, timeout: float = 20) -> tuple[int, dict, bytes]:
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return status, headers, rest[:length]


def raw_post(port: int, path: str, head_extra: str, body_parts: list[bytes]) -> tuple[int, dict, dict]:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall((f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      f"Content-Type: application/json\r\n{head_extra}\r\n").encode())
        for part in body_parts:
            sock.sendall(part)
        status, headers, body = read_response(sock)
    return status, headers, json.loads(body)


def chunked(data: bytes, size: int = 8192) -> list[bytes]:
    """`data` as HTTP/1.1 chunks, WITHOUT the terminating zero chunk."""
    return [b"%x\r\n%s\r\n" % (len(data[i:i + size]), data[i:i + size]) for i in range(0, len(data), size)]


@pytest.fixture
def capped(broker_factory):
    return broker_factory(QUEEN_MAX_BODY_BYTES=str(CAP), QUEEN_LOG_MAX_BODY_BYTES=str(CAP))


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_a_content_length_over_the_cap_is_413_before_the_body_is_read(capped, db, path):
    # the client announces 10 MB and sends 10 bytes: the answer comes from the header alone
    status, headers, body = raw_post(capped.port, path, "Content-Length: 10000000\r\n", [b'{"operati'])
    assert status == 413, body
    assert headers["content-type"].startswith("application/json")
    assert body["error"] == "body_too_large" and str(CAP) in body["detail"], body
    assert written(db) == NOTHING
    with capped.client() as c:
        assert_still_healthy(c, db)


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_a_chunked_body_over_the_cap_is_413_once_the_streamed_bytes_pass_it(capped, db, path):
    # valid JSON all along (a huge payload string), never terminated: the
    # broker must refuse on the bytes it counted, not wait for the end
    start = json.dumps({"operations": [op("schedule", "big", payload=b64(b"x" * CAP))]}).encode()
    data = start[: CAP + 8192]
    status, headers, body = raw_post(capped.port, path, "Transfer-Encoding: chunked\r\n", chunked(data))
    assert status == 413, body
    assert body["error"] == "body_too_large", body
    assert written(db) == NOTHING
    with capped.client() as c:
        assert_still_healthy(c, db)


def test_a_chunked_body_under_the_cap_is_accepted(capped, db):
    body = json.dumps({"operations": [op("schedule", "streamed")]}).encode()
    parts = chunked(body, 16) + [b"0\r\n\r\n"]
    status, _, answer = raw_post(capped.port, "/api/v1/timers", "Transfer-Encoding: chunked\r\n", parts)
    assert status == 200, answer
    assert verdicts(answer)[0]["status"] == "scheduled"


def test_httpx_streaming_generator_over_the_cap(capped, db):
    """The same through an ordinary client streaming a generator (no Content-Length)."""
    def gen():
        yield b'{"operations": [{"op": "schedule", "queue": "q", "timerKey": "k", "payload": "'
        for _ in range(CAP // 4096 + 2):
            yield b"A" * 4096

    with capped.client() as c:
        try:
            r = c.post("/api/v1/timers", content=gen())
        except Exception as exc:  # noqa: BLE001 - the server may close before the client is done
            pytest.fail(f"no 413 before the connection closed: {exc!r}")
        assert_json_error(r, 413, "body_too_large")
    assert written(db) == NOTHING
    with capped.client() as c:
        assert_still_healthy(c, db)


def test_a_body_at_the_cap_is_read(capped, db):
    # exactly CAP bytes of valid JSON: not refused for size
    body = json.dumps({"operations": [op("schedule", "edge")]})
    body = body + " " * (CAP - len(body))
    assert len(body) == CAP
    with capped.client() as c:
        r = c.post("/api/v1/timers", content=body.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        r = c.post("/api/v1/timers", content=(body + " ").encode(), headers={"content-type": "application/json"})
        assert_json_error(r, 413, "body_too_large")


LISTLESS_ROUTES = ["/api/v1/configure", "/api/v1/ack", "/api/v1/lease/some-lease/extend",
                   "/api/v1/system/timers/scheduling", "/api/v1/system/timers/fire"]


@pytest.mark.parametrize("path", LISTLESS_ROUTES)
def test_a_body_without_a_list_takes_at_most_64_kib_whatever_the_log_cap(broker, db, path):
    # Such a body is decoded in one call at its end, so its size is what bounds that call
    # (a 3 MB configure dense in tiny objects held the loop for 0.5 s in the decoder alone).
    # At 64 KiB it is read; past it, 413 by Content-Length or once the streamed bytes pass.
    pad = b'{"junk": [' + b",".join([b'{"a":[]}'] * 8000) + b"]"
    assert len(pad) > CAP
    with broker.client() as c:
        r = c.post(path, content=pad + b"}", headers={"content-type": "application/json"})
        detail = assert_json_error(r, 413, "body_too_large")["detail"]
        assert "65536" in detail and "without a list" in detail, detail
    status, _, body = raw_post(broker.port, path, "Transfer-Encoding: chunked\r\n", chunked(pad))
    assert status == 413 and body["error"] == "body_too_large", body
    assert written(db) == NOTHING
    at_cap = b'{"queue": "fits", "options": {"junk": "' + b"j" * (CAP - 60)
    at_cap += b" " * (CAP - len(at_cap) - 3) + b'"}}'
    assert len(at_cap) == CAP
    with broker.client() as c:
        r = c.post("/api/v1/configure", content=at_cap, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        assert_still_healthy(c, db)


def test_default_cap_is_derived_from_max_ops(broker_factory, db):
    from queen_timers.bodies import default_max_body_bytes
    from queen_timers.config import Settings

    assert default_max_body_bytes(256) == 256 * (1_398_104 + 32_768) + 65_536
    settings = Settings.from_env({"QUEEN_DATABASE_URL": "postgresql://x", "QUEEN_TIMERS_MAX_OPS": "2"})
    assert settings.max_body_bytes == 2 * (1_398_104 + 32_768) + 65_536
    # a full batch of full-size payloads fits under the default
    b = broker_factory(QUEEN_TIMERS_MAX_OPS="2")
    big = b64(b"y" * (1 << 20))
    with b.client() as c:
        r = post(c, op("schedule", "a", payload=big), op("schedule", "b", payload=big))
        assert r.status_code == 200, r.text
        assert [v["status"] for v in verdicts(r.json())] == ["scheduled", "scheduled"]


# ---------------------------------------------------------------------------
# JSON nesting
# ---------------------------------------------------------------------------

DEEP = ("[" * 2000 + "]" * 2000).encode()


def deep_bodies() -> dict[str, bytes]:
    deep_obj = ('{"a":' * 2000 + "1" + "}" * 2000).encode()
    return {
        "/api/v1/timers": b'{"operations": ' + DEEP + b"}",
        "/api/v1/push": b'{"items": [{"queue": "q", "payload": ' + deep_obj + b"}]}",
        "/api/v1/configure": b'{"queue": "q", "options": ' + deep_obj + b"}",
        "/api/v1/ack": b'{"transactionId": "t", "partitionId": "00000000-0000-0000-0000-000000000000", '
                       b'"error": ' + DEEP + b"}",
        "/api/v1/ack/batch": b'{"acknowledgments": ' + DEEP + b"}",
        "/api/v1/system/timers/scheduling": b'{"paused": ' + DEEP + b"}",
        "/api/v1/system/timers/fire": DEEP,
    }


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_json_nested_2000_deep_is_400_on_every_body_route(client, db, path):
    r = client.post(path, content=deep_bodies()[path], headers={"content-type": "application/json"})
    body = assert_json_error(r, 400, "timers_bad_request")
    assert "128" in body["detail"], body
    assert written(db) == NOTHING
    assert_still_healthy(client, db)


def test_nesting_up_to_the_limit_is_accepted_and_brackets_in_strings_do_not_count(client, db):
    payload = json.loads("[" * 120 + "]" * 120)
    r = client.post("/api/v1/push", json={"items": [
        {"queue": "q", "transactionId": "deep-ok", "payload": payload},
        {"queue": "q", "transactionId": "brackets", "payload": "[" * 5000 + "{\\\"" + "{" * 500},
    ]})
    assert r.status_code == 201, r.text
    assert [x["status"] for x in r.json()] == ["queued", "queued"]
    r = client.post("/api/v1/push", json={"items": [
        {"queue": "q", "transactionId": "too-deep", "payload": json.loads("[" * 128 + "]" * 128)}]})
    assert_json_error(r, 400, "timers_bad_request")


@pytest.mark.parametrize("raw, deeper_than_2", [
    (b'{"a": [[1]]}', True),
    (b'{"a": [1], "b": {"c": 2}}', False),
    (b'{"a": "[[[[{{{{", "b": [1]}', False),            # brackets in a string, no escape in the body
    (b'{"a": "]]]]", "b": [[[1]]]}', True),              # a closing bracket in a string hides nothing
    (b'{"a": "\\"[[[[", "b": [1]}', False),            # an escaped quote does not end the string
    (b'{"a": "\\\\", "b": [[1]]}', True),              # an escaped backslash does not escape the quote
    (b'[["' + b"[" * 50, False),                        # an unterminated string runs to the end
])
def test_json_depth_is_counted_outside_strings(raw, deeper_than_2):
    """json_depth_exceeds cuts strings out by splitting on quotes when the body has no
    backslash, by a regex otherwise: both ways count only the brackets outside strings."""
    from queen_timers.bodies import json_depth_exceeds
    assert json_depth_exceeds(raw, 2) is deeper_than_2


def test_a_timer_payload_nested_2000_deep_is_delivered_as_base64_not_a_500(client, db):
    """The log hands out `data` as JSON when the bytes parse: a timer's bytes
    are anyone's, and a 2,000-deep array must not make pop a 500 (a message
    nobody could ever pop)."""
    r = post(client, op("schedule", "deep", queue="deepq", delayMs=-1000, payload=b64(DEEP)))
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    popped = None
    while popped is None and time.monotonic() < deadline:
        p = client.get("/api/v1/pop/queue/deepq", params={"wait": "true", "timeout": "2000"})
        assert p.status_code in (200, 204), p.text
        if p.status_code == 200:
            popped = p.json()["messages"][0]
    assert popped is not None, "the timer did not fire"
    assert popped["data"] == b64(DEEP) == popped["payloadBase64"]


def pop_one(c, queue: str) -> dict:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        p = c.get(f"/api/v1/pop/queue/{queue}", params={"wait": "true", "timeout": "2000"})
        assert p.status_code in (200, 204), p.text
        if p.status_code == 200:
            return p.json()["messages"][0]
    raise AssertionError("the timer did not fire")


def test_a_deep_payload_flagged_encrypted_pops_as_stored_not_a_500(broker_factory, db):
    """`encrypted: true` on a queue that does not encrypt: the frame is flagged,
    the key is loaded, and the bytes are no envelope (a 2,000-deep array)."""
    b = broker_factory(QUEEN_ENCRYPTION_KEY="11" * 32)
    with b.client() as c:
        r = post(c, op("schedule", "deep", queue="flagged", delayMs=-1000, payload=b64(DEEP), encrypted=True))
        assert r.status_code == 200, r.text
        popped = pop_one(c, "flagged")
    assert popped["payloadBase64"] == b64(DEEP)


@pytest.mark.parametrize("envelope", [
    b'{"encrypted":"","iv":"","authTag":""}',  # no nonce: AESGCM's ValueError, not InvalidTag
    b'{"encrypted":"AAAA","iv":"AAAAAAA=","authTag":"AAAA"}',  # a 5-byte nonce
    b'{"encrypted":"","iv":"AAAAAAAAAAAAAAAA","authTag":""}',  # no tag
    b'{"encrypted":1,"iv":[],"authTag":null}',
])
def test_an_envelope_that_cannot_open_pops_and_reads_as_stored_not_a_500(broker_factory, db, envelope):
    """A client may flag any bytes `encrypted` on a queue that does not encrypt: with a key
    loaded, the broker tries them as an envelope. One that cannot open is handed out as
    stored, by pop (with autoAck: a 500 there lost the message) and by message lookup."""
    b = broker_factory(QUEEN_ENCRYPTION_KEY="11" * 32)
    with b.client() as c:
        r = post(c, op("schedule", "fake", queue="fake-env", delayMs=-1000, payload=b64(envelope),
                       txn="t-fake", encrypted=True))
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 30
        while (p := c.get("/api/v1/pop/queue/fake-env", params={"autoAck": "true"})).status_code == 204:
            assert time.monotonic() < deadline, "the timer did not fire"
            time.sleep(0.1)
        assert p.status_code == 200, p.text
        [popped] = p.json()["messages"]
        assert popped["payloadBase64"] == b64(envelope)
        m = c.get(f"/api/v1/messages/{popped['partitionId']}/t-fake")
        assert m.status_code == 200, m.text
        assert m.json()["payloadBase64"] == b64(envelope)


# ---------------------------------------------------------------------------
# unknown routes, wrong methods, unexpected errors: JSON too
# ---------------------------------------------------------------------------

def test_an_unknown_route_is_a_json_404(client, db):
    for method, path in [("GET", "/nope"), ("POST", "/api/v1/nope"), ("GET", "/api/v2/timers/q")]:
        r = client.request(method, path)
        body = assert_json_error(r, 404, "not_found")
        assert path in body["detail"]


def test_head_on_pop_is_405_and_takes_nothing(client, db):
    """Starlette serves HEAD on a GET route by running it: on a pop that took a lease
    (with autoAck, consumed the messages) and answered none of them."""
    assert client.post("/api/v1/push", json={"items": [{"queue": "headq", "payload": {"n": 1}}]}).status_code == 201
    for path in ("/api/v1/pop/queue/headq?autoAck=true", "/api/v1/pop/queue/headq/partition/Default?autoAck=true",
                 "/api/v1/pop/queue/headq"):
        r = client.head(path)
        assert r.status_code == 405 and r.headers["allow"] == "GET", (path, r.status_code, r.headers)
    [m] = client.get("/api/v1/pop/queue/headq").json()["messages"]  # still there, and no lease held it
    assert m["data"] == {"n": 1}
    assert client.head("/api/v1/timers/reminders/k").status_code == 200  # a read: HEAD as GET


def test_a_trailing_slash_is_a_json_404_never_a_redirect(client, db):
    """Starlette's 307 to the path without (or with) the slash had no body, came before
    auth, and built its Location from the client's Host header."""
    for method, path in [("GET", "/api/v1/timers/"), ("GET", "/api/v1/dlq/"), ("POST", "/api/v1/push/"),
                         ("GET", "/health/"), ("POST", "/api/v1/timers/"), ("GET", "/metrics/prometheus/")]:
        r = client.request(method, path, headers={"Host": "evil.example"})
        body = assert_json_error(r, 404, "not_found")
        assert "location" not in r.headers and path in body["detail"], (path, r.headers)
    for path in ("/dashboard", "/dashboard/"):  # the page at both
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), path


def test_a_wrong_method_is_a_json_405_with_allow(client, db):
    for method, path in [("POST", "/health"), ("PUT", "/api/v1/timers"), ("PATCH", "/api/v1/timers/q/k"),
                         ("GET", "/api/v1/push")]:
        r = client.request(method, path)
        body = assert_json_error(r, 405, "method_not_allowed")
        assert r.headers.get("allow"), r.headers
        assert method in body["detail"]
    assert_still_healthy(client, db)


@pytest.fixture
def broken_db(admin_dsn):
    """A database of its own that a test may break (as a careless DBA could)."""
    url = create_database(admin_dsn, "queen_pytest_broken")
    yield url
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute('DROP DATABASE IF EXISTS "queen_pytest_broken" WITH (FORCE)')


def test_an_unexpected_error_is_a_json_500_and_the_broker_lives_on(spawn_broker, broken_db):
    b = spawn_broker(QUEEN_DATABASE_URL=broken_db, QUEEN_SWEEPER_MAX_SLEEP_MS="200")
    with psycopg.connect(broken_db, autocommit=True) as conn:
        # a Python bug path: a status function answering NULL where the broker expects a count
        conn.execute("""CREATE OR REPLACE FUNCTION queen.get_timer_status()
                        RETURNS TABLE (scheduling_paused boolean, fire_paused boolean, pending bigint)
                        LANGUAGE sql STABLE AS $$ SELECT false, false, NULL::bigint $$""")
        # a database error no mapping knows: the function is gone
        conn.execute("DROP FUNCTION queen.peek_timer(text, text, text, timestamptz)")
    with b.client() as c:
        r = c.get("/api/v1/system/timers")
        assert_json_error(r, 500, "internal_error")
        r = c.get("/api/v1/timers/q/k")
        assert_json_error(r, 500, "internal_error")
        assert c.get("/health").status_code == 200
        assert post(c, op("schedule", "still-works")).status_code == 200
    assert b.alive()
    assert "TypeError" in b.log()


# ---------------------------------------------------------------------------
# limits on names, in UTF-8 bytes: queue 255, timerKey 1024, txn 255, partition 255
# ---------------------------------------------------------------------------

OVER = [
    ("queue", {"queue": "q" * 256}, "queue is 256 bytes"),
    ("timerKey", {"key": "k" * 1025}, "timerKey is 1025 bytes"),
    ("timerKey 3 MB", {"key": "k" * 3_000_000}, "timerKey is 3000000 bytes"),
    ("timerKey in bytes", {"key": "€" * 342}, "timerKey is 1026 bytes"),
    ("txn", {"txn": "t" * 256}, "txn is 256 bytes"),
    ("partition", {"partition": "p" * 256}, "partition is 256 bytes"),
    ("lone surrogate", {"key": "k\ud800"}, "not valid Unicode"),
]


@pytest.mark.parametrize("name, fields, detail", OVER, ids=[o[0] for o in OVER])
def test_a_name_over_its_limit_is_400_on_post(client, db, name, fields, detail):
    key = fields.pop("key", "k")
    queue = fields.pop("queue", "reminders")
    # sent as ASCII JSON: a lone surrogate is legal JSON text ("\ud800") but no Unicode string
    content = json.dumps({"operations": [op("schedule", "fine"), op("schedule", key, queue=queue, **fields)]})
    r = client.post("/api/v1/timers", content=content.encode(), headers={"content-type": "application/json"})
    body = assert_json_error(r, 400, "timers_bad_request")
    assert detail in body["detail"], body
    assert written(db) == NOTHING
    assert_still_healthy(client, db)


def test_names_at_their_limits_are_accepted(client, db):
    r = post(client, op("schedule", "k" * 1024, queue="q" * 255, txn="t" * 255, partition="p" * 255),
             op("schedule", "€" * 341, queue="é" * 127, txn="€" * 85))
    assert r.status_code == 200, r.text
    assert [v["status"] for v in verdicts(r.json())] == ["scheduled", "scheduled"]
    r = client.get("/api/v1/timers/" + "q" * 255 + "/" + "k" * 1024)
    assert r.json()["found"] is True and r.json()["txn"] == "t" * 255
    r = client.get("/api/v1/timers/" + "q" * 255, params={"after": "a" * 1024})
    assert [row["timerKey"] for row in r.json()["rows"]] == ["k" * 1024]
    r = client.delete("/api/v1/timers/" + "q" * 255 + "/" + "k" * 1024, params={"txn": "t" * 255})
    assert r.json()["status"] == "cancelled"


@pytest.mark.parametrize("method, path, params, detail", [
    ("GET", "/api/v1/timers/q/" + "k" * 1025, {}, "timerKey is 1025 bytes"),
    ("DELETE", "/api/v1/timers/q/" + "k" * 1025, {}, "timerKey is 1025 bytes"),
    ("DELETE", "/api/v1/timers/q/" + "%E2%82%AC" * 342, {}, "timerKey is 1026 bytes"),
    ("GET", "/api/v1/timers/" + "q" * 256 + "/k", {}, "queue is 256 bytes"),
    ("DELETE", "/api/v1/timers/" + "q" * 256 + "/k", {}, "queue is 256 bytes"),
    ("GET", "/api/v1/timers/" + "q" * 256, {}, "queue is 256 bytes"),
    ("GET", "/api/v1/timers/q", {"after": "a" * 1025}, "after is 1025 bytes"),
    ("DELETE", "/api/v1/timers/q/k", {"txn": "t" * 256}, "txn is 256 bytes"),
    ("GET", "/api/v1/timers/q/" + "k" * 12_000, {}, "timerKey is 12000 bytes"),
    ("DELETE", "/api/v1/timers/q/" + "k" * 12_000, {}, "timerKey is 12000 bytes"),
])
def test_a_path_or_query_name_over_its_limit_is_400(client, db, method, path, params, detail):
    post(client, op("schedule", "k"))
    before = db.execute("SELECT timer_key, message_id FROM queen.timers").fetchall()
    r = client.request(method, path, params=params)
    body = assert_json_error(r, 400, "timers_bad_request")
    assert detail in body["detail"], body
    assert db.execute("SELECT timer_key, message_id FROM queen.timers").fetchall() == before
    assert_still_healthy(client, db)


@pytest.mark.parametrize("method, path, params", [
    ("DELETE", "/api/v1/timers/reminders/k", [("txn", "a"), ("txn", "b")]),
    ("GET", "/api/v1/timers/reminders", [("limit", "1"), ("limit", "2")]),
    ("GET", "/api/v1/timers/reminders", [("after", ""), ("after", "a")]),
    # without the rule the last (empty) timeout won: the 30 s default long poll
    ("GET", "/api/v1/pop/queue/reminders", [("wait", "true"), ("timeout", "x"), ("timeout", "")]),
    ("GET", "/api/v1/pop/queue/reminders", [("wait", "false"), ("wait", "true")]),
    ("GET", "/api/v1/pop/queue/reminders/partition/Default", [("batch", "1"), ("batch", "2")]),
    ("GET", "/api/v1/pop/queue/reminders", [("consumerGroup", "g"), ("consumerGroup", "h")]),
    ("GET", "/api/v1/pop/queue/reminders", [("autoAck", "true"), ("autoAck", "true")]),
    ("GET", "/api/v1/dlq", [("queue", "a"), ("queue", "b")]),
    ("GET", "/api/v1/system/timers/stats", [("buckets", "1"), ("buckets", "1")]),
])
def test_a_query_parameter_given_twice_is_a_json_400_at_once(client, db, method, path, params):
    """Which copy of a repeated parameter wins differs between servers (Starlette keeps
    the last): the broker refuses to guess, before any SQL, and changes nothing."""
    post(client, op("schedule", "k"))
    before = db.execute("SELECT timer_key, message_id FROM queen.timers").fetchall()
    started = time.monotonic()
    r = client.request(method, path, params=params, timeout=10)
    assert time.monotonic() - started < 5
    body = assert_json_error(r, 400, "timers_bad_request")
    assert f"query parameter {params[-1][0]} is given 2 times" in body["detail"], body
    assert db.execute("SELECT timer_key, message_id FROM queen.timers").fetchall() == before
    assert_still_healthy(client, db)


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_a_huge_key_in_the_path_is_a_json_400(client, db, method):
    """Past what the HTTP parser takes in one request head (h11: 16 KiB by
    default), the answer is still the documented JSON, not a bare 400/414."""
    path = "/api/v1/timers/q/" + "k" * 3_000_000
    with socket.create_connection(("127.0.0.1", client.base_url.port), timeout=20) as sock:
        try:
            sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        except OSError:
            pass  # the server may answer and close before it has read it all
        status, headers, body = read_response(sock)
    assert status == 400, body
    assert headers["content-type"].startswith("application/json"), headers
    answer = json.loads(body)
    assert answer["error"] == "timers_bad_request" and answer["detail"], answer
    assert_still_healthy(client, db)



def _raw_request(port: int, data: bytes) -> tuple[int, dict, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        try:
            sock.sendall(data)
        except OSError:
            pass  # the server may answer and close before it has read it all
        return read_response(sock)


@pytest.mark.parametrize("size, status", [(15 * 1024, 200), (17 * 1024, 400), (3_000_000, 400)])
def test_a_request_head_over_16_kib_is_a_json_400_whatever_makes_it_big(client, db, size, status):
    """The HTTP parser (httptools: llhttp has no limit of its own) refuses a request
    line plus headers over 16 KiB, h11's default and the documented limit, before the
    app sees it: a big header on a route that would answer 200 shows it is the parser's."""
    head = f"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: {'p' * size}\r\n\r\n".encode()
    got, headers, body = _raw_request(client.base_url.port, head)
    assert got == status, body[:200]
    if status == 400:
        assert headers["content-type"].startswith("application/json"), headers
        assert headers.get("connection") == "close", headers
        assert json.loads(body)["error"] == "timers_bad_request"
    assert_still_healthy(client, db)


def test_a_header_that_never_ends_is_refused_without_waiting_for_it(client, db):
    """A header value streamed without end (no CRLF) is refused once the head passes
    16 KiB, while the client is still sending: the parser buffers a header until it
    ends, so the broker must not wait for the end to count it."""
    with socket.create_connection(("127.0.0.1", client.base_url.port), timeout=20) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: ")
        sent = 0
        try:
            while sent < 64 * 1024 * 1024:  # far more than any limit: the broker must stop us first
                sock.sendall(b"p" * 65536)
                sent += 65536
        except OSError:  # the broker answered and closed
            pass
        assert sent < 64 * 1024 * 1024, "the broker kept reading a never-ending header"
        status, headers, body = read_response(sock)
    assert status == 400, body[:200]
    assert headers["content-type"].startswith("application/json"), headers
    assert json.loads(body)["error"] == "timers_bad_request"
    assert_still_healthy(client, db)


@pytest.mark.parametrize("raw", [b"NOT HTTP AT ALL\r\n\r\n", b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
                                 b"GET /health HTTP/1.1\r\nBad Header Name: x\r\n\r\n",
                                 b"GET /api/v1/timers/q/k\xff HTTP/1.1\r\nHost: x\r\n\r\n"])
def test_a_malformed_request_is_a_json_400(client, db, raw):
    status, headers, body = _raw_request(client.base_url.port, raw)
    assert status == 400, body
    assert headers["content-type"].startswith("application/json"), headers
    answer = json.loads(body)
    assert answer["error"] == "timers_bad_request" and answer["detail"], answer
    assert_still_healthy(client, db)


# the log routes check the same numbers before any SQL

LOG_OVER = [
    ("POST", "/api/v1/push", {"items": [{"queue": "q" * 256, "payload": 1}]}, "queue is 256 bytes"),
    ("POST", "/api/v1/push", {"items": [{"queue": "q", "payload": 1},
                                        {"queue": "q", "partition": "p" * 256, "payload": 1}]},
     "items[1].partition is 256 bytes"),
    ("POST", "/api/v1/push", {"items": [{"queue": "q", "transactionId": "t" * 256, "payload": 1}]},
     "transactionId is 256 bytes"),
    ("POST", "/api/v1/push", {"items": [{"queue": "q", "transactionId": "é" * 128, "payload": 1}]},
     "transactionId is 256 bytes"),
    ("POST", "/api/v1/push", {"items": [{"queue": "q", "payload": "\ud800"}]}, "not valid Unicode"),
    ("POST", "/api/v1/configure", {"queue": "q" * 256}, "queue is 256 bytes"),
    ("POST", "/api/v1/ack", {"transactionId": "t" * 256, "partitionId": "00000000-0000-0000-0000-000000000000"},
     "transactionId is 256 bytes"),
    ("POST", "/api/v1/ack/batch", {"acknowledgments": [
        {"transactionId": "t" * 256, "partitionId": "00000000-0000-0000-0000-000000000000"}]},
     "transactionId is 256 bytes"),
    ("GET", "/api/v1/pop/queue/" + "q" * 256, None, "queue is 256 bytes"),
    ("GET", "/api/v1/pop/queue/q/partition/" + "p" * 256, None, "partition is 256 bytes"),
    ("GET", "/api/v1/messages/00000000-0000-0000-0000-000000000000/" + "t" * 256, None,
     "transactionId is 256 bytes"),
    ("GET", "/api/v1/dlq?queue=" + "q" * 256, None, "queue is 256 bytes"),
    # a consumer group is a key of the cursors' index: over the limit it is a 400, not a 503
    ("GET", "/api/v1/pop/queue/q?consumerGroup=" + "g" * 256, None, "consumerGroup is 256 bytes"),
    ("GET", "/api/v1/pop/queue/q/partition/p?consumerGroup=" + "é" * 128, None, "consumerGroup is 256 bytes"),
    ("POST", "/api/v1/ack", {"transactionId": "t", "partitionId": "00000000-0000-0000-0000-000000000000",
                             "consumerGroup": "g" * 256}, "body.consumerGroup is 256 bytes"),
    ("POST", "/api/v1/ack/batch", {"consumerGroup": "g" * 256, "acknowledgments": []}, "consumerGroup is 256 bytes"),
    ("POST", "/api/v1/ack/batch", {"acknowledgments": [
        {"transactionId": "t", "partitionId": "00000000-0000-0000-0000-000000000000", "consumerGroup": "g" * 256}]},
     "acknowledgments[0].consumerGroup is 256 bytes"),
    ("POST", "/api/v1/transaction", {"operations": [
        {"type": "ack", "transactionId": "t", "partitionId": "00000000-0000-0000-0000-000000000000",
         "consumerGroup": "g" * 256}]}, "operations[0].consumerGroup is 256 bytes"),
    ("GET", "/api/v1/dlq?queue=q&consumerGroup=" + "g" * 256, None, "consumerGroup is 256 bytes"),
    ("POST", "/api/v1/configure", {"queue": "q", "namespace": "n" * 256}, "namespace is 256 bytes"),
    ("POST", "/api/v1/configure", {"queue": "q", "task": "t" * 256}, "task is 256 bytes"),
]


@pytest.mark.parametrize("method, path, body, detail", LOG_OVER)
def test_log_routes_refuse_names_over_their_limits(client, db, method, path, body, detail):
    content = None if body is None else json.dumps(body).encode()
    r = client.request(method, path, content=content, headers={"content-type": "application/json"})
    answer = assert_json_error(r, 400, "timers_bad_request")
    assert detail in answer["detail"], answer
    assert written(db) == NOTHING
    r = client.post("/api/v1/push", json={"items": [{"queue": "q" * 255, "partition": "p" * 255,
                                                     "transactionId": "t" * 255, "payload": 1}]})
    assert r.status_code == 201 and r.json()[0]["status"] == "queued", r.text


# JSON sets no limit on a number; past a 64-bit float's range, or an integer past 4,300 digits
# (Python's bound on writing one as text), there is no value to hold: a 400 that says so, not
# "not valid JSON"
BIG = "1" + "0" * 4300
NUMBER_RANGE = [
    ("timer delayMs", "/api/v1/timers",
     '{"operations":[{"op":"schedule","queue":"q","timerKey":"k","delayMs":%s,"txn":"t","payload":"eA=="}]}' % BIG),
    ("timer 1e400", "/api/v1/timers",
     '{"operations":[{"op":"schedule","queue":"q","timerKey":"k","delayMs":-1e400,"txn":"t","payload":"eA=="}]}'),
    ("push payload", "/api/v1/push", '{"items":[{"queue":"q","payload":{"n":%s}}]}' % BIG),
    # over 64 KB: read by the streaming scanner, item by item
    ("push, scanned", "/api/v1/push",
     '{"items":[' + ",".join(['{"queue":"q","payload":"%s"}' % ("x" * 1000)] * 80)
     + ',{"queue":"q","payload":[%s]}]}' % BIG),
]


@pytest.mark.parametrize("name, path, text", NUMBER_RANGE, ids=[n[0] for n in NUMBER_RANGE])
def test_a_number_beyond_a_float_is_a_400_that_names_it(client, db, name, path, text):
    r = client.post(path, content=text.encode(), headers={"content-type": "application/json"})
    answer = assert_json_error(r, 400, "timers_bad_request")
    assert answer["detail"] == ("the body holds a number beyond the broker's range: a 64-bit float's "
                                "(about 1.8e308), or an integer of more than 4,300 digits"), answer
    assert written(db) == NOTHING
    # a large number within range is still a value (the payload keeps it as a float)
    r = client.post("/api/v1/push", json={"items": [{"queue": "q", "payload": {"n": 1e300}}]})
    assert r.status_code == 201, r.text


# An integer past 64 bits is a value like any other: a pushed payload keeps its digits (orjson
# read it as a float, and 12345678901234567890123 was stored as 1.2345678901234568e+22), and
# a field that takes a 64-bit integer says it is out of range.
EXACT = ["12345678901234567890123", "18446744073709551617", "-9223372036854775809", "9" * 4300]


@pytest.mark.parametrize("route", ["push", "transaction", "push, scanned"])
def test_an_integer_past_64_bits_is_stored_digit_for_digit(client, db, route):
    payloads = ['{"id":%s,"n":[%s,1.5]}' % (n, n) for n in EXACT]
    items = ",".join('{"queue":"exact","transactionId":"t%d","payload":%s}' % (i, p)
                     for i, p in enumerate(payloads))
    if route == "push, scanned":  # over 64 KB: read by the streaming scanner, item by item
        items += "," + ",".join(['{"queue":"pad","payload":"%s"}' % ("x" * 1000)] * 80)
    if route == "transaction":
        text, status = '{"operations":[{"type":"push","items":[%s]}]}' % items, 200
    else:
        text, status = '{"items":[%s]}' % items, 201
    r = client.post(f"/api/v1/{'transaction' if route == 'transaction' else 'push'}", content=text.encode(),
                    headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    stored = {row["transaction_id"]: bytes(row["payload"]) for row in db.execute(
        "SELECT m.transaction_id, m.payload FROM queen.messages m JOIN queen.partitions p ON p.id = m.partition_id "
        "JOIN queen.queues q ON q.id = p.queue_id WHERE q.name = 'exact'").fetchall()}
    assert stored == {f"t{i}": p.encode() for i, p in enumerate(payloads)}
    popped = client.get("/api/v1/pop/queue/exact?batch=10&autoAck=true").json()["messages"]
    assert sorted((m["transactionId"], m["data"]) for m in popped) == \
        sorted((f"t{i}", json.loads(p)) for i, p in enumerate(payloads))


def test_a_64_bit_field_given_a_longer_integer_is_a_400_that_says_so(client, db):
    r = client.post("/api/v1/timers", content=(
        '{"operations":[{"op":"schedule","queue":"q","timerKey":"k","delayMs":12345678901234567890123,'
        '"txn":"t","payload":"eA=="}]}').encode(), headers={"content-type": "application/json"})
    answer = assert_json_error(r, 400, "timers_bad_request")
    assert answer["detail"] == "operation 0: delayMs is out of range (a 64-bit integer)", answer
    assert written(db) == NOTHING


def test_a_huge_random_consumer_group_is_a_json_400_not_a_503(client, db):
    # random hex does not compress: 12 KB reached the cursors' btree and failed there as a
    # capacity error (54000 -> 503 "the database cannot answer right now")
    group = secrets.token_hex(6000)
    assert client.post("/api/v1/push", json={"items": [{"queue": "hg", "payload": 1}]}).status_code == 201
    before = written(db)
    r = client.get("/api/v1/pop/queue/hg", params={"consumerGroup": group})
    answer = assert_json_error(r, 400, "timers_bad_request")
    assert "consumerGroup is 12000 bytes; at most 255" in answer["detail"], answer
    assert written(db) == before


def test_log_names_at_their_limits_are_accepted(client, db):
    group = "g" * 253 + "é"  # 255 bytes of UTF-8
    r = client.post("/api/v1/configure", json={"queue": "lim", "namespace": "n" * 255, "task": "t" * 255})
    assert r.status_code == 200 and r.json()["namespace"] == "n" * 255, r.text
    assert client.post("/api/v1/push", json={"items": [{"queue": "lim", "payload": {"n": 1}}]}).status_code == 201
    r = client.get("/api/v1/pop/queue/lim", params={"consumerGroup": group})
    assert r.status_code == 200, r.text
    m = r.json()["messages"][0]
    assert m["consumerGroup"] == group
    r = client.post("/api/v1/ack", json={"transactionId": m["transactionId"], "partitionId": m["partitionId"],
                                         "leaseId": m["leaseId"], "consumerGroup": group})
    assert r.status_code == 200 and r.json()[0]["success"] is True, r.text
