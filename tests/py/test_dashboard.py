"""The operator dashboard (GET /dashboard) in a real headless browser against a real broker.

Debian's chromium (/usr/bin/chromium, installed by scripts/install-deps) driven by
playwright for Python; playwright never downloads a browser here. The timers,
dead letters and fires are real: scheduled and failed through the queen.* functions,
fired by the broker's own sweeper.

QUEEN_DASHBOARD_SCREENSHOT=docs/dashboard.png writes the screenshot the README shows.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, expect, sync_playwright

from sweeper_support import sample, schedule, scrape, timer, wait_until
from timers_util import JWT_SECRET, assert_error, op, post, token

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
TOKEN_KEY = "queen-timers-token"
# user data rendered as text, never as HTML
POISON_ERROR = "22023: doomed queue refuses frames (trigger <doomed_guard> on queen.messages) & more"


@pytest.fixture(scope="module")
def browser():
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: run scripts/install-deps"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    """A fresh browser context per test (its own sessionStorage); fails the test on any
    uncaught script error in the page."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(15_000)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    yield pg
    context.close()
    assert not errors, f"script errors in the dashboard: {errors}"


def started(pg: Page) -> int:
    """The sequence number of the dashboard's last refresh started."""
    return int(pg.evaluate("Number(document.body.dataset.started || 0)"))


def wait_refresh(pg: Page, after: int = 0) -> None:
    """Until a refresh started after the `after`-th one completed (every panel loaded):
    a refresh asked for while one runs is queued behind it, so it reads the current token."""
    pg.wait_for_function("after => Number(document.body.dataset.refreshes || 0) > after", arg=after)


def queue_rows(pg: Page) -> dict[str, dict[str, str]]:
    return pg.eval_on_selector_all("#queues tbody tr", """rows => Object.fromEntries(rows.map(r => [r.dataset.queue,
        Object.fromEntries(['pending', 'due', 'claimed', 'retrying'].map(c => [c, r.querySelector('.' + c).textContent]))]))""")


def histogram(pg: Page) -> dict[int, int]:
    counts = pg.eval_on_selector_all("#histogram .bar", "bars => bars.map(b => Number(b.dataset.count))")
    assert len(counts) == 60
    return {i: n for i, n in enumerate(counts) if n}


def cell_status(db) -> dict:
    return db.execute("SELECT * FROM queen.get_timer_status()").fetchone()


def accept_next_dialog(pg: Page, accept: bool = True) -> None:
    pg.once("dialog", lambda d: d.accept() if accept else d.dismiss())


# ---------------------------------------------------------------------------

def test_dashboard_shows_counts_histogram_dlq_and_lag_and_flips_the_fire(db, spawn_broker, page):
    # Before any broker runs: two poison timers dead-lettered and one in backoff,
    # through the same functions a sweeper calls.
    schedule(db, [timer("doomed", "poison-1", 0, b'{"never":true}'), timer("doomed", "poison-2", 0, b"x"),
                  timer("alpha", "flaky", 0, b"f")])
    claimed = db.execute("SELECT * FROM queen.claim_timers('dashboard-test', 10, 60000)").fetchall()
    assert sorted(c["timer_key"] for c in claimed) == ["flaky", "poison-1", "poison-2"]
    for c in claimed:
        verdict = db.execute(
            "SELECT queen.fail_timer('default', %s, %s, %s, 'permanent', %s, %s, 580000, 580000) AS v",
            (c["queue"], c["timer_key"], c["claim_id"], POISON_ERROR if c["queue"] == "doomed" else "flaky",
             1 if c["queue"] == "doomed" else 5)).fetchone()["v"]
        assert verdict == ("dead_lettered" if c["queue"] == "doomed" else "backoff")  # flaky: due in 9 min 40 s

    # What waits: 40 s or more from every bucket edge, so a slow machine reads the same buckets.
    expected = {0: 1, 5: 3, 9: 1, 20: 2}
    waiting = [timer("alpha", f"a{i}", 340_000, b"a") for i in range(3)] + [timer("alpha", "soon", 50_000, b"s"),
               timer("alpha", "later", 7_200_000, b"l")] + [timer("beta", f"b{i}", 1_240_000, b"b") for i in range(2)]
    for minute in range(24, 60, 3):  # a "reports" queue, for a livelier histogram
        n = 1 + (minute * 7) % 4
        waiting += [timer("reports", f"r{minute}-{j}", minute * 60_000 + 40_000, b"r") for j in range(n)]
        expected[minute] = n
    schedule(db, waiting)

    b = spawn_broker(QUEEN_SWEEPER_MAX_SLEEP_MS=200)
    # a dozen fired by the broker: the fire lag
    schedule(db, [timer("quick", f"q{i}", 100 * i, b"q") for i in range(12)])
    wait_until(lambda: sample(scrape(b)[1], "queen_timers_fire_lag_seconds_count") == 12, 20,
               message="the broker to fire the 12 quick timers")

    page.goto(f"{b.url}/dashboard")
    wait_refresh(page)
    expect(page.locator("#broker")).to_contain_text("database connected")
    expect(page.locator("#tenant")).to_contain_text("tenant default")

    # pending timers per queue: the fired and dead-lettered ones are gone
    rows = queue_rows(page)
    n_reports = sum(n for m, n in expected.items() if m >= 24)
    assert rows == {"alpha": {"pending": "6", "due": "0", "claimed": "0", "retrying": "1"},
                    "beta": {"pending": "2", "due": "0", "claimed": "0", "retrying": "0"},
                    "reports": {"pending": str(n_reports), "due": "0", "claimed": "0", "retrying": "0"}}
    expect(page.locator("#queues-total .pending")).to_have_text(str(8 + n_reports))

    # the due-time histogram of the next hour, per minute and stacked per queue
    assert histogram(page) == expected
    assert page.eval_on_selector_all('#histogram .bar[data-bucket="5"] .seg', "s => s.map(x => x.dataset.queue)") == ["alpha"]
    expect(page.locator("#histogram-summary")).to_contain_text(f"{sum(expected.values())} timers due in the next 60 min")

    # the DLQ with each entry's error, as text
    dlq = page.locator("#dlq tbody tr")
    expect(dlq).to_have_count(2)
    assert sorted(page.locator("#dlq tbody td.txn").all_inner_texts()) == ["txn-doomed-poison-1", "txn-doomed-poison-2"]
    for text in page.locator("#dlq tbody td.error-text").all_text_contents():
        assert text == POISON_ERROR
    assert page.locator("#dlq doomed_guard").count() == 0
    expect(page.locator("#dlq-total")).to_have_text("(2)")

    # the fire lag, from this broker's Prometheus histogram
    expect(page.locator("#lag-count")).to_have_text("12")
    expect(page.locator("#fired-total")).to_have_text("12")
    for q in ("#lag-mean", "#lag-p50", "#lag-p95", "#lag-p99"):
        assert re.fullmatch(r"≈? ?[0-9.]+ (ms|s|min)", page.inner_text(q)), page.inner_text(q)
    assert page.locator("#lag-buckets .lagbar").count() >= 1

    if os.environ.get("QUEEN_DASHBOARD_SCREENSHOT"):
        page.screenshot(path=str(ROOT / os.environ["QUEEN_DASHBOARD_SCREENSHOT"]), full_page=True)

    # the fire switch (auth off: every call is admin); a dismissed confirm changes nothing
    expect(page.locator("#fire-state")).to_have_text("running")
    accept_next_dialog(page, accept=False)
    page.click("#fire-toggle")
    expect(page.locator("#fire-state")).to_have_text("running")
    assert cell_status(db)["fire_paused"] is False

    accept_next_dialog(page)
    page.click("#fire-toggle")
    expect(page.locator("#fire-state")).to_have_text("paused")
    expect(page.locator("#fire-toggle")).to_have_text("Resume fire")
    assert cell_status(db) == {"scheduling_paused": False, "fire_paused": True, "pending": 8 + n_reports}
    # and it took effect: a due timer waits
    schedule(db, [timer("quick", "while-paused", 0, b"p")])
    before = started(page)
    wait_refresh(page, before)  # five seconds at most: the automatic refresh
    assert queue_rows(page)["quick"]["due"] == "1"

    accept_next_dialog(page)
    page.click("#fire-toggle")
    expect(page.locator("#fire-state")).to_have_text("running")
    assert cell_status(db)["fire_paused"] is False
    wait_until(lambda: db.execute("SELECT count(*) AS n FROM queen.timers WHERE queue = 'quick'").fetchone()["n"] == 0,
               20, message="the fire to resume")


def test_dashboard_with_jwt_read_only_sees_its_tenant_and_no_switches_admin_flips_them(broker_factory, db, page):
    # acme's admin is the cell's operator here; globex's admin is not
    b = broker_factory(QUEEN_AUTH="jwt", QUEEN_JWT_SECRET=JWT_SECRET, QUEEN_OPERATOR_TENANT="acme")
    with b.client() as c:
        assert post(c, op("schedule", "k1", "alpha", delayMs=340_000), op("schedule", "k2", "alpha", delayMs=345_000),
                    op("schedule", "k3", "beta", delayMs=50_000), headers=token("write-only")).status_code == 200
        assert post(c, op("schedule", "g1", "globex-only"), headers=token("write-only", tenant="globex")).status_code == 200
    read_only = token("read-only")["Authorization"].removeprefix("Bearer ")
    admin = token("admin", sub="ops-oncall")["Authorization"].removeprefix("Bearer ")

    # no token: every data panel says 401, nothing is shown
    page.goto(f"{b.url}/dashboard")
    wait_refresh(page)
    expect(page.locator("#panel-queues .error")).to_contain_text("401 unauthorized")
    expect(page.locator("#panel-dlq .error")).to_contain_text("401 unauthorized")
    expect(page.locator("#panel-switches .error")).to_contain_text("401 unauthorized")
    expect(page.locator("#queues tbody tr")).to_have_count(0)
    expect(page.locator("#who")).to_have_text("no token")

    # a read-only token of tenant acme: its counts only, and no switches
    before = started(page)
    page.fill("#token", read_only)
    page.click("#token-save")
    wait_refresh(page, before)
    assert page.evaluate(f"sessionStorage.getItem('{TOKEN_KEY}')") == read_only
    expect(page.locator("#who")).to_contain_text("read-only · tenant acme")
    expect(page.locator("#tenant")).to_contain_text("tenant acme")
    assert queue_rows(page) == {"alpha": {"pending": "2", "due": "0", "claimed": "0", "retrying": "0"},
                                "beta": {"pending": "1", "due": "0", "claimed": "0", "retrying": "0"}}
    assert histogram(page) == {0: 1, 5: 2}
    expect(page.locator("#panel-queues .error")).to_be_hidden()
    expect(page.locator("#dlq-empty")).to_be_visible()
    expect(page.locator("#switches-note")).to_contain_text("need an admin token")
    assert page.locator("#switches button, #fire-toggle, #scheduling-toggle").count() == 0
    # the API refuses it too, from the page and from outside
    refused = page.evaluate("""token => fetch('/api/v1/system/timers/fire', {method: 'POST',
        headers: {'Authorization': 'Bearer ' + token, 'Content-Type': 'application/json'},
        body: JSON.stringify({paused: true})}).then(r => r.status)""", read_only)
    assert refused == 403
    assert_error(httpx.post(f"{b.url}/api/v1/system/timers/scheduling", json={"paused": True},
                            headers={"Authorization": f"Bearer {read_only}"}), 403, "forbidden")
    assert cell_status(db) == {"scheduling_paused": False, "fire_paused": False, "pending": 4}

    # the token lives in sessionStorage: a reload keeps it
    page.reload()
    wait_refresh(page)
    expect(page.locator("#token")).to_have_value(read_only)
    expect(page.locator('#queues tbody tr[data-queue="alpha"] .pending')).to_have_text("2")

    # another tenant's admin token: its own queues, and no switches (a pause stops every tenant)
    before = started(page)
    page.fill("#token", token("admin", tenant="globex")["Authorization"].removeprefix("Bearer "))
    page.click("#token-save")
    wait_refresh(page, before)
    expect(page.locator("#who")).to_contain_text("admin · tenant globex")
    assert set(queue_rows(page)) == {"globex-only"}
    expect(page.locator("#switches-note")).to_contain_text("operator tenant")
    assert page.locator("#switches button, #fire-toggle, #scheduling-toggle").count() == 0
    assert cell_status(db) == {"scheduling_paused": False, "fire_paused": False, "pending": 4}

    # the operator tenant's admin token: the switches appear and flip the cell
    before = started(page)
    page.fill("#token", admin)
    page.click("#token-save")
    wait_refresh(page, before)
    expect(page.locator("#switches-note")).to_be_hidden()
    expect(page.locator("#scheduling-state")).to_have_text("running")
    accept_next_dialog(page)
    page.click("#scheduling-toggle")
    expect(page.locator("#scheduling-state")).to_have_text("paused")
    assert cell_status(db)["scheduling_paused"] is True
    with b.client() as c:  # and it took effect
        assert_error(post(c, op("schedule", "k9", "alpha"), headers=token("write-only")), 503, "timers_disabled")
    accept_next_dialog(page)
    page.click("#scheduling-toggle")
    expect(page.locator("#scheduling-state")).to_have_text("running")
    assert cell_status(db)["scheduling_paused"] is False

    # Forget: the token leaves sessionStorage and the data with it
    before = started(page)
    page.click("#token-clear")
    wait_refresh(page, before)
    assert page.evaluate(f"sessionStorage.getItem('{TOKEN_KEY}')") is None
    expect(page.locator("#queues tbody tr")).to_have_count(0)
    expect(page.locator("#panel-queues .error")).to_contain_text("401 unauthorized")
