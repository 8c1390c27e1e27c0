// queen-timers operator dashboard: plain JS, no build step.
// Reads the broker's JSON routes with the caller's token (sessionStorage,
// sent as Authorization: Bearer; none needed when QUEEN_AUTH=off):
//   GET  /health                          broker id and version (public)
//   GET  /api/v1/system/timers/stats      per-queue counts, due-time histogram (read-only)
//   GET  /metrics/prometheus              fire lag histogram and counters (public)
//   GET  /api/v1/dlq                      dead letters with their error (read-only)
//   GET  /api/v1/system/timers            the pause switches (the operator tenant's admin)
//   POST /api/v1/system/timers/{scheduling,fire}   flip a switch (the operator tenant's admin)
// Everything from the server is put in the page as text (textContent),
// never as HTML: queue names and error messages are user data.
"use strict";

(() => {
  const TOKEN_KEY = "queen-timers-token";
  const REFRESH_MS = 5000;
  const COLORS = ["#2f6fdf", "#e8833a", "#3aa76d", "#c2417a", "#7c5cd6", "#2aa3b5", "#b8a02a", "#8a6d5a"];
  const $ = (id) => document.getElementById(id);
  let refreshing = null;
  let queued = false;
  let sequence = 0;

  // ------------------------------------------------------------------ helpers

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = String(value);
      else if (key.startsWith("data-")) node.dataset[key.slice(5).replace(/-(\w)/g, (_, c) => c.toUpperCase())] = String(value);
      else node.setAttribute(key, String(value));
    }
    for (const child of children) {
      if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  function token() {
    return sessionStorage.getItem(TOKEN_KEY) || "";
  }

  class ApiError extends Error {
    constructor(status, body) {
      const slug = body && typeof body === "object" ? body.error : null;
      const detail = body && typeof body === "object" ? body.detail : null;
      super(`${status}${slug ? " " + slug : ""}${detail ? ": " + detail : ""}`);
      this.status = status;
      this.slug = slug;
    }
  }

  async function api(path, options) {
    const opts = Object.assign({ cache: "no-store" }, options || {});
    const headers = Object.assign({}, opts.headers || {});
    const t = token();
    if (t) headers.Authorization = "Bearer " + t;
    opts.headers = headers;
    const response = await fetch(path, opts);
    const text = await response.text();
    let body = text;
    if ((response.headers.get("content-type") || "").includes("json")) {
      try { body = JSON.parse(text); } catch (_) { /* keep the text */ }
    }
    if (!response.ok) throw new ApiError(response.status, body);
    return body;
  }

  function panelError(panelId, error) {
    const p = $(panelId).querySelector(".error");
    if (!error) {
      p.hidden = true;
      p.textContent = "";
      return;
    }
    p.hidden = false;
    p.textContent = error.status === 401
      ? `${error.message} (paste a token above)`
      : error.message;
  }

  function fmtNumber(n) {
    return Number(n).toLocaleString("en-US");
  }

  function fmtTime(iso) {
    if (!iso) return "–";
    return iso.replace("T", " ").replace(/\.(\d{3})\d*Z$/, ".$1");
  }

  function fmtSeconds(s) {
    if (s === null || s === undefined || Number.isNaN(s)) return "–";
    if (s < 1) return `${(s * 1000).toFixed(s < 0.01 ? 2 : 1)} ms`;
    if (s < 120) return `${s.toFixed(2)} s`;
    return `${(s / 60).toFixed(1)} min`;
  }

  // a bucket bound: 0.005 -> "5 ms", 2.5 -> "2.5 s"
  function fmtLe(s) {
    return s < 1 ? `${+(s * 1000).toPrecision(3)} ms` : `${+s.toPrecision(3)} s`;
  }

  // A JWT's claims, for display only (the broker verifies the token).
  function claimsOf(jwt) {
    try {
      const part = jwt.split(".")[1].replace(/-/g, "+").replace(/_/g, "/");
      return JSON.parse(atob(part + "=".repeat((4 - (part.length % 4)) % 4)));
    } catch (_) {
      return null;
    }
  }

  // ------------------------------------------------------------------ panels

  async function loadHealth() {
    try {
      const h = await api("/health");
      $("broker").textContent = `broker ${h.worker_id} · v${h.version} · database ${h.database}`;
    } catch (e) {
      $("broker").textContent = `broker unreachable (${e.message})`;
    }
  }

  function queueColor(index) {
    return COLORS[index % COLORS.length];
  }

  async function loadStats() {
    let stats;
    try {
      stats = await api("/api/v1/system/timers/stats?buckets=60&bucketSeconds=60");
      panelError("panel-queues", null);
      panelError("panel-histogram", null);
    } catch (e) {
      panelError("panel-queues", e);
      panelError("panel-histogram", e);
      $("queues").querySelector("tbody").replaceChildren();
      $("queues").querySelector("tfoot").replaceChildren();
      $("histogram").replaceChildren();
      $("legend").replaceChildren();
      $("histogram-summary").textContent = "";
      $("tenant").textContent = "";
      return;
    }
    $("tenant").textContent = `tenant ${stats.tenant} · as of ${fmtTime(stats.asOf)}`;
    renderQueues(stats);
    renderHistogram(stats);
  }

  function renderQueues(stats) {
    const rows = stats.queues.map((q) => el("tr", { "data-queue": q.queue },
      el("td", { class: "queue", text: q.queue }),
      el("td", { class: "num pending", text: fmtNumber(q.pending) }),
      el("td", { class: "num due", text: fmtNumber(q.due) }),
      el("td", { class: "num claimed", text: fmtNumber(q.claimed) }),
      el("td", { class: "num retrying", text: fmtNumber(q.retrying) }),
      el("td", { class: "next", text: fmtTime(q.nextDeliverAt) })));
    rows.forEach((row, i) => { row.firstChild.style.borderLeft = `4px solid ${queueColor(i)}`; });
    $("queues").querySelector("tbody").replaceChildren(...rows);
    const t = stats.totals;
    // the route answers a page of queues (the first by name); the totals cover every one
    const shown = stats.truncated ? `${stats.queues.length} of ${stats.queueCount} queues` : `${stats.queueCount} queues`;
    $("queues").querySelector("tfoot").replaceChildren(stats.queueCount > 1 ? el("tr", { id: "queues-total" },
      el("td", { text: shown }),
      el("td", { class: "num pending", text: fmtNumber(t.pending) }),
      el("td", { class: "num due", text: fmtNumber(t.due) }),
      el("td", { class: "num claimed", text: fmtNumber(t.claimed) }),
      el("td", { class: "num retrying", text: fmtNumber(t.retrying) }),
      el("td")) : "");
    $("queues-empty").hidden = stats.queues.length > 0;
  }

  function renderHistogram(stats) {
    const totals = stats.dueByBucket;
    const max = Math.max(1, ...totals);
    const bars = totals.map((count, i) => {
      const from = i * stats.bucketSeconds / 60;
      const bar = el("div", { class: "bar", "data-bucket": i, "data-count": count,
                              title: `+${from}–${from + stats.bucketSeconds / 60} min: ${count} timer${count === 1 ? "" : "s"}` });
      stats.queues.forEach((q, qi) => {
        const n = q.dueByBucket[i];
        if (!n) return;
        const seg = el("div", { class: "seg", "data-queue": q.queue });
        seg.style.height = `${(100 * n) / max}%`;
        seg.style.background = queueColor(qi);
        bar.append(seg);
      });
      return bar;
    });
    $("histogram").replaceChildren(...bars);
    const total = totals.reduce((a, b) => a + b, 0);
    let summary = `${fmtNumber(total)} timer${total === 1 ? "" : "s"} due in the next ${totals.length * stats.bucketSeconds / 60} min`;
    if (total > 0) {
      const busiest = totals.indexOf(Math.max(...totals));
      summary += `; busiest minute +${busiest}: ${fmtNumber(totals[busiest])}`;
    }
    summary += `; already due: ${fmtNumber(stats.totals.due)}`;
    $("histogram-summary").textContent = summary;
    $("legend").replaceChildren(...stats.queues.map((q, qi) => {
      const swatch = el("span", { class: "swatch" });
      swatch.style.background = queueColor(qi);
      return el("span", {}, swatch, q.queue);
    }));
  }

  // Prometheus text exposition: [{name, labels, value}]
  function parsePrometheus(text) {
    const samples = [];
    for (const line of text.split("\n")) {
      if (!line || line.startsWith("#")) continue;
      const m = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/);
      if (!m) continue;
      const labels = {};
      for (const lm of (m[2] || "").matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g)) labels[lm[1]] = lm[2];
      samples.push({ name: m[1], labels, value: promNumber(m[3]) });
    }
    return samples;
  }

  function promNumber(s) {
    if (s === "+Inf") return Infinity;
    if (s === "-Inf") return -Infinity;
    return Number(s);
  }

  // histogram_quantile as Prometheus computes it: linear within the bucket.
  function quantile(q, buckets, count) {
    if (!count) return null;
    const rank = q * count;
    let prevLe = 0;
    let prevCount = 0;
    for (const b of buckets) {
      if (b.count >= rank) {
        if (b.le === Infinity) return prevLe;
        const inBucket = b.count - prevCount;
        return inBucket > 0 ? prevLe + ((b.le - prevLe) * (rank - prevCount)) / inBucket : b.le;
      }
      prevLe = b.le;
      prevCount = b.count;
    }
    return prevLe;
  }

  async function loadLag() {
    let samples;
    try {
      samples = parsePrometheus(await api("/metrics/prometheus"));
      panelError("panel-lag", null);
    } catch (e) {
      panelError("panel-lag", e);
      return;
    }
    const one = (name, labels) => {
      const s = samples.find((x) => x.name === name && Object.entries(labels || {}).every(([k, v]) => x.labels[k] === v));
      return s ? s.value : null;
    };
    const sum = (name) => samples.filter((x) => x.name === name).reduce((a, x) => a + x.value, 0);
    const base = "queen_timers_fire_lag_seconds";
    const buckets = samples.filter((x) => x.name === `${base}_bucket`)
      .map((x) => ({ le: promNumber(x.labels.le), count: x.value }))
      .sort((a, b) => a.le - b.le);
    const count = one(`${base}_count`) || 0;
    const total = one(`${base}_sum`) || 0;
    $("lag-count").textContent = fmtNumber(count);
    $("lag-mean").textContent = count ? fmtSeconds(total / count) : "–";
    for (const [id, q] of [["lag-p50", 0.5], ["lag-p95", 0.95], ["lag-p99", 0.99]]) {
      const v = quantile(q, buckets, count);
      $(id).textContent = v === null ? "–" : `≈ ${fmtSeconds(v)}`;
    }
    // the distribution, per bucket (not cumulative), up to the last non-empty one
    const rows = [];
    let prev = 0;
    const perBucket = buckets.map((b) => { const n = b.count - prev; prev = b.count; return { le: b.le, n }; });
    const last = perBucket.reduce((acc, b, i) => (b.n > 0 ? i : acc), -1);
    const maxN = Math.max(1, ...perBucket.map((b) => b.n));
    perBucket.slice(0, last + 1).forEach((b) => {
      const bar = el("span", { class: "lagbar" });
      bar.style.width = `${(100 * b.n) / maxN}%`;
      rows.push(el("span", { text: b.le === Infinity ? "more" : `≤ ${fmtLe(b.le)}` }), bar,
                el("span", { class: "num", text: fmtNumber(b.n) }));
    });
    $("lag-buckets").replaceChildren(...rows);
    $("fired-total").textContent = fmtNumber(one("queen_timers_fired_total", { outcome: "fired" }) || 0);
    $("fired-duplicate").textContent = fmtNumber(one("queen_timers_fired_total", { outcome: "duplicate" }) || 0);
    const failures = samples.filter((x) => x.name === "queen_timers_fire_failures_total");
    $("fire-failures").textContent = failures.map((x) => `${x.labels.class} ${fmtNumber(x.value)}`).join(" · ") || "0";
    $("dlq-moves").textContent = fmtNumber(sum("queen_timers_dlq_moves_total"));
    $("claims-lost").textContent = fmtNumber(sum("queen_timers_claims_lost_total"));
  }

  async function loadDlq() {
    let page;
    try {
      page = await api("/api/v1/dlq?limit=50");
      panelError("panel-dlq", null);
    } catch (e) {
      panelError("panel-dlq", e);
      $("dlq").querySelector("tbody").replaceChildren();
      $("dlq-total").textContent = "";
      return;
    }
    const rows = page.messages.map((m) => el("tr", { "data-dlq-id": m.dlqId },
      el("td", { class: "when", text: fmtTime(m.failedAt) }),
      el("td", { class: "queue", text: m.queue }),
      el("td", { text: m.partition }),
      el("td", { class: "mono txn", text: m.transactionId }),
      el("td", { text: m.consumerGroup }),
      el("td", { class: "num", text: m.retryCount }),
      el("td", { class: "error-text", text: m.errorMessage || "" })));
    $("dlq").querySelector("tbody").replaceChildren(...rows);
    $("dlq-total").textContent = page.total > rows.length ? `(newest ${rows.length} of ${fmtNumber(page.total)})` : `(${fmtNumber(page.total)})`;
    $("dlq-empty").hidden = rows.length > 0;
  }

  const SWITCHES = [
    { key: "fire", field: "firePaused", name: "Fire",
      what: "paused: no broker of the cell claims or fires a timer" },
    { key: "scheduling", field: "schedulingPaused", name: "Scheduling",
      what: "paused: POST /api/v1/timers answers 503 timers_disabled" },
  ];

  async function loadSwitches() {
    let status;
    try {
      status = await api("/api/v1/system/timers");
      panelError("panel-switches", null);
    } catch (e) {
      $("switches").replaceChildren();
      if (e.status === 403) {
        panelError("panel-switches", null);
        $("switches-note").hidden = false;
        $("switches-note").textContent = "The pause switches need an admin token of the cell's operator tenant "
          + "(QUEEN_OPERATOR_TENANT); this one is not.";
      } else {
        $("switches-note").hidden = true;
        panelError("panel-switches", e);
      }
      return;
    }
    $("switches-note").hidden = true;
    renderSwitches(status);
  }

  function renderSwitches(status) {
    $("switches").replaceChildren(...SWITCHES.map((s) => {
      const paused = status[s.field];
      const button = el("button", { id: `${s.key}-toggle`, type: "button",
                                    text: `${paused ? "Resume" : "Pause"} ${s.name.toLowerCase()}` });
      button.addEventListener("click", () => flip(s, !paused, button));
      return el("div", { class: "switch", id: `switch-${s.key}` },
        el("span", { class: "name", text: s.name }),
        el("span", { id: `${s.key}-state`, class: `state ${paused ? "paused" : "running"}`, text: paused ? "paused" : "running" }),
        button,
        el("span", { class: "what", text: s.what }));
    }));
  }

  async function flip(s, paused, button) {
    const verb = paused ? "Pause" : "Resume";
    if (!window.confirm(`${verb} ${s.name.toLowerCase()} for every broker of the cell?`)) return;
    button.disabled = true;
    try {
      const status = await api(`/api/v1/system/timers/${s.key}`, {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ paused }),
      });
      panelError("panel-switches", null);
      renderSwitches(status);
    } catch (e) {
      button.disabled = false;
      panelError("panel-switches", e);
    }
  }

  // ------------------------------------------------------------------ wiring

  function showWho() {
    const t = token();
    $("token").value = t;
    if (!t) {
      $("who").textContent = "no token";
      return;
    }
    const c = claimsOf(t);
    $("who").textContent = c ? `${c.role || "?"} · tenant ${c.tenant || "default"} · ${c.sub || ""}` : "token set";
  }

  // One refresh at a time; a refresh asked for meanwhile (a new token, a click)
  // runs right after, so what is shown was read with the current token.
  // body[data-started] / body[data-refreshes]: the sequence numbers of the last
  // refresh started / completed (what a test waits on).
  async function refreshAll() {
    if (refreshing) {
      queued = true;
      return;
    }
    const mine = ++sequence;
    document.body.dataset.started = String(mine);
    refreshing = Promise.all([loadHealth(), loadStats(), loadLag(), loadDlq(), loadSwitches()]);
    try {
      await refreshing;
      $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    } finally {
      refreshing = null;
      document.body.dataset.refreshes = String(mine);
      if (queued) {
        queued = false;
        refreshAll();
      }
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("auth").addEventListener("submit", (event) => {
      event.preventDefault();
      const value = $("token").value.trim();
      if (value) sessionStorage.setItem(TOKEN_KEY, value);
      else sessionStorage.removeItem(TOKEN_KEY);
      showWho();
      refreshAll();
    });
    $("token-clear").addEventListener("click", () => {
      sessionStorage.removeItem(TOKEN_KEY);
      showWho();
      refreshAll();
    });
    $("refresh").addEventListener("click", () => refreshAll());
    setInterval(() => { if ($("auto").checked) refreshAll(); }, REFRESH_MS);
    showWho();
    refreshAll();
  });
})();
