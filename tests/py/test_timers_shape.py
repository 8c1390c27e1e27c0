"""400 timers_bad_request: every shape error is refused before any SQL and writes nothing."""

from __future__ import annotations

import pytest
import zstandard

from timers_util import assert_error, b64, op, post, rows


def refused(client, db, body, fragment: str, *, raw: bytes | None = None):
    """POST body (or raw bytes); expect 400 naming fragment; assert nothing was written."""
    if raw is not None:
        r = client.post("/api/v1/timers", content=raw, headers={"content-type": "application/json"})
    else:
        r = client.post("/api/v1/timers", json=body)
    out = assert_error(r, 400, "timers_bad_request")
    assert fragment in out["detail"], out
    assert rows(db) == []
    return out


def batch(*ops):
    # a valid schedule first: a refused batch must not write it either
    return {"operations": [op("schedule", "good"), *ops]}


@pytest.mark.parametrize("raw, fragment", [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"", "not valid JSON"),
    (b"[]", "JSON object"),
    (b"42", "JSON object"),
    (b"{}", "operations is required"),
    (b'{"operations": {"op": "schedule"}}', "must be an array"),
    (b'{"operations": [], "extra": 1}', "unknown field 'extra'"),
])
def test_body_shape(client, db, raw, fragment):
    refused(client, db, None, fragment, raw=raw)


@pytest.mark.parametrize("bad, fragment", [
    ({"op": "schedule", "timerKey": "k", "delayMs": 1, "txn": "t", "payload": "aGk="}, "queue is required"),
    ({"op": "schedule", "queue": "", "timerKey": "k", "delayMs": 1, "txn": "t", "payload": "aGk="}, "queue is required"),
    ({"op": "cancel", "queue": "q"}, "timerKey is required"),
    ({"op": "cancel", "queue": "q", "timerKey": 42}, "timerKey is required"),
    (op("schedule", "k", delayMs=...), "delayMs is required"),
    (op("reschedule", "k", delayMs=...), "delayMs is required"),
    (op("schedule", "k", delayMs="1000"), "delayMs must be an integer"),
    (op("schedule", "k", delayMs=1.5), "delayMs must be an integer"),
    (op("schedule", "k", delayMs=True), "delayMs must be an integer"),
    (op("schedule", "k", delayMs=2 ** 63), "out of range"),
    (op("schedule", "k", delayMs=-(2 ** 63) - 1), "out of range"),
    (op("schedule", "k", txn=...), "txn is required"),
    (op("schedule", "k", txn=""), "txn must be a non-empty string"),
    (op("schedule", "k", payload=...), "payload is required"),
    (op("schedule", "k", payload="not base64!"), "not valid base64"),
    (op("schedule", "k", payload="aGk"), "not valid base64"),  # missing padding
    (op("schedule", "k", payload=42), "base64 string"),
    (op("schedule", "k", payloadZstd=True), "not valid zstd"),
    (op("schedule", "k", payloadZstd="yes"), "payloadZstd must be a boolean"),
    (op("schedule", "k", encrypted="no"), "encrypted must be a boolean"),
    (op("schedule", "k", partition=""), "partition must be a non-empty string"),
    (op("schedule", "k", producerSub="billing-service"), "'producerSub' is owned by the server"),
    (op("schedule", "k", messageId="018f"), "'messageId' is owned by the server"),
    (op("schedule", "k", tenant="other"), "'tenant' is owned by the server"),
    (op("schedule", "k", _internal=1), "'_internal' is owned by the server"),
    (op("cancel", "k", producerSub="x"), "'producerSub' is owned by the server"),
    (op("schedule", "k", delay=1000), "unknown field 'delay'"),
    (op("cancel", "k", payload="aGk="), "'payload' does not apply to cancel"),
    ({"op": "upsert", "queue": "q", "timerKey": "k"}, "unknown op 'upsert'"),
    ({"queue": "q", "timerKey": "k"}, "unknown op None"),
    ("schedule", "must be an object"),
    (op("schedule", "k\u0000nul"), "NUL"),
])
def test_operation_shape(client, db, bad, fragment):
    out = refused(client, db, batch(bad), fragment)
    assert out["detail"].startswith("operation 1:") or "NUL" in fragment


def test_duplicate_queue_and_timer_key_in_one_batch(client, db):
    refused(client, db, batch(op("schedule", "k"), op("cancel", "k")), "appears more than once")
    # the same key on two queues is two timers
    assert post(client, op("schedule", "k"), op("schedule", "k", queue="other")).status_code == 200


def test_more_than_max_ops(broker_factory, db):
    b = broker_factory(QUEEN_TIMERS_MAX_OPS="3")
    with b.client() as c:
        refused(c, db, {"operations": [op("schedule", f"k{i}") for i in range(4)]}, "at most 3")
        assert post(c, *[op("schedule", f"k{i}") for i in range(3)]).status_code == 200


def test_max_ops_above_the_cell_default_is_the_brokers(broker_factory, db):
    b = broker_factory(QUEEN_TIMERS_MAX_OPS="300")
    with b.client() as c:
        r = post(c, *[op("schedule", f"k{i:03d}") for i in range(257)])
        assert r.status_code == 200, r.text
        assert len(r.json()["results"]) == 257 and len(rows(db)) == 257


def test_zstd_bad_frame_and_good_frame(client, db):
    good = zstandard.ZstdCompressor().compress(b"x" * 1000)
    refused(client, db, batch(op("schedule", "k", payload=b64(good[:-3]), payloadZstd=True)), "zstd")
    assert post(client, op("schedule", "k", payload=b64(good), payloadZstd=True)).status_code == 200


def test_delete_and_peek_shape(client, db):
    assert_error(client.delete("/api/v1/timers/reminders/"), 400, "timers_bad_request")
    assert_error(client.get("/api/v1/timers/reminders/"), 400, "timers_bad_request")
    assert_error(client.get("/api/v1/timers/reminders/%FF"), 400, "timers_bad_request")
    assert_error(client.delete("/api/v1/timers/reminders/a%00b"), 400, "timers_bad_request")


def test_list_limit_must_be_an_integer(client, db):
    for bad in ("ten", "1.5", "0x10"):
        out = assert_error(client.get("/api/v1/timers/reminders", params={"limit": bad}),
                           400, "timers_bad_request")
        assert "limit" in out["detail"]
