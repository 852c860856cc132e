"""The live status page served at `/`: one HTML document, no build step, no external assets.

It reads `GET /v1/events` (server-sent events) through `fetch`, so it can send the API key
as a header (EventSource cannot); if the stream breaks it polls `GET /v1/status` until the
stream comes back. When the server has a key, the page asks for it once and keeps it in
sessionStorage (this tab only). The page itself holds no data, so it is served without a key.
"""

from __future__ import annotations

import base64
import hashlib
import re

STATUS_PAGE_HTML = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>omni-core status</title>
<link rel="icon" href="@ICON@">
<style>
  :root { font-family: system-ui, sans-serif; font-size: 14px; color: #1b1f24; background: #f6f8fa; }
  body { margin: 0 auto; max-width: 1200px; padding: 16px; }
  header { display: flex; align-items: baseline; gap: 16px; }
  h1 { font-size: 20px; margin: 0; }
  #conn { padding: 2px 8px; border-radius: 10px; background: #ddd; }
  #conn.live { background: #c9f2d4; } #conn.polling { background: #fff1b8; } #conn.down { background: #ffd2d2; }
  #auth { display: none; margin: 12px 0; } #auth.shown { display: block; }
  .stage { background: #fff; border: 1px solid #d0d7de; border-radius: 8px; margin: 12px 0; padding: 12px; }
  .stage h2 { font-size: 16px; margin: 0 0 8px 0; display: flex; gap: 12px; align-items: baseline; }
  .state { font-weight: 600; padding: 1px 8px; border-radius: 8px; background: #eee; }
  .state.RUNNING { background: #c9f2d4; } .state.SLEEPING { background: #d6e4ff; }
  .state.PAUSED { background: #d3f0ee; }
  .state.PARTIAL { background: #e6dcff; } .state.NEEDS_RELOAD { background: #ffe7c2; }
  .state.FAILED { background: #ffd2d2; } .state.DRAINING, .state.TRANSITIONING, .state.WAKING { background: #fff1b8; }
  .meta { color: #57606a; font-size: 12px; }
  table { border-collapse: collapse; width: 100%; margin-top: 6px; }
  th, td { text-align: left; padding: 3px 8px; border-bottom: 1px solid #eaeef2; font-variant-numeric: tabular-nums; }
  .strip { width: 100%; height: 14px; margin-top: 8px; display: block; }
  #events { list-style: none; padding: 0; margin: 0; font-family: ui-monospace, monospace; font-size: 12px; }
  #events li { padding: 2px 0; border-bottom: 1px solid #eaeef2; }
  #events .ok { color: #1a7f37; } #events .bad { color: #cf222e; } #events .mistake { color: #9a6700; }
  #banner { background: #ffd2d2; border: 1px solid #cf222e; border-radius: 8px; margin: 12px 0; padding: 8px 12px; }
  #banner div { font-weight: 600; }
  .failure { color: #cf222e; }
  .events-title { font-size: 16px; }
  .legend { list-style: none; padding: 0; margin: 8px 0; display: flex; flex-wrap: wrap; gap: 4px 14px; }
  .legend li { display: flex; align-items: center; gap: 5px; font-size: 12px; color: #57606a; }
  .legend svg { width: 12px; height: 12px; }
  #memory { background: #fff; border: 1px solid #d0d7de; border-radius: 8px; margin: 12px 0; padding: 12px; }
  #memory h2 { font-size: 16px; margin: 0 0 4px 0; }
  #memory-chart { width: 100%; height: 220px; display: block; }
  #memory-chart text { font-size: 11px; fill: #57606a; }
  #memory-chart .grid { stroke: #eaeef2; }
  /* A phone-wide window: headings wrap, a wide table scrolls inside its own box. */
  @media (max-width: 600px) {
    body { padding: 8px; }
    header, .stage h2 { flex-wrap: wrap; }
    table { display: block; overflow-x: auto; }
    #events li { overflow-wrap: anywhere; }
  }
</style>
</head>
<body>
<header>
  <h1>omni-core</h1>
  <span id="conn" class="down">connecting</span>
  <span class="meta" id="updated"></span>
</header>
<div id="banner" hidden></div>
<div id="auth">
  <label>API key <input id="key" type="password" autocomplete="off"></label>
  <button id="key-save">connect</button>
  <span class="meta">this server needs a key; it stays in this tab only</span>
</div>
<section id="memory">
  <h2>Device memory, last 5 minutes</h2>
  <svg id="memory-chart" viewBox="0 0 1000 220" preserveAspectRatio="none"></svg>
  <ul class="legend" id="memory-legend"></ul>
  <div class="meta">each stage's pools over all its ranks, as its lifecycle reports left them (nothing is measured
    before a stage's first sleep or wake through this server)</div>
</section>
<ul class="legend" id="state-legend"></ul>
<main id="stages"></main>
<h2 class="events-title">Recent lifecycle events</h2>
<ol id="events"></ol>
<script>
"use strict";
const STATE_COLORS = {RUNNING: "#2da44e", PAUSED: "#1b998b",
  SLEEPING: "#4f7df0", PARTIAL: "#8250df", NEEDS_RELOAD: "#d4a72c",
  FAILED: "#cf222e", DRAINING: "#e3b341", TRANSITIONING: "#e3b341", WAKING: "#e3b341", STARTING: "#8c959f",
  STOPPED: "#57606a", UNKNOWN: "#d0d7de"};
const STRIP_SPAN_MS = 5 * 60 * 1000;  // the state strips and the memory chart show the last five minutes
const SERIES_COLORS = ["#0969da", "#bf3989", "#1a7f37", "#9a6700", "#8250df", "#cf222e", "#1b7c83", "#57606a"];
// The memory chart's plot area inside its 1000 x 220 viewBox: room left for byte labels, below for times.
const PLOT = {left: 80, right: 990, top: 10, bottom: 190};
let lastSnapshot = null;
const history = {};                   // stage -> [[time_ms, state], ...]
const seenEvents = new Set();
let key = sessionStorage.getItem("omni-core-key") || "";

function headers() { return key ? {"Authorization": "Bearer " + key} : {}; }
function fmtBytes(n) {
  if (n === null || n === undefined) return "-";
  const units = [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
  for (const [u, s] of units) if (Math.abs(n) >= s) return (n / s).toFixed(1) + " " + u;
  return n + " B";
}
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else if (k.startsWith("data-")) node.setAttribute(k, v); else node[k] = v;
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}
function setConn(kind, text) { const c = document.getElementById("conn"); c.className = kind; c.textContent = text; }

function renderStrip(name) {
  const svgNS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(svgNS, "svg");
  svg.setAttribute("class", "strip"); svg.setAttribute("viewBox", "0 0 1000 14");
  svg.setAttribute("preserveAspectRatio", "none");
  const now = Date.now(), points = history[name] || [];
  for (let i = 0; i < points.length; i++) {
    const start = Math.max(points[i][0], now - STRIP_SPAN_MS), end = i + 1 < points.length ? points[i + 1][0] : now;
    if (end <= now - STRIP_SPAN_MS) continue;
    const rect = document.createElementNS(svgNS, "rect");
    rect.setAttribute("x", ((start - (now - STRIP_SPAN_MS)) / STRIP_SPAN_MS * 1000).toFixed(1));
    rect.setAttribute("width", Math.max(1, (end - start) / STRIP_SPAN_MS * 1000).toFixed(1));
    rect.setAttribute("y", "0"); rect.setAttribute("height", "14");
    rect.setAttribute("fill", STATE_COLORS[points[i][1]] || "#999");
    const title = document.createElementNS(svgNS, "title");
    title.textContent = points[i][1] + " from " + new Date(points[i][0]).toLocaleTimeString();
    rect.append(title); svg.append(rect);
  }
  return svg;
}

function swatch(color) {
  const svgNS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(svgNS, "svg");
  svg.setAttribute("viewBox", "0 0 12 12");
  const rect = document.createElementNS(svgNS, "rect");
  rect.setAttribute("width", "12"); rect.setAttribute("height", "12"); rect.setAttribute("rx", "2");
  rect.setAttribute("fill", color);
  svg.append(rect);
  return svg;
}

function renderStateLegend() {
  const legend = document.getElementById("state-legend");
  legend.replaceChildren(el("li", {}, "state strips, last 5 minutes:"),
    ...Object.entries(STATE_COLORS).map(([state, color]) => el("li", {"data-state": state}, swatch(color), state)));
}

function svgEl(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}

function renderMemoryChart(snap) {
  // Each stage's device memory as a step line: a value holds from its sample until the next.
  const chart = document.getElementById("memory-chart");
  const now = Date.now(), start = now - STRIP_SPAN_MS;
  const history = snap.memory_history || {};
  const stages = Object.values(snap.stages || {});
  let top = 0;
  for (const points of Object.values(history)) {
    for (const [, bytes] of points) if (bytes !== null) top = Math.max(top, bytes);
  }
  const x = t => PLOT.left + (Math.max(t, start) - start) / STRIP_SPAN_MS * (PLOT.right - PLOT.left);
  const y = b => PLOT.bottom - (top ? b / top : 0) * (PLOT.bottom - PLOT.top);
  const parts = [];
  for (const frac of [0, 0.5, 1]) {  // the byte axis: 0, half and the highest value shown
    parts.push(svgEl("line", {"class": "grid", x1: PLOT.left, x2: PLOT.right, y1: y(frac * top), y2: y(frac * top)}));
    const label = svgEl("text", {"class": "y-tick", x: PLOT.left - 6, y: y(frac * top) + 4, "text-anchor": "end",
      "data-bytes": Math.round(frac * top)});
    label.textContent = fmtBytes(Math.round(frac * top));
    parts.push(label);
  }
  for (let i = 0; i <= 5; i++) {  // the time axis: one tick a minute, now at the right
    const t = start + i * STRIP_SPAN_MS / 5;
    parts.push(svgEl("line", {"class": "grid", x1: x(t), x2: x(t), y1: PLOT.top, y2: PLOT.bottom}));
    const label = svgEl("text", {"class": "x-tick", x: x(t), y: PLOT.bottom + 18, "data-time": Math.round(t),
      "text-anchor": i === 0 ? "start" : i === 5 ? "end" : "middle"});
    label.textContent = new Date(t).toLocaleTimeString();
    parts.push(label);
  }
  const legend = [];
  for (const st of stages) {
    const color = SERIES_COLORS[st.stage_id % SERIES_COLORS.length];
    const points = (history[st.name] || []).map(([t, bytes]) => [t * 1000, bytes]);
    let current = null, path = "";
    for (let i = 0; i < points.length; i++) {
      const [t, bytes] = points[i], end = i + 1 < points.length ? points[i + 1][0] : now;
      current = bytes;
      if (bytes === null || end <= start) continue;  // unknown (restarted), or before the window
      path += "M" + x(t).toFixed(1) + " " + y(bytes).toFixed(1) + "H" + x(end).toFixed(1);
      if (i + 1 < points.length && points[i + 1][1] !== null) path += "V" + y(points[i + 1][1]).toFixed(1);
    }
    if (path) {
      const line = svgEl("path", {"class": "series", d: path, fill: "none", stroke: color, "stroke-width": 2,
        "data-stage": st.name, "data-bytes": current === null ? "" : current});
      const title = svgEl("title", {}); title.textContent = st.name; line.append(title);
      parts.push(line);
    }
    legend.push(el("li", {"data-stage": st.name}, swatch(color),
      st.name + " " + (current === null ? "not measured yet" : fmtBytes(current))));
  }
  chart.replaceChildren(...parts);
  document.getElementById("memory-legend").replaceChildren(...legend);
}

let seeded = false;
function seedHistory(snap) {
  // The strip starts with the server's recent events, not empty at the moment the page opened.
  for (const ev of [...(snap.events || [])].sort((a, b) => a.time - b.time)) {
    if (!ev.state || ev.time * 1000 < Date.now() - STRIP_SPAN_MS) continue;
    const h = history[ev.stage] || (history[ev.stage] = []);
    if (!h.length || h[h.length - 1][1] !== ev.state) h.push([ev.time * 1000, ev.state]);
  }
}

function renderStatus(snap) {
  lastSnapshot = snap;
  renderMemoryChart(snap);
  const main = document.getElementById("stages");
  const now = Date.now();
  if (!seeded) { seedHistory(snap); seeded = true; }
  main.replaceChildren();
  for (const st of Object.values(snap.stages || {})) {
    const h = history[st.name] || (history[st.name] = []);
    if (!h.length || h[h.length - 1][1] !== st.state) h.push([now, st.state]);
    while (h.length > 1 && h[1][0] < now - STRIP_SPAN_MS) h.shift();
    const tags = st.tags || [];
    const rows = Object.entries(st.ranks || {}).map(([rank, r]) => el("tr", {"data-rank": rank},
      el("td", {}, rank), el("td", {}, r.pid ?? "-"), el("td", {}, r.alive ? "alive" : "gone"),
      el("td", {"class": "rank-state"}, r.state),
      ...tags.map(t => el("td", {"data-tag": t}, fmtBytes((r.pool_bytes || {})[t]))),
      el("td", {}, fmtBytes(r.process_bytes) + (r.process_bytes_source && r.process_bytes_source !== "none"
        ? " (" + r.process_bytes_source + ")" : "")),
      el("td", {}, fmtBytes(r.rss_bytes)), el("td", {}, fmtBytes(r.host_offloaded_bytes))));
    const table = el("table", {},
      el("thead", {}, el("tr", {}, el("th", {}, "rank"), el("th", {}, "pid"), el("th", {}, "process"),
        el("th", {}, "worker state"), ...tags.map(t => el("th", {}, t)), el("th", {}, "device memory"),
        el("th", {}, "host RSS"), el("th", {}, "host offloaded"))),
      el("tbody", {}, ...rows));
    const section = el("section", {"class": "stage", "data-stage": st.name},
      el("h2", {}, el("span", {}, st.name), el("span", {"class": "state " + st.state, "data-field": "state"}, st.state),
        el("span", {"class": "meta"}, "id " + st.stage_id + " · epoch " + st.epoch + " · " + st.runner + " on " +
          st.device + "/" + st.backend + " · admission " + st.admission + " · queued " + st.queued +
          " · in flight " + st.in_flight + " · weights v" + st.weights_version +
          " · host offloaded " + fmtBytes(st.host_offloaded_bytes) +
          (st.last_sleep_level ? " · last sleep L" + st.last_sleep_level : ""))),
      st.failure ? el("div", {"class": "failure"}, st.failure) : "",
      renderStrip(st.name), table, renderCounters(st.runner_counters || {}), renderAdapters(st.adapters || []));
    main.append(section);
  }
  renderBanner(Object.values(snap.stages || {}));
  for (const ev of snap.events || []) addEvent(ev);
  document.getElementById("updated").textContent = "updated " + new Date((snap.time || 0) * 1000).toLocaleTimeString();
}

function renderBanner(stages) {
  // A stage that needs the operator (FAILED, STOPPED) is said at the top, with its restart.
  const down = stages.filter(st => st.state === "FAILED" || st.state === "STOPPED");
  const banner = document.getElementById("banner");
  banner.hidden = down.length === 0;
  banner.replaceChildren(...down.map(st => el("div", {"data-stage": st.name},
    "stage " + st.name + " is " + st.state + ": " + (st.failure || "no reason recorded") +
    " (restart it: omni-core restart " + st.name + ", or POST /v1/stages/" + st.name + "/restart)")));
}

// Outcomes of a caller's mistake (the call was refused, nothing broke), apart from failures.
const MISTAKES = new Set(["invalid", "forbidden", "unknown_stage", "conflict", "rejected"]);

function renderCounters(counters) {
  // The runner's own counters (a prompt cache's hits, misses), summed over the ranks.
  const entries = Object.entries(counters);
  return entries.length ? el("div", {"class": "meta", "data-field": "runner_counters"},
    "runner counters: " + entries.map(([name, value]) => name + " " + value).join(" · ")) : "";
}

function renderAdapters(adapters) {
  // The stage's LoRA adapters (P-20) as its rank 0 listed them last, with where each is now.
  if (!adapters.length) return "";
  const rows = adapters.map(a => el("tr", {"data-adapter": a.name},
    el("td", {}, a.name), el("td", {"data-col": "version"}, "v" + a.version),
    el("td", {"data-col": "base_version"}, "v" + a.base_version),
    el("td", {"data-col": "pinned"}, a.pinned ? "pinned" : "-"),
    el("td", {"data-col": "residency"}, a.residency)));
  return el("table", {"data-field": "adapters"},
    el("thead", {}, el("tr", {}, el("th", {}, "adapter"), el("th", {}, "version"), el("th", {}, "base weights"),
      el("th", {}, "pinned"), el("th", {}, "where"))),
    el("tbody", {}, ...rows));
}

function addEvent(ev) {
  if (seenEvents.has(ev.id)) return;
  seenEvents.add(ev.id);
  const list = document.getElementById("events");
  const text = new Date(ev.time * 1000).toLocaleTimeString() + "  " + ev.stage + "  " + ev.command +
    (ev.level ? " L" + ev.level : "") + "  " + ev.outcome + (ev.state ? " -> " + ev.state : "") +
    (ev.status && ev.status !== "OK" ? " (" + ev.status + ")" : "") + "  " + (ev.duration_s * 1000).toFixed(1) + " ms" +
    (ev.freed_bytes ? "  freed " + fmtBytes(ev.freed_bytes) : "") +
    (ev.restored_bytes ? "  restored " + fmtBytes(ev.restored_bytes) : "") +
    (ev.error ? "  " + ev.error : "");
  const kind = ev.outcome === "ok" ? "ok" : MISTAKES.has(ev.outcome) ? "mistake" : "bad";
  list.prepend(el("li", {"class": kind, "data-event-id": ev.id, "data-kind": kind,
    "data-stage": ev.stage, "data-command": ev.command},
    text + (kind === "mistake" ? "  (refused: the caller's request)" : "")));
  while (list.children.length > 100) list.lastChild.remove();
}

function needKey() { document.getElementById("auth").className = "shown"; setConn("down", "API key needed"); }

async function stream() {
  const response = await fetch("/v1/events", {headers: headers(), cache: "no-store"});
  if (response.status === 401) { needKey(); return false; }
  if (!response.ok || !response.body) throw new Error("events: HTTP " + response.status);
  setConn("live", "live");
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) throw new Error("event stream ended");
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut); buffer = buffer.slice(cut + 2);
      let kind = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) kind = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      if (!data) continue;
      const parsed = JSON.parse(data);
      if (kind === "status") renderStatus(parsed); else if (kind === "lifecycle") addEvent(parsed);
    }
  }
}

async function pollOnce() {
  const response = await fetch("/v1/status", {headers: headers(), cache: "no-store"});
  if (response.status === 401) { needKey(); return false; }
  if (!response.ok) throw new Error("status: HTTP " + response.status);
  renderStatus(await response.json());
  return true;
}

async function run() {
  for (;;) {
    try {
      if (await stream() === false) return;
    } catch (err) {
      // The stream broke (server restart, proxy): poll until it can be opened again.
      try { if (await pollOnce() === false) return; setConn("polling", "polling"); }
      catch (err2) { setConn("down", "disconnected: " + err2.message); }
      await new Promise(r => setTimeout(r, 2000));
    }
  }
}

document.getElementById("key-save").addEventListener("click", () => {
  key = document.getElementById("key").value.trim();
  sessionStorage.setItem("omni-core-key", key);
  document.getElementById("auth").className = "";
  run();
});
setInterval(() => {  // the strips and the chart move with time even when nothing changes
  if (lastSnapshot) renderMemoryChart(lastSnapshot);
  for (const name of Object.keys(history)) {
    const section = document.querySelector('section[data-stage="' + CSS.escape(name) + '"]');
    const strip = section && section.querySelector("svg.strip");
    if (strip) strip.replaceWith(renderStrip(name));
  }
}, 5000);
renderStateLegend();
run();
</script>
</body>
</html>
"""

# The page's icon, inline (the CSP's img-src allows data:): the browser asks for /favicon.ico
# otherwise, the one 404 in every console.
ICON = (
    "data:image/svg+xml,%3Csvg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 16 16'%3E"
    "%3Ccircle cx='8' cy='8' r='7' fill='%232da44e'/%3E%3Ccircle cx='8' cy='8' r='3' fill='%23fff'/%3E%3C/svg%3E"
)
STATUS_PAGE_HTML = STATUS_PAGE_HTML.replace("@ICON@", ICON)


def _inline_hashes(tag: str) -> str:
    """CSP source expressions for each inline <tag> of the page: it runs only its own code."""
    bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", STATUS_PAGE_HTML, flags=re.S)
    assert bodies, f"the page has no inline <{tag}>"
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in bodies)


# Nothing but the page's own script and style, and fetches to this server; never framed.
STATUS_PAGE_CSP = (
    f"default-src 'none'; script-src {_inline_hashes('script')}; style-src {_inline_hashes('style')}; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
