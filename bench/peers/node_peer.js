// One measure of one Node.js peer (graphile-worker or pg-boss), driven by bench/peers/peers.py.
//   node node_peer.js '<json config>'   -> one JSON line of figures on stdout
// (cancel: a line per block asked for on stdin, before that last line)
// The config: {system, measure, url, ...sizes}. Every wait is bounded (cap_s).
"use strict";
const path = require("path");
const NM = path.join(__dirname, ".install", "node_modules");
const { Pool } = require(path.join(NM, "pg"));

const cfg = JSON.parse(process.argv[2]);
const QUEUE = "bench_peer";
const now = () => Date.now() / 1000;
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function pct(v, p) {
  if (!v.length) return null;
  const s = [...v].sort((a, b) => a - b);
  const k = Math.max(0, Math.min(s.length - 1, Math.round((p / 100) * s.length + 0.5) - 1));
  return s[k];
}

async function inParallel(clients, batches, fn) {
  let i = 0;
  const worker = async () => { while (i < batches.length) { const b = batches[i++]; await fn(b); } };
  await Promise.all(Array.from({ length: clients }, worker));
}

function chunks(n, size, make) {
  const out = [];
  for (let s = 0; s < n; s += size) {
    const b = [];
    for (let i = s; i < Math.min(n, s + size); i++) b.push(make(i));
    out.push(b);
  }
  return out;
}

// ---------------------------------------------------------------- graphile-worker
const graphile = {
  version: () => require(path.join(NM, "graphile-worker", "package.json")).version,
  async setup() {
    const gw = require(path.join(NM, "graphile-worker"));
    this.gw = gw;
    this.utils = await gw.makeWorkerUtils({ connectionString: cfg.url });
    await this.utils.migrate();
    this.pool = new Pool({ connectionString: cfg.url, max: 2 });
    await this.pool.query("DELETE FROM graphile_worker._private_jobs");
  },
  async teardown() { await this.utils.release(); await this.pool.end(); },
  async addBatch(jobs) {
    // addJobs: the batch API (one statement per call)
    await this.utils.addJobs(jobs.map((j) => ({ identifier: QUEUE, payload: j.payload, runAt: j.runAt, jobKey: j.key })));
  },
  async count() { return Number((await this.pool.query("SELECT count(*) FROM graphile_worker._private_jobs")).rows[0].count); },
  async cancelOne(key) {
    const r = await this.pool.query({ name: "rm", text: "SELECT id FROM graphile_worker.remove_job($1)", values: [key] });
    return r.rows.length === 1 && r.rows[0].id !== null;
  },
  async work(concurrency, pollMs, onJob) {
    const opts = { connectionString: cfg.url, concurrency, noHandleSignals: true, taskList: { [QUEUE]: async (payload) => { onJob(payload); } } };
    if (pollMs) opts.pollInterval = pollMs;
    const runner = await this.gw.run(opts);
    return async () => { await runner.stop(); };
  },
  defaults: { concurrency: 1, pollMs: 2000 },
  settings(c, p) { return `concurrency=${c}, pollInterval=${p} ms${c === 1 && p === 2000 ? " (defaults)" : ""}`; },
};

// ---------------------------------------------------------------- pg-boss
const pgboss = {
  version: () => require(path.join(NM, "pg-boss", "package.json")).version,
  async setup() {
    // pg-boss 11+ is an ES module exporting { PgBoss }; Node >= 20.19 require()s it
    const mod = require(path.join(NM, "pg-boss"));
    const PgBoss = mod.PgBoss || mod.default || mod;
    this.boss = new PgBoss({ connectionString: cfg.url, max: 8, supervise: true, schedule: false });
    this.boss.on("error", (e) => console.error("pg-boss error", e.message));
    await this.boss.start();
    await this.boss.deleteQueue(QUEUE).catch(() => {});
    await this.boss.createQueue(QUEUE);
    this.pool = new Pool({ connectionString: cfg.url, max: 2 });
  },
  async teardown() { await this.boss.stop({ graceful: false, timeout: 5000 }).catch(() => {}); await this.pool.end(); },
  async addBatch(jobs) {
    // insert: the batch API (one statement per call); id set by the caller so that it can cancel by id
    await this.boss.insert(QUEUE, jobs.map((j) => ({ id: j.id, data: j.payload, startAfter: j.runAt })));
  },
  async count() {
    return Number((await this.pool.query("SELECT count(*) FROM pgboss.job WHERE name = $1 AND state < 'active'", [QUEUE])).rows[0].count);
  },
  async cancelOne(id) { await this.boss.cancel(QUEUE, id); return true; },
  async work(concurrency, pollMs, onJob) {
    // one work() with localConcurrency workers, each fetching batchSize (default 1) jobs per poll
    // tuned: batch_size jobs per fetch, fetching again at once while a fetch comes back full
    const opts = { batchSize: cfg.batch_size || 1, localConcurrency: concurrency };
    if (cfg.batch_size > 1) opts.burstWhenBatchFull = true;
    if (pollMs) opts.pollingIntervalSeconds = pollMs / 1000;
    const id = await this.boss.work(QUEUE, opts, async (jobs) => { for (const j of jobs) onJob(j.data); });
    return async () => { await this.boss.offWork(QUEUE, { id, wait: false }); };
  },
  defaults: { concurrency: 1, pollMs: 2000 },
  settings(c, p) {
    const b = cfg.batch_size || 1;
    return `localConcurrency=${c}, batchSize=${b}${b > 1 ? ", burstWhenBatchFull" : ""}, pollingIntervalSeconds=${p / 1000}${c === 1 && p === 2000 && b === 1 ? " (defaults)" : ""}`;
  },
};

const SYSTEMS = { "graphile-worker": graphile, "pg-boss": pgboss };

const RUN = require("crypto").randomBytes(4).toString("hex");  // ids unique per process
function uuid(i) {
  const h = i.toString(16).padStart(12, "0");
  return `${RUN}-0000-4000-8000-${h}`;
}

async function main() {
  const sys = SYSTEMS[cfg.system];
  if (cfg.measure === "version") { console.log(JSON.stringify({ version: sys.version() })); return; }
  await sys.setup();
  const out = { system: cfg.system, version: sys.version(), measure: cfg.measure };
  try {
    if (cfg.measure === "schedule" || cfg.measure === "seed") {
      // n future (or, for seed, due) jobs in batches, from `clients` concurrent callers
      const due = cfg.measure === "seed" ? new Date(Date.now() - 1000) : new Date(Date.now() + 3600e3);
      const batches = chunks(cfg.n, cfg.batch, (i) => ({ key: `k-${i}`, id: uuid(i + 1), payload: { n: i }, runAt: due }));
      const t0 = now();
      await inParallel(cfg.clients || 1, batches, (b) => sys.addBatch(b));
      out.secs = now() - t0;
      out.per_s = cfg.n / out.secs;
      out.rows = await sys.count();
    } else if (cfg.measure === "cancel") {
      // n future jobs seeded (untimed), then blocks of single cancels on peers.py's demand, one
      // JSON line in and out per block ({start, count} -> {lat, secs, hits}; {end} to stop), so
      // that peers.py can interleave every system's blocks in the same seconds of the disk
      const batches = chunks(cfg.n, 256, (i) => ({ key: `k-${i}`, id: uuid(i + 1), payload: { n: i }, runAt: new Date(Date.now() + 3600e3) }));
      for (const b of batches) await sys.addBatch(b);
      process.stdout.write(JSON.stringify({ ready: true, seeded: await sys.count() }) + "\n");
      const lines = require("readline").createInterface({ input: process.stdin });
      for await (const line of lines) {
        const cmd = JSON.parse(line);
        if (cmd.end) break;
        const lat = [];
        let hits = 0;
        const t0 = process.hrtime.bigint();
        for (let i = cmd.start; i < cmd.start + cmd.count; i++) {
          const t = process.hrtime.bigint();
          hits += (await sys.cancelOne(cfg.system === "pg-boss" ? uuid(i + 1) : `k-${i}`)) ? 1 : 0;
          lat.push(Number(process.hrtime.bigint() - t) / 1e6);
        }
        const secs = Number(process.hrtime.bigint() - t0) / 1e9;
        process.stdout.write(JSON.stringify({ lat, secs, hits }) + "\n");
      }
      lines.close();
      out.left = await sys.count();
    } else if (cfg.measure === "drain") {
      // n due jobs seeded first (untimed); the worker runs until all are done or cap_s
      const conc = cfg.concurrency || sys.defaults.concurrency;
      const poll = cfg.poll_ms || sys.defaults.pollMs;
      const due = new Date(Date.now() - 1000);
      for (const b of chunks(cfg.n, 256, (i) => ({ key: `d-${i}`, id: uuid(i + 1), payload: { n: i }, runAt: due }))) await sys.addBatch(b);
      out.seeded = await sys.count();
      let done = 0;
      const t0 = now();
      const stop = await sys.work(conc, poll, () => { done++; });
      while (done < cfg.n && now() - t0 < cfg.cap_s) await sleep(20);
      out.secs = now() - t0;
      await stop();
      Object.assign(out, { done, per_s: done / out.secs, capped: done < cfg.n, settings: sys.settings(conc, poll) });
    } else if (cfg.measure === "lag") {
      // rate jobs/s for seconds, each due due_s after it is scheduled; lag = handler start - due instant.
      // Both instants are read on this host's clock, which is the database's clock (one machine).
      const conc = cfg.concurrency || sys.defaults.concurrency;
      const poll = cfg.poll_ms || sys.defaults.pollMs;
      const lags = [];
      const dueOf = new Map();
      const stop = await sys.work(conc, poll, (p) => { const d = p && p.due; if (d) lags.push(Date.now() - d); });
      const total = Math.round(cfg.rate * cfg.seconds);
      const tick = 50;  // ms: rate/20 jobs per tick
      const per = cfg.rate * tick / 1000;
      const t0 = Date.now();
      let made = 0;
      while (made < total) {
        const target = Math.min(total, Math.round(((Date.now() - t0) / 1000) * cfg.rate) + per);
        const jobs = [];
        for (; made < target; made++) {
          const due = Date.now() + cfg.due_s * 1000;
          jobs.push({ key: `l-${made}`, id: uuid(made + 1), payload: { due }, runAt: new Date(due) });
        }
        if (jobs.length) await sys.addBatch(jobs);
        await sleep(tick);
      }
      const tEnd = Date.now() + cfg.due_s * 1000 + (cfg.cap_s || 30) * 1000;
      while (lags.length < total && Date.now() < tEnd) await sleep(50);
      await stop();
      const s = lags.map((x) => x);
      Object.assign(out, { scheduled: total, started: s.length, p50_ms: pct(s, 50), p95_ms: pct(s, 95), p99_ms: pct(s, 99),
        max_ms: s.length ? Math.max(...s) : null, settings: sys.settings(conc, poll) });
      void dueOf;
    }
  } finally {
    await sys.teardown();
  }
  console.log(JSON.stringify(out));
}

main().then(() => process.exit(0), (e) => { console.error(e && e.stack || e); process.exit(1); });
