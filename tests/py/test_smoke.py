"""A broker starts over the schema and answers /health, on the stack the README names."""

import re
from pathlib import Path

from test_direct_lane import direct_count


def test_health(client):
    r = client.get("/health")
    assert r.status_code == 200
    assert r.json()["status"] == "healthy"
    assert r.json()["database"] == "connected"


def test_the_broker_runs_on_uvloop_and_httptools(broker, client):
    # the README's "uvicorn (with httptools and uvloop)". uvloop is imported by nothing but
    # uvicorn's loop="uvloop": its compiled loop is mapped in the serving process only then
    maps = Path(f"/proc/{broker.proc.pid}/maps").read_text()
    assert re.search(r"/uvloop/loop\.cpython-[^/]*\.so$", maps, re.M), "uvloop is not loaded"
    # the direct lane is server.py's httptools protocol's: a DELETE it serves is counted
    before = direct_count(broker)
    assert client.delete("/api/v1/timers/reminders/smoke").json()["status"] == "absent"
    assert direct_count(broker) == before + 1
