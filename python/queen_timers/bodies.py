"""Request bodies, read and parsed in one place for every route that has one.

- Size: at most QUEEN_MAX_BODY_BYTES. A Content-Length over it is refused
  before a byte is read; a body without one (chunked) is streamed and
  refused as soon as the bytes read pass it, so no more than the cap is
  ever buffered. 413 {"error": "body_too_large"}.
- JSON: UTF-8 (RFC 8259), nesting at most MAX_JSON_DEPTH levels, checked
  on the bytes before the parser runs (Python's parser recurses: 2,000
  levels were a RecursionError), no NaN/Infinity. 400 timers_bad_request.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate

from starlette.requests import Request

from .errors import ApiError, bad_request, check_json_unicode

# The payload ceiling (decoded) and what it weighs in a JSON body as base64.
PAYLOAD_CEILING_BYTES = 1 << 20
BASE64_CEILING_BYTES = 4 * math.ceil(PAYLOAD_CEILING_BYTES / 3)   # 1,398,104
# Per operation, besides the payload: the identifiers at their limits
# (255 + 1024 + 255 + 255 bytes) even if every byte were sent as a 6-byte
# \u escape, field names, delayMs, and `/` of the base64 sent as `\/`.
PER_OP_OVERHEAD_BYTES = 32 * 1024
BODY_ENVELOPE_BYTES = 64 * 1024

MAX_JSON_DEPTH = 128


def default_max_body_bytes(max_ops: int) -> int:
    """QUEEN_MAX_BODY_BYTES when unset: a full batch of full-size payloads fits.

    max_ops * (4 * ceil(1 MiB / 3) + 32 KiB) + 64 KiB; 366,368,768 for 256 ops."""
    return max_ops * (BASE64_CEILING_BYTES + PER_OP_OVERHEAD_BYTES) + BODY_ENVELOPE_BYTES


def body_too_large(cap: int, seen: int | None = None) -> ApiError:
    said = f"Content-Length {seen}" if seen is not None else "the body"
    return ApiError(413, "body_too_large",
                    f"{said} is over the broker's limit of {cap} bytes (QUEEN_MAX_BODY_BYTES)")


async def read_body(request: Request) -> bytes:
    """The whole body, never more than QUEEN_MAX_BODY_BYTES of it in memory."""
    cap = request.app.state.settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise bad_request("Content-Length is not an integer") from None
        if length > cap:
            raise body_too_large(cap, length)
    buffer = bytearray()
    async for chunk in request.stream():
        if len(buffer) + len(chunk) > cap:
            raise body_too_large(cap)
        buffer += chunk
    return bytes(buffer)


# A JSON string (an unterminated one runs to the end: never rescanned), or
# anything else; brackets outside strings are what nest.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [0] * 256
for _b in b"[{":
    _STEP[_b] = 1
for _b in b"]}":
    _STEP[_b] = -1


def json_depth_exceeds(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when the JSON text nests arrays/objects deeper than `limit`.
    Linear, in C loops: strings are cut out, brackets kept, depth summed."""
    if b"\\" in raw:
        outside = _STRING.sub(b"", raw)
    else:  # no escapes: the strings are exactly every other piece between quotes (5x faster than the regex)
        outside = b"".join(raw.split(b'"')[::2])
    brackets = outside.translate(None, _NOT_BRACKET)
    if brackets.count(b"[") + brackets.count(b"{") <= limit:
        return False
    return max(accumulate(map(_STEP.__getitem__, brackets))) > limit


class JsonTooDeep(ValueError):
    """The text nests deeper than the limit."""


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def parse_json(raw: bytes, *, limit: int = MAX_JSON_DEPTH) -> object:
    """Strict JSON from bytes; ValueError (with a reason) when it is not."""
    text = raw.decode("utf-8")  # UnicodeDecodeError is a ValueError
    if json_depth_exceeds(raw, limit):
        raise JsonTooDeep(f"nests deeper than {limit} levels")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:  # cannot happen under the limit; never a 500 if it did
        raise JsonTooDeep(f"nests deeper than {limit} levels") from None


async def read_json(request: Request, *, empty: object = ..., unicode: bool = False) -> object:
    """The body as JSON (400 timers_bad_request when it is not, 413 when too
    large). `empty`, when given, is the value of an empty body. unicode=True
    also refuses a lone surrogate in any string (errors.check_json_unicode),
    which only a \\u escape can produce: a body without a backslash skips the walk."""
    raw = await read_body(request)
    if not raw and empty is not ...:
        return empty
    try:
        body = parse_json(raw)
    except UnicodeDecodeError:
        raise bad_request("the body is not valid JSON (not UTF-8)") from None
    except JsonTooDeep as exc:
        raise bad_request(f"the body {exc}: the JSON nesting limit is {MAX_JSON_DEPTH}") from None
    except ValueError:
        raise bad_request("the body is not valid JSON") from None
    if unicode and b"\\" in raw:
        check_json_unicode(body)
    return body
