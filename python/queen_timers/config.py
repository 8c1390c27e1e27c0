"""Broker configuration: environment variables, all prefixed QUEEN_, each with a default.

docs/configuration.md is the reference; keep the two in step.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

import psycopg
from psycopg.conninfo import conninfo_to_dict

from .bodies import LOG_WEIGHT, POP_WEIGHT, TIMERS_WEIGHT, default_max_body_bytes, heaviest_request
from .limits import INT32_MAX, INT64_MAX


class ConfigError(ValueError):
    """A QUEEN_* variable has a value the broker cannot use."""


# The longest a sweeper may sleep: queen.schedule_timers sends NOTIFY queen_timers only for a
# batch whose soonest timer is due within 61 s (60 s and a second for its commit); a later one is
# found by a sweeper's next wake-up, which this bound keeps in time.
MAX_SLEEP_CAP_MS = 60_000

# A request head's bytes (server.py): h11's max_incomplete_event_size default, uvicorn's h11 limit.
MAX_HEAD_BYTES = 16 * 1024


def _int(env: dict[str, str], name: str, default: int, minimum: int = 0, maximum: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        if not raw.isascii():  # int() reads any script's digits, and 1_000
            raise ValueError
        value = int(raw.replace("_", "x"))
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name} must be <= {maximum}, got {value}")
    return value


# QUEEN_TIMERS_HORIZON_MS at most 100 years: past about 2.1e14 ms a negative delay clamped at
# minus the horizon overflowed the timestamp, an HTTP 500 (Dec 7 audit; queen.schedule_timers
# refuses the same p_horizon_ms)
MAX_HORIZON_MS = 3_155_760_000_000
# Values PostgreSQL takes as integer (a sweeper's batch, lease, attempts and backoffs;
# statement_timeout) or bigint are held to INT32_MAX / INT64_MAX: past them every sweeper
# cycle failed (42883: no such function for a numeric argument), or every request (Dec 7
# configuration audit).
MAX_TIMER_OPS = 10_000         # a batch, as a push's items (the default body cap grows with it)
MAX_POP_BYTES = 1 << 30        # a pop answer's payloads; the DLQ page's bigint argument too
MAX_JWT_LEEWAY_S = 3600        # more would serve tokens long expired: exp is required
MAX_POOL = 1000                # each connection a PostgreSQL backend and open files here


def _check_public_key(text: str) -> None:
    """QUEEN_JWT_PUBLIC_KEY is a public key (PEM or OpenSSH) of a type a token can be
    signed with: RSA (RS256), EC P-256 (ES256), Ed25519 or Ed448 (EdDSA). Anything else
    started a broker that refused every token. Read as the broker reads it
    (auth.load_public_key; imported here, as auth imports this module)."""
    from cryptography.hazmat.primitives.asymmetric import ec

    from .auth import load_public_key
    key = load_public_key(text)
    if key is None:
        raise ConfigError("QUEEN_JWT_PUBLIC_KEY is not a public key (PEM or OpenSSH) of RSA, EC, Ed25519 or "
                          "Ed448: a private key, a certificate or other text is refused")
    if isinstance(key, ec.EllipticCurvePublicKey) and not isinstance(key.curve, ec.SECP256R1):
        raise ConfigError("QUEEN_JWT_PUBLIC_KEY must be an RSA, EC P-256, Ed25519 or Ed448 public key")


def tenant_share(total: int, auth: str) -> int:
    """One tenant's share of a broker's bound (requests in progress, pool connections):
    half of it under JWT, so that another tenant always finds room; all of it with auth
    off, where every request is tenant `default`'s."""
    return max(1, total // 2) if auth == "jwt" else total


def _choice(env: dict[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    value = (env.get(name) or default).strip().lower()
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _url(env: dict[str, str], name: str) -> str | None:
    """A libpq URL or key=value string (one host or several); None when unset."""
    raw = (env.get(name) or "").strip()
    if not raw:
        return None
    try:
        conninfo_to_dict(raw)
    except psycopg.ProgrammingError as exc:
        raise ConfigError(f"{name} is not a valid libpq connection string: {exc}") from None
    return raw


def _key(env: dict[str, str]) -> bytes | None:
    raw = env.get("QUEEN_ENCRYPTION_KEY") or ""
    if not raw:
        return None
    try:
        key = bytes.fromhex(raw)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise ConfigError("QUEEN_ENCRYPTION_KEY must be exactly 64 hex characters (32 bytes)")
    return key


@dataclass(frozen=True)
class Settings:
    database_url: str
    # a hot standby for peek and list (None: they read the primary like everything else)
    read_database_url: str | None = None
    # session: every connection reaches PostgreSQL (or a session pooler) and keeps its
    # settings; transaction: a transaction pooler (pgbouncer pool_mode=transaction) is
    # between: no startup options, no prepared statements, the timeout set per transaction
    pool_mode: str = "session"
    # a URL without the pooler, for what needs a session: the sweeper's LISTEN
    direct_database_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 6632
    broker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    # sweeper
    sweeper_min_sleep_ms: int = 10
    sweeper_max_sleep_ms: int = 1000
    sweeper_lease_ms: int = 30000
    sweeper_max_attempts: int = 5
    sweeper_batch: int = 256
    # the leased (zstd) path: stored payload bytes claimed per call, and inflated bytes held before a fire call
    sweeper_batch_bytes: int = 16 * 1024 * 1024
    sweeper_backoff_ms: int = 1000
    sweeper_backoff_max_ms: int = 300000
    # log retention (queen.apply_retention): 0 = this broker runs none
    retention_interval_ms: int = 60000
    retention_batch: int = 1000
    # timers
    timers_horizon_ms: int = 90 * 24 * 3600 * 1000
    timers_max_ops: int = 256
    max_body_bytes: int = 0  # from_env derives it from timers_max_ops when unset
    # request bodies (bodies.py): every other route's cap, the budget in flight, its wait,
    # the JSON values a body may hold, and the payload bytes from which a batch is staged
    log_max_body_bytes: int = 8 * 1024 * 1024
    body_budget_bytes: int = 0  # from_env: twice the largest legal weight
    body_wait_ms: int = 5000
    body_timeout_ms: int = 120000
    # connections (server.py): the request head's deadline, and connections or requests at once
    head_timeout_ms: int = 10000
    send_timeout_ms: int = 60000
    send_min_bytes_per_s: int = 65536
    # a stop (SIGTERM): how long the requests in flight may take before they are cancelled
    shutdown_timeout_ms: int = 10000
    # a pop's stored payload bytes (queen.pop_messages p_max_bytes; the first message always goes)
    pop_max_bytes: int = 16 * 1024 * 1024
    max_connections: int = 1000
    tenant_max_requests: int = 1000  # from_env: half of max_connections under JWT, all of it with auth off
    json_max_values: int = 1_000_000
    timers_stage_bytes: int = 4 * 1024 * 1024
    # security and tenancy
    encryption_key: bytes | None = None
    auth: str = "off"
    jwt_secret: str | None = None
    jwt_public_key: str | None = None
    jwt_leeway_seconds: int = 5
    # a credential's length: PyJWT's decode costs about 40 us per KB, spent before the tenant's turn
    jwt_max_bytes: int = 8192
    # the tenant whose admin tokens may flip the cell-wide switches (QUEEN_AUTH=jwt)
    operator_tenant: str = "default"
    tenancy: bool = False
    # database capacity
    pool_min: int = 1
    pool_max: int = 10
    pool_timeout_ms: int = 2000
    statement_timeout_ms: int = 5000
    # how long past its statement timeout a request's statement may go unanswered (db.BrokerPool)
    deadline_grace_ms: int = 2000
    connect_timeout_s: int = 5

    @property
    def listen_url(self) -> str | None:
        """Where the sweeper's LISTEN can hold a session: QUEEN_DIRECT_DATABASE_URL; the
        database URL when no transaction pooler is between; else None (the sweeper polls at
        QUEEN_SWEEPER_MIN_SLEEP_MS)."""
        if self.direct_database_url:
            return self.direct_database_url
        return None if self.pool_mode == "transaction" else self.database_url

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "Settings":
        env = dict(os.environ if env is None else env)
        url = _url(env, "QUEEN_DATABASE_URL")
        if not url:
            raise ConfigError("QUEEN_DATABASE_URL is required (make run sets it for the embedded cluster)")
        auth = _choice(env, "QUEEN_AUTH", "off", ("off", "jwt"))
        settings = cls(
            database_url=url,
            read_database_url=_url(env, "QUEEN_READ_DATABASE_URL"),
            pool_mode=_choice(env, "QUEEN_POOL_MODE", "session", ("session", "transaction")),
            direct_database_url=_url(env, "QUEEN_DIRECT_DATABASE_URL"),
            host=env.get("QUEEN_HOST") or "127.0.0.1",
            port=_int(env, "QUEEN_PORT", 6632, 1),
            broker_id=env.get("QUEEN_BROKER_ID") or f"{socket.gethostname()}-{os.getpid()}",
            sweeper_min_sleep_ms=_int(env, "QUEEN_SWEEPER_MIN_SLEEP_MS", 10),
            sweeper_max_sleep_ms=_int(env, "QUEEN_SWEEPER_MAX_SLEEP_MS", 1000, 1),
            sweeper_lease_ms=_int(env, "QUEEN_SWEEPER_LEASE_MS", 30000, 1, INT32_MAX),
            sweeper_max_attempts=_int(env, "QUEEN_SWEEPER_MAX_ATTEMPTS", 5, 1, INT32_MAX),
            sweeper_batch=_int(env, "QUEEN_SWEEPER_BATCH", 256, 1, INT32_MAX),
            sweeper_batch_bytes=_int(env, "QUEEN_SWEEPER_BATCH_BYTES", 16 * 1024 * 1024, 1, INT64_MAX),
            sweeper_backoff_ms=_int(env, "QUEEN_SWEEPER_BACKOFF_MS", 1000, 1, INT32_MAX),
            sweeper_backoff_max_ms=_int(env, "QUEEN_SWEEPER_BACKOFF_MAX_MS", 300000, 1, INT32_MAX),
            retention_interval_ms=_int(env, "QUEEN_RETENTION_INTERVAL_MS", 60000, 0),
            retention_batch=_int(env, "QUEEN_RETENTION_BATCH", 1000, 1),
            timers_horizon_ms=_int(env, "QUEEN_TIMERS_HORIZON_MS", 90 * 24 * 3600 * 1000, 1, MAX_HORIZON_MS),
            timers_max_ops=(max_ops := _int(env, "QUEEN_TIMERS_MAX_OPS", 256, 1, MAX_TIMER_OPS)),
            max_body_bytes=(max_body := _int(env, "QUEEN_MAX_BODY_BYTES", default_max_body_bytes(max_ops), 1)),
            log_max_body_bytes=(log_max := _int(env, "QUEEN_LOG_MAX_BODY_BYTES", 8 * 1024 * 1024, 1)),
            pop_max_bytes=(pop_max := _int(env, "QUEEN_POP_MAX_BYTES", 16 * 1024 * 1024, 1, MAX_POP_BYTES)),
            body_budget_bytes=_int(env, "QUEEN_BODY_BUDGET_BYTES", 2 * heaviest_request(max_body, log_max, pop_max), 1),
            body_wait_ms=_int(env, "QUEEN_BODY_WAIT_MS", 5000, 0),
            body_timeout_ms=_int(env, "QUEEN_BODY_TIMEOUT_MS", 120000, 1),
            head_timeout_ms=_int(env, "QUEEN_HEAD_TIMEOUT_MS", 10000, 1),
            send_timeout_ms=_int(env, "QUEEN_SEND_TIMEOUT_MS", 60000, 1),
            send_min_bytes_per_s=_int(env, "QUEEN_SEND_MIN_BYTES_PER_S", 65536, 0, INT32_MAX),
            shutdown_timeout_ms=_int(env, "QUEEN_SHUTDOWN_TIMEOUT_MS", 10000, 0),
            max_connections=(max_conn := _int(env, "QUEEN_MAX_CONNECTIONS", 1000, 1)),
            tenant_max_requests=_int(env, "QUEEN_TENANT_MAX_REQUESTS", tenant_share(max_conn, auth), 1),
            json_max_values=_int(env, "QUEEN_JSON_MAX_VALUES", 1_000_000, 1),
            timers_stage_bytes=_int(env, "QUEEN_TIMERS_STAGE_BYTES", 4 * 1024 * 1024, 0),
            encryption_key=_key(env),
            auth=auth,
            jwt_secret=env.get("QUEEN_JWT_SECRET") or None,
            jwt_public_key=env.get("QUEEN_JWT_PUBLIC_KEY") or None,
            jwt_leeway_seconds=_int(env, "QUEEN_JWT_LEEWAY_SECONDS", 5, 0, MAX_JWT_LEEWAY_S),
            jwt_max_bytes=_int(env, "QUEEN_JWT_MAX_BYTES", 8192, 64),
            operator_tenant=env.get("QUEEN_OPERATOR_TENANT") or "default",
            tenancy=_choice(env, "QUEEN_TENANCY", "off", ("off", "on")) == "on",
            pool_min=_int(env, "QUEEN_POOL_MIN", 1, 0),
            pool_max=_int(env, "QUEEN_POOL_MAX", 10, 1, MAX_POOL),
            pool_timeout_ms=_int(env, "QUEEN_POOL_TIMEOUT_MS", 2000, 1),
            statement_timeout_ms=_int(env, "QUEEN_STATEMENT_TIMEOUT_MS", 5000, 0, INT32_MAX),
            deadline_grace_ms=_int(env, "QUEEN_DEADLINE_GRACE_MS", 2000, 1, INT32_MAX),
            # libpq's floor is 2 s; 0 would mean "wait forever" there, which the broker never does
            connect_timeout_s=_int(env, "QUEEN_CONNECT_TIMEOUT_S", 5, 2),
        )
        largest = heaviest_request(settings.max_body_bytes, settings.log_max_body_bytes, settings.pop_max_bytes)
        if settings.body_budget_bytes // 2 < largest:
            # a tenant may hold half the budget: the largest legal request must fit in that half
            raise ConfigError(f"QUEEN_BODY_BUDGET_BYTES must be at least {2 * largest} (twice the weight of the "
                              f"largest legal request: QUEEN_MAX_BODY_BYTES x{TIMERS_WEIGHT}, "
                              f"QUEEN_LOG_MAX_BODY_BYTES x{LOG_WEIGHT}, QUEEN_POP_MAX_BYTES x{POP_WEIGHT} + 10,000 messages), "
                              f"got {settings.body_budget_bytes}")
        if settings.port > 65535:
            raise ConfigError(f"QUEEN_PORT must be <= 65535, got {settings.port}")
        if settings.retention_batch > 100000:
            raise ConfigError(f"QUEEN_RETENTION_BATCH must be <= 100000, got {settings.retention_batch}")
        if settings.sweeper_max_sleep_ms > MAX_SLEEP_CAP_MS:
            # queen.schedule_timers wakes sleeping sweepers only for timers due within 61 s
            raise ConfigError(f"QUEEN_SWEEPER_MAX_SLEEP_MS must be <= {MAX_SLEEP_CAP_MS}, got "
                              f"{settings.sweeper_max_sleep_ms}")
        if settings.sweeper_min_sleep_ms > settings.sweeper_max_sleep_ms:
            raise ConfigError("QUEEN_SWEEPER_MIN_SLEEP_MS must not exceed QUEEN_SWEEPER_MAX_SLEEP_MS")
        if settings.sweeper_min_sleep_ms == 0 and settings.listen_url is None:
            # no LISTEN through a transaction pooler: the sweeper polls at the minimum sleep, and 0
            # would send its next-due query through the pooler without a pause, thousands a second
            raise ConfigError("QUEEN_SWEEPER_MIN_SLEEP_MS=0 with QUEEN_POOL_MODE=transaction and no "
                              "QUEEN_DIRECT_DATABASE_URL would poll without a pause (no LISTEN through the "
                              "pooler): set QUEEN_DIRECT_DATABASE_URL, or a minimum of at least 1")
        if settings.jwt_max_bytes > MAX_HEAD_BYTES:
            raise ConfigError(f"QUEEN_JWT_MAX_BYTES must be <= {MAX_HEAD_BYTES} (the request head's limit), "
                              f"got {settings.jwt_max_bytes}")
        if auth == "jwt" and not (settings.jwt_secret or settings.jwt_public_key):
            raise ConfigError("QUEEN_AUTH=jwt needs QUEEN_JWT_SECRET or QUEEN_JWT_PUBLIC_KEY")
        if settings.jwt_secret and settings.jwt_public_key:
            # one key: the secret was ignored, and every HS256 token refused
            raise ConfigError("set QUEEN_JWT_SECRET or QUEEN_JWT_PUBLIC_KEY, not both")
        if settings.jwt_public_key:
            _check_public_key(settings.jwt_public_key)
        if settings.sweeper_backoff_ms > settings.sweeper_backoff_max_ms:
            raise ConfigError(f"QUEEN_SWEEPER_BACKOFF_MS ({settings.sweeper_backoff_ms}) must not exceed "
                              f"QUEEN_SWEEPER_BACKOFF_MAX_MS ({settings.sweeper_backoff_max_ms})")
        if settings.pool_min > settings.pool_max:
            raise ConfigError(f"QUEEN_POOL_MIN ({settings.pool_min}) must not exceed QUEEN_POOL_MAX "
                              f"({settings.pool_max})")
        return settings
