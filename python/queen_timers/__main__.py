"""python -m queen_timers: migrate the database, then run one broker (HTTP + sweeper)."""

from __future__ import annotations

import logging
import sys

import uvicorn

from .app import create_app
from .config import ConfigError, Settings
from .migrate import migrate
from .server import JsonErrorH11Protocol


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        settings = Settings.from_env()
    except ConfigError as exc:
        print(f"queen-timers: {exc}", file=sys.stderr)
        return 2
    applied = migrate(settings.database_url)
    if applied:
        logging.getLogger("queen_timers").info("applied migrations %s", applied)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                log_level="warning", access_log=False, http=JsonErrorH11Protocol)
    return 0


if __name__ == "__main__":
    sys.exit(main())
