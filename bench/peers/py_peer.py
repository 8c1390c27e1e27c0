"""One measure of one Python peer (procrastinate or PgQueuer), run by bench/peers/peers.py in
the peers' own venv (bench/peers/.install/venv):  python py_peer.py '<json config>'
prints one JSON line of figures (cancel: a line per block asked for on stdin, before it).
Same measures and conventions as node_peer.js."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from datetime import datetime, timedelta, timezone
from importlib.metadata import version

cfg = json.loads(sys.argv[1])
Q = "bench_peer"


def pct(v, p):
    if not v:
        return None
    s = sorted(v)
    return s[max(0, min(len(s) - 1, int(round(p / 100 * len(s) + 0.5)) - 1))]


async def in_parallel(clients, batches, fn):
    it = iter(batches)

    async def worker():
        for b in it:
            await fn(b)
    await asyncio.gather(*(worker() for _ in range(clients)))


def chunks(n, size):
    return [range(s, min(n, s + size)) for s in range(0, n, size)]


# ------------------------------------------------------------------ procrastinate
class Procrastinate:
    name = "procrastinate"
    defaults = {"concurrency": 1, "poll_ms": 5000}  # worker.py: WORKER_CONCURRENCY, FETCH_JOB_POLLING_INTERVAL

    async def setup(self, on_job):
        import procrastinate
        self.app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=cfg["url"]))
        await self.app.open_async()
        async with self.app.connector.pool.connection() as c:
            has = (await (await c.execute("SELECT to_regclass('procrastinate_jobs')")).fetchone())[0]
        if not has:
            await self.app.schema_manager.apply_schema_async()
        await self.app.connector.execute_query_async("DELETE FROM procrastinate_jobs")
        self.on_job = on_job

        @self.app.task(name=Q, queue=Q, pass_context=False)
        async def job(**kw):
            self.on_job(kw)
        self.task = job

    async def teardown(self):
        await self.app.close_async()

    async def add_batch(self, idx, due, payload=None):
        # batch_defer_async: the batch API (one statement per call)
        return await self.task.configure(schedule_at=due).batch_defer_async(
            *[(payload(i) if payload else {"n": i}) for i in idx])

    async def count(self):
        async with self.app.connector.pool.connection() as c:
            return (await (await c.execute("SELECT count(*) FROM procrastinate_jobs WHERE status = 'todo'")).fetchone())[0]

    async def cancel_one(self, job_id):
        return await self.app.job_manager.cancel_job_by_id_async(job_id, delete_job=True)

    async def work(self, conc, poll_ms):
        t = asyncio.create_task(self.app.run_worker_async(queues=[Q], concurrency=conc, wait=True,
                                                          fetch_job_polling_interval=poll_ms / 1000,
                                                          install_signal_handlers=False))

        async def stop():
            t.cancel()
            try:
                await asyncio.wait_for(t, 10)
            except (asyncio.CancelledError, asyncio.TimeoutError):
                pass
        return stop

    def settings(self, c, p):
        return f"concurrency={c}, fetch_job_polling_interval={p / 1000:g} s" + (" (defaults)" if (c, p) == (1, 5000) else "")


# ------------------------------------------------------------------ PgQueuer
class PgQueuer:
    name = "pgqueuer"
    defaults = {"concurrency": 0, "poll_ms": 30000}  # QueueManager.run: batch_size=10, dequeue_timeout=30 s

    async def setup(self, on_job):
        import asyncpg
        from pgqueuer.db import AsyncpgDriver
        from pgqueuer.qm import QueueManager
        from pgqueuer.queries import Queries
        self.conn = await asyncpg.connect(cfg["url"])
        self.conns = [self.conn] + [await asyncpg.connect(cfg["url"]) for _ in range(3)]
        self.qs = [Queries(AsyncpgDriver(c)) for c in self.conns]
        if not await self.qs[0].has_table("pgqueuer"):
            await self.qs[0].install()
        await self.conn.execute("DELETE FROM pgqueuer")
        self.wconn = await asyncpg.connect(cfg["url"])
        self.qm = QueueManager(Queries(AsyncpgDriver(self.wconn)))
        self.ids = []

        @self.qm.entrypoint(Q)
        async def job(j):
            on_job(json.loads(j.payload) if j.payload else {})
        self.rr = 0

    async def teardown(self):
        for c in self.conns + [self.wconn]:
            await c.close()

    async def add_batch(self, idx, due, payload=None):
        # Queries.enqueue with lists: the batch API (one statement per call); one connection per client
        q = self.qs[self.rr % len(self.qs)]
        self.rr += 1
        delay = due - datetime.now(timezone.utc)
        n = len(idx)
        ids = await q.enqueue([Q] * n, [json.dumps(payload(i) if payload else {"n": i}).encode() for i in idx],
                              [0] * n, [max(timedelta(0), delay)] * n)
        return ids

    async def count(self):
        return await self.conn.fetchval("SELECT count(*) FROM pgqueuer WHERE status = 'queued'")

    async def cancel_one(self, job_id):
        await self.qs[0].mark_job_as_cancelled([job_id])
        return True

    async def work(self, conc, poll_ms):
        kw = {"dequeue_timeout": timedelta(milliseconds=poll_ms)}
        if conc:
            kw["batch_size"] = conc
        t = asyncio.create_task(self.qm.run(**kw))

        async def stop():
            self.qm.shutdown.set()
            try:
                await asyncio.wait_for(t, 15)
            except (asyncio.CancelledError, asyncio.TimeoutError):
                t.cancel()
        return stop

    def settings(self, c, p):
        return (f"batch_size={c or 10}, dequeue_timeout={p / 1000:g} s"
                + (" (defaults)" if (c, p) == (0, 30000) else ""))


async def main():
    sys_ = {"procrastinate": Procrastinate, "pgqueuer": PgQueuer}[cfg["system"]]()
    if cfg["measure"] == "version":
        print(json.dumps({"version": version(cfg["system"])}))
        return
    state = {"done": 0, "lags": []}

    def on_job(p):
        state["done"] += 1
        if "due" in p:
            state["lags"].append(time.time() * 1000 - p["due"])
    await sys_.setup(on_job)
    out = {"system": cfg["system"], "version": version(cfg["system"]), "measure": cfg["measure"]}
    m = cfg["measure"]
    try:
        future = datetime.now(timezone.utc) + timedelta(hours=1)
        if m == "schedule":
            t0 = time.perf_counter()
            await in_parallel(cfg.get("clients", 1), chunks(cfg["n"], cfg["batch"]), lambda b: sys_.add_batch(b, future))
            out["secs"] = time.perf_counter() - t0
            out.update(per_s=cfg["n"] / out["secs"], rows=await sys_.count())
        elif m == "cancel":
            # seeded (untimed), then blocks of single cancels on peers.py's demand (node_peer.js)
            ids = []
            for b in chunks(cfg["n"], 256):
                ids += await sys_.add_batch(b, future)
            print(json.dumps({"ready": True, "seeded": await sys_.count()}), flush=True)
            loop = asyncio.get_running_loop()
            while (line := await loop.run_in_executor(None, sys.stdin.readline)):
                cmd = json.loads(line)
                if cmd.get("end"):
                    break
                lat, hits = [], 0
                t0 = time.perf_counter()
                for i in ids[cmd["start"]:cmd["start"] + cmd["count"]]:
                    t = time.perf_counter()
                    hits += bool(await sys_.cancel_one(i))
                    lat.append((time.perf_counter() - t) * 1000)
                print(json.dumps({"lat": lat, "secs": time.perf_counter() - t0, "hits": hits}), flush=True)
            out["left"] = await sys_.count()
        elif m == "drain":
            conc = cfg.get("concurrency", sys_.defaults["concurrency"])
            poll = cfg.get("poll_ms", sys_.defaults["poll_ms"])
            past = datetime.now(timezone.utc) - timedelta(seconds=1)
            for b in chunks(cfg["n"], 256):
                await sys_.add_batch(b, past)
            out["seeded"] = await sys_.count()
            t0 = time.perf_counter()
            stop = await sys_.work(conc, poll)
            while state["done"] < cfg["n"] and time.perf_counter() - t0 < cfg["cap_s"]:
                await asyncio.sleep(0.02)
            out["secs"] = time.perf_counter() - t0
            await stop()
            out.update(done=state["done"], per_s=state["done"] / out["secs"], capped=state["done"] < cfg["n"],
                       settings=sys_.settings(conc, poll))
        elif m == "lag":
            # lag = handler start - due instant, both on this host's clock (the database's clock: one machine)
            conc = cfg.get("concurrency", sys_.defaults["concurrency"])
            poll = cfg.get("poll_ms", sys_.defaults["poll_ms"])
            stop = await sys_.work(conc, poll)
            total = int(cfg["rate"] * cfg["seconds"])
            tick = 0.05
            made = 0
            t0 = time.perf_counter()
            while made < total:
                target = min(total, int((time.perf_counter() - t0) * cfg["rate"] + cfg["rate"] * tick))
                if target > made:
                    due_ms = time.time() * 1000 + cfg["due_s"] * 1000
                    due = datetime.fromtimestamp(due_ms / 1000, timezone.utc)
                    await sys_.add_batch(range(made, target), due, payload=lambda i, d=due_ms: {"due": d})
                    made = target
                await asyncio.sleep(tick)
            end = time.perf_counter() + cfg["due_s"] + cfg.get("cap_s", 30)
            while len(state["lags"]) < total and time.perf_counter() < end:
                await asyncio.sleep(0.05)
            await stop()
            s = state["lags"]
            out.update(scheduled=total, started=len(s), p50_ms=pct(s, 50), p95_ms=pct(s, 95), p99_ms=pct(s, 99),
                       max_ms=max(s) if s else None, settings=sys_.settings(conc, poll))
    finally:
        await sys_.teardown()
    print(json.dumps(out))


asyncio.run(main())
