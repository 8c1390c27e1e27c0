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
                         ("DELETE", "/api/v1/timers/%FF/k"), ("DELETE", "/api/v1/timers/q/%C3")):
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
