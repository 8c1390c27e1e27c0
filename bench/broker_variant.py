"""A broker with another HTTP parser or event loop than the one it ships with, for
the A/B windows of `bench/run --only cancel --cancel-load-variant PARSER:LOOP`.

Runs `python -m queen_timers` (serve) with uvicorn.run's `http` and `loop`
replaced: BENCH_HTTP = h11 | httptools (each with its JSON 400 protocol class
of queen_timers.server), BENCH_LOOP = asyncio | uvloop. BENCH_SWEEPER=off: a
broker that serves HTTP and starts no sweeper (the variant "apart": the timers
are fired meanwhile by the sweeper of another broker, a process of its own).
Everything else is the broker as shipped.
"""

from __future__ import annotations

import os
import sys

import uvicorn

from queen_timers import server
from queen_timers.cli import main

PARSERS = {"h11": server.JsonErrorH11Protocol, "httptools": server.JsonErrorHttpToolsProtocol}
_run = uvicorn.run


def run(app, **kwargs):
    if os.environ.get("BENCH_HTTP"):
        kwargs["http"] = PARSERS[os.environ["BENCH_HTTP"]]
    if os.environ.get("BENCH_LOOP"):
        kwargs["loop"] = os.environ["BENCH_LOOP"]
    return _run(app, **kwargs)


uvicorn.run = run

if os.environ.get("BENCH_SWEEPER") == "off":
    from queen_timers.sweeper import Sweeper

    async def _no_sweeper(self) -> None:
        return None

    Sweeper.start = Sweeper.stop = _no_sweeper

if __name__ == "__main__":
    sys.exit(main(default_command="serve"))
