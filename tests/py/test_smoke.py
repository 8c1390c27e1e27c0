"""A broker starts over the schema and answers /health, on the stack the README names."""

import re
from pathlib import Path


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
    def served_direct() -> float:
        text = client.get("/metrics/prometheus").text
        return float(re.search(r"^queen_timers_http_direct_requests_total (\S+)$", text, re.M).group(1))
    before = served_direct()
    assert client.delete("/api/v1/timers/reminders/smoke").json()["status"] == "absent"
    assert served_direct() == before + 1
