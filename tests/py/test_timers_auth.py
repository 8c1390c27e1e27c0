"""Who may call the timer routes (QUEEN_AUTH=jwt): 401 unauthorized, 403 forbidden,
producerSub from the JWT sub, the tenant from the JWT tenant."""

from __future__ import annotations

import pytest

from timers_util import JWT_SECRET, assert_error, op, post, rows, token


@pytest.fixture
def jwt_client(broker_factory):
    b = broker_factory(QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET)
    with b.client() as c:
        yield c


def calls(c, headers):
    return {
        "POST": post(c, op("schedule", "k"), headers=headers),
        "DELETE": c.delete("/api/v1/timers/reminders/k", headers=headers),
        "PEEK": c.get("/api/v1/timers/reminders/k", headers=headers),
        "LIST": c.get("/api/v1/timers/reminders", headers=headers),
    }


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer not-a-jwt"},
    token("admin", secret="another-secret-of-at-least-32-bytes-long!"),
    token("admin", exp=1),  # expired
    token("superuser"),  # unknown role
])
def test_no_or_bad_credential_is_401(jwt_client, db, headers):
    for name, r in calls(jwt_client, headers).items():
        assert r.status_code == 401, (name, r.text)
        assert r.json()["error"] == "unauthorized"
    assert rows(db) == []


@pytest.mark.parametrize("role, allowed", [
    ("read-only", {"PEEK", "LIST"}),
    ("write-only", {"POST"}),
    ("read-write", {"POST", "DELETE", "PEEK", "LIST"}),
    ("admin", {"POST", "DELETE", "PEEK", "LIST"}),
])
def test_access_levels(jwt_client, db, role, allowed):
    for name, r in calls(jwt_client, token(role)).items():
        if name in allowed:
            assert r.status_code == 200, (role, name, r.text)
        else:
            assert_error(r, 403, "forbidden")
            assert "x-queen-timers-hint" not in r.headers


def test_producer_sub_and_tenant_come_from_the_token(jwt_client, db):
    r = post(jwt_client, op("schedule", "k"), headers=token("write-only", sub="billing-service"))
    assert r.json()["results"][0]["status"] == "scheduled"
    [row] = rows(db)
    assert (row["tenant"], row["producer_sub"]) == ("acme", "billing-service")
    peek = jwt_client.get("/api/v1/timers/reminders/k", headers=token("read-only", sub="someone-else"))
    assert peek.json()["producerSub"] == "billing-service"


def test_another_tenants_timer_is_absent_and_invisible(jwt_client, db):
    post(jwt_client, op("schedule", "k"), headers=token("write-only", tenant="acme"))
    other = token("read-write", tenant="globex")
    assert jwt_client.get("/api/v1/timers/reminders/k", headers=other).json() == {"found": False}
    assert jwt_client.get("/api/v1/timers/reminders", headers=other).json()["rows"] == []
    d = jwt_client.delete("/api/v1/timers/reminders/k", headers=other)
    assert d.json()["status"] == "absent" and d.json()["ok"] is False
    assert post(jwt_client, op("cancel", "k"), headers=token("write-only", tenant="globex")
                ).json()["results"][0]["status"] == "absent"
    # globex scheduling the same key makes a second, separate timer
    post(jwt_client, op("schedule", "k"), headers=token("write-only", tenant="globex"))
    assert [r["tenant"] for r in rows(db)] == ["acme", "globex"]
    assert jwt_client.delete("/api/v1/timers/reminders/k", headers=token("read-write", tenant="acme")
                             ).json()["status"] == "cancelled"
    assert [r["tenant"] for r in rows(db)] == ["globex"]


def test_auth_is_checked_before_shape(jwt_client, db):
    r = jwt_client.post("/api/v1/timers", content=b"{not json")
    assert_error(r, 401, "unauthorized")


def test_openapi_and_health_are_public(jwt_client, db):
    assert jwt_client.get("/openapi.json").status_code == 200
    assert jwt_client.get("/health").status_code == 200
