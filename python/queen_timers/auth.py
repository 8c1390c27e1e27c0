"""Who is calling: QUEEN_AUTH=off (tenant 'default', every level) or JWT.

Checks of who you are answer 401 {"error":"unauthorized"} and
403 {"error":"forbidden"}; they are not rungs of the gate ladder.

A JWT is accepted only as `Authorization: Bearer <token>`, signed, with
`exp` (checked with QUEEN_JWT_LEEWAY_SECONDS of leeway) and with `sub`,
`tenant` and `role` all non-empty strings, `role` one of the four levels.
Anything else is a 401: a token that names no tenant never falls back to
tenant `default`, the namespace of QUEEN_AUTH=off.

A credential is checked before its tenant's turn (turns.py), so what checking
it costs is bounded here: at most QUEEN_JWT_MAX_BYTES; its signature first, in C
(HS256 under the secret, or the one algorithm the public key's type allows), so
that a token the key did not sign never reaches PyJWT (whose decode checks every
character in Python: 0.5 ms for a 13 KB token); a token already accepted is
remembered until its `exp`, and a token refused for good (another key's signature, expired,
a claim that can never pass) is remembered too, by a keyed digest, so a client that repeats
one costs a hash and a lookup, not a signature check. A token refused because its `nbf` or
`iat` lies ahead is not remembered: it may pass later.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import time
from dataclasses import dataclass

import jwt
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, padding, rsa
from jwt.utils import raw_to_der_signature
from starlette.requests import Request

from . import turns
from .bodies import TENANT_KEY, RequestSlots
from .config import Settings
from .errors import ApiError, text_problem
from .limits import MAX_SUB_BYTES, MAX_TENANT_BYTES

READ_ONLY = "read-only"
WRITE_ONLY = "write-only"
READ_WRITE = "read-write"
ADMIN = "admin"

# role -> the access levels it grants
GRANTS: dict[str, frozenset[str]] = {
    READ_ONLY: frozenset({READ_ONLY}),
    WRITE_ONLY: frozenset({WRITE_ONLY}),
    READ_WRITE: frozenset({READ_ONLY, WRITE_ONLY, READ_WRITE}),
    ADMIN: frozenset({READ_ONLY, WRITE_ONLY, READ_WRITE, ADMIN}),
}


@dataclass(frozen=True)
class Principal:
    tenant: str
    sub: str | None
    role: str

    def allows(self, level: str) -> bool:
        return level in GRANTS.get(self.role, frozenset())


ANONYMOUS = Principal(tenant="default", sub=None, role=ADMIN)
PRINCIPAL_KEY = "queen.principal"  # scope key: what identify() found
# tokens accepted, remembered with their exp: at most this many (each at most QUEEN_JWT_MAX_BYTES)
ACCEPTED_TOKENS = 1024
REFUSED_TOKENS = 4096  # refusals remembered: a digest of 16 bytes and a short text each (about 1 MB at most)


def _remember(memory: dict, key, value, most: int) -> None:
    """key -> value in a memory of at most `most` entries, the oldest forgotten first."""
    if len(memory) >= most:
        del memory[next(iter(memory))]
    memory[key] = value


class _NotYet(Exception):
    """A token refused only because its nbf or iat lies ahead: never remembered."""

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


PUBLIC_KEYS = (rsa.RSAPublicKey, ec.EllipticCurvePublicKey, ed25519.Ed25519PublicKey, ed448.Ed448PublicKey)


def load_public_key(text: str):
    """QUEEN_JWT_PUBLIC_KEY as a key object (PyJWT parses a PEM text again at every
    decode), or None when cryptography reads no public key of a type PyJWT verifies
    from it: PyJWT then gets the text, as it would anyway."""
    for load in (serialization.load_pem_public_key, serialization.load_ssh_public_key):
        try:
            key = load(text.encode())
        except (ValueError, UnsupportedAlgorithm):
            continue
        return key if isinstance(key, PUBLIC_KEYS) else None
    return None


def signature_bytes(key) -> int:
    """The length of a JWS signature by `key` (HS256's 32 when None)."""
    if isinstance(key, rsa.RSAPublicKey):
        return (key.key_size + 7) // 8
    if isinstance(key, ec.EllipticCurvePublicKey):
        return 2 * ((key.curve.key_size + 7) // 8)  # r and s, raw (RFC 7518 3.4)
    if isinstance(key, ed448.Ed448PublicKey):
        return 114
    return 64 if isinstance(key, ed25519.Ed25519PublicKey) else 32


class Authenticator:
    def __init__(self, settings: Settings):
        self.enabled = settings.auth == "jwt"
        # the signature checked before PyJWT (_signed): by one of these, when either is set
        self.public_key = self.hs256_key = None
        if settings.jwt_public_key:
            self.public_key = load_public_key(settings.jwt_public_key)
            self.key = self.public_key or settings.jwt_public_key
            self.algorithms = ["RS256", "EdDSA", "ES256"]
        else:
            self.key = settings.jwt_secret
            self.algorithms = ["HS256"]
            self.hs256_key = self.key.encode() if self.key else None
        self.leeway = settings.jwt_leeway_seconds
        self.max_token_bytes = settings.jwt_max_bytes
        # base64url characters of the key's signature, with padding
        self.signature_chars = 4 * -(-signature_bytes(self.public_key) // 3)
        self.accepted: dict[str, tuple[Principal, float]] = {}  # token -> (principal, exp), oldest first
        # a keyed digest of each token refused for good -> its 401's detail, oldest first (the
        # key is this process's: nobody can aim a digest at another token)
        self.refused: dict[bytes, str] = {}
        self._refusal_key = os.urandom(32)
        self.operator_tenant = settings.operator_tenant
        self.slots = RequestSlots(settings.tenant_max_requests, settings.max_connections)

    def identify(self, scope: dict) -> Principal | ApiError:
        """The request's principal, or the 401 its credential earns: checked once per
        request, when it takes its turn (turns.py), and kept in the scope for require()."""
        found = scope.get(PRINCIPAL_KEY)
        if found is None:
            try:
                found = self._check(scope) if self.enabled else ANONYMOUS
            except ApiError as exc:
                found = exc
            except Exception:  # checked before the app's handlers (turns): never a 500 for a token
                found = ApiError(401, "unauthorized", "invalid token")
            scope[PRINCIPAL_KEY] = found
        return found

    def turn_key(self, scope: dict) -> str | None:
        """Whose turn a request takes: its tenant's, or ANONYMOUS's without a valid credential."""
        found = self.identify(scope)
        return turns.ANONYMOUS if isinstance(found, ApiError) else found.tenant

    def _check(self, scope: dict) -> Principal:
        found = [value for name, value in scope.get("headers", ()) if name == b"authorization"]
        if len(found) > 1:
            # a proxy may have checked another copy than the one read here: refuse to guess
            raise ApiError(401, "unauthorized", f"{len(found)} Authorization headers; send one")
        header = found[0].decode("latin-1") if found else ""
        if not header.strip():
            raise ApiError(401, "unauthorized", "a Bearer token is required")
        scheme, _, token = header.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "unauthorized",
                           "the Authorization header must be 'Bearer <token>'")
        if len(token) > self.max_token_bytes:
            raise ApiError(401, "unauthorized", f"invalid token: longer than {self.max_token_bytes} bytes "
                                                "(QUEEN_JWT_MAX_BYTES)")
        if token.count(".") != 2:
            raise ApiError(401, "unauthorized", "invalid token: a JWT is three segments separated by dots")
        if (known := self.accepted.get(token)) is not None:
            # PyJWT's own test of exp; nbf and iat only grow truer with time
            if known[1] > time.time() - self.leeway:
                return known[0]
            del self.accepted[token]
        digest = hashlib.blake2b(token.encode("latin-1"), digest_size=16, key=self._refusal_key).digest()
        if (detail := self.refused.get(digest)) is not None:
            raise ApiError(401, "unauthorized", detail)
        try:
            return self._verified(token)
        except _NotYet as exc:  # nbf or iat ahead: it may pass later
            raise ApiError(401, "unauthorized", exc.detail) from None
        except ApiError as exc:
            _remember(self.refused, digest, exc.detail or "", REFUSED_TOKENS)
            raise

    def _verified(self, token: str) -> Principal:
        """The principal of a token neither accepted nor refused before: its signature,
        then PyJWT's checks and the claims'. Raises the 401 (_NotYet when only time
        stands in its way)."""
        if (self.hs256_key is not None or self.public_key is not None) and not self._signed(token):
            raise ApiError(401, "unauthorized", "invalid token: Signature verification failed")
        try:
            claims = jwt.decode(token, self.key, algorithms=self.algorithms,
                                options={"require": ["exp", "sub"]}, leeway=self.leeway)
        except jwt.ImmatureSignatureError as exc:
            raise _NotYet(f"invalid token: {exc}") from None
        except jwt.PyJWTError as exc:
            raise ApiError(401, "unauthorized", f"invalid token: {exc}") from None
        if not isinstance(claims, dict):
            raise ApiError(401, "unauthorized", "invalid token: the claims are not an object")
        for name in ("sub", "tenant", "role"):
            value = claims.get(name)
            if not isinstance(value, str) or value == "":
                raise ApiError(401, "unauthorized",
                               f"the token's {name} claim is required and must be a non-empty string")
            # libpq reads a text parameter up to its first NUL: "acme\0x" would act as "acme"
            problem = text_problem(value)
            if problem:
                raise ApiError(401, "unauthorized", f"the token's {name} claim {problem}")
        # the tenant is a key of every table (timers_pkey, ...): past about 2,700 bytes its
        # writes failed with a 54000 (Dec 7 audit); a name, bounded as the others are. The
        # sub is stamped on every frame and timer (producerSub): one of 8 KB made each popped
        # message weigh more than the body budget counts for it. OpenID Connect holds a sub
        # to 255 ASCII characters.
        for name, limit in (("tenant", MAX_TENANT_BYTES), ("sub", MAX_SUB_BYTES)):
            size = len(claims[name].encode("utf-8"))
            if size > limit:
                raise ApiError(401, "unauthorized",
                               f"the token's {name} claim is {size} bytes of UTF-8; at most {limit}")
        role = claims["role"]
        if role not in GRANTS:
            raise ApiError(401, "unauthorized",
                           f"the token's role claim must be one of {', '.join(GRANTS)}")
        principal = Principal(tenant=claims["tenant"], sub=claims["sub"], role=role)
        _remember(self.accepted, token, (principal, float(claims["exp"])), ACCEPTED_TOKENS)
        return principal

    def _signed(self, token: str) -> bool:
        """Whether the token's last segment signs the rest: the HS256 MAC under the secret,
        or the public key's signature by the one algorithm of the list its type verifies
        (RS256, ES256 or EdDSA: PyJWT refuses the others for that key). A filter in front of
        PyJWT only: a token that passes is checked again, in full."""
        signing_input, _, signature = token.rpartition(".")
        if len(signature) > self.signature_chars:
            return False
        try:
            sig = base64.urlsafe_b64decode(signature + "=" * (-len(signature) % 4))
            data = signing_input.encode("ascii")
        except (binascii.Error, ValueError):  # UnicodeEncodeError is a ValueError
            return False
        if self.hs256_key is not None:
            return hmac.compare_digest(hmac.digest(self.hs256_key, data, "sha256"), sig)
        key = self.public_key
        try:
            if isinstance(key, rsa.RSAPublicKey):
                key.verify(sig, data, padding.PKCS1v15(), hashes.SHA256())
            elif isinstance(key, ec.EllipticCurvePublicKey):
                key.verify(raw_to_der_signature(sig, key.curve), data, ec.ECDSA(hashes.SHA256()))
            else:
                key.verify(sig, data)
        except (InvalidSignature, ValueError):
            return False
        return True

    def require(self, request: Request, level: str) -> Principal:
        return self.require_scope(request.scope, level)

    def require_operator(self, request: Request) -> Principal:
        """The cell-wide switches (routes_ops): `admin` of QUEEN_OPERATOR_TENANT. A pause
        stops every tenant's scheduling or fire, so another tenant's admin may not flip it
        (the status route is the operator's too; the public scrape shows the same gauges).
        With auth off every call is the operator."""
        return self.require_scope(request.scope, ADMIN, operator=True)

    def require_scope(self, scope: dict, level: str, operator: bool = False) -> Principal:
        principal = self.identify(scope)
        if isinstance(principal, ApiError):
            raise principal
        scope[TENANT_KEY] = principal.tenant  # the body budget's share is per tenant
        if not principal.allows(level):
            raise ApiError(403, "forbidden", f"this route needs {level}; the credential is {principal.role}")
        if operator and self.enabled and principal.tenant != self.operator_tenant:
            raise ApiError(403, "forbidden", "the cell's switches need an admin credential of the operator "
                                             "tenant (QUEEN_OPERATOR_TENANT); this one is another tenant's")
        self.slots.take(scope, principal.tenant)  # 503 past the tenant's share of requests
        return principal
