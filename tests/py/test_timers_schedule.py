"""POST /api/v1/timers, DELETE, peek and list over real HTTP: the five statuses and the shapes."""

from __future__ import annotations

import base64
import re
import uuid

import zstandard

from timers_util import HOUR_MS, b64, op, post, rows

ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")


def test_schedule_answers_verdict_with_message_id_and_deliver_at(client, db):
    r = post(client, op("schedule", "trial:acme:day7", txn="trial-acme-day7-v1", delayMs=604800000))
    assert r.status_code == 200, r.text
    assert set(r.json()) == {"results"}  # the envelope queen-mq reads
    [v] = r.json()["results"]
    assert set(v) == {"ok", "status", "queue", "timerKey", "txn", "messageId", "deliverAt"}
    assert v["ok"] is True and v["status"] == "scheduled"
    assert (v["queue"], v["timerKey"], v["txn"]) == ("reminders", "trial:acme:day7", "trial-acme-day7-v1")
    assert ISO.match(v["deliverAt"]), v["deliverAt"]
    [row] = rows(db)
    assert str(row["message_id"]) == v["messageId"]
    assert row["payload"] == b'{"kind":"day7"}' and row["partition"] == "Default"
    assert row["producer_sub"] is None and row["tenant"] == "default"
    # deliverAt is PostgreSQL's now() + delayMs, rendered to the microsecond
    assert row["deliver_at"].astimezone().strftime("%Y") == v["deliverAt"][:4]
    delta = db.execute("SELECT extract(epoch FROM deliver_at - created_at) * 1000 AS ms FROM queen.timers"
                       ).fetchone()["ms"]
    assert int(delta) == 604800000
    assert db.execute("SELECT to_char(deliver_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') AS s"
                      " FROM queen.timers").fetchone()["s"] == v["deliverAt"]


def test_reschedule_replaces_and_mints_new_message(client, db):
    first = post(client, op("schedule", "k1")).json()["results"][0]
    second = post(client, op("reschedule", "k1", delayMs=2 * HOUR_MS, txn="k1-v2",
                             payload=b64(b"new"), partition="acme")).json()["results"][0]
    assert second["ok"] is True and second["status"] == "rescheduled"
    assert second["txn"] == "k1-v2" and second["messageId"] != first["messageId"]
    assert second["deliverAt"] > first["deliverAt"]
    [row] = rows(db)
    assert row["payload"] == b"new" and row["partition"] == "acme" and row["txn"] == "k1-v2"


def test_reschedule_without_txn_gets_a_minted_txn(client, db):
    post(client, op("schedule", "k1"))
    v = post(client, op("reschedule", "k1")).json()["results"][0]
    assert v["status"] == "rescheduled" and v["txn"] not in (None, "txn-k1")
    assert rows(db)[0]["txn"] == v["txn"]


def test_reschedule_of_a_missing_timer_schedules_it(client, db):
    v = post(client, op("reschedule", "fresh")).json()["results"][0]
    assert v["ok"] is True and v["status"] == "scheduled" and v["txn"]


def test_cancel_in_batch_cancelled_then_absent(client, db):
    post(client, op("schedule", "k1"))
    r = post(client, op("cancel", "k1", txn="txn-k1"))
    assert r.json() == {"results": [{"ok": True, "status": "cancelled", "queue": "reminders", "timerKey": "k1",
                                     "txn": "txn-k1", "messageId": None, "deliverAt": None}]}
    assert rows(db) == []
    again = post(client, op("cancel", "k1")).json()["results"][0]
    assert again["ok"] is False and again["status"] == "absent" and again["txn"] is None


def test_mixed_batch_answers_in_input_order(client, db):
    post(client, op("schedule", "b"))
    r = post(client, op("schedule", "z"), op("cancel", "b"), op("schedule", "a", queue="other"),
             op("cancel", "nope"))
    assert r.status_code == 200, r.text
    assert [(v["timerKey"], v["status"]) for v in r.json()["results"]] == [
        ("z", "scheduled"), ("b", "cancelled"), ("a", "scheduled"), ("nope", "absent")]
    assert [(x["queue"], x["timer_key"]) for x in rows(db)] == [("other", "a"), ("reminders", "z")]


def test_empty_batch_is_an_empty_results_array(client, db):
    r = client.post("/api/v1/timers", json={"operations": []})
    assert r.status_code == 200 and r.json() == {"results": []}


def _claim(db) -> None:
    # Claim as another broker would: a clock two hours ahead makes the one-hour
    # timer due, and the lease (60 s past that) is held for real.
    claimed = db.execute("SELECT * FROM queen.claim_timers('test', 100, 60000, now() + interval '2 hours')"
                         ).fetchall()
    assert len(claimed) == 1


def test_too_late_for_reschedule_cancel_and_delete_of_a_claimed_timer(client, db):
    post(client, op("schedule", "k1", payload=b64(b"old")))
    _claim(db)
    v = post(client, op("reschedule", "k1", payload=b64(b"new"), txn="v2")).json()["results"][0]
    assert v == {"ok": False, "status": "too_late", "queue": "reminders", "timerKey": "k1",
                 "txn": "v2", "messageId": None, "deliverAt": None}
    assert post(client, op("cancel", "k1")).json()["results"][0]["status"] == "too_late"
    d = client.delete("/api/v1/timers/reminders/k1?txn=txn-k1")
    assert d.status_code == 200
    assert d.json() == {"ok": False, "status": "too_late", "queue": "reminders", "timerKey": "k1",
                        "txn": "txn-k1"}
    [row] = rows(db)
    assert row["payload"] == b"old"  # nothing replaced, nothing deleted
    peek = client.get("/api/v1/timers/reminders/k1").json()
    assert peek["claimed"] is True


def test_delete_cancelled_absent_and_txn_echo(client, db):
    post(client, op("schedule", "trial:acme:day7"))
    r = client.delete("/api/v1/timers/reminders/trial:acme:day7?txn=trial-acme-day7-v1")
    assert r.status_code == 200
    assert r.json() == {"ok": True, "status": "cancelled", "queue": "reminders",
                        "timerKey": "trial:acme:day7", "txn": "trial-acme-day7-v1"}
    r = client.delete("/api/v1/timers/reminders/trial:acme:day7?txn=trial-acme-day7-v1")
    assert r.json() == {"ok": False, "status": "absent", "queue": "reminders",
                        "timerKey": "trial:acme:day7", "txn": "trial-acme-day7-v1"}
    assert client.delete("/api/v1/timers/reminders/trial:acme:day7").json()["txn"] is None
    assert db.execute("SELECT queen.get_pending_timers(tenant) AS n FROM queen.tenant_usage").fetchone()["n"] == 0


def test_catch_all_timer_key_raw_and_encoded(client, db):
    assert post(client, op("schedule", "tenant/42"), op("schedule", "a/b/c/")).status_code == 200
    raw = client.get("/api/v1/timers/reminders/tenant/42").json()
    encoded = client.get("/api/v1/timers/reminders/tenant%2F42").json()
    assert raw["found"] is True and raw["timerKey"] == "tenant/42"
    assert encoded == raw
    assert client.get("/api/v1/timers/reminders/a/b/c/").json()["timerKey"] == "a/b/c/"
    # the list route and the catch-all coexist
    listed = client.get("/api/v1/timers/reminders").json()
    assert [x["timerKey"] for x in listed["rows"]] == ["a/b/c/", "tenant/42"]
    assert client.delete("/api/v1/timers/reminders/tenant%2F42").json()["status"] == "cancelled"
    assert client.delete("/api/v1/timers/reminders/a/b/c/").json()["status"] == "cancelled"
    assert rows(db) == []


def test_timer_key_with_a_newline_reaches_its_route(client, db):
    # Starlette's `path` convertor (`.*`) stops at a newline: such a key answered a
    # plain-text 404 from no route at all (found by tests/py/test_openapi_fuzz.py)
    assert post(client, op("schedule", "a\nb/c")).status_code == 200
    peek = client.get("/api/v1/timers/reminders/a%0Ab/c")
    assert peek.status_code == 200 and peek.json()["timerKey"] == "a\nb/c"
    d = client.delete("/api/v1/timers/reminders/a%0Ab%2Fc")
    assert d.status_code == 200 and d.json()["status"] == "cancelled"
    miss = client.get("/api/v1/messages/00000000-0000-0000-0000-000000000000/x%0Ay")
    assert miss.status_code == 404 and miss.json() == {"error": "Message not found"}


def test_percent_encoded_queue_with_a_slash(client, db):
    post(client, op("schedule", "k", queue="team/a"))
    assert client.get("/api/v1/timers/team%2Fa/k").json()["found"] is True
    assert [x["timerKey"] for x in client.get("/api/v1/timers/team%2Fa").json()["rows"]] == ["k"]
    assert client.get("/api/v1/timers/team/a").json()["found"] is False  # queue "team", key "a"


def test_peek_shows_the_row_and_miss_is_found_false(client, db):
    post(client, op("schedule", "k1", partition="p1", payload=b64(b"\x00\xffbytes")))
    r = client.get("/api/v1/timers/reminders/k1")
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"found", "queue", "timerKey", "partition", "deliverAt", "txn", "messageId",
                         "payload", "payloadZstd", "encrypted", "producerSub", "attempts", "lastError",
                         "claimed", "createdAt", "updatedAt"}
    assert body["found"] is True and body["partition"] == "p1" and body["txn"] == "txn-k1"
    assert base64.b64decode(body["payload"]) == b"\x00\xffbytes"
    assert body["payloadZstd"] is False and body["encrypted"] is False
    assert body["attempts"] == 0 and body["lastError"] is None and body["claimed"] is False
    assert body["producerSub"] is None
    assert all(ISO.match(body[k]) for k in ("deliverAt", "createdAt", "updatedAt"))
    uuid.UUID(body["messageId"])
    miss = client.get("/api/v1/timers/reminders/nope")
    assert miss.status_code == 200 and miss.json() == {"found": False}
    assert client.get("/api/v1/timers/elsewhere/k1").json() == {"found": False}


def test_peek_of_a_zstd_payload_is_as_stored(client, db):
    packed = zstandard.ZstdCompressor().compress(b"hello " * 100)
    post(client, op("schedule", "z", payload=b64(packed), payloadZstd=True))
    body = client.get("/api/v1/timers/reminders/z").json()
    assert body["payloadZstd"] is True and base64.b64decode(body["payload"]) == packed


def test_list_pages_with_after_and_limit(client, db):
    post(client, *[op("schedule", f"k{i:02d}") for i in range(7)], op("schedule", "x", queue="other"))
    page = client.get("/api/v1/timers/reminders", params={"limit": "3"}).json()
    assert [x["timerKey"] for x in page["rows"]] == ["k00", "k01", "k02"]
    assert page["truncated"] is True and page["nextAfter"] == "k02"
    assert "payload" not in page["rows"][0]
    assert set(page["rows"][0]) == {"timerKey", "partition", "deliverAt", "txn", "messageId",
                                    "payloadZstd", "encrypted", "producerSub", "attempts",
                                    "lastError", "claimed", "createdAt", "updatedAt"}
    page = client.get("/api/v1/timers/reminders", params={"limit": "3", "after": "k05"}).json()
    assert [x["timerKey"] for x in page["rows"]] == ["k06"]
    assert page["truncated"] is False and page["nextAfter"] is None
    whole = client.get("/api/v1/timers/reminders").json()
    assert len(whole["rows"]) == 7 and whole["truncated"] is False
    # clamped rather than rejected
    assert len(client.get("/api/v1/timers/reminders", params={"limit": "0"}).json()["rows"]) == 1
    assert len(client.get("/api/v1/timers/reminders", params={"limit": "99999999999999"}).json()["rows"]) == 7
    empty = client.get("/api/v1/timers/nothing-here").json()
    assert empty == {"rows": [], "truncated": False, "nextAfter": None}


def test_partition_defaults_and_negative_delay_is_legal(client, db):
    db.execute("SELECT queen.pause_fire()")  # a due timer must stay put for this test
    v = post(client, op("schedule", "past", delayMs=-5000)).json()["results"][0]
    assert v["status"] == "scheduled"
    assert db.execute("SELECT deliver_at < now() AS due FROM queen.timers").fetchone()["due"] is True


def test_metering_counts_schedules_and_reschedules_not_cancels(client, db):
    post(client, op("schedule", "a"), op("schedule", "b"))
    post(client, op("reschedule", "a"), op("cancel", "b"))
    usage = db.execute("SELECT queen.get_pending_timers(tenant) AS pending_timers, billed_messages "
                       "FROM queen.tenant_usage").fetchone()
    assert usage == {"pending_timers": 1, "billed_messages": 3}


def test_results_echo_every_name_exactly_and_match_the_rows(client, db):
    # The broker writes the results from PostgreSQL's verdicts and its own copy
    # of the names: names JSON must escape (quotes, backslashes, control
    # characters, non-ASCII, commas and colons, which the verdict texts use as
    # separators) come back exactly, beside plain ones, in a batch mixing every
    # verdict: scheduled, rescheduled, a minted txn, cancelled, absent, too_late.
    odd = ['q"uote', "back\\slash", "tab\there", "new\nline", "caf\u00e9 \u2603", "a,b:c", "\x7fdel", "plain"]
    post(client, op("schedule", "claimed", queue="held"))
    _claim(db)
    post(client, op("schedule", "k-resched", queue="plain"), op("schedule", "k-cancel", queue="plain"))
    batch = [op("schedule", f"key {name}", queue=name, txn=f"txn {name}") for name in odd]
    batch += [op("reschedule", "k-resched", queue="plain"),  # no txn: PostgreSQL mints one
              op("cancel", "k-cancel", queue="plain"),
              op("cancel", "never", queue="plain", txn="t,1:x"),
              op("reschedule", "claimed", queue="held", txn="late")]
    r = post(client, *batch)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [(v["queue"], v["timerKey"]) for v in results] == [(o["queue"], o["timerKey"]) for o in batch]
    assert [v["status"] for v in results] == ["scheduled"] * len(odd) + ["rescheduled", "cancelled", "absent",
                                                                          "too_late"]
    assert [v["ok"] for v in results] == [True] * (len(odd) + 2) + [False, False]
    stored = {(x["queue"], x["timer_key"]): x for x in rows(db)}
    for v, o in zip(results, batch):
        if v["status"] in ("scheduled", "rescheduled"):
            row = stored[(v["queue"], v["timerKey"])]
            assert v["messageId"] == str(row["message_id"]) and v["txn"] == row["txn"]
            at = db.execute("SELECT to_char(%s::timestamptz AT TIME ZONE 'UTC', "
                            "'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') AS s", (row["deliver_at"],)).fetchone()["s"]
            assert v["deliverAt"] == at
        else:
            assert v["messageId"] is None and v["deliverAt"] is None
        if "txn" in o:
            assert v["txn"] == o["txn"]
    minted = results[len(odd)]["txn"]
    assert minted and str(uuid.UUID(minted)) == minted  # a uuid, not an echo of nothing
    assert results[len(odd) + 1]["txn"] is None and results[len(odd) + 2]["txn"] == "t,1:x"


def test_an_empty_batch_answers_empty_results(client, db):
    r = client.post("/api/v1/timers", json={"operations": []})
    assert r.status_code == 200 and r.json() == {"results": []}
    assert rows(db) == []


def test_fast_batch_results_escape_ascii_names(client, db):
    # schedule-only ASCII batches take the column-by-column path: quotes,
    # backslashes and control characters in its echoes are escaped too
    # (a name with U+001F keeps the arrays: the packed form joins by it)
    names = ['q"uote', "back\\slash", "tab\there", "\x01ctl", "a,b:c", "unit\x1fsep", "plain"]
    batch = [op("schedule", f"k{n} {name}", queue=name, txn=f"t {name}") for n, name in enumerate(names)]
    r = post(client, *batch)
    assert r.status_code == 200, r.text
    got = [(v["queue"], v["timerKey"], v["txn"], v["status"]) for v in r.json()["results"]]
    assert got == [(o["queue"], o["timerKey"], o["txn"], "scheduled") for o in batch]
    assert len(rows(db)) == len(names)
