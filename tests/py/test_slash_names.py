"""Names holding `/` in the path: a percent-encoded slash (`%2F`) is part of the name.

A queue, partition, timerKey, transactionId or leaseId may hold `/`, and the write
routes take it in their JSON body. The routes that name one in the path must reach it
when the client percent-encodes the slash (docs/http-timers.md, docs/log-surface.md):
Starlette matched routes on the decoded path, so `/api/v1/timers/%2Fa/k` became
`/api/v1/timers//a/k` and no route matched (404), `DELETE /api/v1/timers/%2F/%2F` was
redirected (307), and a queue `team/a` (or a partition `p/1`) could be pushed to, a timer
could fire into it, but nothing could pop it. The routes now match the raw path
(convertors.RawRoute): a raw `/` separates segments, `%2F` is a character of its segment.

Every request goes through a real broker (uvicorn, httptools, the DELETE's direct lane)
with httpx, which sends `%2F` as it is given.
"""

from __future__ import annotations

import time
from urllib.parse import quote

import httpx
import pytest

from timers_util import assert_error, op, post, token


def enc(name: str) -> str:
    return quote(name, safe="")


QUEUES = ["/a", "a/b", "/", "a/", "//x//"]
KEYS = ["k", "k/x", "/", "/lead"]


def _schedule(c, queue, key, headers=None):
    r = post(c, op("schedule", key, queue=queue), headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["results"][0]["status"] == "scheduled", r.text


def _peek(c, queue, key, headers=None) -> dict:
    r = c.get(f"/api/v1/timers/{enc(queue)}/{enc(key)}", headers=headers or {})
    assert r.status_code == 200, r.text
    return r.json()


def _keys(c, queue, headers=None) -> list[str]:
    r = c.get(f"/api/v1/timers/{enc(queue)}", headers=headers or {})
    assert r.status_code == 200, r.text
    return [row["timerKey"] for row in r.json()["rows"]]


@pytest.mark.parametrize("queue", QUEUES)
def test_a_timer_in_a_queue_with_a_slash_is_peeked_listed_and_cancelled(client, db, queue):
    for key in KEYS:
        _schedule(client, queue, key)
    assert sorted(_keys(client, queue)) == sorted(KEYS)
    for key in KEYS:
        peeked = _peek(client, queue, key)
        assert peeked["found"] is True and peeked["queue"] == queue and peeked["timerKey"] == key
    # DELETE through the direct lane (keep-alive) ...
    r = client.delete(f"/api/v1/timers/{enc(queue)}/{enc('k')}")
    assert r.status_code == 200, r.text
    assert r.json() == {"ok": True, "status": "cancelled", "queue": queue, "timerKey": "k", "txn": None}
    # ... and through Starlette's stack (Connection: close is not the direct lane's)
    r = client.delete(f"/api/v1/timers/{enc(queue)}/{enc('/')}", headers={"connection": "close"})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "cancelled" and r.json()["queue"] == queue and r.json()["timerKey"] == "/"
    # the key's own slashes may be raw or encoded: one catch-all, the same key
    r = client.delete(f"/api/v1/timers/{enc(queue)}/k/x")
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    # POST's cancel names the queue in the body
    r = post(client, op("cancel", "/lead", queue=queue))
    assert r.status_code == 200 and r.json()["results"][0]["status"] == "cancelled", r.text
    assert _keys(client, queue) == []
    assert _peek(client, queue, "k") == {"found": False}
    assert db.execute("SELECT count(*) AS n FROM queen.timers").fetchone()["n"] == 0


def test_a_raw_slash_separates_segments(client, db):
    """`/api/v1/timers/a/b/k` is queue `a` and key `b/k`, not queue `a/b`; an empty queue
    segment (`//a`) names no queue: a JSON 404, never a redirect."""
    _schedule(client, "a/b", "k")
    _schedule(client, "a", "b/k")
    assert _peek(client, "a/b", "k")["found"] is True
    raw = client.get("/api/v1/timers/a/b/k")
    assert raw.status_code == 200 and raw.json()["queue"] == "a" and raw.json()["timerKey"] == "b/k"
    for method in ("GET", "DELETE"):
        r = client.request(method, "/api/v1/timers//a/k")
        assert_error(r, 404, "not_found")
    # a queue's URL takes GET only, whatever its name
    r = client.delete(f"/api/v1/timers/{enc('/a')}")
    body = assert_error(r, 405, "method_not_allowed")
    assert "/api/v1/timers/%2Fa" in body["detail"]
    assert _peek(client, "a/b", "k")["found"] is True and _peek(client, "a", "b/k")["found"] is True


def test_a_path_that_is_not_utf8_is_a_json_400(client, db):
    for method, path in (("GET", "/api/v1/timers/%FF"), ("GET", "/api/v1/timers/%FF/k"),
                         ("DELETE", "/api/v1/timers/%FF/k"), ("DELETE", "/api/v1/timers/q/%C3"),
                         ("GET", "/api/v1/pop/queue/%FF"), ("GET", "/api/v1/pop/queue/q/partition/%FF"),
                         ("POST", "/api/v1/lease/%FF/extend")):
        body = assert_error(client.request(method, path), 400, "timers_bad_request")
        assert body["detail"] == "the path is not valid percent-encoded UTF-8"


def test_a_queue_with_a_slash_is_sent_encoded_by_the_direct_lane_and_the_stack_alike(client, db):
    """The DELETE's direct lane (server.py) and Starlette's stack route `%2F` the same way."""
    _schedule(client, "/", "/")
    with httpx.Client(base_url=str(client.base_url), timeout=10) as keep:
        r = keep.delete("/api/v1/timers/%2F/%2F")  # was a 307 redirect
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        r = keep.delete("/api/v1/timers/%2F/%2F")
        assert r.status_code == 200 and r.json()["status"] == "absent", r.text
    _schedule(client, "/", "/")
    r = client.delete("/api/v1/timers/%2F/%2F", headers={"connection": "close"})
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text


# ---------------------------------------------------------------------------
# the log surface
# ---------------------------------------------------------------------------

def _push(c, queue, txn, partition=None, headers=None) -> dict:
    item = {"queue": queue, "transactionId": txn, "payload": {"txn": txn}}
    if partition is not None:
        item["partition"] = partition
    r = c.post("/api/v1/push", json={"items": [item]}, headers=headers or {})
    assert r.status_code == 201, r.text
    assert r.json()[0]["status"] == "queued", r.text
    return r.json()[0]


def _pop(c, path, headers=None) -> list[dict]:
    r = c.get(path, params={"batch": 10}, headers=headers or {})
    assert r.status_code in (200, 204), r.text
    return [] if r.status_code == 204 else r.json()["messages"]


@pytest.mark.parametrize("queue", ["team/a", "/lead", "/"])
def test_pop_reaches_a_queue_with_a_slash(client, db, queue):
    _push(client, queue, "t1")
    msgs = _pop(client, f"/api/v1/pop/queue/{enc(queue)}")
    assert [(m["transactionId"], m["queue"]) for m in msgs] == [("t1", queue)]
    assert _pop(client, f"/api/v1/pop/queue/{enc(queue)}") == []  # leased


@pytest.mark.parametrize("queue,partition", [("q1", "p/1"), ("team/a", "/"), ("a/b", "x/y/z")])
def test_pop_reaches_a_partition_with_a_slash(client, db, queue, partition):
    _push(client, queue, "t1", partition=partition)
    _push(client, queue, "t2", partition="Default")
    msgs = _pop(client, f"/api/v1/pop/queue/{enc(queue)}/partition/{enc(partition)}")
    assert [(m["transactionId"], m["partition"]) for m in msgs] == [("t1", partition)]
    ack = client.post("/api/v1/ack", json={"transactionId": "t1", "partitionId": msgs[0]["partitionId"],
                                           "leaseId": msgs[0]["leaseId"], "status": "completed"})
    assert ack.status_code == 200 and ack.json()[0]["success"] is True, ack.text


def test_a_raw_slash_in_a_pop_path_is_a_json_404(client, db):
    """A raw `/` separates segments: `/api/v1/pop/queue/team/a` names no route."""
    _push(client, "team/a", "t1")
    for path in ("/api/v1/pop/queue/team/a", "/api/v1/pop/queue/q1/partition/p/1", "/api/v1/pop/queue//a"):
        assert_error(client.get(path), 404, "not_found")
    assert len(_pop(client, "/api/v1/pop/queue/team%2Fa")) == 1


def test_message_lease_and_replay_routes_read_an_encoded_slash_as_part_of_the_name(client, db):
    pushed = _push(client, "team/a", "/t/1", partition="p/1")
    pid = pushed["partition_id"]
    for path in (f"/api/v1/messages/{pid}/%2Ft%2F1", f"/api/v1/messages/{pid}//t/1"):
        r = client.get(path)
        assert r.status_code == 200, r.text
        assert (r.json()["transactionId"], r.json()["queue"], r.json()["partition"]) == ("/t/1", "team/a", "p/1")
    # a partitionId holding an encoded slash is one segment: no transactionId, no route
    assert_error(client.get(f"/api/v1/messages/{pid}%2Ft"), 404, "not_found")
    # a leaseId with a slash reaches the route: a lease that does not exist, not a missing route
    r = client.post("/api/v1/lease/a%2Fb/extend", json={})
    assert r.status_code == 200, r.text
    assert r.json()[0]["leaseId"] == "a/b" and r.json()[0]["success"] is False
    # a DLQ id with a slash is not a UUID: the route's own 404
    body = assert_error(client.post("/api/v1/dlq/a%2Fb/replay"), 404, "not_found")
    assert "not a UUID" in body["detail"]


def test_a_timer_fired_into_a_queue_and_partition_with_slashes_is_popped(client, db):
    r = post(client, op("schedule", "k/1", queue="team/a", partition="p/1", delayMs=0))
    assert r.status_code == 200 and r.json()["results"][0]["status"] == "scheduled", r.text
    deadline = time.monotonic() + 15
    while True:
        db.execute("SELECT * FROM queen.fire_due_timers(100)").fetchall()
        msgs = _pop(client, "/api/v1/pop/queue/team%2Fa/partition/p%2F1")
        if msgs:
            break
        assert time.monotonic() < deadline, "the fired timer's frame was never popped"
        time.sleep(0.1)
    assert [(m["transactionId"], m["queue"], m["partition"]) for m in msgs] == [("txn-k/1", "team/a", "p/1")]


# ---------------------------------------------------------------------------
# two tenants (QUEEN_AUTH=jwt): the routes read the caller's tenant's data only
# ---------------------------------------------------------------------------

A = token("read-write", tenant="acme", sub="svc-a")
B = token("read-write", tenant="globex", sub="svc-b")


def test_a_slash_name_is_read_in_the_callers_tenant_only(jwt_client, db):
    c = jwt_client
    _schedule(c, "/a", "k/1", headers=A)
    # B sees nothing of A's timer, and cannot cancel it
    assert _peek(c, "/a", "k/1", headers=B) == {"found": False}
    assert _keys(c, "/a", headers=B) == []
    r = c.delete(f"/api/v1/timers/{enc('/a')}/{enc('k/1')}", headers=B)
    assert r.status_code == 200 and r.json()["status"] == "absent", r.text
    assert _peek(c, "/a", "k/1", headers=A)["found"] is True
    assert _keys(c, "/a", headers=A) == ["k/1"]
    # the log: B's pop of the same names finds nothing; A's finds A's message
    _push(c, "team/a", "t-a", partition="p/1", headers=A)
    assert _pop(c, "/api/v1/pop/queue/team%2Fa/partition/p%2F1", headers=B) == []
    assert _pop(c, "/api/v1/pop/queue/team%2Fa", headers=B) == []
    msgs = _pop(c, "/api/v1/pop/queue/team%2Fa/partition/p%2F1", headers=A)
    assert [(m["transactionId"], m["partition"]) for m in msgs] == [("t-a", "p/1")]
    # and A's DELETE cancels A's timer
    r = c.delete(f"/api/v1/timers/{enc('/a')}/{enc('k/1')}", headers=A)
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    assert db.execute("SELECT count(*) AS n FROM queen.timers").fetchone()["n"] == 0


def test_a_key_with_a_dot_segment_is_reached_with_its_dots_percent_encoded(client, db):
    # httpx (so the queen-mq client) removes `..` from a URL before sending it: the raw form
    # reaches the timer `x`, the documented encoded form reaches `user/../x` (docs/http-timers.md)
    for key in ("x", "user/../x"):
        assert post(client, op("schedule", key, queue="dots")).status_code == 200
    assert client.get("/api/v1/timers/dots/user/%2E%2E/x").json()["timerKey"] == "user/../x"
    r = client.delete("/api/v1/timers/dots/user/../x")  # what the client sends is /dots/x
    assert r.json()["timerKey"] == "x" and r.json()["status"] == "cancelled", r.text
    r = client.delete("/api/v1/timers/dots/user/%2E%2E/x")
    assert r.json()["timerKey"] == "user/../x" and r.json()["status"] == "cancelled", r.text
    assert db.execute("SELECT count(*) AS n FROM queen.timers WHERE queue = 'dots'").fetchone()["n"] == 0
