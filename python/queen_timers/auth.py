"""Who is calling: QUEEN_AUTH=off (tenant 'default', every level) or JWT.

Checks of who you are answer 401 {"error":"unauthorized"} and
403 {"error":"forbidden"}; they are not rungs of the gate ladder.
"""

from __future__ import annotations

from dataclasses import dataclass

import jwt
from starlette.requests import Request

from .config import Settings
from .errors import ApiError

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


class Authenticator:
    def __init__(self, settings: Settings):
        self.enabled = settings.auth == "jwt"
        if settings.jwt_public_key:
            self.key = settings.jwt_public_key
            self.algorithms = ["RS256", "EdDSA", "ES256"]
        else:
            self.key = settings.jwt_secret
            self.algorithms = ["HS256"]

    def principal(self, request: Request) -> Principal:
        if not self.enabled:
            return ANONYMOUS
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header[:7].lower() == "bearer " else header.strip()
        if not token:
            raise ApiError(401, "unauthorized", "a Bearer token is required")
        try:
            claims = jwt.decode(token, self.key, algorithms=self.algorithms,
                                options={"require": ["sub"]}, leeway=5)
        except jwt.PyJWTError as exc:
            raise ApiError(401, "unauthorized", f"invalid token: {exc}") from None
        role = claims.get("role")
        tenant = claims.get("tenant") or "default"
        if role not in GRANTS or not isinstance(tenant, str) or not isinstance(claims["sub"], str):
            raise ApiError(401, "unauthorized", "token claims need sub, tenant and a known role")
        return Principal(tenant=tenant, sub=claims["sub"], role=role)

    def require(self, request: Request, level: str) -> Principal:
        principal = self.principal(request)
        if not principal.allows(level):
            raise ApiError(403, "forbidden", f"this route needs {level}; the credential is {principal.role}")
        return principal
