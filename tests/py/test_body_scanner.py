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
