"""Payload bytes: strict base64, bounded zstd, and Queen's AES-256-GCM envelope."""

from __future__ import annotations

import base64
import binascii
import json
import os

import orjson
import zstandard
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

# The payload ceiling is never above this (min(1 MiB, the plan's max)),
# so inflating one byte past it is enough to prove a payload too large.
ABSOLUTE_CEILING = 1024 * 1024


class PayloadError(ValueError):
    """The payload is not what it claims to be (bad base64, bad zstd, bad envelope)."""


def decode_base64(text: object) -> bytes:
    """Standard base64 with padding; anything else is a PayloadError."""
    if not isinstance(text, str):
        raise PayloadError("payload must be a base64 string")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise PayloadError("payload is not valid base64") from None


def encode_base64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def inflate(data: bytes, limit: int = ABSOLUTE_CEILING) -> tuple[bytes, bool]:
    """Decompress zstd without ever producing more than limit + 1 bytes.

    Returns (bytes, over_limit). A frame that is not zstd is a PayloadError;
    a bomb stops at limit + 1 bytes instead of filling memory.
    """
    if not data:
        raise PayloadError("payload is not valid zstd: empty")
    dctx = zstandard.ZstdDecompressor()
    try:
        reader = dctx.stream_reader(data, read_across_frames=True)
        out = reader.read(limit + 1)
        # read() may return less than asked at a frame boundary: drain in bounded steps
        while len(out) <= limit:
            chunk = reader.read(limit + 1 - len(out))
            if not chunk:
                break
            out += chunk
        if len(out) <= limit:
            _require_complete_frames(dctx, data)
    except zstandard.ZstdError as exc:
        raise PayloadError(f"payload is not valid zstd: {exc}") from None
    return out[: limit + 1], len(out) > limit


def _require_complete_frames(dctx: "zstandard.ZstdDecompressor", data: bytes) -> None:
    """The stream reader returns what it could for a truncated frame, without an error.
    Called only once the whole output is known to be within the limit, so decoding
    the same bytes again is bounded too."""
    while data:
        dobj = dctx.decompressobj()
        dobj.decompress(data)
        if not dobj.eof:
            raise PayloadError("payload is not valid zstd: truncated frame")
        data = dobj.unused_data


def encrypt(key: bytes, plaintext: bytes) -> bytes:
    """Queen's envelope: JSON {"encrypted","iv","authTag"} (base64), AES-256-GCM, no AAD."""
    iv = os.urandom(12)
    sealed = AESGCM(key).encrypt(iv, plaintext, None)
    envelope = {
        "encrypted": encode_base64(sealed[:-16]),
        "iv": encode_base64(iv),
        "authTag": encode_base64(sealed[-16:]),
    }
    return json.dumps(envelope, separators=(",", ":")).encode("utf-8")


def is_envelope(value: object) -> bool:
    return isinstance(value, dict) and {"encrypted", "iv", "authTag"} <= value.keys()


def decrypt(key: bytes, envelope_bytes: bytes) -> bytes:
    """Open an envelope made by encrypt() or by Queen (16-byte IV: first 12 bytes are the nonce)."""
    from .bodies import parse_json  # depth-limited: stored bytes are anyone's
    try:
        env = parse_json(envelope_bytes)
        if not is_envelope(env):
            raise PayloadError("not an encryption envelope")
        iv = base64.b64decode(env["iv"])
        ct = base64.b64decode(env["encrypted"]) + base64.b64decode(env["authTag"])
    except (ValueError, TypeError, binascii.Error) as exc:
        raise PayloadError(f"bad encryption envelope: {exc}") from None
    try:
        return AESGCM(key).decrypt(iv[:12], ct, None)
    except InvalidTag:
        raise PayloadError("envelope does not open with this key") from None
    except ValueError as exc:  # a nonce under 8 bytes (an empty "iv"): no envelope this key can open
        raise PayloadError(f"bad encryption envelope: {exc}") from None


def json_data_fragment(data: bytes) -> object:
    """What Queen clients read as `data`, for an answer encoded by orjson: valid JSON
    bytes embedded as they are (orjson.Fragment), not parsed into Python objects and
    encoded again; otherwise the bytes as base64 text."""
    from .bodies import json_text_ok
    if json_text_ok(data):  # what parse_json accepts (strict, depth-limited), without its values
        return orjson.Fragment(data)
    return encode_base64(data)
