"""Log retention over real brokers: queues configured through POST /api/v1/configure,
the brokers' retention task (queen.apply_retention) deleting frames and dead letters
once their window has passed, two brokers at once, and consumers that still get every
unexpired frame exactly once while the head of their partition is being deleted."""

from __future__ import annotations

import threading
import time

import pytest

from queen_timers.config import ConfigError, Settings
from sweeper_support import sample, scrape, wait_until

FAST = {"QUEEN_RETENTION_INTERVAL_MS": "100"}
DELETED = "queen_timers_retention_deleted_total"


def configure(client, queue, **options):
    r = client.post("/api/v1/configure", json={"queue": queue, "options": options})
    assert r.status_code == 200, r.text
    return r.json()


def push(client, queue, txns, partition=None):
    items = [{"queue": queue, "transactionId": t, "payload": {"t": t}} for t in txns]
    if partition:
        for it in items:
            it["partition"] = partition
    r = client.post("/api/v1/push", json={"items": items})
    assert r.status_code == 201, r.text
    assert all(o["status"] == "queued" for o in r.json())
    return r.json()


def pop(client, queue, **params):
    r = client.get(f"/api/v1/pop/queue/{queue}", params=params)
    assert r.status_code in (200, 204), r.text
    return [] if r.status_code == 204 else r.json()["messages"]


def ack_all(client, msgs, status="completed", group=None):
    body = {"consumerGroup": group, "acknowledgments": [
        {"transactionId": m["transactionId"], "partitionId": m["partitionId"], "leaseId": m["leaseId"],
         "status": status} for m in msgs]}
    r = client.post("/api/v1/ack/batch", json=body)
    assert r.status_code == 200, r.text
    assert all(x["success"] for x in r.json()), r.json()


def txns_left(db, queue, tenant="default") -> list[str]:
    return [r["transaction_id"] for r in db.execute("""
        SELECT m.transaction_id FROM queen.messages m JOIN queen.partitions p ON p.id = m.partition_id
          JOIN queen.queues q ON q.id = p.queue_id WHERE q.tenant = %s AND q.name = %s ORDER BY m.seq""",
        (tenant, queue)).fetchall()]


def deleted(broker, kind) -> float:
    return sample(scrape(broker)[1], DELETED, kind=kind)


def test_settings_bounds():
    base = {"QUEEN_DATABASE_URL": "postgresql://x/y"}
    s = Settings.from_env(base)
    assert (s.retention_interval_ms, s.retention_batch) == (60000, 1000)
    assert Settings.from_env({**base, "QUEEN_RETENTION_INTERVAL_MS": "0"}).retention_interval_ms == 0
    for bad in ({"QUEEN_RETENTION_BATCH": "0"}, {"QUEEN_RETENTION_BATCH": "100001"},
                {"QUEEN_RETENTION_INTERVAL_MS": "-1"}, {"QUEEN_RETENTION_INTERVAL_MS": "soon"}):
        with pytest.raises(ConfigError, match="QUEEN_RETENTION_"):
            Settings.from_env({**base, **bad})


def test_pending_retention_deletes_frames_once_their_window_passed(db, spawn_broker):
    b = spawn_broker(**FAST)
    with b.client() as c:
        conf = configure(c, "ret-pend", retentionEnabled=True, retentionSeconds=3)
        assert {k: conf["options"][k] for k in ("retentionEnabled", "retentionSeconds", "completedRetentionSeconds")} \
            == {"retentionEnabled": True, "retentionSeconds": 3, "completedRetentionSeconds": 0}
        configure(c, "ret-keep", retentionEnabled=False, retentionSeconds=1)
        push(c, "ret-keep", ["k1", "k2"])
        out = push(c, "ret-pend", ["a1", "a2", "a3"])
        pid = out[0]["partition_id"]
        born = db.execute("SELECT extract(epoch FROM max(created_at))::float8 AS t FROM queen.messages "
                          "WHERE partition_id = %s", (pid,)).fetchone()["t"]
        # watch the frames on the database clock: never gone before the window, gone soon after it
        seen = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            row = db.execute("SELECT count(*) AS n, extract(epoch FROM clock_timestamp())::float8 AS now "
                             "FROM queen.messages WHERE partition_id = %s", (pid,)).fetchone()
            seen.append((row["now"] - born, row["n"]))
            if row["n"] == 0:
                break
            time.sleep(0.1)
        assert seen[-1][1] == 0, f"frames still there after 30 s: {seen[-3:]}"
        early = [(age, n) for age, n in seen if n < 3 and age < 3.0]
        assert not early, f"frames deleted before retentionSeconds: {early}"
        assert c.get(f"/api/v1/messages/{pid}/a1").status_code == 404
        assert txns_left(db, "ret-keep") == ["k1", "k2"], "a queue without retentionEnabled keeps its frames"
        wait_until(lambda: deleted(b, "pending") == 3, 5, message="the pending counter to read 3")
        assert deleted(b, "completed") == 0 and deleted(b, "dlq") == 0


def test_completed_retention_keeps_unconsumed_frames_and_cursors_move_on(db, spawn_broker):
    b = spawn_broker(**FAST)
    with b.client() as c:
        configure(c, "ret-done", retentionEnabled=True, completedRetentionSeconds=1)
        push(c, "ret-done", [f"d{i}" for i in range(1, 7)])
        first = pop(c, "ret-done", batch=3)
        assert [m["transactionId"] for m in first] == ["d1", "d2", "d3"]
        ack_all(c, first)
        wait_until(lambda: txns_left(db, "ret-done") == ["d4", "d5", "d6"], 20,
                   message="the consumed frames to go")
        time.sleep(1.5)  # more passes: unconsumed frames are never completed
        assert txns_left(db, "ret-done") == ["d4", "d5", "d6"]
        assert c.get(f"/api/v1/messages/{first[0]['partitionId']}/d1").status_code == 404
        # the group's cursor points at a deleted frame: the next pop goes on from there
        rest = pop(c, "ret-done", batch=10)
        assert [m["transactionId"] for m in rest] == ["d4", "d5", "d6"]
        ack_all(c, rest)
        wait_until(lambda: txns_left(db, "ret-done") == [], 20, message="the rest to go once consumed")
        assert pop(c, "ret-done", batch=10) == []
        # a new group starts at the first frame left
        push(c, "ret-done", ["d7"])
        assert [m["transactionId"] for m in pop(c, "ret-done", batch=10, consumerGroup="late")] == ["d7"]
        wait_until(lambda: deleted(b, "completed") == 6, 5, message="the completed counter to read 6")


def test_dead_letters_go_after_the_cell_dlq_retention(db, spawn_broker):
    db.execute("UPDATE queen.cell_settings SET dlq_retention_seconds = 1")
    b = spawn_broker(**FAST)
    with b.client() as c:
        configure(c, "ret-dlq", retentionEnabled=True)
        configure(c, "ret-dlq-off")
        push(c, "ret-dlq", ["x1", "x2"])
        push(c, "ret-dlq-off", ["y1"])
        ack_all(c, pop(c, "ret-dlq", batch=10), status="dlq")
        ack_all(c, pop(c, "ret-dlq-off", batch=10), status="dlq")

        def dlq_total(q):
            r = c.get("/api/v1/dlq", params={"queue": q})
            assert r.status_code == 200, r.text
            return r.json()["total"]

        wait_until(lambda: dlq_total("ret-dlq") == 0, 20, message="the dead letters to go")
        assert dlq_total("ret-dlq-off") == 1, "a queue without retentionEnabled keeps its dead letters"
        assert txns_left(db, "ret-dlq") == ["x1", "x2"], "the DLQ rule deletes no frame"
        wait_until(lambda: deleted(b, "dlq") == 2, 5, message="the dlq counter to read 2")


def test_two_brokers_delete_a_backlog_while_a_consumer_gets_every_live_frame_once(db, spawn_broker):
    # a backlog of expired frames in four partitions, written before any broker runs
    db.execute("SELECT queen.configure_queue('default', 'ret-bulk', NULL, NULL, "
               "'{\"retentionEnabled\": true, \"retentionSeconds\": 3600}')")
    db.execute("""SELECT count(*) FROM queen.push_messages('default', (SELECT array_agg(
                      ROW('ret-bulk', 'p' || (g % 4), 'bulk-' || g, NULL, '\\x00'::bytea, false)::queen.push_item)
                    FROM generate_series(1, 6000) g))""")
    db.execute("UPDATE queen.messages SET created_at = created_at - interval '2 hours'")
    env = {"QUEEN_RETENTION_INTERVAL_MS": "50", "QUEEN_RETENTION_BATCH": "50"}
    b1, b2 = spawn_broker(**env), spawn_broker(**env)
    live = [f"live-{i}" for i in range(400)]
    got: list[str] = []
    errors: list[BaseException] = []

    def produce():
        try:
            with b1.client() as c:
                for i in range(0, len(live), 20):
                    push(c, "ret-live", live[i:i + 20], partition=f"p{i % 3}")
                    time.sleep(0.02)
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)

    with b2.client() as c:
        configure(c, "ret-live", retentionEnabled=True, retentionSeconds=3600, completedRetentionSeconds=1)
        producer = threading.Thread(target=produce)
        producer.start()
        deadline = time.monotonic() + 90
        while len(got) < len(live) and time.monotonic() < deadline and not errors:
            msgs = pop(c, "ret-live", batch=7)
            if not msgs:
                time.sleep(0.02)
                continue
            got.extend(m["transactionId"] for m in msgs)
            ack_all(c, msgs)
        producer.join(30)
    assert not errors, errors
    assert len(got) == len(set(got)), "a live frame was delivered twice"
    assert sorted(got) == sorted(live), f"missing: {sorted(set(live) - set(got))[:10]}"

    wait_until(lambda: db.execute("SELECT count(*) AS n FROM queen.messages").fetchone()["n"] == 0, 60,
               message="the backlog and the consumed live frames to be deleted")

    def counted():
        return sum(deleted(b, k) for b in (b1, b2) for k in ("pending", "completed"))

    # every row deleted once: the two brokers' counters add up to exactly what was written
    wait_until(lambda: counted() == 6000 + len(live), 10, message="the counters to add up to 6400")
    time.sleep(0.3)
    assert counted() == 6000 + len(live)
    assert sum(deleted(b, "completed") for b in (b1, b2)) == len(live)
    for b in (b1, b2):
        log = b.log()
        assert "pass failed" not in log and "deadlock" not in log.lower(), log[-2000:]
