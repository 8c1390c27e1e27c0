"""GET /openapi.json: an OpenAPI 3.1 document naming every route the app registers,
and for the timer routes every status code and error slug of the contract."""

from __future__ import annotations

import re

from starlette.routing import Route

from queen_timers.app import create_app
from queen_timers.config import Settings


def registered_routes() -> set[tuple[str, str]]:
    app = create_app(Settings(database_url="postgresql://127.0.0.1:1/none"))
    out = set()
    for route in app.routes:
        assert isinstance(route, Route), route
        path = re.sub(r"\{(\w+)(:\w+)?\}", r"{\1}", route.path)
        for method in route.methods or ():
            if method != "HEAD":
                out.add((path, method.lower()))
    return out


def test_document_lists_every_registered_route(client, db):
    r = client.get("/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    assert doc["openapi"].startswith("3.1")
    documented = {(p, m) for p, methods in doc["paths"].items() for m in methods}
    missing = registered_routes() - documented
    assert not missing, f"routes missing from /openapi.json: {sorted(missing)}"


def _slugs(response: dict) -> set[str]:
    schema = response["content"]["application/json"]["schema"]
    return set(schema["allOf"][1]["properties"]["error"]["enum"])


def test_timer_routes_document_every_status_and_slug(client, db):
    paths = client.get("/openapi.json").json()["paths"]
    post = paths["/api/v1/timers"]["post"]["responses"]
    assert set(post) == {"200", "400", "401", "403", "408", "413", "429", "500", "503"}
    # the answer is the object envelope {"results": [...]} Queen's clients read
    ok = post["200"]["content"]["application/json"]["schema"]
    assert ok == {"$ref": "#/components/schemas/ScheduleResult"}
    envelope = client.get("/openapi.json").json()["components"]["schemas"]["ScheduleResult"]
    assert envelope["type"] == "object" and envelope["required"] == ["results"]
    assert envelope["properties"]["results"]["items"] == {"$ref": "#/components/schemas/TimerVerdict"}
    assert _slugs(post["403"]) == {"forbidden", "feature_gated", "produce_blocked",
                                   "timers_quota_exceeded", "timer_horizon_exceeded"}
    assert _slugs(post["413"]) == {"payload_too_large", "body_too_large"}
    assert _slugs(post["429"]) == {"rate_limited"}
    assert _slugs(post["503"]) == {"timers_disabled", "timers_unavailable"}
    assert _slugs(post["400"]) == {"timers_bad_request"}
    assert _slugs(post["408"]) == {"request_timeout"}
    assert "Retry-After" in post["429"]["headers"] and "Retry-After" in post["503"]["headers"]
    for code in ("403", "413", "429", "503"):
        assert "x-queen-timers-hint" in post[code]["headers"]
    delete = paths["/api/v1/timers/{queue}/{timerKey}"]["delete"]["responses"]
    assert set(delete) == {"200", "400", "401", "403", "500", "503"}
    assert _slugs(delete["403"]) == {"forbidden"}  # no rung of the gate ladder
    assert _slugs(delete["503"]) == {"timers_unavailable"}
    for route in (paths["/api/v1/timers/{queue}/{timerKey}"]["get"], paths["/api/v1/timers/{queue}"]["get"]):
        assert {"200", "401", "403", "503"} <= set(route["responses"])
    statuses = client.get("/openapi.json").json()["components"]["schemas"]["TimerStatus"]["enum"]
    assert statuses == ["scheduled", "rescheduled", "cancelled", "absent", "too_late"]


def test_every_ref_resolves(client, db):
    doc = client.get("/openapi.json").json()
    refs = set(re.findall(r'"\$ref": ?"#/components/schemas/([^"]+)"', client.get("/openapi.json").text))
    assert refs and refs <= set(doc["components"]["schemas"])


def test_every_body_route_documents_413_body_too_large_and_every_route_500(client, db):
    paths = client.get("/openapi.json").json()["paths"]
    with_body = {(p, m) for p, methods in paths.items() for m, o in methods.items() if "requestBody" in o}
    assert ("/api/v1/push", "post") in with_body and ("/api/v1/system/timers/fire", "post") in with_body
    for path, method in with_body:
        assert "body_too_large" in _slugs(paths[path][method]["responses"]["413"]), (path, method)
    for path, methods in paths.items():
        for method, operation in methods.items():
            assert _slugs(operation["responses"]["500"]) == {"internal_error"}, (path, method)
