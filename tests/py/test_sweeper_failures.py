"""Fires that fail: a poison timer is isolated and dead-lettered after its
attempts while the others keep flowing; a transient failure costs no attempt."""

from __future__ import annotations

import httpx
import psycopg
import pytest

from sweeper_support import (  # noqa: F401  (fixtures)
    messages, sample, schedule, scrape, sdb, sweeper_broker, sweeper_url, timer, timer_count, wait_until,
)

QUEUE_OF_PARTITION = """(SELECT q.name FROM queen.partitions p JOIN queen.queues q ON q.id = p.queue_id
                           WHERE p.id = NEW.partition_id)"""


def install_doomed_trigger(conn) -> None:
    """Every frame for queue 'doomed' fails with SQLSTATE 22023 (a permanent failure)."""
    conn.execute(f"""
        CREATE FUNCTION public.sweeper_test_doomed() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF {QUEUE_OF_PARTITION} = 'doomed' THEN
                RAISE EXCEPTION 'doomed queue refuses frames' USING ERRCODE = '22023';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER sweeper_test_doomed BEFORE INSERT ON queen.messages
            FOR EACH ROW EXECUTE FUNCTION public.sweeper_test_doomed();""")


def install_flaky_trigger(conn, times: int) -> None:
    """The first `times` frames for queue 'flaky' fail with 40001 (a sequence survives the rollback)."""
    conn.execute(f"""
        CREATE SEQUENCE public.sweeper_test_flaky_seq;
        CREATE FUNCTION public.sweeper_test_flaky() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF {QUEUE_OF_PARTITION} = 'flaky' AND nextval('public.sweeper_test_flaky_seq') <= {int(times)} THEN
                RAISE EXCEPTION 'could not serialize access (test)' USING ERRCODE = '40001';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER sweeper_test_flaky BEFORE INSERT ON queen.messages
            FOR EACH ROW EXECUTE FUNCTION public.sweeper_test_flaky();""")


def test_poison_timer_is_dead_lettered_after_five_attempts_and_others_flow(sdb, sweeper_broker):
    install_doomed_trigger(sdb)
    b = sweeper_broker(QUEEN_SWEEPER_BACKOFF_MS=50, QUEEN_SWEEPER_BACKOFF_MAX_MS=200, QUEEN_SWEEPER_MAX_SLEEP_MS=200)
    # the poison and healthy timers share every batch: the fast path fails as a whole
    schedule(sdb, [timer("doomed", "poison", 0, b'{"never":true}', txn="txn-poison"),
                   timer("healthy", "h1", 0, b"h1"),
                   timer("healthy", "h2", 0, b"h2", compressed=True)])

    dlq = wait_until(lambda: sdb.execute("SELECT * FROM queen.dead_letter_queue").fetchall(), 20,
                     message="the DLQ row")
    assert len(dlq) == 1
    row = dlq[0]
    assert row["consumer_group"] == "__QUEEN_TIMERS__"
    assert row["retry_count"] == 5
    assert row["transaction_id"] == "txn-poison"
    assert bytes(row["payload"]) == b'{"never":true}'
    assert "22023" in row["error_message"]
    assert timer_count(sdb) == 0
    assert sorted(m["txn"] for m in messages(sdb)) == ["txn-healthy-h1", "txn-healthy-h2"]
    assert {m["txn"]: bytes(m["payload"]) for m in messages(sdb)}["txn-healthy-h2"] == b"h2"

    _, s = scrape(b)
    assert sample(s, "queen_timers_fire_failures_total", **{"class": "permanent"}) == 5
    assert sample(s, "queen_timers_fire_failures_total", **{"class": "transient"}) == 0
    assert sample(s, "queen_timers_dlq_moves_total") == 1
    assert sample(s, "queen_timers_fired_total", outcome="fired") == 2

    # a timer's dead letter is not replayable
    with pytest.raises(psycopg.Error) as err:
        sdb.execute("SELECT queen.replay_dlq_entry(%s, %s)", ("default", row["id"]))
    assert err.value.sqlstate == "QTRPL"
    assert len(sdb.execute("SELECT * FROM queen.dead_letter_queue").fetchall()) == 1


def test_timer_dead_letter_replay_over_http_is_409(sdb, sweeper_broker):
    b = sweeper_broker()
    # a DLQ row as the fire leaves it, made from SQL (no wait for attempts): a timer due in a
    # minute (the broker leaves it alone), claimed at a pinned future instant, failed for good
    schedule(sdb, [timer("doomed", "p", 60_000, b"x")])
    rows = sdb.execute("SELECT * FROM queen.claim_timers('sql', 1, 60000, now() + interval '61 s')").fetchall()
    verdict = sdb.execute("SELECT queen.fail_timer('default', 'doomed', 'p', %s, 'permanent', 'test', 1) AS v",
                          (rows[0]["claim_id"],)).fetchone()["v"]
    assert verdict == "dead_lettered"
    dlq_id = sdb.execute("SELECT id FROM queen.dead_letter_queue").fetchone()["id"]
    r = httpx.post(f"{b.url}/api/v1/dlq/{dlq_id}/replay", timeout=10)
    if r.status_code in (404, 405) and "json" not in r.headers.get("content-type", ""):
        pytest.skip("POST /api/v1/dlq/{id}/replay route not present")
    assert r.status_code == 409, r.text
    assert r.json()["error"] == "dlq_replay_refused"


def test_transient_failure_costs_no_attempt(sdb, sweeper_broker):
    install_flaky_trigger(sdb, times=2)
    # a long backoff keeps the row visible in its backoff state
    b = sweeper_broker(QUEEN_SWEEPER_BACKOFF_MS=1500, QUEEN_SWEEPER_MAX_SLEEP_MS=200)
    schedule(sdb, [timer("flaky", "f", 0, b"eventually")])

    backoff = wait_until(
        lambda: sdb.execute("SELECT * FROM queen.timers WHERE failures > 0").fetchone(), 10,
        interval=0.02, message="the timer in backoff")
    assert backoff["attempts"] == 0
    assert backoff["last_error_class"] == "transient"
    assert "40001" in backoff["last_error"]
    assert backoff["claimed_by"] is None

    wait_until(lambda: timer_count(sdb) == 0, 15, message="delivery after the backoff")
    assert [(m["txn"], bytes(m["payload"])) for m in messages(sdb)] == [("txn-flaky-f", b"eventually")]
    assert sdb.execute("SELECT count(*) AS n FROM queen.dead_letter_queue").fetchone()["n"] == 0
    _, s = scrape(b)
    assert sample(s, "queen_timers_fire_failures_total", **{"class": "transient"}) >= 1
    assert sample(s, "queen_timers_fire_failures_total", **{"class": "permanent"}) == 0
    assert sample(s, "queen_timers_fired_total", outcome="fired") == 1
