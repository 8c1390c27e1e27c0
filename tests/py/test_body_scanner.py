"""bodies.JsonScanner, the incremental scan of large bodies, against orjson.

Any JSON document cut into chunks of any size gives back what orjson parses
from it whole, with the member array's elements handed out one by one in
order, and the values counted exactly as documented (commas outside strings,
plus arrays and objects, plus one). Pure Python: no database needed.
"""

from __future__ import annotations

import json
import random
import re

import orjson
import pytest

from queen_timers.bodies import JsonLimit, JsonScanner

ODD_STRINGS = ["", 'a"b', "\\", 'x\\\\"y', "é😀", "[{,}]", '\\"\\\\', "a,b,c", ",", "operations", "\u2028"]


def document(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 4 or r < 0.3:
        return rng.choice([1, -2.5, 1e300, True, False, None, *ODD_STRINGS])
    if r < 0.65:
        return [document(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = ["operations", 'k"', "a\\", "[", "x,y", "items"]
    return {rng.choice(keys) + str(rng.randint(0, 3)): document(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def expected_values(raw: bytes) -> int:
    outside = re.sub(rb'"(?:[^"\\]|\\.)*"', b"", raw)
    return outside.count(b",") + outside.count(b"[") + outside.count(b"{") + 1


def scan(raw: bytes, rng: random.Random, **kw) -> tuple[JsonScanner, object, list]:
    handed: list = []
    scanner = JsonScanner(max_values=10 ** 6, on_item=lambda item: (handed.append(item), item)[1], **kw)
    pos = 0
    while pos < len(raw):
        step = rng.randint(1, 9)
        scanner.feed(raw[pos:pos + step])
        pos += step
    return scanner, scanner.finish(), handed


def test_any_document_in_any_chunks_parses_as_orjson_parses_it_whole():
    rng = random.Random(2026)
    for _ in range(1500):
        doc = document(rng)
        if rng.random() < 0.5:
            doc = {"z": document(rng, 2), "operations": [document(rng, 2) for _ in range(rng.randint(0, 5))],
                   "y": document(rng, 2)}
        raw = json.dumps(doc, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1])).encode()
        scanner, parsed, handed = scan(raw, rng, member=b"operations")
        whole = orjson.loads(raw)
        assert parsed == whole, raw
        if isinstance(whole, dict) and isinstance(whole.get("operations"), list):
            assert handed == whole["operations"], raw
        assert scanner.values == expected_values(raw), raw


@pytest.mark.parametrize("raw, fragment", [
    (b"[" * 129 + b"]" * 129, "nests deeper than 128"),
    (b'{"a": [' + b'"x",' * 2000 + b'"x"]}', "more than 1000 JSON values"),
    (b'{"a": {' + b",".join(b'"k%d": 1' % i for i in range(2000)) + b"}}", "more than 1000 JSON values"),
])
def test_a_limit_is_met_in_the_chunk_that_passes_it(raw, fragment):
    scanner = JsonScanner(max_values=1000)
    with pytest.raises(JsonLimit, match=fragment):
        for i in range(0, len(raw), 256):
            scanner.feed(raw[i:i + 256])
    assert i < len(raw) - 256 or fragment.startswith("nests")  # refused before the end arrived


def test_the_member_cap_and_the_kept_text_cap():
    scanner = JsonScanner(max_values=10 ** 6, member=b"operations", member_cap=3)
    with pytest.raises(JsonLimit, match="more than 3 elements"):
        scanner.feed(b'{"operations": [1, 2, 3, 4, ')
    scanner = JsonScanner(max_values=10 ** 6, member=b"operations", kept_cap=100)
    with pytest.raises(JsonLimit, match="more than 100 bytes outside"):
        scanner.feed(b'{"operations": [], "pad": "' + b"p" * 200)


def nested(depth: int, rng: random.Random) -> bytes:
    """A value nesting `depth` levels of arrays and objects, odd strings beside each level."""
    raw = b"1"
    for _ in range(depth):
        s = json.dumps(rng.choice(ODD_STRINGS)).encode()
        raw = b"[" + s + b"," + raw + b"]" if rng.random() < 0.5 else b'{"k":' + raw + b',"s":' + s + b"}"
    return raw


@pytest.mark.parametrize("chunk", [1, 7, 256, 8192, 1 << 20])
def test_the_depth_limit_holds_inside_elements_whatever_the_chunks(chunk):
    # Inside an element the scanner skips runs of complete values in one C call when they
    # cannot reach the limit (FAST_NEST levels below the depth it is at): 128 levels in
    # all still parse, 129 are refused, wherever the levels start and the chunks end.
    rng = random.Random(chunk)
    for total in (127, 128, 129, 140):
        for before in (1, 2, 3, 60, 115, 116, 117, 126):
            inner = total - 2 - before  # the document's object and the member's array
            if inner < 0:
                continue
            raw = (b'{"operations": [' + b"[" * before + nested(inner, rng) + b"]" * before
                   + b', {"a": [' + b'{"b": []},' * 50 + b'"x"]}]}')
            scanner = JsonScanner(max_values=10 ** 6, member=b"operations")
            if total <= 128:
                for i in range(0, len(raw), chunk):
                    scanner.feed(raw[i:i + chunk])
                assert scanner.finish() == orjson.loads(raw)
                assert scanner.values == expected_values(raw)
            else:
                with pytest.raises(JsonLimit, match="nests deeper than 128"):
                    for i in range(0, len(raw), chunk):
                        scanner.feed(raw[i:i + chunk])


@pytest.mark.parametrize("chunk", [3, 8192])
def test_a_body_dense_in_small_containers_counts_every_value(chunk):
    # the shape of the Dec 7 audit's body (a payload of thousands of tiny objects), with
    # strings that hold brackets, commas, quotes and backslashes between them
    rng = random.Random(chunk)
    parts = [rng.choice([b'{"a":[]}', b'[{}]', b'{"s":"[{,}]\\"\\\\"}', b'[1,[2,{"x":","}]]', b'"]"'])
             for _ in range(3000)]
    raw = b'{"items": [{"queue": "q", "payload": [' + b",".join(parts) + b']}, 2], "t": [' + b",".join(parts) + b"]}"
    scanner = JsonScanner(max_values=10 ** 6, member=b"items")
    for i in range(0, len(raw), chunk):
        scanner.feed(raw[i:i + chunk])
    assert scanner.finish() == orjson.loads(raw)
    assert scanner.values == expected_values(raw)
    limited = JsonScanner(max_values=expected_values(raw) - 1, member=b"items")
    with pytest.raises(JsonLimit, match="JSON values"):
        for i in range(0, len(raw), chunk):
            limited.feed(raw[i:i + chunk])
