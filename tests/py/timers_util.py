"""Helpers shared by tests/py/test_timers_*.py (the HTTP timer routes)."""

from __future__ import annotations

import base64
import time

import jwt

HOUR_MS = 3_600_000
HINT = "DELETE /api/v1/timers/:queue/*timerKey"
JWT_SECRET = "test-secret-for-queen-timers-hs256-0123456789"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def op(kind: str, key: str, queue: str = "reminders", **fields) -> dict:
    """One operation; schedule/reschedule default to a one-hour delay (no sweeper reaches it)."""
    out = {"op": kind, "queue": queue, "timerKey": key}
    if kind != "cancel":
        out.setdefault("delayMs", HOUR_MS)
        out["payload"] = b64(b"{\"kind\":\"day7\"}")
        if kind == "schedule":
            out["txn"] = f"txn-{key}"
    out.update(fields)
    return {k: v for k, v in out.items() if v is not ...}


def post(client, *ops, headers=None):
    return client.post("/api/v1/timers", json={"operations": list(ops)}, headers=headers or {})


def rows(db, tenant: str | None = None) -> list[dict]:
    if tenant is None:
        return db.execute("SELECT * FROM queen.timers ORDER BY queue, timer_key").fetchall()
    return db.execute("SELECT * FROM queen.timers WHERE tenant = %s ORDER BY queue, timer_key",
                      (tenant,)).fetchall()


def token(role: str, sub: str = "billing-service", tenant: str = "acme", secret: str = JWT_SECRET,
          **claims) -> dict:
    body = {"sub": sub, "tenant": tenant, "role": role, "exp": int(time.time()) + 600, **claims}
    return {"Authorization": f"Bearer {jwt.encode(body, secret, algorithm='HS256')}"}


def assert_error(response, status: int, slug: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"] == slug, body
    return body
