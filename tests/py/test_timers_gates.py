"""The gate ladder over HTTP: every refusal of POST /api/v1/timers refuses the whole batch,
writes nothing and names the cancel route; DELETE passes no rung."""

from __future__ import annotations

import pytest
import zstandard

from timers_util import HINT, HOUR_MS, assert_error, b64, op, post, rows

MiB = 1024 * 1024


@pytest.fixture
def tenancy(broker_factory):
    b = broker_factory(QUEEN_TENANCY="on")
    with b.client() as c:
        yield c


def plan(db, name="pro", tenant="default", **limits) -> None:
    cols = ", ".join(["plan", *limits])
    marks = ", ".join(["%s"] * (1 + len(limits)))
    db.execute(f"INSERT INTO queen.plans ({cols}) VALUES ({marks})", (name, *limits.values()))
    if tenant:
        db.execute("INSERT INTO queen.tenants (tenant, plan) VALUES (%s, %s)", (tenant, name))


def refused(r, status: int, slug: str, db, *, before: int = 0) -> dict:
    """A whole-batch refusal: documented shape, the hint header, nothing written."""
    body = assert_error(r, status, slug)
    assert body.get("detail"), body
    assert r.headers["x-queen-timers-hint"] == HINT
    assert len(rows(db)) == before
    return body


def mixed():
    # a schedule and a cancel in the same batch: refused whole, not half-applied
    return op("schedule", "new"), op("cancel", "existing")


# ---- 503 timers_disabled -------------------------------------------------------

def test_paused_scheduling_is_503_timers_disabled_with_retry_after(client, db):
    post(client, op("schedule", "existing"))
    db.execute("SELECT queen.pause_scheduling()")
    r = post(client, *mixed())
    refused(r, 503, "timers_disabled", db, before=1)
    assert int(r.headers["Retry-After"]) >= 1
    # the cancel the batch carried still works on its own route
    d = client.delete("/api/v1/timers/reminders/existing")
    assert d.status_code == 200 and d.json()["status"] == "cancelled"
    db.execute("SELECT queen.resume_scheduling()")
    assert post(client, op("schedule", "new")).status_code == 200



def test_an_empty_batch_passes_the_ladder_too(client, db):
    # nothing to write, but the rungs answer as for any batch (migration 035): an empty
    # batch got 200 while scheduling was paused
    db.execute("SELECT queen.pause_scheduling()")
    r = client.post("/api/v1/timers", json={"operations": []})
    refused(r, 503, "timers_disabled", db, before=0)
    assert int(r.headers["Retry-After"]) >= 1
    db.execute("SELECT queen.resume_scheduling()")
    r = client.post("/api/v1/timers", json={"operations": []})
    assert r.status_code == 200 and r.json() == {"results": []}, r.text


# ---- 403 feature_gated --------------------------------------------------------

def test_tenancy_without_quota_row_is_feature_gated(tenancy, db):
    refused(post(tenancy, op("schedule", "k")), 403, "feature_gated", db)


def test_plan_without_timers_is_feature_gated(tenancy, db):
    plan(db, timers_enabled=False)
    body = refused(post(tenancy, op("schedule", "k")), 403, "feature_gated", db)
    assert "plan" in body["detail"]


# ---- 403 produce_blocked ------------------------------------------------------

def test_cluster_produce_block_is_403(client, db):
    post(client, op("schedule", "existing"))
    db.execute("UPDATE queen.cell_settings SET produce_blocked = true")
    refused(post(client, *mixed()), 403, "produce_blocked", db, before=1)
    assert client.delete("/api/v1/timers/reminders/existing").json()["status"] == "cancelled"


def test_tenant_produce_block_is_403(tenancy, db):
    plan(db)
    assert post(tenancy, op("schedule", "existing")).status_code == 200
    db.execute("UPDATE queen.tenants SET produce_blocked = true")
    refused(post(tenancy, *mixed()), 403, "produce_blocked", db, before=1)


# ---- 429 rate_limited ---------------------------------------------------------

def test_rate_limited_is_429_with_retry_after(tenancy, db):
    # one operation per 1000 s: the second call cannot have refilled, whatever the machine's speed
    plan(db, rate_ops_per_second=0.001, rate_burst=1)
    assert post(tenancy, op("schedule", "existing")).status_code == 200
    r = post(tenancy, *mixed())
    refused(r, 429, "rate_limited", db, before=1)
    assert int(r.headers["Retry-After"]) >= 900
    # DELETE takes no token
    assert tenancy.delete("/api/v1/timers/reminders/existing").json()["status"] == "cancelled"


# ---- 403 timers_quota_exceeded ------------------------------------------------

def test_pending_quota_is_403_and_cancel_still_answers(tenancy, db):
    plan(db, max_pending_timers=2)
    assert post(tenancy, op("schedule", "a"), op("schedule", "b")).status_code == 200
    # a batch that grows past the quota is refused whole, cancel included
    body = refused(post(tenancy, op("schedule", "c"), op("schedule", "d"), op("cancel", "a")), 403,
                   "timers_quota_exceeded", db, before=2)
    assert "2" in body["detail"]
    # rescheduling an existing row creates nothing and passes
    assert post(tenancy, op("reschedule", "a")).json()["results"][0]["status"] == "rescheduled"
    # a cancel for a tenant over quota still answers 200 on DELETE
    d = tenancy.delete("/api/v1/timers/reminders/a?txn=txn-a")
    assert d.status_code == 200 and d.json()["status"] == "cancelled"
    assert post(tenancy, op("schedule", "c")).status_code == 200


# ---- 403 timer_horizon_exceeded ------------------------------------------------

def test_delay_beyond_the_cell_horizon_is_403(client, db):
    ninety_days = 90 * 24 * HOUR_MS
    refused(post(client, op("schedule", "k", delayMs=ninety_days + 1), op("schedule", "ok")),
            403, "timer_horizon_exceeded", db)
    assert post(client, op("schedule", "k", delayMs=ninety_days)).status_code == 200


def test_plan_horizon_narrows_and_broker_horizon_applies(tenancy, db, broker_factory):
    plan(db, horizon_ms=HOUR_MS)
    refused(post(tenancy, op("schedule", "k", delayMs=HOUR_MS + 1)), 403, "timer_horizon_exceeded", db)
    assert post(tenancy, op("schedule", "k", delayMs=HOUR_MS)).status_code == 200
    with broker_factory(QUEEN_TIMERS_HORIZON_MS="60000").client() as c:
        refused(post(c, op("schedule", "x", delayMs=60001)), 403, "timer_horizon_exceeded", db, before=1)


# ---- 413 payload_too_large -----------------------------------------------------

def test_raw_payload_over_one_mib_is_413(client, db):
    r = post(client, op("schedule", "big", payload=b64(b"x" * (MiB + 1))))
    refused(r, 413, "payload_too_large", db)
    assert post(client, op("schedule", "fits", payload=b64(b"x" * MiB))).status_code == 200


def test_zstd_payload_judged_on_decompressed_size(client, db):
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (8 * MiB))
    assert len(bomb) < 4096
    refused(post(client, op("schedule", "bomb", payload=b64(bomb), payloadZstd=True)),
            413, "payload_too_large", db)
    fits = zstandard.ZstdCompressor().compress(b"\0" * MiB)
    assert post(client, op("schedule", "fits", payload=b64(fits), payloadZstd=True)).status_code == 200


def test_plan_max_payload_below_one_mib(tenancy, db):
    plan(db, max_payload_bytes=1000)
    refused(post(tenancy, op("schedule", "k", payload=b64(b"x" * 1001))), 413, "payload_too_large", db)
    small = zstandard.ZstdCompressor().compress(b"y" * 1001)
    refused(post(tenancy, op("schedule", "k", payload=b64(small), payloadZstd=True)),
            413, "payload_too_large", db)
    assert post(tenancy, op("schedule", "k", payload=b64(b"x" * 1000))).status_code == 200


# ---- DELETE passes no rung ------------------------------------------------------

def test_delete_passes_every_rung(broker_factory, db):
    """Paused, over quota, produce blocked, rate exhausted, tenancy on without a quota row:
    DELETE still answers 200 and still cancels."""
    with broker_factory(QUEEN_TENANCY="on").client() as c:
        plan(db, max_pending_timers=1, rate_ops_per_second=0.001, rate_burst=1)
        assert post(c, op("schedule", "k1")).status_code == 200  # the quota is full, the bucket empty
        db.execute("SELECT queen.pause_scheduling()")
        db.execute("UPDATE queen.cell_settings SET produce_blocked = true")
        db.execute("UPDATE queen.tenants SET produce_blocked = true")
        db.execute("UPDATE queen.plans SET timers_enabled = false")
        refused(post(c, op("cancel", "k1")), 503, "timers_disabled", db, before=1)
        assert c.delete("/api/v1/timers/reminders/nope").json()["status"] == "absent"
        # and with no quota row at all
        db.execute("DELETE FROM queen.tenants")
        d = c.delete("/api/v1/timers/reminders/k1?txn=txn-k1")
        assert d.status_code == 200
        assert d.json() == {"ok": True, "status": "cancelled", "queue": "reminders", "timerKey": "k1",
                            "txn": "txn-k1"}
        assert rows(db) == []
