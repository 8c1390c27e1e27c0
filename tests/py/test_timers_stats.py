"""GET /api/v1/system/timers/stats (aggregates of the caller's tenant, read-only) and the
dashboard's static files (GET /dashboard, public). The page itself is driven in a real
browser by tests/py/test_dashboard.py."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

from queen_timers.routes_ops import stats_page_size
from timers_util import assert_error, op, post, token

ROOT = Path(__file__).resolve().parents[2]
STATS = "/api/v1/system/timers/stats"
QUEUE_FIELDS = {"queue", "pending", "due", "claimed", "retrying", "nextDeliverAt", "dueByBucket"}


def test_counts_per_queue_and_the_due_histogram(client, db):
    # margins of 20 s and more against the bucket edges: the machine may be slow
    r = post(client, op("schedule", "a1", "alpha", delayMs=340_000), op("schedule", "a2", "alpha", delayMs=345_000),
             op("schedule", "a3", "alpha", delayMs=7_200_000), op("schedule", "b1", "beta", delayMs=40_000))
    assert [v["status"] for v in r.json()["results"]] == ["scheduled"] * 4
    deliver = {v["timerKey"]: v["deliverAt"] for v in r.json()["results"]}

    r = client.get(STATS)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"tenant", "asOf", "buckets", "bucketSeconds", "totals", "dueByBucket", "queueCount",
                         "queues", "truncated", "nextAfter"}
    assert (body["queueCount"], body["truncated"], body["nextAfter"]) == (2, False, None)
    assert (body["tenant"], body["buckets"], body["bucketSeconds"]) == ("default", 60, 60)
    assert body["totals"] == {"pending": 4, "due": 0, "claimed": 0, "retrying": 0}
    assert [q["queue"] for q in body["queues"]] == ["alpha", "beta"]
    alpha, beta = body["queues"]
    assert set(alpha) == QUEUE_FIELDS  # counts only: no key, txn or payload of any timer
    assert (alpha["pending"], beta["pending"]) == (3, 1)
    assert alpha["nextDeliverAt"] == deliver["a1"] and beta["nextDeliverAt"] == deliver["b1"]
    assert len(alpha["dueByBucket"]) == 60
    assert {i: n for i, n in enumerate(alpha["dueByBucket"]) if n} == {5: 2}  # a3 (2 h) is past the hour
    assert {i: n for i, n in enumerate(beta["dueByBucket"]) if n} == {0: 1}
    assert {i: n for i, n in enumerate(body["dueByBucket"]) if n} == {0: 1, 5: 2}

    r = client.get(STATS, params={"buckets": 3, "bucketSeconds": 150})
    assert r.json()["dueByBucket"] == [1, 0, 2]  # 40 s, then 340 s and 345 s in [300 s, 450 s)
    assert r.json()["queues"][0]["dueByBucket"] == [0, 0, 2]


def test_the_queues_come_a_page_at_a_time_and_the_totals_cover_them_all(broker, client, db):
    # 30 queues of one timer each, due in 30, 90 or 150 s: ten in each of the first three buckets
    ops = [op("schedule", f"k{i}", f"q{i:02d}", delayMs=30_000 + 60_000 * (i % 3)) for i in range(30)]
    assert post(client, *ops).status_code == 200
    seen, after, pages = [], None, 0
    while True:
        r = client.get(STATS, params={"limit": 7, **({"after": after} if after else {})})
        assert r.status_code == 200, r.text
        body = r.json()
        pages += 1
        assert len(body["queues"]) <= 7 and body["queueCount"] == 30
        # the totals and the histogram are the tenant's, on every page
        assert body["totals"]["pending"] == 30 and body["dueByBucket"][:3] == [10, 10, 10]
        seen += [q["queue"] for q in body["queues"]]
        if not body["truncated"]:
            assert body["nextAfter"] is None
            break
        assert body["nextAfter"] == body["queues"][-1]["queue"]
        after = body["nextAfter"]
    assert seen == [f"q{i:02d}" for i in range(30)] and pages == 5

    # the page is bounded by configuration, not by the client: 100,000 counts (69 queues at 1440 buckets)
    big = client.get(STATS, params={"buckets": 1440, "limit": 100000}).json()
    assert len(big["queues"]) == 30 and not big["truncated"]
    assert (stats_page_size(60), stats_page_size(1440), stats_page_size(1)) == (1000, 69, 1000)
    assert len(client.get(STATS, params={"limit": 0}).json()["queues"]) == 1  # clamped to 1..page
    assert client.get(STATS, params={"after": "q28"}).json()["queues"][0]["queue"] == "q29"
    assert_error(client.get(STATS, params={"after": "x" * 256}), 400, "timers_bad_request")
    assert_error(client.get(STATS, params={"limit": "many"}), 400, "timers_bad_request")


def test_timers_past_their_deliver_at_are_due(client, db):
    db.execute("SELECT queen.pause_fire()")  # else the broker fires them at once
    try:
        post(client, op("schedule", "x", "q", delayMs=-1000), op("schedule", "y", "q", delayMs=0),
             op("schedule", "z", "q", delayMs=600_000))
        body = client.get(STATS).json()
        assert body["totals"] == {"pending": 3, "due": 2, "claimed": 0, "retrying": 0}
        assert sum(body["dueByBucket"]) == 1  # the histogram holds what is not due yet
    finally:
        db.execute("SELECT queen.pause_fire(false)")


def test_an_empty_tenant_and_bad_parameters(client, db):
    body = client.get(STATS).json()
    assert body["queues"] == [] and body["dueByBucket"] == [0] * 60
    assert body["totals"] == {"pending": 0, "due": 0, "claimed": 0, "retrying": 0}
    for params, detail in [({"buckets": "0"}, "buckets must be 1..1440"), ({"buckets": "1441"}, "buckets must be 1..1440"),
                           ({"bucketSeconds": "0"}, "bucketSeconds must be 1..86400"),
                           ({"buckets": "ten"}, "buckets must be an integer"),
                           # past a 32-bit integer: the same range error, not a 500
                           ({"buckets": "2147483647"}, "buckets must be 1..1440"),
                           ({"buckets": "2147483648"}, "buckets is out of range"),
                           ({"buckets": "-99999999999999999999"}, "buckets is out of range"),
                           ({"bucketSeconds": "9223372036854775808"}, "bucketSeconds is out of range")]:
        r = client.get(STATS, params=params)
        assert detail in assert_error(r, 400, "timers_bad_request")["detail"]
    for limit in ("99999999999999999999", "-99999999999999999999"):  # clamped, as any limit
        r = client.get(STATS, params={"limit": limit})
        assert r.status_code == 200, r.text


def test_only_the_callers_tenant_and_read_only_access(jwt_client, db):
    post(jwt_client, op("schedule", "k1", "alpha"), op("schedule", "k2", "shared"), headers=token("write-only"))
    post(jwt_client, op("schedule", "g1", "shared"), op("schedule", "g2", "secret-queue"),
         headers=token("write-only", tenant="globex"))
    assert_error(jwt_client.get(STATS), 401, "unauthorized")
    assert_error(jwt_client.get(STATS, headers=token("write-only")), 403, "forbidden")
    for role in ("read-only", "read-write", "admin"):
        r = jwt_client.get(STATS, headers=token(role))
        assert r.status_code == 200, (role, r.text)
        body = r.json()
        assert body["tenant"] == "acme"
        assert [(q["queue"], q["pending"]) for q in body["queues"]] == [("alpha", 1), ("shared", 1)]
    body = jwt_client.get(STATS, headers=token("read-only", tenant="globex")).json()
    assert [(q["queue"], q["pending"]) for q in body["queues"]] == [("secret-queue", 1), ("shared", 1)]
    # a page at a time, each tenant walks its own queues only, and its counts are its own
    for tenant, expected in (("acme", ["alpha", "shared"]), ("globex", ["secret-queue", "shared"])):
        seen, after = [], None
        while True:
            body = jwt_client.get(STATS, params={"limit": 1, **({"after": after} if after else {})},
                                  headers=token("read-only", tenant=tenant)).json()
            assert (body["queueCount"], body["totals"]["pending"]) == (2, 2)
            seen += [q["queue"] for q in body["queues"]]
            if not body["truncated"]:
                break
            after = body["nextAfter"]
        assert seen == expected
    # after "beta", acme's next queue is "shared": globex's "secret-queue", which sorts between, never shows
    assert jwt_client.get(STATS, params={"after": "beta"}, headers=token("read-only")).json()["queues"][0]["queue"] \
        == "shared"


def test_the_dashboard_files_are_served_with_a_strict_policy(jwt_client, db):
    r = jwt_client.get("/dashboard")  # public under QUEEN_AUTH=jwt too: the page holds no data
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert '<script src="/dashboard/dashboard.js"' in r.text
    js = jwt_client.get("/dashboard/dashboard.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert "sessionStorage" in js.text and "Authorization" in js.text
    assert jwt_client.get("/dashboard/dashboard.css").headers["content-type"].startswith("text/css")
    assert_error(jwt_client.get("/dashboard/app.py"), 404, "not_found")
    assert jwt_client.get("/dashboard/..%2Fapp.py").status_code == 404


def test_every_dashboard_file_is_package_data():
    """A wheel carries what [tool.setuptools.package-data] names: every file of the
    dashboard's folder must match one of its patterns."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["queen_timers"]
    folder = ROOT / "python" / "queen_timers" / "dashboard"
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    assert {"index.html", "dashboard.js", "dashboard.css"} <= set(files)
    for name in files:
        assert any(fnmatch.fnmatch(f"dashboard/{name}", pat) for pat in patterns), name


def test_a_tenant_with_many_timers_gets_its_stats_past_the_plain_statement_timeout(broker_factory, db):
    # Each stats statement passes over every timer of the tenant (about 0.6 s a million here),
    # so at the plain statement timeout a tenant of 3,000,000 timers always got the 503 (Dec 7
    # audit). Their transaction's timeout grows by 2.5 s per started million of the tenant's
    # pending timers: here 300,000 timers under a 40 ms statement timeout.
    db.execute("""INSERT INTO queen.timers (tenant, queue, timer_key, partition, deliver_at, txn, message_id, payload)
                  SELECT 'default', 'q' || (g % 7), 'k-' || g, 'Default',
                         now() + (600 + g % 7200) * interval '1 second', 'k-' || g, gen_random_uuid(), '\\x7b7d'
                    FROM generate_series(1, 300000) g""")
    db.execute("SELECT queen.bump_tenant_usage('default', 300000, 0)")
    db.execute("ANALYZE queen.timers")
    b = broker_factory(QUEEN_STATEMENT_TIMEOUT_MS="40")
    with b.client() as c:
        r = c.get("/api/v1/system/timers/stats")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["totals"]["pending"] == 300000 and body["queueCount"] == 7
        assert sum(q["pending"] for q in body["queues"]) == 300000
        r = c.get("/api/v1/timers/q1", params={"limit": 1000})  # and the broker goes on serving
        assert r.status_code == 200 and len(r.json()["rows"]) == 1000, r.text
