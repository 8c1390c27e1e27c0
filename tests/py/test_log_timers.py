"""The user story of the log: a fired timer's txn is found in the destination queue and consumed.

Timers are created with the SQL functions (queen.schedule_timers ...), not the HTTP
timer routes, so these tests stand on the log surface alone. A broker's sweeper may
fire a due timer before the test calls queen.fire_due_timers itself; either way the
frame must end up in the queue, so the tests wait for it by condition, not by time.
"""

from __future__ import annotations

import base64
import time

from queen_timers import payloads

KEY_HEX = "22" * 32
SCHEDULE = """
SELECT * FROM queen.schedule_timers('default', ARRAY[
    ROW('schedule', %(queue)s, %(key)s, %(delay)s, %(txn)s, %(payload)s, %(partition)s, false, %(enc)s, NULL)::queen.timer_op])
"""


def schedule(db, queue, key, txn, payload: bytes, partition=None, delay_ms=0, encrypted=False):
    rows = db.execute(SCHEDULE, {"queue": queue, "key": key, "delay": delay_ms, "txn": txn,
                                 "payload": payload, "partition": partition, "enc": encrypted}).fetchall()
    assert [r["status"] for r in rows] == ["scheduled"]
    return rows[0]


def fire_and_find(db, client, queue, txn, partition="Default") -> dict:
    """Fire due timers ourselves, then find the frame through GET /api/v1/messages."""
    db.execute("SELECT * FROM queen.fire_due_timers(100)").fetchall()
    deadline = time.monotonic() + 15
    while True:
        part = db.execute("SELECT p.id FROM queen.partitions p JOIN queen.queues q ON q.id = p.queue_id "
                          "WHERE q.name = %s AND p.name = %s", (queue, partition)).fetchone()
        if part is not None:
            r = client.get(f"/api/v1/messages/{part['id']}/{txn}")
            if r.status_code == 200:
                return r.json()
            assert r.status_code == 404 and r.json() == {"error": "Message not found"}
        assert time.monotonic() < deadline, "the timer's frame never reached the log"
        time.sleep(0.1)
        db.execute("SELECT * FROM queen.fire_due_timers(100)").fetchall()


def test_a_fired_timer_is_found_by_txn_and_consumed(client, db):
    verdict = schedule(db, "reminders", "trial:acme:day7", "trial-acme-day7-v1", b'{"kind":"day7"}')
    detail = fire_and_find(db, client, "reminders", "trial-acme-day7-v1")
    assert detail["status"] == "pending"
    assert detail["id"] == str(verdict["message_id"])  # the messageId minted at schedule
    assert detail["payload"] == {"kind": "day7"} and detail["queue"] == "reminders"
    assert db.execute("SELECT count(*) AS n FROM queen.timers").fetchone()["n"] == 0

    res = client.get("/api/v1/pop/queue/reminders", params={"batch": 10})
    assert res.status_code == 200
    msgs = res.json()["messages"]
    assert [m["transactionId"] for m in msgs] == ["trial-acme-day7-v1"]
    assert msgs[0]["data"] == {"kind": "day7"} and msgs[0]["id"] == str(verdict["message_id"])
    ack = client.post("/api/v1/ack", json={"transactionId": msgs[0]["transactionId"],
                                           "partitionId": msgs[0]["partitionId"],
                                           "leaseId": msgs[0]["leaseId"], "status": "completed"})
    assert ack.json()[0]["success"] is True
    after = client.get(f"/api/v1/messages/{msgs[0]['partitionId']}/trial-acme-day7-v1").json()
    assert after["status"] == "completed"


def test_a_binary_timer_payload_comes_back_lossless(client, db):
    raw = bytes(range(256)) + b"\xff\xfe\x00"
    schedule(db, "bin", "k", "bin-1", raw, partition="acme")
    detail = fire_and_find(db, client, "bin", "bin-1", partition="acme")
    assert base64.b64decode(detail["payloadBase64"]) == raw
    res = client.get("/api/v1/pop/queue/bin/partition/acme")
    assert res.status_code == 200
    msg = res.json()["messages"][0]
    assert msg["partition"] == "acme"
    assert base64.b64decode(msg["payloadBase64"]) == raw
    assert msg["data"] == base64.b64encode(raw).decode()  # not JSON: data is the base64 text


def test_an_encrypted_timer_frame_is_read_in_plaintext(broker_factory, db):
    key = bytes.fromhex(KEY_HEX)
    broker = broker_factory(QUEEN_ENCRYPTION_KEY=KEY_HEX)
    envelope = payloads.encrypt(key, b'{"secret":true}')
    schedule(db, "vault", "k", "enc-1", envelope, encrypted=True)
    with broker.client() as client:
        detail = fire_and_find(db, client, "vault", "enc-1")
        assert detail["isEncrypted"] is True and detail["payload"] == {"secret": True}
        stored = db.execute("SELECT payload FROM queen.messages WHERE transaction_id = 'enc-1'").fetchone()
        assert bytes(stored["payload"]) == envelope
        msg = client.get("/api/v1/pop/queue/vault").json()["messages"][0]
        assert msg["data"] == {"secret": True}


def test_replay_of_a_timer_dead_letter_is_refused(client, db):
    # schedule and claim in one transaction: no sweeper can fire it in between
    with db.transaction():
        schedule(db, "jobs", "poison", "poison-1", b'{"x":1}')
        claim = db.execute("SELECT * FROM queen.claim_timers('log-test', 100, 60000)").fetchall()
    assert [c["timer_key"] for c in claim] == ["poison"]
    out = db.execute("SELECT queen.fail_timer('default', 'jobs', 'poison', %s, 'permanent', 'bad frame', 1) AS r",
                     (claim[0]["claim_id"],)).fetchone()
    assert out["r"] == "dead_lettered"

    page = client.get("/api/v1/dlq", params={"queue": "jobs", "partition": "Default"}).json()
    assert page["total"] == 1
    entry = page["messages"][0]
    assert entry["consumerGroup"] == "__QUEEN_TIMERS__" and entry["transactionId"] == "poison-1"
    assert entry["errorMessage"] == "bad frame" and entry["data"] == {"x": 1}
    r = client.post(f"/api/v1/dlq/{entry['dlqId']}/replay")
    assert r.status_code == 409
    assert r.json()["error"] == "dlq_replay_refused" and r.json()["detail"]
    # nothing changed: the dead letter is still there and nothing entered the log
    assert client.get("/api/v1/dlq", params={"queue": "jobs"}).json()["total"] == 1
    assert db.execute("SELECT count(*) AS n FROM queen.messages").fetchone()["n"] == 0
