"""The log routes are scoped by the caller's tenant (QUEEN_AUTH=jwt, two tenants).

Tenant A (acme) and tenant B (globex) use a queue of the same name, `leakq`. For
every route, B must not see, take, change or be refused by A's queue: pop is 204,
a lookup is 404, the DLQ is empty, replay is 404, configure and push create B's own
queue of that name. Timers fire into the queue of the timer's tenant.
"""

from __future__ import annotations

import time

import pytest

from timers_util import JWT_SECRET, assert_error, b64, token

A = token("read-write", tenant="acme", sub="svc-a")
B = token("read-write", tenant="globex", sub="svc-b")
Q = "leakq"


@pytest.fixture
def c(jwt_client):
    return jwt_client


def push(c, headers, txn, queue=Q, payload=None, partition=None):
    item = {"queue": queue, "transactionId": txn, "payload": payload or {"from": txn}}
    if partition:
        item["partition"] = partition
    r = c.post("/api/v1/push", json={"items": [item]}, headers=headers)
    assert r.status_code == 201, r.text
    return r.json()[0]


def pop(c, headers, queue=Q, **params):
    r = c.get(f"/api/v1/pop/queue/{queue}", params={"batch": 10, **params}, headers=headers)
    assert r.status_code in (200, 204), r.text
    return None if r.status_code == 204 else r.json()


def queues(db):
    return db.execute("SELECT tenant, name, lease_time FROM queen.queues ORDER BY tenant, name").fetchall()


def cursor(db, partition_id):
    return db.execute("SELECT last_consumed_seq, lease_id, lease_expires_at FROM queen.partition_consumers "
                      "WHERE partition_id = %s", (partition_id,)).fetchone()


def test_configure_makes_each_tenant_its_own_queue(c, db):
    a = c.post("/api/v1/configure", json={"queue": Q, "options": {"leaseTime": 30}}, headers=A)
    assert a.status_code == 200, a.text
    b = c.post("/api/v1/configure", json={"queue": Q, "options": {"leaseTime": 90}}, headers=B)
    assert b.status_code == 200, b.text
    assert a.json()["queueId"] != b.json()["queueId"]
    assert a.json()["partitionId"] != b.json()["partitionId"]
    # B's configure did not overwrite A's options
    assert queues(db) == [{"tenant": "acme", "name": Q, "lease_time": 30},
                          {"tenant": "globex", "name": Q, "lease_time": 90}]
    again = c.post("/api/v1/configure", json={"queue": Q, "options": {"leaseTime": 45}}, headers=A)
    assert again.json()["queueId"] == a.json()["queueId"]
    assert [q["lease_time"] for q in queues(db)] == [45, 90]


def test_push_goes_into_the_callers_queue(c, db):
    a = push(c, A, "leak-1")
    b = push(c, B, "leak-1")  # the same txn in the same-named queue: not a duplicate of A's
    assert (a["status"], b["status"]) == ("queued", "queued")
    assert a["partition_id"] != b["partition_id"]
    rows = db.execute("""SELECT q.tenant, m.transaction_id, m.producer_sub FROM queen.messages m
                           JOIN queen.partitions p ON p.id = m.partition_id JOIN queen.queues q ON q.id = p.queue_id
                          ORDER BY q.tenant""").fetchall()
    assert [(r["tenant"], r["producer_sub"]) for r in rows] == [("acme", "svc-a"), ("globex", "svc-b")]


def test_a_timer_fires_into_its_tenants_queue_and_b_cannot_pop_it(c, db):
    """The leak of the issue: A schedules a timer into leakq; B's pop took A's frame and its lease."""
    r = c.post("/api/v1/timers", headers=token("write-only", tenant="acme", sub="svc-a"), json={"operations": [
        {"op": "schedule", "queue": Q, "timerKey": "k1", "delayMs": 0, "txn": "leak-1",
         "payload": b64(b'{"secret":"acme"}')}]})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 20
    while db.execute("SELECT count(*) AS n FROM queen.messages").fetchone()["n"] == 0:
        assert time.monotonic() < deadline, "the sweeper never fired the timer"
        time.sleep(0.1)
    assert queues(db) == [{"tenant": "acme", "name": Q, "lease_time": 300}]
    part = db.execute("SELECT id FROM queen.partitions").fetchone()["id"]

    assert pop(c, B) is None
    r = c.get(f"/api/v1/pop/queue/{Q}/partition/Default", headers=B)
    assert r.status_code == 204
    assert cursor(db, part) is None  # B took no lease, created no consumer row
    assert queues(db) == [{"tenant": "acme", "name": Q, "lease_time": 300}]  # pop creates nothing

    got = pop(c, A)
    assert [m["transactionId"] for m in got["messages"]] == ["leak-1"]
    assert got["messages"][0]["data"] == {"secret": "acme"}


def test_ack_and_ack_batch_cannot_touch_another_tenants_message(c, db):
    push(c, A, "leak-1")
    msg = pop(c, A)["messages"][0]
    before = cursor(db, msg["partitionId"])
    body = {"transactionId": "leak-1", "partitionId": msg["partitionId"], "status": "completed"}
    r = c.post("/api/v1/ack", json=body, headers=B)
    assert r.status_code == 200
    assert r.json()[0]["success"] is False and r.json()[0]["error"] == "Message not found"
    r = c.post("/api/v1/ack/batch", json={"acknowledgments": [{**body, "status": "dlq"}]}, headers=B)
    assert r.json()[0]["success"] is False and r.json()[0]["error"] == "Message not found"
    assert cursor(db, msg["partitionId"]) == before  # A's cursor and lease untouched
    assert db.execute("SELECT count(*) AS n FROM queen.dead_letter_queue").fetchone()["n"] == 0
    # A's own ack still works with A's lease
    r = c.post("/api/v1/ack", json={**body, "leaseId": msg["leaseId"]}, headers=A)
    assert r.json()[0]["success"] is True


def test_message_lookup_is_404_for_another_tenant(c, db):
    a = push(c, A, "leak-1")
    r = c.get(f"/api/v1/messages/{a['partition_id']}/leak-1", headers=B)
    assert r.status_code == 404 and r.json() == {"error": "Message not found"}
    r = c.get(f"/api/v1/messages/{a['partition_id']}/leak-1", headers=A)
    assert r.status_code == 200 and r.json()["payload"] == {"from": "leak-1"}


def _dead_letter(c, headers, txn):
    push(c, headers, txn)
    msg = pop(c, headers)["messages"][0]
    r = c.post("/api/v1/ack", json={"transactionId": txn, "partitionId": msg["partitionId"], "status": "dlq",
                                    "error": "gave up", "leaseId": msg["leaseId"]}, headers=headers)
    assert r.json()[0]["dlq"] is True


def test_dlq_list_shows_only_the_callers_dead_letters(c, db):
    _dead_letter(c, A, "leak-1")
    for params in ({}, {"queue": Q}):
        r = c.get("/api/v1/dlq", params=params, headers=B)
        assert r.status_code == 200
        assert r.json()["messages"] == [] and r.json()["total"] == 0
        mine = c.get("/api/v1/dlq", params=params, headers=A).json()
        assert [m["transactionId"] for m in mine["messages"]] == ["leak-1"] and mine["total"] == 1


def test_dlq_replay_of_another_tenants_entry_is_404(c, db):
    _dead_letter(c, A, "leak-1")
    dlq_id = c.get("/api/v1/dlq", headers=A).json()["messages"][0]["dlqId"]
    r = c.post(f"/api/v1/dlq/{dlq_id}/replay", headers=B)
    assert_error(r, 404, "not_found")
    assert db.execute("SELECT count(*) AS n FROM queen.dead_letter_queue").fetchone()["n"] == 1
    assert db.execute("SELECT count(*) AS n FROM queen.messages").fetchone()["n"] == 1
    r = c.post(f"/api/v1/dlq/{dlq_id}/replay", headers=A)
    assert r.status_code == 200 and r.json()["replayed"] is True


def test_encryption_follows_the_callers_queue(broker_factory, db):
    """acme's `secret` encrypts at rest, globex's `secret` does not: push and schedule ask
    about the caller's queue of that name, never another tenant's."""
    key_hex = "22" * 32
    with broker_factory(QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET,
                        QUEEN_ENCRYPTION_KEY=key_hex).client() as c:
        r = c.post("/api/v1/configure", json={"queue": "secret", "options": {"encryptionEnabled": True}}, headers=A)
        assert r.status_code == 200
        for headers, who in ((A, "acme"), (B, "globex")):
            push(c, headers, f"push-{who}", queue="secret")
            r = c.post("/api/v1/timers", headers=token("write-only", tenant=who), json={"operations": [
                {"op": "schedule", "queue": "secret", "timerKey": "k", "delayMs": 3_600_000, "txn": f"t-{who}",
                 "payload": b64(b"card 4242")}]})
            assert r.status_code == 200, r.text
        stored = db.execute("""SELECT q.tenant, m.is_encrypted FROM queen.messages m
                                 JOIN queen.partitions p ON p.id = m.partition_id JOIN queen.queues q ON q.id = p.queue_id
                                ORDER BY q.tenant""").fetchall()
        assert [(r["tenant"], r["is_encrypted"]) for r in stored] == [("acme", True), ("globex", False)]
        timers = db.execute("SELECT tenant, encrypted FROM queen.timers ORDER BY tenant").fetchall()
        assert [(r["tenant"], r["encrypted"]) for r in timers] == [("acme", True), ("globex", False)]
        # each reads its own message back in the clear
        assert pop(c, A, queue="secret")["messages"][0]["data"] == {"from": "push-acme"}
        assert pop(c, B, queue="secret")["messages"][0]["data"] == {"from": "push-globex"}


def test_auth_off_is_tenant_default(client, db):
    r = client.post("/api/v1/push", json={"items": [{"queue": "plain", "payload": 1}]})
    assert r.status_code == 201
    assert [(q["tenant"], q["name"]) for q in queues(db)] == [("default", "plain")]


# ---------------------------------------------------------------------------
# byte limits: queue, partition and transactionId are at most 255 bytes of UTF-8
# ---------------------------------------------------------------------------

OK_NAME = "q" * 255
LONG_NAME = "é" * 128  # 128 characters, 256 bytes: the limit is on bytes


def counts(db):
    return db.execute("SELECT (SELECT count(*) FROM queen.queues) AS q, (SELECT count(*) FROM queen.messages) AS m, "
                      "(SELECT count(*) FROM queen.partitions) AS p").fetchone()


@pytest.mark.parametrize("item, field", [
    ({"queue": LONG_NAME}, "queue"),
    ({"queue": "ok", "partition": "p" * 256}, "partition"),
    ({"queue": "ok", "transactionId": "t" * 256}, "transactionId"),
])
def test_push_over_the_byte_limits_is_400_and_writes_nothing(client, db, item, field):
    r = client.post("/api/v1/push", json={"items": [{"queue": "fine", "payload": 1}, {"payload": 2, **item}]})
    body = assert_error(r, 400, "timers_bad_request")
    assert field in body["detail"] and "255" in body["detail"]
    assert counts(db) == {"q": 0, "m": 0, "p": 0}


def test_names_of_exactly_255_bytes_are_accepted(client, db):
    r = client.post("/api/v1/push", json={"items": [
        {"queue": OK_NAME, "partition": "p" * 255, "transactionId": "é" * 127 + "t", "payload": 1}]})
    assert r.status_code == 201 and r.json()[0]["status"] == "queued"


def test_other_log_routes_refuse_names_over_255_bytes(client, db):
    assert_error(client.post("/api/v1/configure", json={"queue": LONG_NAME}), 400, "timers_bad_request")
    assert_error(client.get(f"/api/v1/pop/queue/{LONG_NAME}"), 400, "timers_bad_request")
    assert_error(client.get(f"/api/v1/pop/queue/ok/partition/{'p' * 256}"), 400, "timers_bad_request")
    part = "0190f1e2-aaaa-7bbb-8ccc-0123456789ab"
    assert_error(client.post("/api/v1/ack", json={"transactionId": "t" * 256, "partitionId": part}),
                 400, "timers_bad_request")
    assert_error(client.post("/api/v1/ack/batch", json={"acknowledgments": [
        {"transactionId": "t" * 256, "partitionId": part}]}), 400, "timers_bad_request")
    assert_error(client.get(f"/api/v1/messages/{part}/{'t' * 256}"), 400, "timers_bad_request")
    assert_error(client.get("/api/v1/dlq", params={"queue": LONG_NAME}), 400, "timers_bad_request")
    assert counts(db) == {"q": 0, "m": 0, "p": 0}
    assert db.execute("SELECT count(*) AS n FROM queen.partition_consumers").fetchone()["n"] == 0


def test_a_nul_character_in_a_name_is_400_not_a_database_failure(client, db):
    part = "0190f1e2-aaaa-7bbb-8ccc-0123456789ab"
    calls = [
        client.post("/api/v1/configure", json={"queue": "a\x00b"}),
        client.post("/api/v1/configure", json={"queue": "ok", "options": {"note": "a\x00b"}}),
        client.post("/api/v1/push", json={"items": [{"queue": "a\x00b"}]}),
        client.post("/api/v1/push", json={"items": [{"queue": "ok", "partition": "a\x00b"}]}),
        client.post("/api/v1/push", json={"items": [{"queue": "ok", "transactionId": "a\x00b"}]}),
        client.get("/api/v1/pop/queue/a%00b"),
        client.get("/api/v1/pop/queue/ok", params={"consumerGroup": "a\x00b"}),
        client.post("/api/v1/ack", json={"transactionId": "a\x00b", "partitionId": part}),
        client.post("/api/v1/ack/batch", json={"acknowledgments": [
            {"transactionId": "t", "partitionId": part, "leaseId": "a\x00b"}]}),
        client.get(f"/api/v1/messages/{part}/a%00b"),
        client.get("/api/v1/dlq", params={"queue": "a\x00b"}),
        client.post("/api/v1/transaction", json={"operations": [{"type": "push", "items": [{"queue": "a\x00b"}]}]}),
        client.post("/api/v1/lease/a%00b/extend", json={}),
    ]
    for r in calls:
        assert "NUL" in assert_error(r, 400, "timers_bad_request")["detail"], r.request.url
    assert counts(db) == {"q": 0, "m": 0, "p": 0}
