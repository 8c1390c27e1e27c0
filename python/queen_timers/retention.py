"""Log retention: a small task beside the sweeper in every broker.

Every QUEEN_RETENTION_INTERVAL_MS it calls queen.apply_retention(QUEEN_RETENTION_BATCH)
on a connection of its own, again while a call comes back full (a backlog;
after resting three times as long as that call took), and counts what was deleted (queen_timers_retention_deleted_total{kind}).
What may be deleted, and when, is decided in SQL from the queues' options and
PostgreSQL's clock (sql/schema/70_retention.sql). Any number of brokers may run it:
a partition is worked on by one session at a time and the others skip it.
QUEEN_RETENTION_INTERVAL_MS=0 turns it off on this broker.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

import psycopg

from . import db
from .config import Settings
from .metrics import Metrics
from .sweeper import stop_loop_task

log = logging.getLogger("queen_timers.retention")

APPLY = "SELECT * FROM queen.apply_retention(%s)"
REST_FACTOR = 3  # rest after a full call, in multiples of the call's time
SQL_MAX_LIMIT = 100000  # apply_retention clamps p_limit to 1..100000 (config refuses more)


class Retention:
    def __init__(self, settings: Settings, metrics: Metrics):
        self.settings = settings
        self.metrics = metrics
        self._conn: psycopg.AsyncConnection | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._sleeping = False
        self.ticks = 0

    @property
    def enabled(self) -> bool:
        return self.settings.retention_interval_ms > 0

    async def start(self) -> None:
        if self.enabled and self._task is None:
            self._stopping = False
            self._task = asyncio.create_task(self._run(), name="queen-retention")

    async def stop(self) -> None:
        task, self._task = self._task, None
        self._stopping = True
        await stop_loop_task(task, self._sleeping)
        await self._close()

    async def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                await conn.close()
            except Exception:  # closing a broken connection may itself fail; nothing to do
                pass

    async def _sleep(self, seconds: float) -> None:
        self._sleeping = True
        try:
            await asyncio.sleep(seconds)
        finally:
            self._sleeping = False

    async def _run(self) -> None:
        interval = self.settings.retention_interval_ms / 1000
        # the first pass after a random part of the interval: the brokers of a cell spread out
        await self._sleep(random.uniform(0.1, 1.0) * interval)
        while not self._stopping:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the task must survive anything: log, reconnect next time
                log.warning("retention %s: pass failed (%s: %s); next pass in %.1f s",
                            self.settings.broker_id, type(exc).__name__, exc, interval)
                await self._close()
            if self._stopping:
                break
            await self._sleep(interval)

    async def tick(self) -> int:
        """One pass: apply_retention until a call comes back short of a full batch. Returns rows deleted."""
        self.ticks += 1
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = await db.connect(self.settings, "retention", self.settings.direct_database_url)
        batch = min(self.settings.retention_batch, SQL_MAX_LIMIT)
        total = 0
        while not self._stopping:
            t0 = time.monotonic()
            n = self.metrics.observe_retention((await db.fetch_bounded(self._conn, self.settings, APPLY, (batch,)))[0])
            total += n
            if n < batch:
                break
            # a backlog: go on after resting REST_FACTOR times as long as the batch took, so
            # retention takes at most about a quarter of one connection's time and the fire,
            # which shares the cores, keeps its pace (a backlog still drains at thousands/s)
            await self._sleep(REST_FACTOR * (time.monotonic() - t0))
        if total:
            log.info("retention %s: deleted %d rows", self.settings.broker_id, total)
        return total
