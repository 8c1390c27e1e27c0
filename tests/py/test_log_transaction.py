"""Queen's POST /api/v1/transaction (atomic pushes + acks) and
POST /api/v1/lease/:leaseId/extend, over real HTTP, in the shapes queen-mq sends and reads."""

from __future__ import annotations

import time
import uuid

import pytest

from timers_util import assert_error, token


def configure(c, queue, headers=None, **options):
    r = c.post("/api/v1/configure", json={"queue": queue, "options": options}, headers=headers or {})
    assert r.status_code == 200, r.text
    return r.json()


def push(c, queue, txn, payload=None, headers=None):
    r = c.post("/api/v1/push", json={"items": [{"queue": queue, "transactionId": txn, "payload": payload or {}}]},
               headers=headers or {})
    assert r.status_code == 201, r.text
    return r.json()[0]


def pop(c, queue, headers=None, **params):
    r = c.get(f"/api/v1/pop/queue/{queue}", params={"batch": 10, **params}, headers=headers or {})
    assert r.status_code in (200, 204), r.text
    return None if r.status_code == 204 else r.json()


def txn(c, body, headers=None):
    r = c.post("/api/v1/transaction", json=body, headers=headers or {})
    assert r.status_code == 200, r.text
    return r.json()


def ack_op(msg, **extra):
    """An ack operation as queen-mq's TransactionBuilder.ack builds it."""
    op = {"type": "ack", "transactionId": msg["transactionId"], "partitionId": msg["partitionId"],
          "status": "completed"}
    if msg.get("leaseId"):
        op["leaseId"] = msg["leaseId"]
    return {**op, **extra}


def push_op(queue, *txns):
    """A push operation as TransactionQueueBuilder.push builds it (payload, transactionId per item)."""
    return {"type": "push", "items": [{"queue": queue, "payload": {"t": t}, "transactionId": t} for t in txns]}


def state(db):
    return db.execute("""
        SELECT (SELECT count(*) FROM queen.messages) AS messages,
               (SELECT count(*) FROM queen.queues) AS queues,
               (SELECT count(*) FROM queen.dead_letter_queue) AS dlq,
               (SELECT coalesce(json_agg(json_build_object('seq', last_consumed_seq, 'lease', lease_id::text,
                                                          'expires', lease_expires_at) ORDER BY partition_id), '[]')
                  FROM queen.partition_consumers) AS cursors""").fetchone()


# ---------------------------------------------------------------------------
# transaction
# ---------------------------------------------------------------------------

def test_ack_and_push_commit_together(client, db):
    configure(client, "in")
    push(client, "in", "m1", {"n": 1})
    msg = pop(client, "in")["messages"][0]
    out = txn(client, {"operations": [ack_op(msg), push_op("out", "o1", "o2")],
                       "requiredLeases": [msg["leaseId"]]})
    assert out["success"] is True and "error" not in out
    uuid.UUID(out["transactionId"])
    ack, p1, p2 = out["results"]
    assert ack == {"index": 0, "type": "ack", "success": True, "transactionId": "m1", "error": None,
                   "partitionId": msg["partitionId"], "queueName": "in", "partitionName": "Default",
                   "leaseReleased": True, "dlq": False}
    assert (p1["index"], p1["type"], p1["success"], p1["status"], p1["transactionId"], p1["queueName"]) == \
        (1, "push", True, "queued", "o1", "out")
    assert uuid.UUID(p1["messageId"]).version == 7 and p2["transactionId"] == "o2" and p2["index"] == 2
    # both happened: the cursor moved past m1, and o1, o2 are in the out queue
    assert pop(client, "in") is None
    got = pop(client, "out")
    assert [m["transactionId"] for m in got["messages"]] == ["o1", "o2"]
    assert got["messages"][0]["data"] == {"t": "o1"} and got["partitionId"] == p1["partitionId"]


def test_a_failing_ack_rolls_back_the_whole_transaction(client, db):
    configure(client, "in")
    push(client, "in", "m1")
    push(client, "in", "m2")
    msgs = pop(client, "in")["messages"]
    before = state(db)
    body = {"operations": [ack_op(msgs[0]), push_op("out", "o1"),
                           {"type": "ack", "transactionId": "no-such", "partitionId": msgs[0]["partitionId"]},
                           push_op("out", "o2")]}
    out = txn(client, body)
    assert out["success"] is False
    assert out["failedIndex"] == 2 and out["error"] == "ACK operation failed: Message not found"
    assert out["results"] == []
    # nothing happened: no out queue or message, m1's ack undone (cursor and lease as they were)
    assert state(db) == before
    # the lease is still held: m1 and m2 are acked normally afterwards
    again = txn(client, {"operations": [ack_op(msgs[0]), ack_op(msgs[1]), push_op("out", "o1")]})
    assert again["success"] is True and [r["success"] for r in again["results"]] == [True, True, True]


def test_an_ack_with_an_expired_lease_rolls_back_the_push(client, db):
    configure(client, "in", leaseTime=1)
    push(client, "in", "m1")
    msg = pop(client, "in")["messages"][0]
    time.sleep(2.2)
    out = txn(client, {"operations": [push_op("out", "o1"), ack_op(msg)]})
    assert out["success"] is False and out["failedIndex"] == 1
    assert out["error"] == "ACK operation failed: Invalid or expired lease"
    assert db.execute("SELECT count(*) AS n FROM queen.queues WHERE name = 'out'").fetchone()["n"] == 0
    assert db.execute("SELECT count(*) AS n FROM queen.messages").fetchone()["n"] == 1


def test_required_leases_must_be_held_and_lend_the_single_lease(client, db):
    for part in ("p1", "p2"):
        r = client.post("/api/v1/push", json={"items": [{"queue": "in", "partition": part, "transactionId": part}]})
        assert r.status_code == 201
    m1 = client.get("/api/v1/pop/queue/in/partition/p1").json()["messages"][0]
    m2 = client.get("/api/v1/pop/queue/in/partition/p2").json()["messages"][0]
    assert m1["leaseId"] != m2["leaseId"]
    bogus = str(uuid.uuid4())
    before = state(db)
    out = txn(client, {"operations": [push_op("out", "o1")], "requiredLeases": [m1["leaseId"], bogus]})
    assert out["success"] is False and out["failedIndex"] is None and bogus in out["error"]
    assert state(db) == before
    # an ack without its own leaseId borrows the bundle's one required lease: m1's lease is
    # not m2's partition's, so acking m2 under it fails...
    bare = {k: v for k, v in ack_op(m2).items() if k != "leaseId"}
    out = txn(client, {"operations": [bare], "requiredLeases": [m1["leaseId"]]})
    assert out["success"] is False and out["error"] == "ACK operation failed: Invalid or expired lease"
    assert state(db) == before
    # ...while with its own lease, or with m2's lease required, it passes
    assert txn(client, {"operations": [bare], "requiredLeases": [m2["leaseId"]]})["success"] is True
    assert txn(client, {"operations": [ack_op(m1)], "requiredLeases": [m1["leaseId"], m1["leaseId"]]}
               )["success"] is True


def test_a_repeated_push_transaction_is_idempotent(client, db):
    first = txn(client, {"operations": [push_op("out", "o1")]})
    second = txn(client, {"operations": [push_op("out", "o1", "o2")]})
    assert first["success"] and second["success"]
    assert [r["status"] for r in second["results"]] == ["duplicate", "queued"]
    assert second["results"][0]["messageId"] == first["results"][0]["messageId"]
    assert db.execute("SELECT count(*) AS n FROM queen.messages").fetchone()["n"] == 2


@pytest.mark.parametrize("body, detail", [
    ({}, "operations"),
    ({"operations": []}, "operations"),
    ({"operations": [{"type": "delete"}]}, "type"),
    ({"operations": [{"type": "push", "items": [{"payload": 1}]}]}, "queue"),
    ({"operations": [{"type": "ack", "transactionId": "t", "partitionId": "nope"}]}, "partitionId"),
    ({"operations": [{"type": "push", "items": []}]}, "no operations"),
    ({"operations": [{"type": "push", "items": [{"queue": "q" * 256}]}]}, "255"),
    ({"operations": [{"type": "push", "items": [{"queue": "out"}]}], "requiredLeases": "x"}, "requiredLeases"),
    ({"operations": [{"type": "push", "items": [{"queue": "out"}]}],
      "kv": [{"op": "put", "ns": "n", "key": "k"}]}, "kv"),
    ({"operations": [{"type": "push", "items": [{"queue": "out"}]}], "timers": [{"op": "cancel"}]}, "timers"),
    # one push operation past the 10,000 operations in all, refused before its items are parsed
    ({"operations": [{"type": "push", "items": [{"queue": "out"}] * 10001}]}, "at most 10000 operations"),
    ({"operations": [{"type": "ack", "transactionId": "t", "partitionId": "00000000-0000-0000-0000-000000000000"},
                     {"type": "push", "items": [{"queue": "out", "payload": {"a": [1]}}] * 10000}]},
     "at most 10000 operations"),
])
def test_transaction_shape_errors_are_400_and_write_nothing(client, db, body, detail):
    r = client.post("/api/v1/transaction", json=body)
    assert detail in assert_error(r, 400, "timers_bad_request")["detail"]
    assert state(db)["messages"] == 0 and state(db)["queues"] == 0


# ---------------------------------------------------------------------------
# lease extension
# ---------------------------------------------------------------------------

def extend(c, lease_id, body=None, headers=None):
    r = c.post(f"/api/v1/lease/{lease_id}/extend", json=body if body is not None else {}, headers=headers or {})
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and len(out) == 1 and out[0]["index"] == 0 and out[0]["leaseId"] == lease_id
    return out[0]


def lease_expiry(db):
    return db.execute("SELECT lease_expires_at, lease_id::text AS lease FROM queen.partition_consumers").fetchone()


def test_extend_keeps_the_lease_past_its_time(client, db):
    configure(client, "in", leaseTime=2)
    push(client, "in", "m1")
    msg = pop(client, "in")["messages"][0]
    out = extend(client, msg["leaseId"], {"seconds": 120})
    assert out["success"] is True and out["error"] is None and out["renewed"] == 1
    assert out["expiresAt"] == out["newExpiresAt"] and out["expiresAt"].endswith("Z")
    left = db.execute("SELECT extract(epoch FROM lease_expires_at - now()) AS s FROM queen.partition_consumers"
                      ).fetchone()["s"]
    assert 100 < left <= 121
    time.sleep(2.5)  # past the queue's 2 s lease: without the extension the partition would be free
    assert pop(client, "in") is None
    ack = client.post("/api/v1/ack", json={"transactionId": "m1", "partitionId": msg["partitionId"],
                                           "leaseId": msg["leaseId"]}).json()[0]
    assert ack["success"] is True
    # the body queen-mq's renew() sends is {}: 60 seconds, never shortening a longer lease
    push(client, "in", "m2")
    msg2 = pop(client, "in")["messages"][0]  # default leaseTime 2 s
    assert extend(client, msg2["leaseId"])["success"] is True
    left = db.execute("SELECT extract(epoch FROM lease_expires_at - now()) AS s FROM queen.partition_consumers"
                      ).fetchone()["s"]
    assert 50 < left <= 61


def test_extend_of_an_unknown_released_or_expired_lease_fails_and_changes_nothing(client, db):
    for lease in (str(uuid.uuid4()), "not-a-uuid"):
        out = extend(client, lease)
        assert (out["success"], out["error"], out["expiresAt"], out["renewed"]) == (False, "Lease not found", None, 0)
    configure(client, "in", leaseTime=1)
    push(client, "in", "m1")
    msg = pop(client, "in")["messages"][0]
    time.sleep(1.5)
    before = lease_expiry(db)
    out = extend(client, msg["leaseId"])
    assert (out["success"], out["error"]) == (False, "Lease already expired")
    assert lease_expiry(db) == before
    again = pop(client, "in")["messages"][0]  # the partition is free again, under a new lease
    client.post("/api/v1/ack", json={"transactionId": "m1", "partitionId": again["partitionId"],
                                     "leaseId": again["leaseId"]})
    assert extend(client, again["leaseId"])["error"] == "Lease not found"  # released by the ack


@pytest.mark.parametrize("body", [{"seconds": 0}, {"seconds": "60"}, {"seconds": True}, {"seconds": 86401}, [1]])
def test_extend_shape_errors_are_400(client, db, body):
    assert_error(client.post(f"/api/v1/lease/{uuid.uuid4()}/extend", json=body), 400, "timers_bad_request")


# ---------------------------------------------------------------------------
# both routes are scoped by the caller's tenant (QUEEN_AUTH=jwt)
# ---------------------------------------------------------------------------

A = token("read-write", tenant="acme", sub="svc-a")
B = token("read-write", tenant="globex", sub="svc-b")


def test_transaction_is_tenant_scoped(jwt_client, db):
    c = jwt_client
    push(c, "leakq", "leak-1", headers=A)
    msg = pop(c, "leakq", headers=A)["messages"][0]
    before = state(db)
    out = txn(c, {"operations": [push_op("leakq", "b1"), ack_op(msg)]}, headers=B)
    assert out["success"] is False and out["error"] == "ACK operation failed: Message not found"
    assert state(db) == before
    out = txn(c, {"operations": [push_op("leakq", "leak-1")]}, headers=B)  # B's own leakq: not a duplicate
    assert out["results"][0]["status"] == "queued"
    rows = db.execute("""SELECT q.tenant, m.transaction_id, m.producer_sub FROM queen.messages m
                           JOIN queen.partitions p ON p.id = m.partition_id JOIN queen.queues q ON q.id = p.queue_id
                          ORDER BY q.tenant""").fetchall()
    assert [(r["tenant"], r["producer_sub"]) for r in rows] == [("acme", "svc-a"), ("globex", "svc-b")]
    # B's required lease check does not see A's lease either
    out = txn(c, {"operations": [push_op("leakq", "b2")], "requiredLeases": [msg["leaseId"]]}, headers=B)
    assert out["success"] is False
    assert_error(c.post("/api/v1/transaction", json={"operations": [push_op("x", "y")]},
                        headers=token("read-only", tenant="acme")), 403, "forbidden")


def test_lease_extend_is_tenant_scoped(jwt_client, db):
    c = jwt_client
    push(c, "leakq", "leak-1", headers=A)
    msg = pop(c, "leakq", headers=A)["messages"][0]
    before = lease_expiry(db)
    out = extend(c, msg["leaseId"], {"seconds": 3600}, headers=B)
    assert (out["success"], out["error"]) == (False, "Lease not found")
    assert lease_expiry(db) == before
    assert extend(c, msg["leaseId"], {"seconds": 3600}, headers=A)["success"] is True
    assert_error(c.post(f"/api/v1/lease/{msg['leaseId']}/extend", json={},
                        headers=token("read-only", tenant="acme")), 403, "forbidden")


# ---------------------------------------------------------------------------
# requiredLeases: bounded (10,000 entries, duplicates included) and checked as a set
# ---------------------------------------------------------------------------

MAX_LEASES = 10000


def many_cursors(db, tenant, queue, n):
    """n more cursor rows, each a consumer group holding its own lease on the queue's one
    message, made in SQL; their lease ids, in group order."""
    rows = db.execute("""SELECT m.lease_id::text AS lease
                           FROM generate_series(1, %s) g, LATERAL queen.pop_messages(%s, %s, NULL, 'g' || g, 1) m
                          ORDER BY g""", (n, tenant, queue)).fetchall()
    assert len(rows) == n
    return [r["lease"] for r in rows]


def analyze(db):
    """Statistics that know the cursor rows, as autovacuum leaves them: the old per-element
    check then scanned them once per element (tests/sql/88_required_leases.sql has the
    statistics of an empty table)."""
    db.execute("ANALYZE queen.partition_consumers")


def timed_txn(c, body, headers):
    started = time.monotonic()
    r = c.post("/api/v1/transaction", json=body, headers=headers)
    return r, time.monotonic() - started


def test_a_large_legal_required_leases_list_answers_quickly(jwt_client, db):
    c = jwt_client
    push(c, "in", "m1", headers=A)
    leases = many_cursors(db, "acme", "in", 3000)
    msg = pop(c, "in", headers=A)["messages"][0]  # the newest of 3,001 cursor rows
    analyze(db)
    # 10,000 copies of the one lease the ack holds: 10,000 scans of the cursor rows before (the
    # statement timeout's 503, on every retry); one index probe now
    r, took = timed_txn(c, {"operations": [ack_op(msg), push_op("out", "o1")],
                            "requiredLeases": [msg["leaseId"]] * MAX_LEASES}, A)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["success"] is True and [x["success"] for x in out["results"]] == [True, True]
    assert took < 3, f"{took:.2f} s"
    # 3,000 distinct held leases (in upper case) padded with copies to the limit: all held
    padded = [x.upper() for x in leases] + [leases[0]] * (MAX_LEASES - len(leases))
    r, took = timed_txn(c, {"operations": [push_op("out", "o2")], "requiredLeases": padded}, A)
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert took < 3, f"{took:.2f} s"
    # one that is not held among them is named, and nothing is written
    before = state(db)
    bogus = str(uuid.uuid4())
    out = txn(c, {"operations": [push_op("out", "o3")], "requiredLeases": padded[:5000] + [bogus] + padded[5000:-1]},
              headers=A)
    assert (out["success"], out["error"], out["failedIndex"], out["results"]) == \
        (False, f"Invalid or expired lease: {bogus}", None, [])
    # a malformed id is a lease nobody holds (200, success false), not an error
    out = txn(c, {"operations": [push_op("out", "o3")], "requiredLeases": leases[:10] + ["not-a-lease"]}, headers=A)
    assert (out["success"], out["error"]) == (False, "Invalid or expired lease: not-a-lease")
    assert state(db) == before


def test_copies_of_another_tenants_lease_do_not_satisfy_required_leases(jwt_client, db):
    c = jwt_client
    push(c, "in", "m1", headers=A)
    msg = pop(c, "in", headers=A)["messages"][0]
    many_cursors(db, "acme", "in", 1000)
    push(c, "in", "g1", headers=B)
    pop(c, "in", headers=B)  # globex holds a lease of its own
    analyze(db)
    before = state(db)
    r, took = timed_txn(c, {"operations": [push_op("in", "b1")], "requiredLeases": [msg["leaseId"]] * MAX_LEASES}, B)
    assert r.status_code == 200, r.text
    out = r.json()
    assert (out["success"], out["error"], out["failedIndex"]) == \
        (False, f"Invalid or expired lease: {msg['leaseId']}", None)
    assert took < 3, f"{took:.2f} s"
    assert state(db) == before  # b1 is not in globex's queue "in"


@pytest.mark.parametrize("n", [MAX_LEASES + 1, 200000])
def test_required_leases_past_the_limit_is_400_and_writes_nothing(client, db, n):
    configure(client, "in")
    push(client, "in", "m1")
    msg = pop(client, "in")["messages"][0]
    before = state(db)
    # the audit's body at n = 200,000: 8 MB of one valid lease, which timed out (503) on every retry
    r, took = timed_txn(client, {"operations": [ack_op(msg), push_op("out", "o1")],
                                 "requiredLeases": [msg["leaseId"]] * n}, {})
    detail = assert_error(r, 400, "timers_bad_request")["detail"]
    assert detail == f"at most {MAX_LEASES} requiredLeases per transaction (duplicates count)"
    assert took < 5, f"{took:.2f} s"
    assert state(db) == before
    # the lease is still held: the same transaction within the limit commits
    out = txn(client, {"operations": [ack_op(msg), push_op("out", "o1")], "requiredLeases": [msg["leaseId"]] * MAX_LEASES})
    assert out["success"] is True


def test_data_is_read_by_a_transactions_push_item_not_by_push(client, db):
    """Queen's transaction route reads an item's `data` when it has no `payload`; its push
    route reads `payload` only (absent: {}). Both as documented in docs/log-surface.md."""
    r = client.post("/api/v1/push", json={"items": [{"queue": "datas", "transactionId": "p", "data": {"y": 1}}]})
    assert r.status_code == 201, r.text
    out = txn(client, {"operations": [{"type": "push", "items": [
        {"queue": "datas", "transactionId": "t", "data": {"y": 1}},
        {"queue": "datas", "transactionId": "both", "data": {"y": 1}, "payload": {"z": 2}}]}]})
    assert out["success"], out
    stored = {m["transactionId"]: m["data"] for m in pop(client, "datas")["messages"]}
    assert stored == {"p": {}, "t": {"y": 1}, "both": {"z": 2}}
