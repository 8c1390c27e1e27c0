"""Who is calling: QUEEN_AUTH=off (tenant 'default', every level) or JWT.

Checks of who you are answer 401 {"error":"unauthorized"} and
403 {"error":"forbidden"}; they are not rungs of the gate ladder.

A JWT is accepted only as `Authorization: Bearer <token>`, signed, with
`exp` (checked with QUEEN_JWT_LEEWAY_SECONDS of leeway) and with `sub`,
`tenant` and `role` all non-empty strings, `role` one of the four levels.
Anything else is a 401: a token that names no tenant never falls back to
tenant `default`, the namespace of QUEEN_AUTH=off.

A credential is checked before its tenant's turn (turns.py), so what checking
it costs is bounded here: at most QUEEN_JWT_MAX_BYTES; with a shared secret,
its HS256 signature first, in C, so that a token the secret did not sign never
reaches PyJWT (whose decode checks every character in Python: 0.5 ms for a
13 KB token); and a token already accepted is remembered until its `exp`.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import time
from dataclasses import dataclass

import jwt
from starlette.requests import Request

from . import turns
from .bodies import TENANT_KEY, RequestSlots
from .config import Settings
from .errors import ApiError, text_problem

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


class Authenticator:
    def __init__(self, settings: Settings):
        self.enabled = settings.auth == "jwt"
        if settings.jwt_public_key:
            self.key = settings.jwt_public_key
            self.algorithms = ["RS256", "EdDSA", "ES256"]
        else:
            self.key = settings.jwt_secret
            self.algorithms = ["HS256"]
        self.leeway = settings.jwt_leeway_seconds
        self.max_token_bytes = settings.jwt_max_bytes
        self.hs256_key = self.key.encode() if self.algorithms == ["HS256"] and self.key else None
        self.accepted: dict[str, tuple[Principal, float]] = {}  # token -> (principal, exp), oldest first
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
        if self.hs256_key is not None and not self._signed(token):
            raise ApiError(401, "unauthorized", "invalid token: Signature verification failed")
        try:
            claims = jwt.decode(token, self.key, algorithms=self.algorithms,
                                options={"require": ["exp", "sub"]}, leeway=self.leeway)
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
        role = claims["role"]
        if role not in GRANTS:
            raise ApiError(401, "unauthorized",
                           f"the token's role claim must be one of {', '.join(GRANTS)}")
        principal = Principal(tenant=claims["tenant"], sub=claims["sub"], role=role)
        if len(self.accepted) >= ACCEPTED_TOKENS:
            del self.accepted[next(iter(self.accepted))]
        self.accepted[token] = (principal, float(claims["exp"]))
        return principal

    def _signed(self, token: str) -> bool:
        """Whether the token's last segment is the HS256 MAC of the rest under the secret:
        a filter in front of PyJWT only (a token that passes is checked again, in full)."""
        signing_input, _, signature = token.rpartition(".")
        if len(signature) > 44:  # 32 bytes: 43 characters, 44 with a padding '='
            return False
        try:
            mac = base64.urlsafe_b64decode(signature + "=" * (-len(signature) % 4))
            data = signing_input.encode("ascii")
        except (binascii.Error, ValueError):  # UnicodeEncodeError is a ValueError
            return False
        return hmac.compare_digest(hmac.digest(self.hs256_key, data, "sha256"), mac)

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
