"""Property-based fuzzing of every route in /openapi.json with schemathesis.

A real broker process with QUEEN_AUTH=jwt; every request carries a valid admin
token. For every operation the document lists, schemathesis generates schema-valid
and schema-invalid requests (a bounded number per operation, to keep the run
short on a loaded machine), sends them over HTTP, and checks each response:

- not_a_server_error:           no 5xx at all (not even a documented 503)
- status_code_conformance:      the status code is documented for the operation
- content_type_conformance:     the Content-Type is the documented one
- response_schema_conformance:  the body validates against the documented schema
- response_headers_conformance: documented required headers are there and valid
- ignored_auth:                 an operation the document secures refuses the same
                                 request sent without the token (401)

Any failing check fails the test of that operation (one pytest item per operation).
"""

from __future__ import annotations

from urllib.parse import unquote

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

import pytest

from queen_timers.openapi import build_document
from timers_util import JWT_SECRET, token

ADMIN = token("admin", sub="fuzzer", tenant="acme")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, response_headers_conformance, ignored_auth]
MAX_EXAMPLES = 20      # per operation and generation mode (positive, negative)
POP_WAIT_CAP_MS = 100  # a generated long poll may wait this long, not the 30 s default


# The document the broker serves at /openapi.json, built in-process so pytest can
# collect one test per operation; test_the_fuzzed_document_is_the_served_one
# proves it is the same document.
DOCUMENT = build_document()
schema = schemathesis.openapi.from_dict(DOCUMENT, config=SchemathesisConfig.from_dict({
    "headers": ADMIN,
    "request-timeout": 30,
    "generation": {"mode": "all", "max-examples": MAX_EXAMPLES, "database": "none"},
    "phases": {"examples": {"enabled": True}, "coverage": {"enabled": False},
               "fuzzing": {"enabled": True}, "stateful": {"enabled": False}},
}))


@pytest.fixture
def jwt_broker(broker_factory):
    return broker_factory(QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET)


def test_the_fuzzed_document_is_the_served_one(jwt_broker):
    with jwt_broker.client() as c:
        served = c.get("/openapi.json")
    assert served.status_code == 200
    assert served.json() == DOCUMENT
    assert len(list(schema.get_all_operations())) == sum(len(m) for m in DOCUMENT["paths"].values())


def _truthy(value) -> bool:
    return str(value).strip().lower() in ("true", "1", "yes")


def _one(value):
    """What the broker reads of a generated query value: a list of one is sent as that
    value, an empty list not at all (None), a longer one repeated (a 400 at once)."""
    if not isinstance(value, list):
        return value
    if len(value) > 1:
        raise ValueError("repeated")
    return value[0] if value else None


def _bound_long_poll(case) -> None:
    """GET /api/v1/pop/...?wait=true holds the request up to `timeout` ms (30 s by
    default): keep the generated value when it is short, else cap it."""
    query = case.query
    if not case.path.startswith("/api/v1/pop/") or not isinstance(query, dict):
        return
    try:
        wait, timeout = _one(query.get("wait")), _one(query.get("timeout"))
    except ValueError:
        return  # a repeated parameter: 400 at once
    if not _truthy(wait):
        return
    if timeout is None or str(timeout) == "":
        timeout = POP_WAIT_CAP_MS + 1  # absent or empty: the 30 s default
    try:
        timeout = int(str(timeout))
    except ValueError:
        return  # not an integer: the broker answers 400 at once
    if timeout > POP_WAIT_CAP_MS:
        query["timeout"] = POP_WAIT_CAP_MS


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_every_route_conforms_to_the_document(case, jwt_broker):
    _bound_long_poll(case)
    case.call_and_validate(base_url=jwt_broker.url, headers=ADMIN, checks=CHECKS)


CANCEL = schema["/api/v1/timers/{queue}/{timerKey}"]["DELETE"]


def _echoes(response, case, queue: str, key: str) -> None:
    txn = (case.query or {}).get("txn")
    if "\x00" in queue + key + str(txn or ""):
        assert response.status_code == 400, response.text
        return
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["queue"], body["timerKey"], body["status"]) == (queue, key, "absent")
    assert body["txn"] == (txn or None)


def test_generated_timer_keys_reach_the_catch_all(jwt_broker):
    """The document's `{timerKey}` as schemathesis serialises it (a '/' as %2F, any
    other reserved or non-ASCII character percent-encoded) reaches the catch-all
    route and names the key that was generated: the cancel echoes queue and key."""
    seen: list[str] = []
    quick = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(HealthCheck))

    @given(case=CANCEL.as_strategy())
    @quick
    def generated(case):
        response = case.call(base_url=jwt_broker.url, headers=ADMIN)
        key = unquote(case.path_parameters["timerKey"])
        _echoes(response, case, unquote(case.path_parameters["queue"]), key)
        seen.append(key)

    @given(data=st.data())
    @quick
    def with_slashes(data):
        key = data.draw(st.lists(st.text(min_size=1), min_size=2, max_size=4).map("/".join))
        case = data.draw(CANCEL.as_strategy(path_parameters={"queue": "reminders", "timerKey": key}))
        assert "/" not in case.path_parameters["timerKey"]  # sent as %2F, as the document says
        response = case.call(base_url=jwt_broker.url, headers=ADMIN)
        expected = unquote(case.path_parameters["timerKey"])
        assert expected.count("/") >= 1
        _echoes(response, case, "reminders", expected)

    generated()
    assert "tenant/42" in seen  # the document's example, sent as tenant%2F42
    with_slashes()
