// kvroute's dashboard: polls GET v1/dashboard every second, keeps the history in the page
// and draws it. No library, nothing fetched from anywhere but this server.
"use strict";

const POLL_MS = 1000;
const HISTORY = 300;            // samples kept: five minutes at one a second
const TOKEN_KEY = "kvroute-api-token";

const history = [];             // {t, rate, latency, events, predicted, actual, inflight, gaps}
let previous = null;            // the last answer, for differences
let since = null;               // routed counts per worker when the page opened
let token = sessionStorage.getItem(TOKEN_KEY) || "";

const $ = (id) => document.getElementById(id);

function workersOf(snapshot) {
  const out = [];
  for (const instance of snapshot.instances) {
    for (const worker of instance.workers) out.push({instance, worker, key: `${instance.id}#${worker.dp_rank}`});
  }
  return out;
}

function totals(snapshot) {
  const sum = {events: 0, predicted: 0, actual: 0, inflight: 0, gaps: 0, replays: 0};
  for (const {worker} of workersOf(snapshot)) {
    sum.events += worker.stats.events;
    sum.gaps += worker.stats.gaps;
    sum.replays += worker.stats.replays;
    sum.predicted += worker.hits.predicted;
    sum.actual += worker.hits.actual;
    sum.inflight += worker.inflight;
  }
  return sum;
}

// One sample of the charts from two answers; counters that went back (a worker removed)
// give no negative rate.
function sample(now, before) {
  const a = totals(now), b = totals(before);
  const dt = Math.max(now.time - before.time, 1e-3);
  const rate = (x, y) => Math.max(x - y, 0) / dt;
  const decisions = now.routes.decisions - before.routes.decisions;
  return {
    t: now.time,
    rate: Math.max(now.routes.routed - before.routes.routed, 0) / dt,
    latency: decisions > 0 ? 1000 * (now.routes.seconds - before.routes.seconds) / decisions : null,
    events: rate(a.events, b.events),
    predicted: rate(a.predicted, b.predicted),
    actual: rate(a.actual, b.actual),
    inflight: a.inflight,
    gaps: Math.max(a.gaps - b.gaps, 0) + Math.max(a.replays - b.replays, 0),
  };
}

function fmt(value, digits = 1) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (Math.abs(value) >= 1e6) return (value / 1e6).toFixed(digits) + "M";
  if (Math.abs(value) >= 1e4) return (value / 1e3).toFixed(digits) + "k";
  return Number.isInteger(value) ? String(value) : value.toFixed(digits);
}

// A small time-series chart: one line per series (`width` px), a shared y axis from 0. The
// x axis spans the history seen so far (at least a minute, at most HISTORY samples).
function drawChart(canvas, series) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
  if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const styles = getComputedStyle(document.documentElement);
  let top = 0, points = 0, span = 60;
  for (const s of series) {
    span = Math.max(span, s.values.length);
    for (const v of s.values) if (v !== null) { top = Math.max(top, v); points++; }
  }
  top = top > 0 ? top * 1.1 : 1;
  const left = 38, upper = 8, bottom = height - 14;
  const yOf = (v) => bottom - (v / top) * (bottom - upper);
  ctx.strokeStyle = styles.getPropertyValue("--line");
  ctx.fillStyle = styles.getPropertyValue("--muted");
  ctx.font = "10px system-ui, sans-serif";
  ctx.lineWidth = 1;
  for (const fraction of [0, 0.5, 1]) {
    const y = yOf(top * fraction);
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(width, y); ctx.stroke();
    ctx.fillText(fmt(top * fraction, top < 10 ? 1 : 0), 2, y + 3);
  }
  ctx.fillText(span >= 120 ? `${Math.round(span / 60)} min` : `${span} s`, left, height - 2);
  const step = (width - left) / (span - 1);
  for (const s of series) {
    ctx.strokeStyle = styles.getPropertyValue(s.color);
    ctx.lineWidth = s.width || 1.6;
    ctx.beginPath();
    let drawing = false;
    const offset = span - s.values.length;
    s.values.forEach((v, i) => {
      if (v === null) { drawing = false; return; }
      const x = left + (offset + i) * step, y = yOf(v);
      if (drawing) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      drawing = true;
    });
    ctx.stroke();
  }
  canvas.dataset.points = String(points);
}

function drawCharts() {
  const pick = (name) => history.map((h) => h[name]);
  drawChart($("chart-rate"), [{values: pick("rate"), color: "--a"}]);
  drawChart($("chart-latency"), [{values: pick("latency"), color: "--a"}]);
  drawChart($("chart-events"), [{values: pick("events"), color: "--a"}]);
  // Predicted wide underneath, actual on top: where they agree both stay visible.
  drawChart($("chart-hits"), [{values: pick("predicted"), color: "--a", width: 4},
                              {values: pick("actual"), color: "--b", width: 1.6}]);
  drawChart($("chart-inflight"), [{values: pick("inflight"), color: "--a"}]);
  drawChart($("chart-gaps"), [{values: pick("gaps"), color: "--down"}]);
  const last = history[history.length - 1];
  if (!last) return;
  $("now-rate").textContent = `${fmt(last.rate)}/s`;
  $("now-latency").textContent = last.latency === null ? "–" : `${fmt(last.latency, 2)} ms`;
  $("now-events").textContent = `${fmt(last.events)}/s`;
  $("now-hits").textContent = `${fmt(last.predicted, 0)} / ${fmt(last.actual, 0)} tok/s`;
  $("now-inflight").textContent = fmt(last.inflight);
  $("now-gaps").textContent = fmt(last.gaps);
}

function cell(row, text, className) {
  const td = document.createElement("td");
  if (className) td.className = className;
  if (text instanceof Node) td.append(text); else td.textContent = text;
  row.append(td);
  return td;
}

function badge(state) {
  const span = document.createElement("span");
  span.className = state;
  span.textContent = state;
  return span;
}

function renderTable(snapshot) {
  const body = $("instances");
  const rows = [];
  const dt = previous ? Math.max(snapshot.time - previous.time, 1e-3) : null;
  const before = new Map(previous ? workersOf(previous).map((w) => [w.key, w.worker]) : []);
  const all = workersOf(snapshot);
  const routedNow = all.reduce((n, {key, worker}) => n + worker.routed - (since.get(key) ?? 0), 0);
  const routedAll = all.reduce((n, {worker}) => n + worker.routed, 0);
  for (const {instance, worker, key} of all) {
    const row = document.createElement("tr");
    row.className = "worker" + (worker.dp_rank === instance.workers[0].dp_rank ? " first-rank" : "");
    row.dataset.instance = instance.id;
    row.dataset.state = worker.state;
    const name = document.createElement("span");
    name.className = "instance";
    name.textContent = instance.id;
    const where = document.createElement("span");
    where.className = "url";
    where.textContent = `${instance.url ?? "events only"} · ${instance.models.join(", ") || "no model yet"}`;
    const first = document.createElement("div");
    first.append(name, where);
    cell(row, first);
    cell(row, String(worker.dp_rank));
    cell(row, badge(worker.state), "state");
    cell(row, fmt(worker.holdings.GPU));
    cell(row, fmt(worker.holdings.CPU));
    cell(row, fmt(worker.holdings.STORAGE));
    cell(row, fmt(worker.unconfirmed_blocks));
    const old = before.get(key);
    cell(row, old && dt ? fmt(Math.max(worker.stats.events - old.stats.events, 0) / dt) : "–");
    cell(row, fmt(worker.stats.gaps));
    cell(row, fmt(worker.stats.replays));
    cell(row, `${worker.inflight}` + (worker.queued_prefill ? ` (${fmt(worker.queued_prefill)} tok)` : ""));
    cell(row, worker.running === null ? "–" : `${fmt(worker.running, 0)} / ${fmt(worker.waiting, 0)}`);
    cell(row, worker.kv_usage === null ? "–" : `${(100 * worker.kv_usage).toFixed(0)}%`);
    const share = routedNow ? (worker.routed - (since.get(key) ?? 0)) / routedNow : 0;
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.width = `${Math.round(share * 60)}px`;
    const shareCell = cell(row, bar);
    shareCell.append(routedNow ? `${(100 * share).toFixed(0)}%` : "–");
    cell(row, routedAll ? `${(100 * worker.routed / routedAll).toFixed(0)}% (${fmt(worker.routed)})` : "–");
    const hits = worker.hits;
    cell(row, hits.requests ? `${hits.exact}/${hits.requests}` + (hits.unavailable ? ` +${hits.unavailable} n/a` : "")
                            : (hits.unavailable ? `${hits.unavailable} n/a` : "–"));
    cell(row, hits.requests ? `${fmt(hits.predicted)} / ${fmt(hits.actual)}` : "–");
    rows.push(row);
  }
  body.replaceChildren(...rows);
  $("empty").hidden = all.length > 0;
}

function renderHeader(snapshot) {
  const ready = $("ready");
  ready.textContent = snapshot.ready ? "ready" : "not ready";
  ready.className = "badge " + (snapshot.ready ? "live" : "degraded");
  ready.title = snapshot.ready_reason;
  const workers = workersOf(snapshot);
  const live = workers.filter(({worker}) => worker.state === "live").length;
  const r = snapshot.routes;
  $("summary").textContent =
    `${snapshot.instances.length} instances, ${live}/${workers.length} workers live · ` +
    `${fmt(snapshot.index_nodes)} blocks indexed (${fmt(snapshot.index_bytes / 1048576)} MiB) · ` +
    `${fmt(r.routed)} routed, p50 ${fmt(r.recent_p50_ms, 2)} ms, p99 ${fmt(r.recent_p99_ms, 2)} ms · ` +
    (snapshot.proxy ? "proxy" : "route answers only") +
    ` · up ${fmt(snapshot.uptime_seconds / 60, 0)} min`;
  $("updated").textContent = new Date(snapshot.time * 1000).toLocaleTimeString();
}

function show(snapshot) {
  if (since === null) since = new Map(workersOf(snapshot).map((w) => [w.key, w.worker.routed]));
  if (previous) {
    history.push(sample(snapshot, previous));
    if (history.length > HISTORY) history.shift();
  }
  renderHeader(snapshot);
  renderTable(snapshot);
  previous = snapshot;
  drawCharts();
}

async function poll() {
  try {
    const headers = token ? {Authorization: `Bearer ${token}`} : {};
    const answer = await fetch("v1/dashboard", {headers, cache: "no-store"});
    if (answer.status === 401) {
      $("login").hidden = false;
      $("login-error").textContent = token ? "that token was refused" : "";
      $("ready").textContent = "token needed";
      return;
    }
    if (!answer.ok) throw new Error(`GET v1/dashboard answered ${answer.status}`);
    $("login").hidden = true;
    show(await answer.json());
  } catch (error) {
    $("ready").textContent = "unreachable";
    $("ready").className = "badge down";
    $("ready").title = String(error);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  token = $("token").value.trim();
  sessionStorage.setItem(TOKEN_KEY, token);
});
window.addEventListener("resize", drawCharts);
poll();
