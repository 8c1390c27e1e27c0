"""End to end with the real Queen client: queen-mq 2.6.0 (pinned in the test extras)
against a real broker process, with auth off and with QUEEN_AUTH=jwt (the client's
bearer token).

Every request here is made by the client's own API (queue builder, ack, renew,
transaction, dlq, timers, consume, admin); nothing is sent by hand. The README's
"checked with the queen-mq client" names exactly the routes these tests drive:

    POST /api/v1/configure            client.queue(q).config(...).create()
    POST /api/v1/push                 client.queue(q).push([...])
    GET  /api/v1/pop/queue/:q         client.queue(q).pop(), .consume(handler)
    POST /api/v1/ack                  client.ack(msg, True | False)
    POST /api/v1/ack/batch            client.ack([msgs], True | False)
    GET  /api/v1/dlq                  client.queue(q).dlq().get()
    GET  /api/v1/messages/:pid/:txn   client.admin.get_message(...)
    POST /api/v1/transaction          client.transaction()...commit()
    POST /api/v1/lease/:id/extend     client.renew(msg)
    POST /api/v1/timers               client.timers.schedule / .batch, client.timer(q)...schedule()
    GET  /api/v1/timers/:q/*key       client.timers.peek
    GET  /api/v1/timers/:q            client.timers.list
    DELETE /api/v1/timers/:q/*key     client.timers.cancel
    GET  /health                      client.admin.health()

The client is async: each test runs one scenario with asyncio.run.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import signal
from datetime import datetime

import pytest
from queen import Queen
from queen.timers import ops as timer_ops

from timers_util import HOUR_MS, JWT_SECRET, token

SUB = "e2e-client"


@pytest.fixture(params=["auth-off", "jwt"])
def target(request, broker_factory):
    """(broker, bearer token or None): one run with auth off, one with QUEEN_AUTH=jwt."""
    if request.param == "auth-off":
        return broker_factory(), None
    b = broker_factory(QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET)
    bearer = token("read-write", sub=SUB, tenant="acme")["Authorization"].split(" ", 1)[1]
    return b, bearer


@contextlib.contextmanager
def _signals_kept():
    """Queen() installs SIGINT/SIGTERM handlers and close() resets them to SIG_DFL:
    give pytest its own back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def drive(target, scenario):
    """Run `await scenario(client)` with a fresh Queen client on the target broker."""
    broker, bearer = target

    async def main():
        client = Queen(url=broker.url, bearer_token=bearer, retry_attempts=1, timeout_millis=20000)
        try:
            return await scenario(client)
        finally:
            await client.close()

    with _signals_kept():
        return asyncio.run(main())


def _ts(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


async def _configure(client, queue: str, **options) -> dict:
    res = await client.queue(queue).config(options).create()
    assert res["configured"] is True and res["queue"] == queue, res
    return res


async def _pop_one(client, queue: str) -> dict:
    msgs = await client.queue(queue).batch(1).wait(True).timeout_millis(5000).pop()
    assert len(msgs) == 1, msgs
    return msgs[0]


# ---------------------------------------------------------------------------
# configure, push, pop, ack, ack failed -> DLQ, dlq list
# ---------------------------------------------------------------------------

def test_configure_push_pop_ack_and_failed_ack_to_dlq(target):
    async def scenario(client):
        assert (await client.admin.health())["status"] == "healthy"
        # retryLimit 0: the first failed ack dead-letters the message
        res = await _configure(client, "orders", retry_limit=0, dead_letter_queue=True,
                               dlq_after_max_retries=True, lease_time=60)
        assert res["options"]["retryLimit"] == 0 and res["options"]["deadLetterQueue"] is True

        pushed = await client.queue("orders").push([
            {"data": {"order": 1}, "transactionId": "order-1"},
            {"data": {"order": 2}, "transactionId": "order-2"},
        ])
        assert [(p["status"], p["transaction_id"]) for p in pushed] == [
            ("queued", "order-1"), ("queued", "order-2")]
        again = await client.queue("orders").push([{"data": {"order": 1}, "transactionId": "order-1"}])
        assert again[0]["status"] == "duplicate"

        first = await _pop_one(client, "orders")
        assert (first["transactionId"], first["data"]) == ("order-1", {"order": 1})
        assert first["id"] == pushed[0]["message_id"] and first["leaseId"]
        if target[1] is not None:
            assert first["producerSub"] == SUB  # the JWT's sub, attested by the broker
        acked = await client.ack(first, True)
        assert acked["success"] is True and acked["dlq"] is False, acked
        detail = await client.admin.get_message(first["partitionId"], "order-1")
        assert detail["status"] == "completed", detail

        second = await _pop_one(client, "orders")
        assert (second["transactionId"], second["data"]) == ("order-2", {"order": 2})
        failed = await client.ack(second, False, {"error": "card declined"})
        assert failed["success"] is True and failed["dlq"] is True, failed

        dlq = await client.queue("orders").dlq().limit(10).get()
        assert dlq["total"] == 1, dlq
        [dead] = dlq["messages"]
        assert (dead["transactionId"], dead["data"], dead["errorMessage"]) == (
            "order-2", {"order": 2}, "card declined")
        assert dead["queue"] == "orders" and dead["id"] == second["id"]
        assert (await client.admin.get_message(second["partitionId"], "order-2"))["status"] == "dead_letter"
        # nothing left to deliver: the failed message went to the DLQ, not back to the queue
        assert await client.queue("orders").batch(1).wait(False).pop() == []

    drive(target, scenario)


def test_a_batch_nacked_then_acked_as_a_list(target):
    # client.ack(list, ...) is POST /api/v1/ack/batch with the batch's lease on every item.
    # A nack of the whole batch is one retry: every item succeeds and the batch comes back
    # whole (before migration 033 the first item released the lease and the others were
    # refused, so the client reported the nack as failed; Dec 7 audit). Then the batch
    # acked as a list: the cursor passes it, nothing comes back.
    async def scenario(client):
        await _configure(client, "batches", retry_limit=3, lease_time=60)
        await client.queue("batches").push([{"data": {"n": i}, "transactionId": f"b-{i}"} for i in range(3)])
        first = await client.queue("batches").batch(3).wait(True).timeout_millis(5000).pop()
        assert [m["transactionId"] for m in first] == ["b-0", "b-1", "b-2"]
        nacked = await client.ack(first, False, {"error": "handler raised"})
        assert nacked["success"] is True, nacked
        again = await client.queue("batches").batch(3).wait(True).timeout_millis(5000).pop()
        assert [m["transactionId"] for m in again] == ["b-0", "b-1", "b-2"]
        assert again[0]["leaseId"] != first[0]["leaseId"]
        acked = await client.ack(again, True)
        assert acked["success"] is True, acked
        assert await client.queue("batches").batch(3).wait(False).pop() == []
        detail = await client.admin.get_message(again[2]["partitionId"], "b-2")
        assert detail["status"] == "completed" and (await client.queue("batches").dlq().get())["total"] == 0

    drive(target, scenario)


# ---------------------------------------------------------------------------
# transaction: push + ack, atomically (POST /api/v1/transaction)
# ---------------------------------------------------------------------------

def test_transaction_pushes_and_acks_atomically(target):
    async def scenario(client):
        await _configure(client, "jobs", lease_time=60)
        await _configure(client, "results", lease_time=60)
        await client.queue("jobs").push([{"data": {"job": 1}, "transactionId": "job-1"},
                                         {"data": {"job": 2}, "transactionId": "job-2"}])
        job = await _pop_one(client, "jobs")
        assert job["transactionId"] == "job-1"

        res = await (client.transaction()
                     .queue("results").push([{"data": {"done": 1}, "transactionId": "result-1"}])
                     .ack(job)
                     .commit())
        assert res["success"] is True, res
        out = await _pop_one(client, "results")
        assert (out["transactionId"], out["data"]) == ("result-1", {"done": 1})
        assert (await client.admin.get_message(job["partitionId"], "job-1"))["status"] == "completed"

        # all or nothing: an ack under a lease that is not the holder's fails the
        # transaction, and its push is not in the log either
        job2 = await _pop_one(client, "jobs")
        assert job2["transactionId"] == "job-2"
        stale = {**job2, "leaseId": "00000000-0000-0000-0000-000000000000"}
        with pytest.raises(Exception):
            await (client.transaction()
                   .queue("results").push([{"data": {"done": 2}, "transactionId": "result-2"}])
                   .ack(stale)
                   .commit())
        assert await client.queue("results").batch(1).wait(False).pop() == []
        assert (await client.admin.get_message(job2["partitionId"], "job-2"))["status"] == "processing"

    drive(target, scenario)


def test_a_batch_nacked_then_acked_as_a_list_in_a_transaction(target):
    # client.transaction().ack(messages, status) adds one ack operation per message. Before
    # migration 039 each was its own ack_messages call: the first failed ack released the
    # batch's lease and the second was refused, so the transaction failed and the client
    # raised; completed acks listed out of log order failed the same way once the last
    # message's ack had released the lease (Dec 7 log-surface audit).
    async def scenario(client):
        await _configure(client, "tbatches", retry_limit=3, lease_time=60)
        await client.queue("tbatches").push([{"data": {"n": i}, "transactionId": f"t-{i}"} for i in range(3)])
        first = await client.queue("tbatches").batch(3).wait(True).timeout_millis(5000).pop()
        assert [m["transactionId"] for m in first] == ["t-0", "t-1", "t-2"]
        res = await client.transaction().ack(first, "failed").commit()
        assert res["success"] is True, res
        again = await client.queue("tbatches").batch(3).wait(True).timeout_millis(5000).pop()
        assert [m["transactionId"] for m in again] == ["t-0", "t-1", "t-2"]  # the batch came back whole
        res = await client.transaction().ack(list(reversed(again))).commit()
        assert res["success"] is True, res
        assert await client.queue("tbatches").batch(3).wait(False).pop() == []
        assert (await client.admin.get_message(again[0]["partitionId"], "t-0"))["status"] == "completed"

    drive(target, scenario)


def test_acks_under_a_named_consumer_group_leave_the_other_groups_alone(target):
    # a consumer group has its own cursor: client.queue(q).group(g).pop(), then
    # client.ack(msg, ..., {"group": g}) (one and batch); the queue-mode consumer
    # still gets every message, and a failed ack in the group redelivers to it alone
    async def scenario(client):
        await _configure(client, "fanout", retry_limit=3, lease_time=60)
        await client.queue("fanout").push([{"data": {"n": i}, "transactionId": f"f-{i}"} for i in range(3)])
        audit = client.queue("fanout").group("audit")
        got = await audit.batch(2).wait(True).timeout_millis(5000).pop()
        assert [m["transactionId"] for m in got] == ["f-0", "f-1"]
        acked = await client.ack(got[0], True, {"group": "audit"})
        assert acked["success"] is True, acked
        nacked = await client.ack(got[1], False, {"group": "audit"})
        assert nacked["success"] is True, nacked
        # without the group the ack is the queue mode's: no lease there, refused
        refused = await client.ack(got[1], True)
        assert refused["success"] is False, refused
        back = await audit.batch(3).wait(True).timeout_millis(5000).pop()
        assert [m["transactionId"] for m in back] == ["f-1", "f-2"]  # f-0 stays consumed in audit
        batch = await client.ack(back, True, {"group": "audit"})
        assert batch["success"] is True, batch
        assert await audit.batch(3).wait(False).pop() == []
        # the queue mode's own cursor never moved
        plain = await client.queue("fanout").batch(3).wait(True).timeout_millis(5000).pop()
        assert [m["transactionId"] for m in plain] == ["f-0", "f-1", "f-2"]

    drive(target, scenario)


# ---------------------------------------------------------------------------
# renew: lease extend (POST /api/v1/lease/:leaseId/extend)
# ---------------------------------------------------------------------------

def test_renew_extends_the_lease_until_it_is_released(target, db):
    async def scenario(client):
        await _configure(client, "slow", lease_time=10)
        await client.queue("slow").push([{"data": {"n": 1}, "transactionId": "slow-1"}])
        msg = await _pop_one(client, "slow")
        before = db.execute("SELECT max(lease_expires_at) AS t FROM queen.partition_consumers").fetchone()["t"]
        assert before is not None

        renewed = await client.renew(msg)
        assert renewed["success"] is True and renewed["leaseId"] == msg["leaseId"], renewed
        new_expiry = _ts(renewed["newExpiresAt"])
        assert new_expiry > before
        after = db.execute("SELECT max(lease_expires_at) AS t FROM queen.partition_consumers").fetchone()["t"]
        assert after == new_expiry

        assert (await client.ack(msg, True))["success"] is True
        # the ack released the lease: nothing left to extend
        gone = await client.renew(msg)
        assert gone["success"] is False and gone["newExpiresAt"] is None, gone

    drive(target, scenario)


# ---------------------------------------------------------------------------
# timers: schedule / batch / builder / peek / list / cancel
# ---------------------------------------------------------------------------

def test_timers_schedule_batch_peek_list_cancel(target):
    async def scenario(client):
        v = await client.timers.schedule("reminders", "tenant/42", {"kind": "day7"}, delay_ms=HOUR_MS,
                                         txn="day7-v1", partition="acme")
        assert bool(v) and v["ok"] is True and v["status"] == "scheduled", v
        assert (v["queue"], v["timerKey"], v["txn"]) == ("reminders", "tenant/42", "day7-v1")
        assert v["messageId"] and _ts(v["deliverAt"])

        results = await client.timers.batch([
            timer_ops.schedule("reminders", "a", {"n": "a"}, delay_ms=HOUR_MS, txn="txn-a"),
            timer_ops.schedule("reminders", "b", {"n": "b"}, delay_ms=HOUR_MS, txn="txn-b"),
            timer_ops.schedule("reminders", "tenant/42", {"kind": "day7", "v": 2}, delay_ms=2 * HOUR_MS,
                               txn="day7-v2", reschedule=True),
            timer_ops.cancel("reminders", "nope"),
        ])
        assert [(r["timerKey"], r["status"]) for r in results] == [
            ("a", "scheduled"), ("b", "scheduled"), ("tenant/42", "rescheduled"), ("nope", "absent")]
        assert [bool(r) for r in results] == [True, True, True, False]

        built = await client.timer("reminders").key("c").payload({"n": "c"}).after_ms(HOUR_MS).txn("txn-c").schedule()
        assert built["status"] == "scheduled" and built["txn"] == "txn-c"

        peek = await client.timers.peek("reminders", "tenant/42")
        assert peek["found"] is True and peek["timerKey"] == "tenant/42" and peek["txn"] == "day7-v2"
        assert json.loads(base64.b64decode(peek["payload"])) == {"kind": "day7", "v": 2}
        assert peek["claimed"] is False and peek["partition"] == "Default"
        if target[1] is not None:
            assert peek["producerSub"] == SUB
        miss = await client.timers.peek("reminders", "nope")
        assert miss == {"found": False} and not miss

        page = await client.timers.list("reminders", limit=2)
        assert [r["timerKey"] for r in page["rows"]] == ["a", "b"] and page["truncated"] is True
        assert [r["timerKey"] for r in await client.timers.list_all("reminders", limit=2)] == [
            "a", "b", "c", "tenant/42"]

        cancelled = await client.timers.cancel("reminders", "tenant/42", txn="day7-v2")
        assert cancelled == {"ok": True, "status": "cancelled", "queue": "reminders",
                             "timerKey": "tenant/42", "txn": "day7-v2"}
        absent = await client.timers.cancel("reminders", "tenant/42", txn="day7-v2")
        assert absent["status"] == "absent" and not absent and absent["txn"] == "day7-v2"
        assert (await client.timer("reminders").key("c").cancel())["status"] == "cancelled"
        assert [r["timerKey"] for r in (await client.timers.list("reminders"))["rows"]] == ["a", "b"]

    drive(target, scenario)


# ---------------------------------------------------------------------------
# a fired timer, consumed by the client
# ---------------------------------------------------------------------------

def test_fired_timer_is_consumed_with_its_payload(target):
    async def scenario(client):
        fired = await (client.timer("wakeups").key("user/7:nudge")
                       .payload({"nudge": "come back", "user": 7}).after_ms(300).schedule())
        assert fired["status"] == "scheduled"
        got: list[dict] = []

        async def handler(message):
            got.append(message)

        await asyncio.wait_for(
            client.queue("wakeups").batch(1).timeout_millis(5000).limit(1).consume(handler), 60)
        [frame] = got
        assert frame["data"] == {"nudge": "come back", "user": 7}
        assert frame["transactionId"] == fired["txn"] and frame["id"] == fired["messageId"]
        if target[1] is not None:
            assert frame["producerSub"] == SUB
        # delivered: the timer has no row any more, and consume acked the frame
        assert await client.timers.peek("wakeups", "user/7:nudge") == {"found": False}
        assert (await client.timers.cancel("wakeups", "user/7:nudge"))["status"] == "absent"
        detail = await client.admin.get_message(frame["partitionId"], fired["txn"])
        assert detail["status"] == "completed", detail

    drive(target, scenario)
