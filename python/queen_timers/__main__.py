"""python -m queen_timers: the queen-timers command line (cli.py).

With no arguments it runs `serve` (migrate the database, then one broker:
HTTP + sweeper), as it always has; `--help` prints help and starts nothing.
"""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(default_command="serve"))
