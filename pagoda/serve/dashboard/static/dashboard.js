// pagoda's live dashboard: reads /dashboard/events (one JSON snapshot a second) and draws
// tiles, SVG line charts, a tenant table and the last requests' timelines. No dependencies.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#2f6fde", "#e0733a", "#2f9e6a"];

const TILES = [
  ["running", "requests running", (s) => s.now.running],
  ["waiting", "requests waiting", (s) => s.now.waiting],
  ["rejected", "requests rejected", (s) => s.totals.requests_rejected,
   (s) => fmt(s.now.rejected_s) + " /s"],
  ["finished", "requests finished", (s) => s.totals.requests_finished],
  ["output_tok_s", "output tok/s", (s) => s.now.output_tok_s],
  ["generation_tokens", "tokens generated", (s) => s.totals.generation_tokens],
  ["ttft", "TTFT p50", (s) => s.now.ttft_p50, (s) => "p99 " + fmtSeconds(s.now.ttft_p99), "s"],
  ["itl", "ITL p50", (s) => s.now.itl_p50, (s) => "p99 " + fmtSeconds(s.now.itl_p99), "s"],
  ["queue", "queue time p50", (s) => s.now.queue_p50, (s) => "p99 " + fmtSeconds(s.now.queue_p99), "s"],
  ["kv_usage", "KV cache usage", (s) => s.now.kv_usage, null, "%"],
  ["prefix_hit_rate", "prefix-cache hit rate", (s) => s.totals.prefix_hit_rate, null, "%"],
  ["preemptions", "preemptions", (s) => s.totals.preemptions,
   (s) => fmt(s.totals.preemptions_window) + " in window"],
  ["spec_acceptance", "spec. acceptance", (s) => s.totals.spec_acceptance_rate, null, "%"],
  ["guard_blocks", "guardrail blocks", (s) => s.totals.guard_blocks,
   (s) => s.totals.guard_blocks == null ? "guardrails off"
     : fmt(s.totals.guard_redactions) + " redacted · " + fmt(s.totals.guard_flags) + " flagged"],
];

const CHARTS = [
  ["output_tok_s", "output tokens / s", [["output_tok_s", "tok/s"]]],
  ["requests", "requests", [["running", "running"], ["waiting", "waiting"], ["rejected_s", "rejected/s"]]],
  ["ttft", "time to first token (s, window)", [["ttft_p50", "p50"], ["ttft_p99", "p99"]]],
  ["itl", "inter-token latency (s, window)", [["itl_p50", "p50"], ["itl_p99", "p99"]]],
  ["queue", "queue time (s, window)", [["queue_p50", "p50"], ["queue_p99", "p99"]]],
  ["kv_usage", "KV cache usage", [["kv_usage", "used"]]],
];

function fmt(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (Math.abs(v) >= 1000) return Math.round(v).toLocaleString("en");
  if (Number.isInteger(v)) return String(v);
  return v.toFixed(Math.abs(v) >= 10 ? 1 : 2);
}
function fmtSeconds(v) {
  if (v === null || v === undefined) return "–";
  return v < 1 ? (v * 1000).toFixed(v < 0.01 ? 2 : 1) + " ms" : v.toFixed(2) + " s";
}
function fmtUnit(v, unit) {
  if (v === null || v === undefined) return "–";
  if (unit === "%") return (v * 100).toFixed(1) + "%";
  if (unit === "s") return fmtSeconds(v);
  return fmt(v);
}
function el(tag, attrs, parent, ns) {
  const node = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "text") node.textContent = v; else node.setAttribute(k, v);
  }
  if (parent) parent.appendChild(node);
  return node;
}

function buildTiles() {
  const root = document.getElementById("tiles");
  for (const [id, label] of TILES) {
    const tile = el("div", {class: "tile", id: "tile-" + id}, root);
    el("div", {class: "label", text: label}, tile);
    el("div", {class: "value", text: "–"}, tile);
    el("div", {class: "sub", text: "\u00a0"}, tile);
  }
}
function buildCharts() {
  const root = document.getElementById("charts");
  for (const [id, title, series] of CHARTS) {
    const box = el("div", {class: "chart", id: "chart-" + id}, root);
    el("h3", {text: title}, box);
    el("svg", {viewBox: "0 0 400 120", preserveAspectRatio: "none", "data-points": "0"}, box, SVG);
    const legend = el("div", {class: "legend"}, box);
    series.forEach(([, name], i) => {
      el("i", {style: "background:" + COLORS[i]}, legend);
      legend.appendChild(document.createTextNode(name));
    });
  }
}

function drawChart(id, series, history) {
  const svg = document.querySelector("#chart-" + id + " svg");
  svg.replaceChildren();
  const W = 400, H = 120, left = 34, bottom = 12;
  let max = 0;
  for (const [key] of series) for (const p of history) if (p[key] != null) max = Math.max(max, p[key]);
  max = max > 0 ? max * 1.1 : 1;
  for (const f of [0, 0.5, 1]) {
    const y = (H - bottom) * (1 - f) + 0.5;
    el("line", {x1: left, x2: W, y1: y, y2: y, class: "grid"}, svg, SVG);
    el("text", {x: 2, y: Math.max(9, y + 3), class: "axis", text: fmt(max * f)}, svg, SVG);
  }
  const n = history.length;
  const x = (i) => left + (W - left) * (n <= 1 ? 1 : i / (n - 1));
  const y = (v) => (H - bottom) * (1 - v / max);
  series.forEach(([key], s) => {
    let d = "";
    history.forEach((p, i) => {
      if (p[key] == null) return;
      d += (d ? "L" : "M") + x(i).toFixed(1) + "," + y(p[key]).toFixed(1);
    });
    if (d) el("path", {d, fill: "none", stroke: COLORS[s], "stroke-width": 1.6,
                       "vector-effect": "non-scaling-stroke"}, svg, SVG);
  });
  if (n > 1) {
    const span = Math.round(history[n - 1].t - history[0].t);
    el("text", {x: left, y: H - 1, class: "axis", text: "-" + span + " s"}, svg, SVG);
  }
  svg.setAttribute("data-points", String(n));
}

function drawTiles(snap) {
  for (const [id, , value, sub, unit] of TILES) {
    const tile = document.getElementById("tile-" + id);
    const v = value(snap);
    tile.dataset.value = v === null || v === undefined ? "" : String(v);
    tile.querySelector(".value").textContent = fmtUnit(v, unit);
    tile.querySelector(".sub").textContent = sub ? sub(snap) : "\u00a0";
  }
}

function drawTenants(snap) {
  const body = document.querySelector("#tenants tbody");
  body.replaceChildren();
  document.getElementById("tenants-window").textContent = "last " + snap.window_s + " s";
  for (const [name, t] of Object.entries(snap.tenants)) {
    const row = el("tr", {"data-tenant": name}, body);
    // The window's cost in USD ("–" without a --price-table).
    const cost = t.cost_usd === null || t.cost_usd === undefined ? "–" : "$" + t.cost_usd.toFixed(4);
    for (const v of [name, fmt(t.requests_per_s), fmt(t.tokens_per_s), fmt(t.output_tokens_per_s),
                     t.requests, t.rejected, cost]) el("td", {text: String(v)}, row);
  }
}

function drawTimelines(snap) {
  const root = document.getElementById("timelines");
  root.replaceChildren();
  const longest = Math.max(1e-3, ...snap.requests.map((r) => r.queue_s + r.prefill_s + r.decode_s));
  for (const r of snap.requests) {
    const row = el("div", {class: "timeline" + (r.status >= 400 ? " failed" : ""),
                           "data-request": r.id}, root);
    el("div", {class: "id", title: r.id, text: (r.tenant || "-") + " · " + r.id}, row);
    const bar = el("div", {class: "bar"}, row);
    for (const part of ["queue", "prefill", "decode"]) {
      const seconds = r[part + "_s"];
      el("span", {class: part, title: part + " " + fmtSeconds(seconds),
                  style: "width:" + (100 * seconds / longest).toFixed(2) + "%"}, bar);
    }
    const total = r.queue_s + r.prefill_s + r.decode_s;
    el("div", {text: fmtSeconds(total) + " · " + r.prompt_tokens + "→" + r.output_tokens +
                     " tok" + (r.status >= 400 ? " · " + r.status : "")}, row);
  }
}

function drawDiagnosis(snap) {
  const root = document.getElementById("diagnosis");
  root.replaceChildren();
  const findings = snap.diagnosis || [];
  if (!findings.length) el("div", {class: "muted", text: "nothing found in this window"}, root);
  for (const f of findings) {
    const item = el("details", {class: "finding " + f.severity, "data-finding": f.id}, root);
    el("summary", {text: f.severity + " · " + f.title}, item);
    const evidence = Object.entries(f.evidence).filter(([, v]) => v !== null)
      .map(([k, v]) => k + " = " + (typeof v === "number" ? fmt(v) : typeof v === "object" ? JSON.stringify(v) : String(v)));
    el("div", {class: "evidence", text: evidence.join(" · ")}, item);
    const checks = el("ul", {}, item);
    for (const check of f.next_checks) el("li", {text: check}, checks);
  }
}

// One row per MoE layer: a cell per expert shaded by its tokens relative to the layer's busiest
// expert (over the window when tokens were routed in it, else since the server started), then the
// imbalance figures (max / mean; 1 is even).
function drawExperts(snap) {
  const panel = document.getElementById("moe-panel");
  panel.hidden = !snap.moe;
  if (!snap.moe) return;
  const root = document.getElementById("moe");
  root.replaceChildren();
  for (const layer of snap.moe) {
    const inWindow = layer.window_tokens && layer.window_tokens.some((t) => t > 0);
    const counts = inWindow ? layer.window_tokens : layer.expert_tokens;
    const row = el("div", {class: "moe-layer", "data-layer": String(layer.layer),
                           "data-span": inWindow ? "window" : "total"}, root);
    el("div", {class: "id", text: "layer " + layer.layer}, row);
    const strip = el("div", {class: "strip"}, row);
    const busiest = Math.max(1e-9, ...counts);
    counts.forEach((tokens, expert) => {
      el("span", {title: "expert " + expert + ": " + fmt(tokens) + " tokens" + (inWindow ? " in the window" : " since start"),
                  style: "opacity:" + (0.08 + 0.92 * tokens / busiest).toFixed(3)}, strip);
    });
    const rank = layer.rank_imbalance == null ? "" : " · ranks " + fmt(layer.rank_imbalance);
    el("div", {text: (inWindow ? "window " + fmt(layer.window_imbalance) : "since start") + " · last step " +
                     fmt(layer.expert_imbalance) + rank}, row);
  }
}

function render(snap) {
  drawTiles(snap);
  drawDiagnosis(snap);
  for (const [id, , series] of CHARTS) drawChart(id, series, snap.history);
  drawExperts(snap);
  drawTenants(snap);
  drawTimelines(snap);
  document.getElementById("scope").textContent =
    snap.scope === "all" ? "all tenants" : "tenant: " + snap.scope.join(", ");
  document.body.dataset.snapshots = String(Number(document.body.dataset.snapshots || 0) + 1);
}

function setStatus(state, text) {
  const status = document.getElementById("status");
  status.dataset.state = state;
  status.textContent = text;
}

// The key: #key= (a fragment never reaches the server) or ?key= once, then dropped from the
// address bar and kept in this tab's sessionStorage; else the one typed in the form. It is sent
// only as an Authorization header.
function takeKey() {
  const url = new URL(location.href);
  const fromHash = new URLSearchParams(url.hash.slice(1)).get("key");
  const fromUrl = fromHash || url.searchParams.get("key");
  if (fromUrl) {
    sessionStorage.setItem("pagoda-key", fromUrl);
    url.searchParams.delete("key");
    history.replaceState(null, "", url.pathname + url.search);
  }
  return sessionStorage.getItem("pagoda-key") || "";
}

async function stream() {
  const key = takeKey();
  const headers = key ? {Authorization: "Bearer " + key} : {};
  const response = await fetch("/dashboard/events", {headers, cache: "no-store"});
  if (response.status === 401) {
    document.getElementById("key-form").hidden = false;
    setStatus("error", key ? "invalid key" : "API key needed");
    return false;
  }
  if (!response.ok) throw new Error("HTTP " + response.status);
  document.getElementById("key-form").hidden = true;
  setStatus("live", "live");
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) throw new Error("stream ended");
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (event.startsWith("data: ")) render(JSON.parse(event.slice(6)));
    }
  }
}

async function connect() {
  try {
    if (await stream() === false) return;  // waits for a key from the form
  } catch (err) {
    setStatus("error", "reconnecting (" + err.message + ")");
  }
  setTimeout(connect, 2000);
}

document.getElementById("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("pagoda-key", document.getElementById("key-input").value);
  connect();
});
buildTiles();
buildCharts();
connect();
