"""bodies.json_text_ok decides what parse_json would accept without building the
values (a stored payload shown as `data` in a pop, a DLQ page or a message
lookup is embedded as it is when it is JSON, else given as base64). The two must
agree on every text: a corpus of the edges, and mutations of valid documents."""

from __future__ import annotations

import json
import random
from itertools import accumulate

import orjson
import pytest

from queen_timers import bodies, payloads
from queen_timers.bodies import MAX_JSON_DEPTH, json_depth_exceeds, json_text_ok, parse_json


@pytest.fixture(params=["skipped", "as sized"])
def every_path(request, monkeypatch):
    """Every text through msgspec's skip and the steps around it, and then as sized
    (a text under bodies._SKIP_FROM_BYTES is parsed whole)."""
    if request.param == "skipped":
        monkeypatch.setattr(bodies, "_SKIP_FROM_BYTES", 0)


def accepted(raw: bytes) -> bool:
    try:
        parse_json(raw)
    except ValueError:
        return False
    return True


EDGES = [
    b"", b" ", b"1", b"-0", b"01", b"1.", b".5", b"-", b"1e", b"1e5", b"1E+5", b"1e-400", b"1e400", b"-1e400",
    b"1" * 299, b"1" * 300, b"1" * 309, b"1" * 310, b"1" * 4300, b"1" * 4301, b"0." + b"1" * 400,
    b"[" + b"1" * 5000 + b"]", b'"' + b"1e400" + b'"', b'{"1e400":"1e999"}', b'["12e"]', b"[1e308]", b"[1.8e308]",
    b"true", b"tru", b"false", b"null", b"nul", b"NaN", b"Infinity", b"-Infinity", b"[NaN]",
    b"[1,2,]", b"[1,,2]", b"[,]", b"{,}", b'{"a":1,}', b'{"a" 1}', b'{"a":}', b'{1:2}', b"[]]", b"[[]", b"[}",
    b"{]", b"[1] x", b"[1] [2]", b" [1] ", b"\t\n\r[1]\r\n", b"\xef\xbb\xbf[1]", b"\x00", b"[1]\x00",
    b'"abc', b'"abc"', b'"a\x01b"', b'"a\\x"', b'"a\\u00"', b'"a\\u0041"', b'"\\ud800"', b'"\\udc00"',
    b'"\\ud800\\udc00"', b'"\\ud800\\u0041"', b'"\\uDBFF\\uDFFF"', b'"\\\\"', b'"\\/"', b'"\\"',
    b'"\xff"', b'"\xc3\xa9"', b'"\xed\xa0\x80"', b'"\xf4\x90\x80\x80"', b'"\xe2\x82"', b"\xff",
    b'["a\\"]', b'["a\\\\"]', b'["[[[["]', b'["]]]]"]', b'{"a":"}"}',
    b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH, b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1),
    b"[{" * (MAX_JSON_DEPTH // 2) + b"}]" * (MAX_JSON_DEPTH // 2),
    b"[{" * (MAX_JSON_DEPTH // 2) + b"[]" + b"}]" * (MAX_JSON_DEPTH // 2),
    b"[" * 5000, b"]" * 5000, b"[" * (MAX_JSON_DEPTH + 1) + b"}" * (MAX_JSON_DEPTH + 1),
    b'{"a":[' * 64 + b"1" + b"]}" * 64, b'{"a":[' * 65 + b"1" + b"]}" * 65,
]


@pytest.mark.parametrize("raw", EDGES, ids=lambda r: repr(r[:24]))
def test_agrees_with_parse_json_on_the_edges(raw, every_path):
    assert json_text_ok(raw) is accepted(raw)


def test_the_depth_shortcut_agrees_with_the_running_sum():
    rng = random.Random(7)
    for _ in range(3000):
        text = bytes(rng.choice(b"[]{}") for _ in range(rng.randrange(0, 300)))
        want = max([0, *accumulate(1 if c in b"[{" else -1 for c in text)]) > 40
        assert json_depth_exceeds(text, 40) is want, text
    for _ in range(3000):  # well nested, around the limit: what the shortcut decides alone
        depth = rng.randrange(30, 50)
        opens = [rng.choice((b"[", b"{")) for _ in range(depth)]
        inner = b"".join(opens) + b"".join(b"]" if o == b"[" else b"}" for o in reversed(opens))
        text = rng.choice((b"", b"[]", b"{[]}")) + inner + rng.choice((b"", b"[[]]", b"{}"))
        want = max(accumulate(1 if c in b"[{" else -1 for c in text)) > 40
        assert json_depth_exceeds(text, 40) is want, text


def _document(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 6 else 6)
    if kind == 0:
        return rng.choice([0, -1, 7, 2 ** 63, -(2 ** 70), 3.5, -1e-7, 1e300])
    if kind == 1:
        return rng.choice(["", "a", "é", "\u2028", "a\"b", "c\\d", "\n", "1e400", "😀", "[{"])
    if kind in (2, 3, 4, 5):
        return rng.choice([True, False, None, "x"])
    if kind in (6, 7):
        return [_document(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}": _document(rng, depth + 1) for i in range(rng.randrange(4))}


def test_agrees_with_parse_json_on_mutated_documents(every_path):
    rng = random.Random(19)
    alphabet = b'[]{}",:\\0123456789eE+-.tfnul \xff\xc3\xa9'
    checked = 0
    for _ in range(4000):
        raw = bytearray(json.dumps(_document(rng), ensure_ascii=rng.random() < 0.5).encode())
        for _ in range(rng.randrange(3)):  # 0: still valid; else a byte inserted, deleted or replaced
            at = rng.randrange(len(raw) + 1)
            op = rng.randrange(3)
            if op == 0:
                raw[at:at] = bytes([rng.choice(alphabet)])
            elif at < len(raw):
                if op == 1:
                    del raw[at]
                else:
                    raw[at] = rng.choice(alphabet)
        assert json_text_ok(bytes(raw)) is accepted(bytes(raw)), bytes(raw)
        checked += 1
    assert checked == 4000


def test_a_dense_document_is_embedded_as_stored_and_a_bad_one_as_base64():
    dense = orjson.dumps({f"k{i}": [i, {"a": i}] for i in range(20_000)})
    assert isinstance(payloads.json_data_fragment(dense), orjson.Fragment)
    assert orjson.loads(orjson.dumps({"data": payloads.json_data_fragment(dense)}))["data"]["k7"] == [7, {"a": 7}]
    assert payloads.json_data_fragment(b"[1e400]") == "WzFlNDAwXQ=="
    assert payloads.json_data_fragment(b'["\\ud800"]') == payloads.encode_base64(b'["\\ud800"]')
