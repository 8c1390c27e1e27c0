"""The log order without a partition lock (issue 9): no cursor ever skips a
frame that commits late.

Writers (push, the fire, a DLQ replay) take no partition lock, so frames of
concurrent transactions commit in any order. The log order inside a
partition is (xid, seq) and a pop reads only frames whose xid is below
queen.log_read_horizon() (the xmin of its snapshot: every transaction with a
smaller xid has ended). These tests drive the interleavings with several real
connections and check that every frame reaches every consumer group exactly
once, in (xid, seq) order.

Why they would catch a skip:
- test_a_frame_that_commits_after_a_later_one_is_not_skipped: writer A appends
  first (lower seq, lower xid) and stays open; writer B appends and commits; a
  consumer pops. With a seq-only cursor and no partition lock (main's pop with
  lock_partition's FOR NO KEY UPDATE removed) the pop hands out B's frame and
  moves the cursor past A's seq: A's frame, committed next, is never popped
  (verified on main's code with the lock removed: the final assertion fails
  with A's frame missing).
- test_a_smaller_xid_that_appends_later_is_not_skipped: A takes its xid first,
  B appends (lower seq, larger xid) and commits, then A appends (higher seq,
  smaller xid) and stays open. Ordering by xid without the horizon would hand
  out B's frame and skip A's.
- test_an_ack_of_a_frame_past_the_horizon_does_not_skip_a_late_commit: an ack of
  a frame no pop handed out, while an older transaction runs, moved the cursor
  past that transaction's frames before migration 040.
- the stress test mixes both, from two fire sessions and a pusher whose
  transactions hold their xid open for random times, against consumers
  popping and acking all along.
"""

from __future__ import annotations

import random
import threading
import time

import psycopg
import pytest

PUSH = """SELECT status FROM queen.push_messages('acme', ARRAY[ROW('orders', NULL, %s, NULL, %s::bytea, false)::queen.push_item])"""
POP = """SELECT transaction_id, lease_id FROM queen.pop_messages('acme', 'orders', NULL, %s, %s, %s)"""


@pytest.fixture
def conns(database_url, db):
    # the queue and its partition exist (committed): creating them on first use
    # is the one thing concurrent first writers of a queue do wait on each other for
    db.execute("SELECT queen.configure_queue('acme', 'orders')")
    opened: list[psycopg.Connection] = []

    def connect(autocommit: bool = False) -> psycopg.Connection:
        conn = psycopg.connect(database_url, autocommit=autocommit)
        # a writer that waits on another (a partition lock) fails the test instead of hanging it
        conn.execute("SET lock_timeout = '5s'")
        if not autocommit:
            conn.commit()
        opened.append(conn)
        return conn

    yield connect
    for conn in opened:
        conn.close()


def pop_all(conn: psycopg.Connection, group: str = "__QUEUE_MODE__") -> list[str]:
    """Pop (auto-ack) until nothing comes; the transaction ids in order."""
    out: list[str] = []
    while True:
        rows = conn.execute(POP, (group, 100, True)).fetchall()
        if not rows:
            return out
        out += [r[0] for r in rows]


def test_a_frame_that_commits_after_a_later_one_is_not_skipped(db, conns):
    a, b, consumer = conns(), conns(), conns(autocommit=True)
    db.execute(PUSH, ("before", b"0"))
    a.execute(PUSH, ("a1", b"a"))             # A: lower seq, lower xid, not committed
    b.execute(PUSH, ("b1", b"b"))             # B: does not wait for A (no partition lock)
    b.commit()
    early = {g: pop_all(consumer, g) for g in ("__QUEUE_MODE__", "bus")}  # B committed, A not yet
    a.commit()
    for group, got in early.items():
        got = got + pop_all(consumer, group)
        assert sorted(got) == ["a1", "b1", "before"], f"{group}: every frame exactly once (none skipped)"
        assert got == ["before", "a1", "b1"], f"{group}: in log order"
        # B's frame waited for A (a smaller xid) to end
        assert early[group] == ["before"]


def test_a_smaller_xid_that_appends_later_is_not_skipped(db, conns):
    a, b, consumer = conns(), conns(), conns(autocommit=True)
    a.execute("SELECT pg_current_xact_id()")  # A takes its xid first
    b.execute(PUSH, ("b1", b"b"))             # B: lower seq, larger xid
    b.commit()
    a.execute(PUSH, ("a1", b"a"))             # A: higher seq, smaller xid, still open
    early = consumer.execute(POP, ("__QUEUE_MODE__", 10, False)).fetchall()  # a leased pop
    a.commit()
    rows = db.execute("SELECT transaction_id, seq FROM queen.messages ORDER BY xid, seq").fetchall()
    assert [r["transaction_id"] for r in rows] == ["a1", "b1"] and rows[0]["seq"] > rows[1]["seq"]
    got = [r[0] for r in early]
    if early:  # (a design that handed B's frame out early: ack it, as a consumer would)
        consumer.execute("""SELECT queen.ack_messages('acme', ARRAY[ROW('b1', m.partition_id, 'completed', NULL, %s, NULL)::queen.ack_item])
                              FROM queen.messages m WHERE m.transaction_id = 'b1'""", (str(early[0][1]),))
    popped = consumer.execute(POP, ("__QUEUE_MODE__", 10, False)).fetchall()
    got += [r[0] for r in popped]
    assert sorted(got) == ["a1", "b1"], "every frame exactly once (none skipped)"
    assert got == ["a1", "b1"], "in log order (xid, seq), B's frame held back while A ran"
    acks = consumer.execute(
        """SELECT bool_and(success) FROM queen.ack_messages('acme', (SELECT array_agg(ROW(m.transaction_id, m.partition_id,
               'completed', NULL, %s, NULL)::queen.ack_item) FROM queen.messages m))""", (str(popped[0][1]),)).fetchone()[0]
    assert acks is True
    assert pop_all(consumer) == []


def test_an_ack_of_a_frame_past_the_horizon_does_not_skip_a_late_commit(db, conns):
    """A client acks a frame that no pop handed it (its transaction id and partition are
    known to the producer), while a transaction with a smaller xid still runs. The ack
    is refused and the cursor stays; before migration 040 it moved to that frame, and
    the older transaction's frame, committed next, was never popped by that group."""
    a, b, consumer = conns(), conns(), conns(autocommit=True)
    a.execute("SELECT pg_current_xact_id()")  # A takes its xid first
    b.execute(PUSH, ("b1", b"b"))             # B: a larger xid, committed
    b.commit()
    acks = consumer.execute(
        """SELECT r.success, r.error FROM queen.ack_messages('acme', ARRAY(
               SELECT ROW(m.transaction_id, m.partition_id, 'completed', NULL, NULL, g)::queen.ack_item
                 FROM queen.messages m, unnest(ARRAY['__QUEUE_MODE__', 'bus']) g WHERE m.transaction_id = 'b1')) r
            ORDER BY r.idx""").fetchall()
    assert acks == [(False, "Message not yet readable")] * 2
    a.execute(PUSH, ("a1", b"a"))             # A: a smaller xid, appended and committed after
    a.commit()
    for group in ("__QUEUE_MODE__", "bus"):
        assert pop_all(consumer, group) == ["a1", "b1"], f"{group}: A's frame not skipped, in log order"
    # once below the horizon, the same ack is taken (and behind the cursor, changes nothing)
    again = consumer.execute(
        """SELECT r.success FROM queen.ack_messages('acme', ARRAY(SELECT ROW(m.transaction_id, m.partition_id,
               'completed', NULL, NULL, NULL)::queen.ack_item FROM queen.messages m WHERE m.transaction_id = 'b1')) r""")
    assert again.fetchall() == [(True,)]


def test_a_fire_in_flight_holds_back_later_frames_then_delivers_them(db, conns):
    """A fire transaction (fire_due_timers) takes no partition lock: a push to the
    same partition does not wait for it, and the pushed frame waits for the fire
    to end before a consumer sees it, behind the fired frame."""
    db.execute("""SELECT queen.schedule_timers('acme', ARRAY[queen.make_timer_op('schedule', 'orders', 't1',
                      p_delay_ms => -1000, p_txn => 'fired-1', p_payload => '\\x01'::bytea)])""")
    fire, pusher, consumer = conns(), conns(), conns(autocommit=True)
    assert [r[0] for r in fire.execute("SELECT outcome FROM queen.fire_due_timers(10)").fetchall()] == ["fired"]
    pusher.execute(PUSH, ("pushed-1", b"p"))
    pusher.commit()
    assert pop_all(consumer) == []
    fire.commit()
    assert pop_all(consumer) == ["fired-1", "pushed-1"]


def test_a_long_write_transaction_anywhere_delays_consumers(db, conns):
    """The cost of the design (docs/design.md): a frame is readable once every
    write transaction with a smaller xid, on any table, has ended."""
    db.execute(PUSH, ("m1", b"1"))
    other = conns()
    other.execute("SELECT pg_current_xact_id()")   # any transaction holding an xid
    db.execute(PUSH, ("m2", b"2"))
    consumer = conns(autocommit=True)
    assert pop_all(consumer) == ["m1"]
    other.rollback()
    assert pop_all(consumer) == ["m2"]


def test_own_frames_are_readable_in_the_appending_transaction(db, conns):
    """A transaction that pushes and then pops (psql, the pgTAP tests) sees its own
    frames when no older transaction runs, as before; a frame it appends after
    the pop lands after the cursor."""
    conn = conns()
    conn.execute(PUSH, ("own-1", b"1"))
    assert pop_all(conn) == ["own-1"]
    conn.execute(PUSH, ("own-2", b"2"))
    assert pop_all(conn) == ["own-2"]
    conn.commit()
    assert pop_all(conns(autocommit=True)) == []


FIRE_SESSIONS = 2
TIMERS = 1200
PUSHES = 300


def test_concurrent_writers_and_consumers_deliver_every_frame_once_in_order(db, database_url):
    """Two fire sessions and a pusher append to ONE partition concurrently, their
    transactions holding xids open for random times; a leased queue-mode group
    (two competing consumers, acking) and an auto-ack bus group read all along.
    At the end each group got every frame exactly once, in (xid, seq) order."""
    db.execute("SELECT queen.configure_queue('acme', 'orders')")
    for start in range(0, TIMERS, 200):
        ops = ", ".join(f"queen.make_timer_op('schedule', 'orders', 'k{i}', p_delay_ms => -1000, "
                        f"p_txn => 'fire-{i}', p_payload => '\\x01'::bytea)" for i in range(start, start + 200))
        db.execute(f"SELECT count(*) FROM queen.schedule_timers('acme', ARRAY[{ops}])")
    stop_writers = threading.Event()
    writers_done = threading.Event()
    errors: list[BaseException] = []
    delivered: dict[str, list[tuple[int, int, str]]] = {"__QUEUE_MODE__": [], "bus": []}
    lock = threading.Lock()

    def guarded(fn):
        def run(*args):
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
                stop_writers.set()
        return run

    @guarded
    def fire(seed):
        rnd = random.Random(seed)
        with psycopg.connect(database_url) as conn:
            while not stop_writers.is_set():
                conn.execute("SELECT pg_current_xact_id()")  # the xid first ...
                time.sleep(rnd.random() * 0.004)
                n = len(conn.execute("SELECT 1 FROM queen.fire_due_timers(%s)", (rnd.randint(1, 40),)).fetchall())
                time.sleep(rnd.random() * 0.004)           # ... the commit later
                conn.commit()
                if n == 0:
                    return

    @guarded
    def push(seed):
        rnd = random.Random(seed)
        with psycopg.connect(database_url) as conn:
            for i in range(PUSHES):
                if stop_writers.is_set():
                    return
                if rnd.random() < 0.5:
                    conn.execute("SELECT pg_current_xact_id()")
                    time.sleep(rnd.random() * 0.004)
                conn.execute(PUSH, (f"push-{i}", b"p"))
                time.sleep(rnd.random() * 0.002)
                conn.commit()

    # the log position of what was popped, read in a statement of its own (a join
    # in the pop's statement would use a snapshot older than the pop's reads)
    POS = """SELECT m.xid::text::bigint, m.seq FROM unnest(%s::uuid[]) WITH ORDINALITY u(id, n)
               JOIN queen.messages m ON m.id = u.id ORDER BY u.n"""

    @guarded
    def consume(group, auto_ack, seed):
        rnd = random.Random(seed)
        with psycopg.connect(database_url, autocommit=True) as conn:
            idle_since = None  # once the writers are done: stop after 0.5 s without a frame
            while idle_since is None or time.monotonic() - idle_since < 0.5:
                rows = conn.execute("SELECT transaction_id, lease_id, message_id FROM queen.pop_messages("
                                    "'acme', 'orders', NULL, %s, %s, %s)", (group, rnd.randint(1, 25), auto_ack)).fetchall()
                if not rows:
                    if writers_done.is_set() and idle_since is None:
                        idle_since = time.monotonic()
                    time.sleep(0.002)
                    continue
                idle_since = None
                pos = conn.execute(POS, ([r[2] for r in rows],)).fetchall()
                assert len(pos) == len(rows)
                with lock:
                    delivered[group] += [(x, s, r[0]) for (x, s), r in zip(pos, rows)]
                if not auto_ack:
                    acks = conn.execute(
                        """SELECT bool_and(success) FROM queen.ack_messages('acme',
                               (SELECT array_agg(ROW(m.transaction_id, m.partition_id, 'completed', NULL, %s, NULL)::queen.ack_item)
                                  FROM queen.messages m WHERE m.transaction_id = ANY(%s)))""",
                        (str(rows[0][1]), [r[0] for r in rows])).fetchone()[0]
                    assert acks is True, "an ack of a popped batch failed"

    writers = [threading.Thread(target=fire, args=(s,)) for s in range(FIRE_SESSIONS)]
    writers.append(threading.Thread(target=push, args=(99,)))
    consumers = [threading.Thread(target=consume, args=("__QUEUE_MODE__", False, 10 + s)) for s in range(2)]
    consumers.append(threading.Thread(target=consume, args=("bus", True, 20)))
    for t in writers + consumers:
        t.start()
    for t in writers:
        t.join(timeout=60)
    writers_done.set()
    for t in consumers:
        t.join(timeout=60)
    assert not errors, errors
    assert not any(t.is_alive() for t in writers + consumers)

    log = [(r["xid"], r["seq"], r["transaction_id"]) for r in db.execute(
        "SELECT xid::text::bigint AS xid, seq, transaction_id FROM queen.messages ORDER BY xid, seq").fetchall()]
    assert len(log) == TIMERS + PUSHES
    assert db.execute("SELECT count(*) AS n FROM queen.partitions").fetchone()["n"] == 1
    # the fire really interleaved with the pushes: some frame's seq order differs from its log order
    assert sorted(log, key=lambda x: x[1]) != log, "no interleaving happened; the test proved nothing"
    with psycopg.connect(database_url, autocommit=True) as conn:
        for group in delivered:
            left = pop_all(conn, group)
            assert left == [], f"{group}: the consumers stopped before the end ({len(left)} frames left)"
    for group, got in delivered.items():
        ids = [g[2] for g in got]
        missing = {x[2] for x in log} - set(ids)
        assert not missing, f"{group}: {len(missing)} frames never delivered (skipped), e.g. {sorted(missing)[:5]}"
        assert len(ids) == len(set(ids)), f"{group}: a frame was delivered twice"
        assert got == log, f"{group}: not delivered in (xid, seq) order"
