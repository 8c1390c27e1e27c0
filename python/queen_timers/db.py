"""Database access: the request pool and where the SQL lives.

Every timer state change is one call of a queen.* function; this module
only opens connections. The sweeper keeps its own connections so that a
starved request pool never stops the fire.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from psycopg import AsyncConnection
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from .config import Settings



def find_sql_dir() -> Path:
    """Where sql/ (schema/ and migrations/) is: QUEEN_SQL_DIR when set; else the copy a
    wheel carries inside the package (queen_timers/sql, see setup.py); else the
    checkout's sql/ at the repository root (an editable install, tests)."""
    override = os.environ.get("QUEEN_SQL_DIR")
    if override:
        return Path(override)
    packaged = resources.files("queen_timers") / "sql"
    if packaged.is_dir() and isinstance(packaged, Path):
        return packaged
    return Path(__file__).resolve().parents[2] / "sql"


SQL_DIR = find_sql_dir()


def connect_kwargs(settings: Settings, application_name: str) -> dict:
    options = f"-c statement_timeout={settings.statement_timeout_ms}" if settings.statement_timeout_ms else ""
    return {
        "application_name": application_name,
        "options": options,
        "row_factory": dict_row,
        "autocommit": True,
    }


def make_pool(settings: Settings) -> AsyncConnectionPool:
    return AsyncConnectionPool(
        settings.database_url,
        min_size=settings.pool_min,
        max_size=settings.pool_max,
        timeout=settings.pool_timeout_ms / 1000,
        kwargs=connect_kwargs(settings, f"queen-broker:{settings.broker_id}"),
        open=False,
        name="queen-requests",
    )


async def connect(settings: Settings, role: str) -> AsyncConnection:
    """A dedicated autocommit connection (sweeper, LISTEN)."""
    return await AsyncConnection.connect(
        settings.database_url, **connect_kwargs(settings, f"queen-{role}:{settings.broker_id}")
    )
