"""Encryption happens at schedule: the stored payload of a timer bound for a queue that
encrypts at rest is Queen's envelope, and peek shows the envelope, never the plaintext."""

from __future__ import annotations

import base64
import json
import os

import pytest
import zstandard

from queen_timers import payloads
from timers_util import HINT, assert_error, b64, op, post, rows

KEY_HEX = "00112233445566778899aabbccddeeff" * 2
KEY = bytes.fromhex(KEY_HEX)


@pytest.fixture
def enc_client(broker_factory, db):
    db.execute("INSERT INTO queen.queues (name, encryption_enabled) VALUES ('secret', true)")
    with broker_factory(QUEEN_ENCRYPTION_KEY=KEY_HEX).client() as c:
        yield c


def test_encrypting_queue_stores_the_envelope(enc_client, db):
    r = post(enc_client, op("schedule", "k", queue="secret", payload=b64(b"card 4242")))
    assert r.json()["results"][0]["status"] == "scheduled"
    [row] = rows(db)
    assert row["encrypted"] is True and row["payload_zstd"] is False
    assert b"card 4242" not in row["payload"]
    assert payloads.decrypt(KEY, row["payload"]) == b"card 4242"
    peek = enc_client.get("/api/v1/timers/secret/k").json()
    assert peek["encrypted"] is True and peek["payloadZstd"] is False
    envelope = json.loads(base64.b64decode(peek["payload"]))
    assert payloads.is_envelope(envelope)
    assert base64.b64decode(peek["payload"]) == row["payload"]


def test_a_batch_for_an_encrypting_queue_is_written_once(enc_client, db):
    """The route asks which queues encrypt in the statement that schedules: a batch that
    names one is not written by that first statement (only once, encrypted), so every
    op is scheduled, not rescheduled, and billed once."""
    r = post(enc_client, op("schedule", "a", queue="plain"), op("schedule", "b", queue="secret"),
             op("reschedule", "c", queue="secret"))
    assert [v["status"] for v in r.json()["results"]] == ["scheduled", "scheduled", "scheduled"]
    usage = db.execute("SELECT pending_timers, billed_messages FROM queen.tenant_usage "
                       "WHERE tenant = 'default'").fetchone()
    assert (usage["pending_timers"], usage["billed_messages"]) == (3, 3)
    assert {row["timer_key"]: row["encrypted"] for row in rows(db)} == {"a": False, "b": True, "c": True}


def test_zstd_is_inflated_before_encryption(enc_client, db):
    packed = zstandard.ZstdCompressor().compress(b"hello " * 50)
    post(enc_client, op("schedule", "z", queue="secret", payload=b64(packed), payloadZstd=True))
    [row] = rows(db)
    assert row["payload_zstd"] is False and row["encrypted"] is True
    assert payloads.decrypt(KEY, row["payload"]) == b"hello " * 50


def test_reschedule_encrypts_too_and_other_queues_do_not(enc_client, db):
    post(enc_client, op("schedule", "k", queue="secret"), op("schedule", "k", queue="plain"))
    post(enc_client, op("reschedule", "k", queue="secret", payload=b64(b"v2")))
    by_queue = {r["queue"]: r for r in rows(db)}
    assert payloads.decrypt(KEY, by_queue["secret"]["payload"]) == b"v2"
    assert by_queue["plain"]["encrypted"] is False
    assert by_queue["plain"]["payload"] == b'{"kind":"day7"}'


@pytest.mark.parametrize("value", [True, False])
def test_client_encrypted_field_is_refused_for_an_encrypting_queue(enc_client, db, value):
    r = post(enc_client, op("schedule", "k", queue="secret", encrypted=value))
    body = assert_error(r, 400, "timers_bad_request")
    assert "encrypted" in body["detail"]
    assert rows(db) == []


def test_client_encrypted_true_is_stored_as_given_for_a_plain_queue(client, db):
    sealed = payloads.encrypt(os.urandom(32), b"client-side")
    post(client, op("schedule", "k", payload=b64(sealed), encrypted=True))
    [row] = rows(db)
    assert row["encrypted"] is True and row["payload"] == sealed


def test_encrypting_queue_without_a_key_is_403_feature_gated(client, db):
    db.execute("INSERT INTO queen.queues (name, encryption_enabled) VALUES ('secret', true)")
    r = post(client, op("schedule", "k", queue="secret"), op("schedule", "k", queue="plain"))
    body = assert_error(r, 403, "feature_gated")
    assert "QUEEN_ENCRYPTION_KEY" in body["detail"]
    assert r.headers["x-queen-timers-hint"] == HINT
    assert rows(db) == []
    # cancels into that queue are unaffected
    assert post(client, op("cancel", "k", queue="secret")).json()["results"][0]["status"] == "absent"



@pytest.mark.parametrize("staged", [False, True], ids=["batch", "staged batch"])
def test_the_ladder_comes_before_the_missing_key(broker_factory, db, staged):
    # The contract's rungs, in order, then the broker's own 403: a paused cell is 503
    # (retry later), not 403 (retrying will not help), and a batch over the horizon is its
    # own refusal; a staged batch (its payloads past QUEEN_TIMERS_STAGE_BYTES) the same.
    env = {"QUEEN_TIMERS_STAGE_BYTES": "0"} if staged else {}
    db.execute("INSERT INTO queen.queues (name, encryption_enabled) VALUES ('secret', true)")
    with broker_factory(**env).client() as c:
        db.execute("SELECT queen.pause_scheduling()")
        r = post(c, op("schedule", "k", queue="secret"))
        assert_error(r, 503, "timers_disabled")
        assert int(r.headers["Retry-After"]) >= 1 and r.headers["x-queen-timers-hint"] == HINT
        db.execute("SELECT queen.resume_scheduling()")
        assert_error(post(c, op("schedule", "k", queue="secret", delayMs=10 ** 15)), 403, "timer_horizon_exceeded")
        assert "QUEEN_ENCRYPTION_KEY" in assert_error(post(c, op("schedule", "k", queue="secret")),
                                                      403, "feature_gated")["detail"]
        assert rows(db) == []


def test_the_missing_key_is_logged_once_a_minute_not_once_a_request(spawn_broker, db):
    # a line per request let any client write the broker's log as fast as it could send
    db.execute("INSERT INTO queen.queues (name, encryption_enabled) VALUES ('secret', true)")
    b = spawn_broker()
    with b.client() as c:
        for i in range(20):
            assert_error(post(c, op("schedule", f"k{i}", queue="secret")), 403, "feature_gated")
    assert b.log().count("QUEEN_ENCRYPTION_KEY is not set") == 1, b.log()[-2000:]


def test_the_ceiling_is_on_the_client_bytes_not_the_envelope(enc_client, db):
    # before: the ceiling was judged on the stored envelope (4/3 of the bytes plus 77), so a
    # payload of 800,000 bytes into an encrypting queue was 413, into a plain one 200 (Dec 8 review)
    at_ceiling = os.urandom(1048576)
    r = post(enc_client, op("schedule", "big", queue="secret", payload=b64(at_ceiling)),
             op("schedule", "mid", queue="secret", payload=b64(os.urandom(800_000))))
    assert [v["status"] for v in r.json()["results"]] == ["scheduled", "scheduled"], r.text
    stored = {row["timer_key"]: row["payload"] for row in rows(db)}
    assert payloads.decrypt(KEY, stored["big"]) == at_ceiling and len(stored["big"]) > 1048576
    r = post(enc_client, op("schedule", "over", queue="secret", payload=b64(os.urandom(1048577))))
    assert_error(r, 413, "payload_too_large")
    assert "1048577 bytes" in r.json()["detail"]
    # a zstd payload that inflates past the ceiling is refused by its decompressed size, as before
    packed = zstandard.ZstdCompressor().compress(b"\0" * 1048577)
    r = post(enc_client, op("schedule", "bomb", queue="secret", payload=b64(packed), payloadZstd=True))
    assert_error(r, 413, "payload_too_large")
    assert sorted(row["timer_key"] for row in rows(db)) == ["big", "mid"]
