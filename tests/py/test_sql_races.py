"""Two sessions racing on one timer row, against a real PostgreSQL.

The claim (FOR UPDATE SKIP LOCKED) and the cancel (FOR UPDATE) meet on the
row lock: a cancel that arrives while a claim holds the row waits for it and
then answers too_late; a claim that arrives while a cancel holds the row
passes over it. "Waits" is observed in pg_stat_activity (the backend is
blocked on a Lock), never inferred from elapsed time.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone

import psycopg
import pytest

SCHEDULE = """
SELECT status FROM queen.schedule_timers('acme', ARRAY[
    ROW('schedule', 'races', %s, -1000, 'txn-' || %s, '\\x6869'::bytea, NULL, NULL, NULL, NULL)::queen.timer_op])
"""


def schedule(db, key: str) -> None:
    assert db.execute(SCHEDULE, (key, key)).fetchone()["status"] == "scheduled"


def pid_of(conn: psycopg.Connection) -> int:
    return conn.info.backend_pid


def wait_until_blocked_on_lock(db, pid: int, deadline_s: float = 30.0) -> None:
    """Poll until backend `pid` is waiting on a heavyweight lock."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        row = db.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
        if row and row["wait_event_type"] == "Lock":
            return
        time.sleep(0.02)
    pytest.fail(f"backend {pid} never blocked on a lock")


class Background:
    """Run one statement on its own connection in a thread; keep its result or error."""

    def __init__(self, conn: psycopg.Connection, sql: str, params=()):
        self.conn, self.sql, self.params = conn, sql, params
        self.result = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.result = self.conn.execute(self.sql, self.params).fetchall()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc

    def join(self):
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the background statement never returned"
        if self.error:
            raise self.error
        return self.result


@pytest.fixture
def sessions(database_url, db):
    """Two extra sessions (transactions left to the test), closed at teardown."""
    a = psycopg.connect(database_url)
    b = psycopg.connect(database_url, autocommit=True)
    yield a, b
    for conn in (a, b):
        conn.close()


def test_cancel_waits_for_a_claim_then_answers_too_late(db, sessions):
    claimer, canceller = sessions
    schedule(db, "k")
    claimed = claimer.execute("SELECT timer_key FROM queen.claim_timers('b1', 10, 60000)").fetchall()
    assert claimed == [("k",)]  # claim transaction still open: it holds the row lock

    cancel = Background(canceller, "SELECT queen.cancel_timer('acme', 'races', 'k')")
    wait_until_blocked_on_lock(db, pid_of(canceller))
    assert cancel.thread.is_alive()
    claimer.commit()

    assert cancel.join() == [("too_late",)]
    row = db.execute("SELECT claimed_by, lease_until > now() AS held FROM queen.timers WHERE timer_key = 'k'").fetchone()
    assert row == {"claimed_by": "b1", "held": True}
    assert db.execute("SELECT queen.get_pending_timers('acme') AS n").fetchone()["n"] == 1


def test_cancel_waiting_on_a_claim_that_rolls_back_cancels(db, sessions):
    claimer, canceller = sessions
    schedule(db, "k")
    assert claimer.execute("SELECT timer_key FROM queen.claim_timers('b1', 10, 60000)").fetchall() == [("k",)]

    cancel = Background(canceller, "SELECT queen.cancel_timer('acme', 'races', 'k')")
    wait_until_blocked_on_lock(db, pid_of(canceller))
    claimer.rollback()  # the broker died before committing its claim

    assert cancel.join() == [("cancelled",)]
    assert db.execute("SELECT count(*) AS n FROM queen.timers").fetchone()["n"] == 0


def pending(db) -> int:
    return db.execute("SELECT queen.get_pending_timers('acme') AS n").fetchone()["n"]


def test_cancel_waiting_on_a_claim_that_backs_off_cancels(db, sessions):
    """The claim ends in a failed fire (backoff drops the lease): the waiting
    cancel deletes the row it was waiting for, and counts it once."""
    claimer, canceller = sessions
    schedule(db, "k")
    schedule(db, "bystander")  # the counter must not be clamped at 0 into looking right
    claim = claimer.execute("SELECT claim_id FROM queen.claim_timers('b1', 10, 60000) WHERE timer_key = 'k'").fetchone()[0]

    cancel = Background(canceller, "SELECT queen.cancel_timer('acme', 'races', 'k')")
    wait_until_blocked_on_lock(db, pid_of(canceller))
    assert claimer.execute("SELECT queen.fail_timer('acme', 'races', 'k', %s, 'transient', 'no', 5, 60000)",
                           (claim,)).fetchone() == ("backoff",)
    claimer.commit()

    assert cancel.join() == [("cancelled",)]
    assert db.execute("SELECT timer_key FROM queen.timers").fetchall() == [{"timer_key": "bystander"}]
    assert pending(db) == 1


def test_cancel_waiting_on_a_fire_answers_absent(db, sessions):
    """The row is delivered while the cancel waits: absent (no longer pending),
    and only the fire takes it off the counter."""
    firer, canceller = sessions
    schedule(db, "k")
    schedule(db, "bystander")
    db.execute("UPDATE queen.timers SET deliver_at = now() + interval '1 hour' WHERE timer_key = 'bystander'")
    assert firer.execute("SELECT count(*) FROM queen.fire_due_timers(10)").fetchone() == (1,)  # not committed

    cancel = Background(canceller, "SELECT queen.cancel_timer('acme', 'races', 'k')")
    wait_until_blocked_on_lock(db, pid_of(canceller))
    firer.commit()

    assert cancel.join() == [("absent",)]
    assert db.execute("SELECT count(*) AS n FROM queen.messages WHERE transaction_id = 'txn-k'").fetchone()["n"] == 1
    assert pending(db) == 1


def test_two_cancels_of_one_key_count_it_once(db, sessions):
    first, second = sessions
    schedule(db, "k")
    schedule(db, "bystander")
    assert first.execute("SELECT queen.cancel_timer('acme', 'races', 'k')").fetchall() == [("cancelled",)]  # not committed

    late = Background(second, "SELECT queen.cancel_timer('acme', 'races', 'k')")
    wait_until_blocked_on_lock(db, pid_of(second))
    first.commit()

    assert late.join() == [("absent",)]
    assert pending(db) == 1


def test_batch_cancel_waits_for_a_claim_then_answers_too_late(db, sessions):
    claimer, canceller = sessions
    schedule(db, "k")
    assert claimer.execute("SELECT timer_key FROM queen.claim_timers('b1', 10, 60000)").fetchall() == [("k",)]

    cancel = Background(canceller, """
        SELECT status, ok FROM queen.schedule_timers('acme', ARRAY[
            ROW('cancel', 'races', 'k', NULL, NULL, NULL, NULL, NULL, NULL, NULL)::queen.timer_op])""")
    wait_until_blocked_on_lock(db, pid_of(canceller))
    claimer.commit()

    assert cancel.join() == [("too_late", False)]


def test_claim_skips_a_row_a_cancel_holds(db, sessions):
    claimer, canceller = sessions
    schedule(db, "k")
    schedule(db, "other")
    canceller.autocommit = False
    assert canceller.execute("SELECT queen.cancel_timer('acme', 'races', 'k')").fetchall() == [("cancelled",)]
    # the cancel is not committed: it holds the row. A claim must pass over it, not wait:
    claimer.execute("SET lock_timeout = '10s'")
    claimed = claimer.execute("SELECT timer_key FROM queen.claim_timers('b1', 10, 60000)").fetchall()
    assert claimed == [("other",)]
    assert claimer.execute("SELECT count(*) FROM queen.fire_due_timers(10)").fetchone() == (0,)
    claimer.commit()

    canceller.commit()
    assert db.execute("SELECT timer_key FROM queen.timers").fetchall() == [{"timer_key": "other"}]
    assert db.execute("SELECT count(*) AS n FROM queen.claim_timers('b2', 10, 60000)").fetchone()["n"] == 0


def test_two_claims_take_disjoint_rows(db, sessions):
    first, second = sessions
    second.autocommit = False
    for key in ("k1", "k2", "k3"):
        schedule(db, key)
    a = [r[0] for r in first.execute("SELECT timer_key FROM queen.claim_timers('b1', 2, 60000)").fetchall()]
    b = [r[0] for r in second.execute("SELECT timer_key FROM queen.claim_timers('b2', 10, 60000)").fetchall()]
    assert len(a) == 2 and len(b) == 1
    assert set(a) | set(b) == {"k1", "k2", "k3"}
    first.commit()
    second.commit()
    owners = db.execute("SELECT timer_key, claimed_by FROM queen.timers ORDER BY timer_key").fetchall()
    assert {r["claimed_by"] for r in owners if r["timer_key"] in a} == {"b1"}
    assert {r["claimed_by"] for r in owners if r["timer_key"] in b} == {"b2"}


def test_concurrent_batches_cannot_overshoot_the_quota(db, sessions):
    """Both batches pass the quota rung on the committed counter; the second
    re-checks under the counter row's lock and is refused whole."""
    first, second = sessions
    second.autocommit = False
    db.execute("INSERT INTO queen.plans (plan, max_pending_timers) VALUES ('tiny', 1)")
    db.execute("INSERT INTO queen.tenants (tenant, plan) VALUES ('acme', 'tiny')")
    one = """SELECT status FROM queen.schedule_timers('acme', ARRAY[
                ROW('schedule', 'races', %s, 60000, 't', '\\x00'::bytea, NULL, NULL, NULL, NULL)::queen.timer_op],
                p_tenancy => true)"""
    assert first.execute(one, ("k1",)).fetchall() == [("scheduled",)]  # not committed: holds the counter row
    late = Background(second, one, ("k2",))
    wait_until_blocked_on_lock(db, pid_of(second))
    first.commit()
    with pytest.raises(psycopg.Error) as refused:
        late.join()
    assert refused.value.sqlstate == "QTQUO"
    second.rollback()
    rows = db.execute("SELECT timer_key FROM queen.timers").fetchall()
    assert rows == [{"timer_key": "k1"}]
    usage = db.execute("SELECT queen.get_pending_timers('acme') AS pending_timers, billed_messages "
                       "FROM queen.tenant_usage WHERE tenant = 'acme'").fetchone()
    assert usage == {"pending_timers": 1, "billed_messages": 1}


def test_a_mixed_batch_takes_the_counter_row_last(db, sessions):
    """A batch that cancels one key and then waits on another must not hold
    the tenant's counter row meanwhile, or the batch holding that other key
    deadlocks with it when it meters."""
    other, mixed = sessions
    schedule(db, "a")
    schedule(db, "b")
    # `other` is a batch half-way through: it holds row b and has not metered yet
    assert other.execute("SELECT 1 FROM queen.timers WHERE timer_key = 'b' FOR UPDATE").fetchall() == [(1,)]
    batch = Background(mixed, """
        SELECT timer_key, status FROM queen.schedule_timers('acme', ARRAY[
            ROW('cancel', 'races', 'a', NULL, NULL, NULL, NULL, NULL, NULL, NULL)::queen.timer_op,
            ROW('reschedule', 'races', 'b', 1000, 'b2', '\\x00'::bytea, NULL, NULL, NULL, NULL)::queen.timer_op])""")
    wait_until_blocked_on_lock(db, pid_of(mixed))
    other.execute("SET lock_timeout = '10s'")
    other.execute("SELECT queen.bump_tenant_usage('acme', 0, 1)")  # the other batch meters: must not wait
    other.commit()
    assert batch.join() == [("a", "cancelled"), ("b", "rescheduled")]
    usage = db.execute("SELECT queen.get_pending_timers('acme') AS pending_timers, billed_messages "
                       "FROM queen.tenant_usage WHERE tenant = 'acme'").fetchone()
    assert usage == {"pending_timers": 1, "billed_messages": 4}


def test_two_fair_batches_take_disjoint_rows(db, sessions):
    # Behind a backlog (a full batch, every row due 1 s ago: over p_fair_after_ms) a batch
    # adds the share of each tenant it left out; a second session passes over the rows the
    # first holds, never waits.
    first, second = sessions
    second.autocommit = False
    for tenant in ("acme", "globex"):
        rows = db.execute("""
            SELECT status FROM queen.schedule_timers(%s, (
                SELECT array_agg(ROW('schedule', 'races', 'k' || g, -1000, 'txn-k' || g, '\\x6869'::bytea,
                                     NULL, NULL, NULL, NULL)::queen.timer_op) FROM generate_series(1, 6) g))""",
                          (tenant,)).fetchall()
        assert [r["status"] for r in rows] == ["scheduled"] * 6
        # the log partition exists first: its creation by the first fire would hold the second
        db.execute("SELECT queen.ensure_partition(%s, 'races', 'Default')", (tenant,))
    second.execute("SET lock_timeout = '10s'")
    a = first.execute("SELECT tenant, timer_key FROM queen.fire_due_timers(4)").fetchall()  # not committed
    b = second.execute("SELECT tenant, timer_key FROM queen.fire_due_timers(100)").fetchall()
    # acme's 4 oldest, and globex, left out, its share (4 / 2 tenants)
    assert sorted(t for t, _ in a) == ["acme"] * 4 + ["globex"] * 2
    assert len(b) == 6 and not set(a) & set(b)
    first.commit()
    second.commit()
    assert db.execute("SELECT count(*) AS n FROM queen.timers").fetchone()["n"] == 0
    assert db.execute("SELECT count(*) AS n, count(DISTINCT transaction_id || partition_id::text) AS d"
                      " FROM queen.messages").fetchone() == {"n": 12, "d": 12}


GLOBEX_ONE = """
SELECT status FROM queen.schedule_timers('globex', ARRAY[
    ROW('schedule', 'races', %(key)s, %(delay)s, 'txn-' || %(key)s, '\\x6869'::bytea, NULL, NULL, NULL, NULL)::queen.timer_op])
"""


def globex_bound(db):
    return db.execute("SELECT next_due_at FROM queen.tenant_usage WHERE tenant = 'globex'").fetchone()["next_due_at"]


def test_the_fair_share_passes_over_a_schedule_holding_the_tenant(db, sessions):
    # find_due_tenants raises the bound (next_due_at) of a tenant it found with nothing due
    # only under that tenant's usage row lock, taken SKIP LOCKED: a schedule holding the row
    # (its timer not yet visible) is passed over, never waited for, and its bound is left.
    first, second = sessions
    assert db.execute(GLOBEX_ONE, {"key": "tomorrow", "delay": 86_400_000}).fetchone()["status"] == "scheduled"
    db.execute("UPDATE queen.tenant_usage SET next_due_at = '-infinity' WHERE tenant = 'globex'")
    assert first.execute(GLOBEX_ONE, {"key": "now", "delay": -1000}).fetchall() == [("scheduled",)]  # not committed
    second.execute("SET lock_timeout = '10s'")
    assert second.execute("SELECT queen.find_due_tenants(now(), 10)").fetchone()[0] is None
    assert db.execute("SELECT next_due_at = '-infinity' AS left_alone FROM queen.tenant_usage "
                      "WHERE tenant = 'globex'").fetchone()["left_alone"]
    first.commit()
    assert second.execute("SELECT queen.find_due_tenants(now(), 10)").fetchone()[0] == ["globex"]


def test_a_schedule_waits_for_the_raised_bound_then_lowers_it(db, sessions):
    # The other order: the fire raised the bound (not committed) from what it read after the
    # lock; a schedule of an earlier timer waits for that lock, then lowers the bound over the
    # fire's value, so the tenant is a candidate again as soon as its timer is due.
    first, second = sessions
    assert db.execute(GLOBEX_ONE, {"key": "tomorrow", "delay": 86_400_000}).fetchone()["status"] == "scheduled"
    db.execute("UPDATE queen.tenant_usage SET next_due_at = '-infinity' WHERE tenant = 'globex'")
    assert first.execute("SELECT queen.find_due_tenants(now(), 10)").fetchone()[0] is None  # not committed
    raised = first.execute("SELECT next_due_at FROM queen.tenant_usage WHERE tenant = 'globex'").fetchone()[0]
    assert raised > datetime.now(timezone.utc) + timedelta(hours=23)
    late = Background(second, GLOBEX_ONE, {"key": "now", "delay": -1000})
    wait_until_blocked_on_lock(db, pid_of(second))
    first.commit()
    assert late.join() == [("scheduled",)]
    deliver_at = db.execute("SELECT deliver_at FROM queen.timers WHERE tenant = 'globex' AND timer_key = 'now'"
                            ).fetchone()["deliver_at"]
    assert globex_bound(db) == deliver_at
    assert second.execute("SELECT queen.find_due_tenants(now(), 10)").fetchone()[0] == ["globex"]


BATCH = """
SELECT timer_key, status FROM queen.schedule_timers('acme', ARRAY(
    SELECT ROW('schedule', 'races', k, 60000, 'txn-' || k, '\\x00'::bytea, NULL, NULL, NULL, NULL)::queen.timer_op
      FROM unnest(%s::text[]) WITH ORDINALITY AS u(k, n) ORDER BY n))
"""


def usage(db) -> dict:
    return db.execute("SELECT queen.get_pending_timers('acme') AS pending, billed_messages AS billed "
                      "FROM queen.tenant_usage WHERE tenant = 'acme'").fetchone()


def test_a_plain_insert_meeting_a_key_another_batch_inserts_does_the_upsert(db, sessions):
    """A batch of new schedules is tried as a plain INSERT (migration 020). Another
    batch's uncommitted key in its middle: the INSERT waits for it, meets
    unique_violation when it commits, undoes its subtransaction, and the upsert does
    the batch: no error, the key rescheduled, every key once, counted once."""
    first, second = sessions
    assert first.execute(BATCH, (["k2", "k3"],)).fetchall() == [("k2", "scheduled"), ("k3", "scheduled")]
    late = Background(second, BATCH, (["k1", "k2", "k4"],))  # its ends k1, k4 are new: the plain INSERT
    wait_until_blocked_on_lock(db, pid_of(second))
    first.commit()
    assert late.join() == [("k1", "scheduled"), ("k2", "rescheduled"), ("k4", "scheduled")]
    rows = db.execute("SELECT timer_key, txn FROM queen.timers ORDER BY timer_key").fetchall()
    assert rows == [{"timer_key": k, "txn": f"txn-{k}"} for k in ("k1", "k2", "k3", "k4")]
    assert usage(db) == {"pending": 4, "billed": 5}


def test_a_plain_insert_waiting_on_a_batch_that_rolls_back_inserts(db, sessions):
    first, second = sessions
    assert first.execute(BATCH, (["k2"],)).fetchall() == [("k2", "scheduled")]
    late = Background(second, BATCH, (["k1", "k2", "k4"],))
    wait_until_blocked_on_lock(db, pid_of(second))
    first.rollback()
    assert late.join() == [("k1", "scheduled"), ("k2", "scheduled"), ("k4", "scheduled")]
    assert [r["timer_key"] for r in db.execute("SELECT timer_key FROM queen.timers ORDER BY 1")] == ["k1", "k2", "k4"]
    assert usage(db) == {"pending": 3, "billed": 3}
