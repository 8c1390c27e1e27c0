"""The Queen-compatible log over real HTTP: configure, push, pop, ack, message lookup, DLQ."""

from __future__ import annotations

import base64
import json
import re
import time
import uuid

import jwt
import psycopg
import pytest

CREATED_AT = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
KEY_HEX = "11" * 32
JWT_SECRET = "log-test-secret-0123456789-abcdefghijklmnop"


def configure(client, queue, **options):
    r = client.post("/api/v1/configure", json={"queue": queue, "options": options})
    assert r.status_code == 200, r.text
    return r.json()


def push(client, *items, headers=None):
    r = client.post("/api/v1/push", json={"items": list(items)}, headers=headers or {})
    assert r.status_code == 201, r.text
    return r.json()


def pop(client, queue, partition=None, headers=None, **params):
    path = f"/api/v1/pop/queue/{queue}" + (f"/partition/{partition}" if partition else "")
    r = client.get(path, params=params, headers=headers or {})
    assert r.status_code in (200, 204), r.text
    return None if r.status_code == 204 else r.json()


def ack(client, msg, status="completed", **extra):
    body = {"transactionId": msg["transactionId"], "partitionId": msg["partitionId"], "status": status,
            "leaseId": msg.get("leaseId") or None, **extra}
    r = client.post("/api/v1/ack", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and len(out) == 1
    return out[0]


def counts(db):
    return db.execute("SELECT (SELECT count(*) FROM queen.messages) AS messages, "
                      "(SELECT count(*) FROM queen.queues) AS queues").fetchone()


# ---------------------------------------------------------------------------

def test_configure_push_pop_ack_round_trip(client, db):
    conf = configure(client, "orders", leaseTime=30, retryLimit=5, encryptionEnabled=False, bogusKey=1)
    assert conf["configured"] is True and conf["queue"] == "orders"
    assert conf["options"]["leaseTime"] == 30 and conf["options"]["retryLimit"] == 5
    assert conf["options"]["ttl"] == 3600 and "bogusKey" not in conf["options"]
    assert len(conf["options"]) == 15
    # configure overwrites every option: a missing one goes back to its default
    again = configure(client, "orders", leaseTime=45)
    assert again["options"]["retryLimit"] == 3 and again["options"]["leaseTime"] == 45
    assert again["queueId"] == conf["queueId"] and again["partitionId"] == conf["partitionId"]

    trace = str(uuid.uuid4())
    out = push(client, {"queue": "orders", "payload": {"n": 1}, "transactionId": "t1", "traceId": trace},
               {"queue": "orders", "payload": [1, "two"], "producerSub": "forged", "messageId": "forged"})
    assert [o["status"] for o in out] == ["queued", "queued"]
    assert [o["index"] for o in out] == [0, 1]
    assert out[0]["transaction_id"] == "t1" and out[0]["trace_id"] == trace
    assert out[0]["partition_id"] == conf["partitionId"] and out[0]["queueName"] == "orders"
    assert out[1]["transaction_id"]  # generated
    uuid.UUID(out[0]["message_id"])
    assert uuid.UUID(out[0]["message_id"]).version == 7

    res = pop(client, "orders", batch=10)
    assert res["success"] is True and res["queue"] == "orders" and res["partition"] == "Default"
    assert res["consumerGroup"] == "__QUEUE_MODE__" and res["leaseId"]
    msgs = res["messages"]
    assert [m["transactionId"] for m in msgs] == ["t1", out[1]["transaction_id"]]
    assert msgs[0]["data"] == {"n": 1} and msgs[1]["data"] == [1, "two"]
    assert base64.b64decode(msgs[0]["payloadBase64"]) == b'{"n":1}'
    assert msgs[0]["traceId"] == trace and msgs[0]["id"] == out[0]["message_id"]
    assert all(m["producerSub"] is None for m in msgs)  # auth off; client-sent value ignored
    assert all(CREATED_AT.match(m["createdAt"]) for m in msgs)
    assert all(m["leaseId"] == res["leaseId"] and m["partitionId"] == conf["partitionId"] for m in msgs)

    r = client.post("/api/v1/ack/batch", json={"consumerGroup": None, "acknowledgments": [
        {"transactionId": m["transactionId"], "partitionId": m["partitionId"], "status": "completed",
         "leaseId": m["leaseId"], "error": None} for m in msgs]})
    assert r.status_code == 200
    results = r.json()
    assert [x["index"] for x in results] == [0, 1]
    assert all(x["success"] and x["error"] is None and not x["dlq"] for x in results)
    assert results[-1]["leaseReleased"] is True
    assert results[0]["queueName"] == "orders" and results[0]["partitionName"] == "Default"

    assert pop(client, "orders") is None
    detail = client.get(f"/api/v1/messages/{conf['partitionId']}/t1").json()
    assert detail["status"] == "completed" and detail["payload"] == {"n": 1}
    assert detail["queuePath"] == "orders/Default" and detail["mode"]["type"] == "queue"


def test_a_batch_nacked_with_its_lease_on_every_item_is_one_retry(client, db):
    # Every item of /api/v1/ack/batch carries the batch's lease. The first failed item releases
    # it; before migration 033 every later one was answered "Invalid or expired lease" (the
    # batch still came back). Now they succeed and change nothing more: one retry spent.
    # A completed item after that release is still refused: the cursor cannot pass the failed
    # message, so the batch comes back whole, that message with it.
    configure(client, "nack", retryLimit=3)
    push(client, *({"queue": "nack", "payload": i, "transactionId": f"n{i}"} for i in range(3)))

    def ack(msgs, statuses):
        r = client.post("/api/v1/ack/batch", json={"acknowledgments": [
            {"transactionId": m["transactionId"], "partitionId": m["partitionId"], "status": st,
             "leaseId": m["leaseId"]} for m, st in zip(msgs, statuses)]})
        assert r.status_code == 200, r.text
        return [(x["success"], x["error"], x["leaseReleased"]) for x in r.json()]

    msgs = pop(client, "nack", batch=3)["messages"]
    assert ack(msgs, ["failed"] * 3) == [(True, None, True), (True, None, False), (True, None, False)]
    retries = db.execute("SELECT batch_retry_count AS n FROM queen.partition_consumers").fetchone()["n"]
    assert retries == 1
    msgs = pop(client, "nack", batch=3)["messages"]
    assert [m["transactionId"] for m in msgs] == ["n0", "n1", "n2"]
    assert ack(msgs, ["completed", "failed", "completed"]) == [
        (True, None, False), (True, None, True), (False, "Invalid or expired lease", False)]
    msgs = pop(client, "nack", batch=3)["messages"]
    assert [m["transactionId"] for m in msgs] == ["n1", "n2"]
    assert ack(msgs, ["completed", "completed"]) == [(True, None, False), (True, None, True)]
    assert pop(client, "nack") is None


def test_push_duplicate_transaction_id_is_per_partition(client, db):
    first = push(client, {"queue": "dup", "payload": 1, "transactionId": "x"})
    again = push(client, {"queue": "dup", "payload": 2, "transactionId": "x"},
                 {"queue": "dup", "payload": 3, "transactionId": "y"},
                 {"queue": "dup", "payload": 4, "transactionId": "y"},
                 {"queue": "dup", "partition": "other", "payload": 5, "transactionId": "x"})
    assert [o["status"] for o in again] == ["duplicate", "queued", "duplicate", "queued"]
    assert again[0]["message_id"] == first[0]["message_id"]
    assert again[2]["message_id"] == again[1]["message_id"]
    assert counts(db)["messages"] == 3
    # the original payload is kept
    res = pop(client, "dup", partition="Default", batch=10)
    assert [m["data"] for m in res["messages"]] == [1, 3]
    assert push(client) == []


@pytest.mark.parametrize("body", [
    {},
    {"items": "nope"},
    {"items": [{"payload": 1}]},
    {"items": [{"queue": 7}]},
    {"items": [{"queue": "q", "partition": 3}]},
    {"items": [{"queue": "q", "transactionId": 5}]},
    {"items": [{"queue": "q", "traceId": "not-a-uuid"}]},
    {"items": [{"queue": "q", "payload": 1}, {"queue": ""}]},
])
def test_push_bad_shape_is_400_and_writes_nothing(client, db, body):
    r = client.post("/api/v1/push", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == "timers_bad_request" and r.json()["detail"]
    assert counts(db) == {"messages": 0, "queues": 0}


def test_push_of_a_non_json_constant_is_400(client, db):
    r = client.post("/api/v1/push", content=b'{"items": [{"queue": "q", "payload": NaN}]}',
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"] == "timers_bad_request"
    assert counts(db)["messages"] == 0


def test_configure_bad_input_is_400(client, db):
    for body in ({}, {"queue": ""}, {"queue": "q", "options": []},
                 {"queue": "q", "options": {"leaseTime": "long"}},
                 {"queue": "q", "options": {"retryLimit": -1}},
                 {"queue": "q", "options": {"encryptionEnabled": "yes"}}):
        r = client.post("/api/v1/configure", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"] == "timers_bad_request"
    assert counts(db)["queues"] == 0


def test_pop_is_204_when_empty_and_long_poll_returns_a_late_message(client, db):
    assert pop(client, "nowhere") is None
    configure(client, "empty")
    assert pop(client, "empty") is None
    assert pop(client, "empty", wait="true", timeout=300) is None
    assert pop(client, "empty", partition="Default") is None


def test_an_ack_batch_item_may_name_its_own_consumer_group(client, db):
    # docs/log-surface.md: an item's consumerGroup applies to it instead of the body's
    push(client, *({"queue": "groups", "payload": i, "transactionId": f"g{i}"} for i in range(2)))
    audit = pop(client, "groups", consumerGroup="audit", batch=2)
    plain = pop(client, "groups", batch=2)
    def item(m, lease, **group):
        return {"transactionId": m["transactionId"], "partitionId": m["partitionId"], "leaseId": lease, **group}

    r = client.post("/api/v1/ack/batch", json={"consumerGroup": "audit", "acknowledgments": [
        item(audit["messages"][0], audit["leaseId"]),
        item(plain["messages"][0], plain["leaseId"], consumerGroup="__QUEUE_MODE__")]})
    assert r.status_code == 200 and [x["success"] for x in r.json()] == [True, True], r.text
    # each group's cursor moved to g0 and no further

    def cursor(group):
        return db.execute("SELECT m.transaction_id FROM queen.partition_consumers pc JOIN queen.messages m "
                          "ON (m.xid, m.seq) = (pc.last_consumed_xid, pc.last_consumed_seq) "
                          "WHERE pc.consumer_group = %s", (group,)).fetchone()["transaction_id"]
    assert (cursor("audit"), cursor("__QUEUE_MODE__")) == ("g0", "g0")


def test_pop_and_ack_details_the_reference_states(client, db):
    """docs/log-surface.md's smaller rules of pop and ack, each against the database clock."""
    from datetime import datetime, timedelta

    def at(iso):
        return datetime.fromisoformat(iso.replace("Z", "+00:00"))

    configure(client, "lt0", leaseTime=0)
    push(client, *({"queue": "lt0", "payload": i, "transactionId": f"l{i}"} for i in range(3)))
    now = db.execute("SELECT now() AS t").fetchone()["t"]
    # batch=0 is clamped to 1; leaseTime 0 means a lease of 60 s, said in leaseExpiresAt
    first = pop(client, "lt0", batch=0, subscriptionMode="new", subscriptionFrom="now", partitions=4)
    assert [m["transactionId"] for m in first["messages"]] == ["l0"]  # the subscription options change nothing
    held = at(first["leaseExpiresAt"]) - now
    assert timedelta(seconds=59) < held < timedelta(seconds=65), held
    # "success" is a synonym of "completed": the cursor moves to l0 and the lease is released
    done = ack(client, first["messages"][0], "success")
    assert done["success"] is True and done["leaseReleased"] is True, done
    # an ack of a message already behind the cursor changes nothing
    before = db.execute("SELECT last_consumed_seq, lease_id FROM queen.partition_consumers").fetchall()
    again = ack(client, {**first["messages"][0], "leaseId": None}, "dlq")
    assert again["success"] is True and again["dlq"] is False, again
    assert db.execute("SELECT last_consumed_seq, lease_id FROM queen.partition_consumers").fetchall() == before
    assert db.execute("SELECT count(*) AS n FROM queen.dead_letter_queue").fetchone()["n"] == 0
    # autoAck: no lease (leaseId ""), the cursor moved at once
    auto = pop(client, "lt0", batch=1, autoAck="true")
    assert auto["leaseId"] == "" and [m["transactionId"] for m in auto["messages"]] == ["l1"]
    assert [m["transactionId"] for m in pop(client, "lt0", batch=5)["messages"]] == ["l2"]


def test_message_detail_mode_follows_the_groups_that_read_the_partition(client, db):
    """docs/log-surface.md's message detail: mode.type none / bus / hybrid and the
    consumerGroups entries, as groups pop and ack in the message's partition."""
    conf = configure(client, "modes")
    push(client, {"queue": "modes", "payload": 1, "transactionId": "md1"})

    def detail():
        r = client.get(f"/api/v1/messages/{conf['partitionId']}/md1")
        assert r.status_code == 200, r.text
        return r.json()
    d = detail()
    assert d["mode"] == {"hasQueueMode": False, "busGroupsCount": 0, "consumedByGroups": 0, "type": "none"}
    assert d["consumerGroups"] == [] and d["status"] == "pending"
    audit = pop(client, "modes", consumerGroup="audit")
    d = detail()
    assert (d["mode"]["type"], d["mode"]["busGroupsCount"], d["status"]) == ("bus", 1, "processing")
    [g] = d["consumerGroups"]
    assert (g["name"], g["consumed"], g["processing"]) == ("audit", False, True) and g["leaseExpiresAt"]
    ack(client, audit["messages"][0], consumerGroup="audit")
    queue_mode = pop(client, "modes")
    d = detail()
    assert d["mode"] == {"hasQueueMode": True, "busGroupsCount": 1, "consumedByGroups": 1, "type": "hybrid"}
    assert [(g["name"], g["consumed"], g["processing"]) for g in d["consumerGroups"]] == [
        ("__QUEUE_MODE__", False, True), ("audit", True, False)]
    assert d["status"] == "completed"  # some group's cursor passed it
    assert queue_mode["messages"][0]["transactionId"] == "md1"


def test_a_pop_without_a_partition_serves_the_least_recently_served_first(client, db):
    """docs/log-surface.md: of the partitions with messages after the group's cursor and no
    live lease, the least recently served comes first."""
    for part in ("a", "b", "c"):
        push(client, *({"queue": "rr", "partition": part, "payload": i, "transactionId": f"{part}{i}"}
                       for i in range(2)))
    served = []
    for _ in range(6):
        got = pop(client, "rr", batch=1)
        served.append(got["partition"])
        ack(client, got["messages"][0])
    # every partition once before any twice, then the same order again
    assert sorted(served[:3]) == ["a", "b", "c"] and served[3:] == served[:3], served


def test_lease_held_partition_is_not_handed_to_another_consumer(client, db):
    push(client, *({"queue": "work", "payload": i, "transactionId": f"m{i}"} for i in range(3)))
    a = pop(client, "work", batch=1)
    assert [m["transactionId"] for m in a["messages"]] == ["m0"]
    # the only partition is leased: another consumer of the group gets nothing
    assert pop(client, "work") is None
    assert pop(client, "work", partition="Default") is None
    # another consumer group has its own cursor and lease
    bus = pop(client, "work", consumerGroup="audit", batch=5)
    assert [m["transactionId"] for m in bus["messages"]] == ["m0", "m1", "m2"]
    assert bus["consumerGroup"] == "audit"
    # a second partition is free
    push(client, {"queue": "work", "partition": "p2", "payload": "x", "transactionId": "other"})
    b = pop(client, "work")
    assert b["partition"] == "p2" and b["messages"][0]["transactionId"] == "other"
    # an ack with somebody else's lease is refused (HTTP 200, success false)
    wrong = ack(client, {**a["messages"][0], "leaseId": b["leaseId"]})
    assert wrong["success"] is False and wrong["error"] == "Invalid or expired lease"
    ok = ack(client, a["messages"][0])
    assert ok["success"] is True and ok["leaseReleased"] is True
    c = pop(client, "work")
    assert [m["transactionId"] for m in c["messages"]] == ["m1"]


def test_failed_ack_retries_the_batch_then_dead_letters(client, db):
    conf = configure(client, "flaky", retryLimit=2)
    push(client, {"queue": "flaky", "payload": {"job": 1}, "transactionId": "j1"},
         {"queue": "flaky", "payload": {"job": 2}, "transactionId": "j2"})
    verdicts = []
    for _ in range(3):  # first delivery + retryLimit redeliveries
        res = pop(client, "flaky")
        assert [m["transactionId"] for m in res["messages"]] == ["j1"]
        verdicts.append(ack(client, res["messages"][0], "failed", error="boom"))
    assert [v["dlq"] for v in verdicts] == [False, False, True]
    assert all(v["success"] for v in verdicts)
    # the cursor moved past j1: the next pop gets j2
    nxt = pop(client, "flaky")
    assert [m["transactionId"] for m in nxt["messages"]] == ["j2"]
    dlq = client.get("/api/v1/dlq", params={"queue": "flaky"}).json()
    assert dlq["total"] == 1
    entry = dlq["messages"][0]
    assert entry["transactionId"] == "j1" and entry["errorMessage"] == "boom"
    assert entry["retryCount"] == 2 and entry["data"] == {"job": 1}
    assert entry["consumerGroup"] == "__QUEUE_MODE__" and entry["partitionId"] == conf["partitionId"]
    detail = client.get(f"/api/v1/messages/{conf['partitionId']}/j1").json()
    assert detail["status"] == "dead_letter" and detail["errorMessage"] == "boom"
    # j2 is processing (leased), then retry releases the lease for an immediate redelivery
    assert client.get(f"/api/v1/messages/{conf['partitionId']}/j2").json()["status"] == "processing"
    assert ack(client, nxt["messages"][0], "retry")["leaseReleased"] is True
    assert [m["transactionId"] for m in pop(client, "flaky")["messages"]] == ["j2"]


def test_message_lookup_and_ack_of_unknown_message(client, db):
    out = push(client, {"queue": "look", "payload": "p", "transactionId": "order:42 v1"})
    pid = out[0]["partition_id"]
    r = client.get(f"/api/v1/messages/{pid}/order:42%20v1")
    assert r.status_code == 200 and r.json()["transactionId"] == "order:42 v1" and r.json()["data"] == "p"
    push(client, {"queue": "look", "payload": 7, "transactionId": "tenant/42"})
    r = client.get(f"/api/v1/messages/{pid}/tenant/42")
    assert r.status_code == 200 and r.json()["data"] == 7
    r = client.get(f"/api/v1/messages/{pid}/nope")
    assert r.status_code == 404 and r.json() == {"error": "Message not found"}
    r = client.get("/api/v1/messages/not-a-uuid/nope")
    assert r.status_code == 404 and r.json() == {"error": "Message not found"}
    push(client, {"queue": "look", "payload": {"a": 1}, "transactionId": "plain"})
    detail = client.get(f"/api/v1/messages/{pid}/plain").json()
    assert detail["status"] == "pending" and detail["payload"] == {"a": 1} and detail["isEncrypted"] is False
    assert CREATED_AT.match(detail["createdAt"]) and detail["queueConfig"]["retryLimit"] == 3
    res = ack(client, {"transactionId": "missing", "partitionId": pid})
    assert res["success"] is False and res["error"] == "Message not found"
    r = client.post("/api/v1/ack", json={"transactionId": "plain", "partitionId": "nope"})
    assert r.status_code == 400
    r = client.post("/api/v1/ack", json={"transactionId": "plain", "partitionId": pid, "status": "maybe"})
    assert r.status_code == 400
    r = client.post("/api/v1/ack/batch", json={"acknowledgments": [{"transactionId": 1, "partitionId": pid}]})
    assert r.status_code == 400


def test_an_ack_of_a_message_no_pop_could_hand_out_is_refused(client, db, database_url):
    """While a write transaction older than a pushed message runs, no pop hands the message
    out; an ack of it (the producer knows its ids) answers the documented per-item error
    and moves no cursor, alone, in a batch and in a transaction. Once that transaction
    ends, the message is popped and acked as usual."""
    out = push(client, {"queue": "early", "payload": 1, "transactionId": "before"})
    pid = out[0]["partition_id"]
    with psycopg.connect(database_url) as older:
        older.execute("SELECT pg_current_xact_id()")  # an older write transaction, left open
        push(client, {"queue": "early", "payload": 2, "transactionId": "after"})
        msg = {"transactionId": "after", "partitionId": pid}
        res = ack(client, msg)
        assert res["success"] is False and res["error"] == "Message not yet readable"
        r = client.post("/api/v1/ack/batch", json={"consumerGroup": "g", "acknowledgments": [
            {"transactionId": "before", "partitionId": pid}, {**msg, "status": "dlq"}]})
        assert r.status_code == 200
        assert [(x["success"], x["error"]) for x in r.json()] == [(True, None), (False, "Message not yet readable")]
        r = client.post("/api/v1/transaction", json={"operations": [{"type": "ack", **msg}]})
        assert r.status_code == 200 and r.json()["success"] is False
        assert r.json()["error"] == "ACK operation failed: Message not yet readable"
        assert [m["transactionId"] for m in pop(client, "early", batch=10)["messages"]] == ["before"]
        older.rollback()
    assert db.execute("SELECT count(*) AS n FROM queen.dead_letter_queue").fetchone()["n"] == 0
    got = pop(client, "early", consumerGroup="g", batch=10)
    assert [m["transactionId"] for m in got["messages"]] == ["after"], "group g's cursor did not pass it"
    assert ack(client, got["messages"][0], consumerGroup="g")["success"] is True


def test_dlq_list_ignores_partition_pages_newest_first_and_replays(client, db):
    push(client, *({"queue": "dead", "partition": p, "payload": {"i": i}, "transactionId": f"d{i}"}
                   for i, p in enumerate(["Default", "Default", "east"])))
    for part in ("Default", "Default", "east"):
        msg = pop(client, "dead", partition=part)["messages"][0]
        assert ack(client, msg, "dlq", error=f"bad {msg['transactionId']}")["dlq"] is True
    page = client.get("/api/v1/dlq", params={"queue": "dead", "partition": "Default", "limit": 2}).json()
    assert page["total"] == 3 and page["pagination"] == {"limit": 2, "offset": 0}
    assert [m["transactionId"] for m in page["messages"]] == ["d2", "d1"]  # newest first, all partitions
    rest = client.get("/api/v1/dlq", params={"queue": "dead", "limit": 2, "offset": 2}).json()
    assert [m["transactionId"] for m in rest["messages"]] == ["d0"] and rest["total"] == 3
    assert client.get("/api/v1/dlq", params={"queue": "dead", "consumerGroup": "other"}).json()["total"] == 0
    assert all(CREATED_AT.match(m["failedAt"]) for m in page["messages"])

    entry = page["messages"][0]
    r = client.post(f"/api/v1/dlq/{entry['dlqId']}/replay")
    assert r.status_code == 200, r.text
    new_id = r.json()["messageId"]
    again = pop(client, "dead", partition="east")["messages"]
    assert [m["id"] for m in again] == [new_id] and again[0]["data"] == {"i": 2}
    assert again[0]["transactionId"].startswith("d2#replay-")
    assert client.get("/api/v1/dlq", params={"queue": "dead"}).json()["total"] == 2
    r = client.post(f"/api/v1/dlq/{entry['dlqId']}/replay")
    assert r.status_code == 404 and r.json()["error"] == "not_found"
    assert client.post("/api/v1/dlq/not-a-uuid/replay").status_code == 404


def test_lease_expiry_redelivers_without_spending_a_retry(db):
    """SQL level, with the injectable clock: an expired lease is free again."""
    db.execute("SELECT queen.configure_queue('default', 'exp', NULL, NULL, '{\"leaseTime\": 10}')")
    db.execute("SELECT * FROM queen.push_messages('default', ARRAY[ROW('exp', NULL, 't', NULL, '1'::bytea, false)::queen.push_item])")
    first = db.execute("SELECT * FROM queen.pop_messages('default', 'exp')").fetchall()
    assert len(first) == 1
    assert db.execute("SELECT * FROM queen.pop_messages('default', 'exp', p_now => now() + interval '9 seconds')").fetchall() == []
    later = db.execute("SELECT * FROM queen.pop_messages('default', 'exp', p_now => now() + interval '11 seconds')").fetchall()
    assert [r["transaction_id"] for r in later] == ["t"] and later[0]["lease_id"] != first[0]["lease_id"]
    pc = db.execute("SELECT batch_retry_count FROM queen.partition_consumers").fetchone()
    assert pc["batch_retry_count"] == 0


def test_encrypted_queue_round_trip(broker_factory, db):
    broker = broker_factory(QUEEN_ENCRYPTION_KEY=KEY_HEX)
    with broker.client() as client:
        configure(client, "secret", encryptionEnabled=True)
        out = push(client, {"queue": "secret", "payload": {"card": "4242"}, "transactionId": "s1"})
        row = db.execute("SELECT payload, is_encrypted FROM queen.messages").fetchone()
        assert row["is_encrypted"] is True
        envelope = json.loads(bytes(row["payload"]))
        assert set(envelope) == {"encrypted", "iv", "authTag"}
        assert b"4242" not in bytes(row["payload"])
        detail = client.get(f"/api/v1/messages/{out[0]['partition_id']}/s1").json()
        assert detail["payload"] == {"card": "4242"} and detail["isEncrypted"] is True
        msg = pop(client, "secret")["messages"][0]
        assert msg["data"] == {"card": "4242"}
        assert base64.b64decode(msg["payloadBase64"]) == b'{"card":"4242"}'
        # the DLQ route does not decrypt, as Queen's
        ack(client, msg, "dlq")
        dlq = client.get("/api/v1/dlq", params={"queue": "secret"}).json()["messages"][0]
        assert set(dlq["data"]) == {"encrypted", "iv", "authTag"} and dlq["isEncrypted"] is True
        # a queue that does not encrypt stores plaintext even with the key loaded
        push(client, {"queue": "open", "payload": "hi", "transactionId": "o"})
        assert db.execute("SELECT payload FROM queen.messages WHERE transaction_id = 'o'").fetchone()["payload"] == b'"hi"'


def _token(role: str, sub: str = "svc-a") -> dict:
    claims = {"sub": sub, "role": role, "tenant": "default", "exp": int(time.time()) + 600}
    return {"Authorization": "Bearer " + jwt.encode(claims, JWT_SECRET, algorithm="HS256")}


def test_access_levels_and_producer_sub_from_the_credential(broker_factory, db):
    broker = broker_factory(QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET)
    with broker.client() as client:
        item = {"queue": "authq", "payload": 1, "transactionId": "a1", "producerSub": "forged"}
        assert client.post("/api/v1/push", json={"items": [item]}).status_code == 401
        r = client.post("/api/v1/push", json={"items": [item]}, headers=_token("read-only"))
        assert r.status_code == 403 and r.json()["error"] == "forbidden"
        assert client.get("/api/v1/pop/queue/authq", headers=_token("read-only")).status_code == 403
        assert client.post("/api/v1/configure", json={"queue": "authq"},
                           headers=_token("write-only")).status_code == 403
        assert counts(db)["messages"] == 0
        out = push(client, item, headers=_token("read-write", sub="billing"))
        assert out[0]["status"] == "queued"
        assert db.execute("SELECT producer_sub FROM queen.messages").fetchone()["producer_sub"] == "billing"
        assert client.get("/api/v1/dlq", headers=_token("read-only")).status_code == 200
        detail = client.get(f"/api/v1/messages/{out[0]['partition_id']}/a1", headers=_token("read-only"))
        assert detail.status_code == 200 and detail.json()["producerSub"] == "billing"
        msg = pop(client, "authq", headers=_token("admin"))["messages"][0]
        assert msg["producerSub"] == "billing"
        r = client.post("/api/v1/dlq/00000000-0000-0000-0000-000000000000/replay", headers=_token("read-only"))
        assert r.status_code == 403


def test_concurrent_pops_hand_a_partition_to_exactly_one_consumer(broker, db):
    from concurrent.futures import ThreadPoolExecutor

    with broker.client() as client:
        push(client, *({"queue": "race", "payload": i, "transactionId": f"r{i}"} for i in range(3)))

    def one_pop(_):
        with broker.client() as c:
            r = c.get("/api/v1/pop/queue/race", params={"batch": 3})
            return r.status_code, (r.json()["messages"] if r.status_code == 200 else [])

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one_pop, range(4)))
    winners = [msgs for status, msgs in results if status == 200]
    assert len(winners) == 1, results
    assert [m["transactionId"] for m in winners[0]] == ["r0", "r1", "r2"]
    assert sorted(status for status, _ in results) == [200, 204, 204, 204]


def test_a_push_over_a_mebibyte_closes_its_connection_without_a_warning(spawn_broker, db):
    # The connection that sent a parameter over 1 MiB is closed after the request (libpq
    # keeps its buffer at that size); psycopg_pool logged a WARNING for each one, which told
    # operators something was wrong on every large push. A closed connection the broker did
    # not close itself still warns (psycopg_pool's own message).
    broker = spawn_broker()
    big = "x" * (3 << 19)  # 1.5 MiB of JSON string: over routes_log.DISCARD_AFTER_BYTES
    with broker.client() as c:
        for i in range(3):
            push(c, {"queue": "big", "transactionId": f"big-{i}", "payload": {"blob": big}})
        got = pop(c, "big", batch=3, autoAck="true")
    assert sorted(m["transactionId"] for m in got["messages"]) == ["big-0", "big-1", "big-2"]
    assert all(m["data"] == {"blob": big} for m in got["messages"])
    assert "discarding closed connection" not in broker.log(), broker.log()[-2000:]


def test_the_group_of_timers_dead_letters_is_not_a_consumer_group(client, db):
    # before: a consumer could pop and dead-letter in __QUEEN_TIMERS__, and its dead letter
    # was then refused replay as a timer's (409 dlq_replay_refused; Dec 8 review)
    push(client, {"queue": "gq", "payload": {"n": 1}, "transactionId": "g1"})
    msg = pop(client, "gq")["messages"][0]
    r = client.get("/api/v1/pop/queue/gq", params={"consumerGroup": "__QUEEN_TIMERS__"})
    assert r.status_code == 400 and "reserved" in r.json()["detail"], r.text
    for path, body in (("/api/v1/ack", {"transactionId": "g1", "partitionId": msg["partitionId"], "status": "dlq",
                                        "consumerGroup": "__QUEEN_TIMERS__"}),
                       ("/api/v1/ack/batch", {"consumerGroup": "__QUEEN_TIMERS__", "acknowledgments": [
                           {"transactionId": "g1", "partitionId": msg["partitionId"], "status": "dlq"}]}),
                       ("/api/v1/transaction", {"operations": [
                           {"type": "ack", "transactionId": "g1", "partitionId": msg["partitionId"],
                            "status": "dlq", "consumerGroup": "__QUEEN_TIMERS__"}]})):
        r = client.post(path, json=body)
        assert r.status_code == 400 and "reserved" in r.json()["detail"], (path, r.text)
    assert db.execute("SELECT count(*) AS n FROM queen.dead_letter_queue").fetchone()["n"] == 0
    # the DLQ is still listed by that group (the timers' dead letters)
    r = client.get("/api/v1/dlq", params={"consumerGroup": "__QUEEN_TIMERS__"})
    assert r.status_code == 200 and r.json()["messages"] == [], r.text
