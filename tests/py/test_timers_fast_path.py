"""POST /api/v1/timers' fast path (routes_timers._fast_batch) against the general one.

The fast path checks a batch column by column and hands PostgreSQL the columns it
was sent; the general path (_parse_ops, _schedule_params) checks field by field and
owns every refusal. The fast path may decline anything, but what it accepts the
general path must accept too, with the same columns. No database: pure functions.
"""

from __future__ import annotations

import base64
import copy
import random
import json

import psycopg
import pytest

from queen_timers.bodies import parse_json
from queen_timers.errors import ApiError
from queen_timers import db as qdb
from queen_timers.routes_timers import (SCHEDULE_JSON_SQL, SCHEDULE_PACKED_JSON_SQL, FastBatch, _array_params,
                                        _fast_batch, _parse_ops, _route_statement, _schedule_params)

MAX_OPS = 256
MAX_VALUES = 100_000
STAGE = 4 * 1024 * 1024


def op(i: int, **over) -> dict:
    o = {"op": "schedule", "queue": "q", "timerKey": f"k-{i}", "delayMs": 1000 + i, "txn": f"t-{i}",
         "payload": base64.b64encode(b'{"n": %d}' % i).decode()}
    o.update(over)
    return {k: v for k, v in o.items() if v is not ...}


def body(*ops, **extra) -> bytes:
    return json.dumps({"operations": list(ops), **extra}).encode()


def general(raw: bytes):
    """What the route's general path makes of a small body: the parameters, or the refusal."""
    try:
        raw.decode("utf-8")
        doc = parse_json(raw, max_values=MAX_VALUES)
        return _schedule_params(_parse_ops(doc, MAX_OPS))
    except ApiError as exc:
        return exc
    except ValueError as exc:  # read_json's 400 for text that is not JSON
        return exc


def fast(raw: bytes, max_values: int = MAX_VALUES, stage: int = STAGE):
    got = _fast_batch(raw, max_values, max_ops=MAX_OPS, stage_bytes=stage)
    if got is None:
        return None
    assert isinstance(got, FastBatch)
    return _array_params(got.columns)


ACCEPTED = {
    "plain": body(*(op(i) for i in range(256))),
    "reschedule": body(op(0, op="reschedule"), op(1)),
    "partition": body(op(0, partition="p1"), op(1)),
    "encrypted flag": body(op(0, encrypted=False), op(1, encrypted=True)),
    "zstd false": body(op(0, payloadZstd=False), op(1)),
    "nulls": body(op(0, partition=None, encrypted=None, payloadZstd=None)),
    "empty payload": body(op(0, payload="")),
    "padding": body(op(0, payload="QQ=="), op(1, payload="QUI="), op(2, payload="QUJD")),
    "non-canonical bits": body(op(0, payload="QR=="), op(1, payload="QUJ=")),
    "limits": body(op(0, queue="q" * 255, timerKey="k" * 1024, txn="t" * 255, partition="p" * 255,
                      delayMs=2 ** 63 - 1), op(1, delayMs=-(2 ** 63))),
    "two queues": body(op(0, queue="a"), op(0, queue="b")),
    # field names written with escapes: the text lacks "partition" and "encrypted",
    # yet the operations have them
    "escaped names": body(op(0, partition="p1", encrypted=True), op(1)).replace(
        b'"partition"', b'"partit\\u0069on"').replace(b'"encrypted"', b'"\\u0065ncrypted"'),
    "escaped values": body(op(0, queue='q"1', timerKey="k\\1", txn="t\t1"), op(1)),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_the_fast_path_takes_the_common_batches_with_the_general_paths_columns(name):
    raw = ACCEPTED[name]
    want = general(raw)
    assert not isinstance(want, Exception), want
    got = fast(raw)
    assert got is not None, f"{name}: the fast path declined"
    assert got == want


DECLINED = {
    # what the general path refuses: the fast path must leave it to it
    "not json": b'{"operations": [',
    "not utf-8": b'{"operations": [{"op": "schedule", "queue": "\xff"}]}',
    "lone surrogate": body(op(0, queue="\\ud800")).replace(b"\\\\ud800", b"\\ud800"),
    "not an object": b"[]",
    "extra member": body(op(0), extra=1),
    "operations not a list": b'{"operations": {}}',
    "op not an object": b'{"operations": [1]}',
    "too many": body(*(op(i) for i in range(257))),
    "unknown op": body(op(0, op="fire")),
    "unknown field": body(op(0, color="red")),
    "server owned": body(op(0, messageId="x")),
    "underscore": body(op(0, _x=1)),
    "no queue": body(op(0, queue=...)),
    "empty queue": body(op(0, queue="")),
    "queue not a string": body(op(0, queue=5)),
    "queue too long": body(op(0, queue="q" * 256)),
    "key too long": body(op(0, timerKey="k" * 1025)),
    "txn too long": body(op(0, txn="t" * 256)),
    "NUL in key": body(op(0, timerKey="a\x00b")),
    "no txn on schedule": body(op(0, txn=...)),
    "empty txn": body(op(0, txn="")),
    "duplicate": body(op(0), op(0)),
    "no delay": body(op(0, delayMs=...)),
    "float delay": body(op(0, delayMs=1.5)),
    "bool delay": body(op(0, delayMs=True)),
    "string delay": body(op(0, delayMs="5")),
    "huge delay": body(op(0, delayMs=2 ** 63)),
    "tiny delay": body(op(0, delayMs=-(2 ** 63) - 1)),
    "empty partition": body(op(0, partition="")),
    "partition not a string": body(op(0, partition=3)),
    "partition too long": body(op(0, partition="p" * 256)),
    "zstd not bool": body(op(0, payloadZstd="yes")),
    "encrypted not bool": body(op(0, encrypted=1)),
    "no payload": body(op(0, payload=...)),
    "payload not a string": body(op(0, payload=5)),
    "payload bad chars": body(op(0, payload="QU*D")),
    "payload no padding": body(op(0, payload="QQ")),
    "payload short padding": body(op(0, payload="QQ=")),
    "payload newline": body(op(0, payload="QUJD\nQUJD")),
    "payload newline, length 4n": body(op(0, payload="QUJ\nQUJD")),
    "payload inner padding": body(op(0, payload="QQ==QUJD")),
    "payload inner single pad": body(op(1), op(0, payload="QUI=QUJD")),
    "payload pads and newline": body(op(0, payload="QQ=\n")),
    "payload space": body(op(0, payload=" QUJD")),
    "payload urlsafe": body(op(0, payload="-_-_")),
    "payload excess padding": body(op(0, payload="QUI==")),
    "deep field": body(op(0, partition=[[[[["x"]]]]])),
}

# the general path takes these; the fast path leaves them to it (cancel, zstd, names
# that are not ASCII, a reschedule without txn, an empty batch)
GENERAL_ONLY = {
    "cancel": body(op(0), {"op": "cancel", "queue": "q", "timerKey": "k-9"}),
    "zstd": body(op(0, payloadZstd=True, payload=base64.b64encode(
        __import__("zstandard").ZstdCompressor().compress(b"{}")).decode())),
    "non-ascii": body(op(0, queue="café")),
    "reschedule without txn": body(op(0, op="reschedule", txn=...)),
    "empty batch": body(),
}


@pytest.mark.parametrize("name", sorted(DECLINED))
def test_the_fast_path_declines_what_the_general_path_refuses(name):
    raw = DECLINED[name]
    want = general(raw)
    assert isinstance(want, Exception), f"{name}: the general path accepted it"
    assert fast(raw) is None


@pytest.mark.parametrize("name", sorted(GENERAL_ONLY))
def test_the_general_path_keeps_what_the_fast_path_declines(name):
    raw = GENERAL_ONLY[name]
    assert not isinstance(general(raw), Exception)
    assert fast(raw) is None


def test_the_fast_path_declines_a_batch_past_the_value_bound_or_to_stage():
    raw = ACCEPTED["plain"]
    assert fast(raw, max_values=100) is None  # the general path's exact count decides
    assert fast(raw, stage=1000) is None      # ~2.5 KB of payloads: the staged path
    assert fast(raw, stage=10_000) is not None


def test_mutations_never_make_the_fast_path_accept_what_the_general_path_refuses():
    """Every single-field mutation of a valid operation by a hostile value: whatever
    the fast path accepts, the general path accepts with the same columns."""
    hostile = [None, "", " ", "x" * 1100, "\x00", "é", 0, -1, 1.0, True, False, [], {}, "QQ", "QQ==", "====",
               2 ** 63, -(2 ** 63), "schedule", "cancel", "reschedule"]
    base = op(0)
    seen_fast = 0
    for field in ("op", "queue", "timerKey", "delayMs", "txn", "payload", "partition", "payloadZstd",
                  "encrypted", "extra"):
        for value in hostile:
            o = copy.deepcopy(base)
            o[field] = value
            raw = body(o, op(1))
            got, want = fast(raw), general(raw)
            if got is not None:
                seen_fast += 1
                assert not isinstance(want, Exception), (field, value, want)
                assert got == want, (field, value)
    assert seen_fast > 10  # the fast path did take the legal mutations


ARRAYS = [
    (qdb.TextArray, "text[]", ["a", "é€ 🎉", "", "x" * 300, 'q"\\{},']),
    (qdb.TextArray, "text[]", ["a", None, "b"]),
    (qdb.ByteaArray, "bytea[]", [b"\x00\x01", b"", b"zz" * 1000]),
    (qdb.ByteaArray, "bytea[]", [None, b"q"]),
    # the edges of the length-word table (elements under 4 KiB) and past it
    (qdb.ByteaArray, "bytea[]", [b"a" * 4095, b"b" * 4096, b"c"]),
    (qdb.ByteaArray, "bytea[]", [b"a" * 4095, None, b"c" * 70000]),
    (qdb.TextArray, "text[]", ["x" * 4095, "y" * 4096]),
    # one value n times, and ASCII columns (encoded as one text)
    (qdb.TextArray, "text[]", ["schedule"] * 5),
    (qdb.Int8Array, "bigint[]", [3_600_000] * 4),
    (qdb.Int4Array, "integer[]", [-7] * 3),
    (qdb.BoolArray, "boolean[]", [False] * 2),
    (qdb.TextArray, "text[]", ["é"] * 3),
    (qdb.TextArray, "text[]", [""] * 2),
    (qdb.ByteaArray, "bytea[]", [b"\x00z"] * 4),
    (qdb.TextArray, "text[]", ["a", "bc", "", "d\x7f\x01"]),
    (qdb.TextArray, "text[]", ["a", "é", "b"]),
    (qdb.Int8Array, "bigint[]", [1, -(2 ** 63), 2 ** 63 - 1]),
    (qdb.Int8Array, "bigint[]", [None, 5]),
    (qdb.Int4Array, "integer[]", [1, None, -3, 2 ** 31 - 1]),
    (qdb.BoolArray, "boolean[]", [True, False, None]),
    (qdb.BoolArray, "boolean[]", [True, False]),
]


def test_binary_arrays_are_what_postgresql_reads(db, database_url):
    """db.binary_array's bytes, read by PostgreSQL, equal psycopg's own dump of the list."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        for kind, sql_type, values in ARRAYS:
            param = qdb.binary_array(kind, values)
            same, back = conn.execute(f"SELECT %b::{sql_type} = %s::{sql_type}, %b::{sql_type}",
                                      (param, values, param)).fetchone()
            assert same and back == values, (kind, values)
    assert qdb.binary_array(qdb.TextArray, [None, None]) is None  # all NULL: the parameter is NULL


def test_random_payload_texts_decode_alike_or_are_declined():
    """The fast path decodes base64 while it parses (msgspec): over random texts of the
    alphabet, padding and strangers, whatever it accepts the general path decodes to
    the same bytes."""
    rng = random.Random(19)
    taken = 0
    for n in range(0, 13):
        for _ in range(300):
            text = "".join(rng.choice("AQB+/=-_\n ") for _ in range(n))
            raw = body(op(0, payload=text), op(1))
            got, want = fast(raw), general(raw)
            if got is not None:
                taken += 1
                assert not isinstance(want, Exception), text
                assert got == want, text
    assert taken > 50


def test_duplicate_members_are_read_as_the_general_path_reads_them():
    """A JSON object may repeat a name; both parsers keep the last value (or the fast
    path declines): never two readings of one body."""
    one = '"op": "schedule", "queue": "q", "timerKey": "k-0", "delayMs": 5, "txn": "t", "payload": "QUJD"'
    bodies = [
        '{"operations": [{%s, "op": "reschedule"}]}' % one,
        '{"operations": [{%s, "queue": "other"}]}' % one,
        '{"operations": [{%s, "payload": "QQ=="}]}' % one,
        '{"operations": [{%s, "delayMs": 7}]}' % one,
        '{"operations": [{%s, "txn": null}]}' % one,
        '{"operations": [{%s, "partition": "p", "partition": null}]}' % one,
        '{"operations": [], "operations": [{%s}]}' % one,
        '{"operations": [{%s}], "operations": [{%s, "timerKey": "k-1"}]}' % (one, one),
    ]
    for text in bodies:
        raw = text.encode()
        got, want = fast(raw), general(raw)
        if got is not None:
            assert not isinstance(want, Exception), text
            assert got == want, text


def test_packed_names_write_what_the_arrays_write(database_url):
    """The route sends a fast batch's names as three texts joined by U+001F: the same
    batch through the packed statement and through the arrays writes the same rows
    with the same verdicts (each in a transaction rolled back); a name holding the
    separator keeps the arrays."""
    from types import SimpleNamespace
    settings = SimpleNamespace(timers_horizon_ms=90 * 24 * 3600 * 1000, tenancy=False, timers_max_ops=MAX_OPS)
    who = SimpleNamespace(tenant="default", sub=None)
    raw = body(op(0, queue="q a", timerKey='k "0",:', txn="t\\0"), op(1, queue="q a", partition="p"),
               op(2, queue="q-b", op="reschedule", timerKey="\x7fk"), op(3, queue="q-b", payload=""))
    batch = _fast_batch(raw, MAX_VALUES, max_ops=MAX_OPS, stage_bytes=STAGE)
    assert isinstance(batch, FastBatch)
    sql, params = _route_statement(batch, who, settings, batch.upserts)
    assert sql == SCHEDULE_PACKED_JSON_SQL and isinstance(params["timer_key"], str)
    arrays = dict(params, **_array_params(batch.columns))
    seen = []
    with psycopg.connect(database_url) as conn:
        for statement, p in ((SCHEDULE_PACKED_JSON_SQL, params), (SCHEDULE_JSON_SQL, arrays)):
            queues, triples, minted = conn.execute(statement, p).fetchone()
            rows = conn.execute("SELECT queue, timer_key, txn, payload, partition FROM queen.timers "
                                "ORDER BY queue, timer_key").fetchall()
            conn.rollback()
            seen.append((queues, triples.split(" ")[0::3], minted, rows))
    assert seen[0] == seen[1]
    assert seen[0][1] == ["scheduled"] * 4 and len(seen[0][3]) == 4
    # the separator in a name: the arrays
    raw = body(op(0, timerKey="a\x1fb"), op(1))
    batch = _fast_batch(raw, MAX_VALUES, max_ops=MAX_OPS, stage_bytes=STAGE)
    assert isinstance(batch, FastBatch)
    assert _route_statement(batch, who, settings, batch.upserts)[0] == SCHEDULE_JSON_SQL
