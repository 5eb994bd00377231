"""Markup, style and script of the plan report page (tools/report_html.py fills in the data).

The script reads the JSON in `#plan-data` and draws, into SVG: per policy of the selected step a
timeline with one row per rank (integer axis), a rectangle per micro-batch a rank runs (local ones
blue, ring groups coloured by size and linked across their members), its exposed communication
and offload as hatched/purple ends, offload ratios as labels, idle time as the grey remainder up to
the makespan; and the length histogram. `#step=N` or `#step=all` in the URL selects the step.
"""

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>__TITLE__</title>
<style>
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 18px 24px; color: #222; }
h1 { font-size: 19px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 22px 0 6px; }
h3 { font-size: 14px; margin: 14px 0 2px; } .params { color: #555; margin: 0 0 8px; }
table { border-collapse: collapse; margin: 4px 0; }
th, td { border: 1px solid #ccc; padding: 3px 9px; text-align: right; }
th:first-child, td:first-child { text-align: left; } thead th { background: #f1f1f1; }
.note { color: #666; font-size: 12px; } .speedup { font-weight: 600; }
.legend span { display: inline-block; margin-right: 14px; font-size: 12px; }
.legend i { display: inline-block; width: 14px; height: 10px; margin-right: 4px; vertical-align: -1px; border: 1px solid #888; }
svg text { font-size: 10px; fill: #333; } svg .axis-title { font-size: 11px; }
svg text.offload-label { fill: #fff; }
.mb.local { fill: #4c78a8; } .mb.ring { stroke: #333; stroke-width: 0.6; }
.idle { fill: #e9e9e9; } .comm { fill: url(#hatch); } .offload { fill: #8e5ac8; }
.ring-link { stroke: #222; stroke-width: 1; stroke-dasharray: 2 1; }
.bound { stroke: #000; stroke-dasharray: 4 3; } .makespan { stroke: #c00; }
.bar { fill: #4c78a8; } .share { fill: none; stroke: #e45756; stroke-width: 2; }
.cap { stroke: #555; stroke-dasharray: 5 3; }
</style></head>
<body>
<h1 id="title"></h1><p class="params" id="params"></p>
<h2>Policies</h2>
<table id="policy-table"><thead></thead><tbody></tbody></table>
<div id="speedups"></div>
<h2>Planning time</h2>
<table id="timing-table"><thead><tr><th>policy</th><th>warm-up pass ms</th>
<th>mean ms/step</th><th>min ms</th><th>max ms</th><th>timed steps</th></tr></thead><tbody></tbody></table>
<p class="note">Each policy first plans every step once, a warm-up pass (numba compiles or loads
each kernel on its first use); the per-step times are from a second pass over the same steps.</p>
<h2>Per-rank timelines</h2>
<label>step <select id="step-select"></select></label> <span id="step-info" class="note"></span>
<div class="legend" id="legend"></div>
<div id="timelines"></div>
<h2>Sample lengths</h2>
<div id="histogram"></div>
<script type="application/json" id="plan-data">__DATA__</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("plan-data").textContent);
const NS = "http://www.w3.org/2000/svg";
const RING_COLORS = ["#f58518", "#e45756", "#b279a2", "#9d755d", "#54a24b", "#eeca3b"];
function ringColor(k) { return RING_COLORS[Math.min(k - 2, RING_COLORS.length - 1)]; }
function svgEl(tag, attrs, parent, text) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function htmlEl(tag, attrs, parent, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function niceStep(span, n) {
  const raw = span / Math.max(n, 1), p = Math.pow(10, Math.floor(Math.log10(raw)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= raw) return m * p;
  return 10 * p;
}
function fmtS(x) { return x === 0 ? "0" : x >= 100 ? x.toFixed(0) : x >= 1 ? x.toFixed(2) : x >= 0.01 ? x.toFixed(3) : x.toExponential(1); }

function header() {
  const defsSvg = svgEl("svg", {"width": 0, "height": 0, "style": "position:absolute"}, document.body);
  const pat = svgEl("pattern", {"id": "hatch", "width": 4, "height": 4, "patternUnits": "userSpaceOnUse",
    "patternTransform": "rotate(45)"}, svgEl("defs", {}, defsSvg));
  svgEl("rect", {"width": 4, "height": 4, "fill": "#fff"}, pat);
  svgEl("rect", {"width": 2, "height": 4, "fill": "#222"}, pat);
  document.getElementById("title").textContent = D.title;
  document.getElementById("params").textContent =
    Object.entries(D.params).map(([k, v]) => k + " " + v).join(" · ");
  const t = document.getElementById("policy-table");
  const hr = htmlEl("tr", {}, t.tHead);
  htmlEl("th", {}, hr, "");
  for (const p of D.policies) htmlEl("th", {"data-policy": p}, hr, p);
  for (const [name, cells] of D.table) {
    const tr = htmlEl("tr", {"data-row": name}, t.tBodies[0]);
    htmlEl("td", {}, tr, name);
    cells.forEach((c, i) => htmlEl("td", {"data-policy": D.policies[i]}, tr, c));
  }
  const sp = document.getElementById("speedups");
  for (const [p, x] of D.speedups)
    htmlEl("div", {"class": "speedup", "data-policy": p}, sp, "speedup of " + p + " over static: " + x.toFixed(2) + "x");
  const tt = document.getElementById("timing-table").tBodies[0];
  for (const [p, r] of Object.entries(D.timings)) {
    const tr = htmlEl("tr", {"data-policy": p}, tt);
    htmlEl("td", {}, tr, p);
    for (const v of [r.warmup_ms, r.mean_ms, r.min_ms, r.max_ms]) htmlEl("td", {}, tr, v.toFixed(2));
    htmlEl("td", {}, tr, String(r.steps));
  }
  const lg = document.getElementById("legend");
  const items = [["#4c78a8", "local micro-batch"]];
  RING_COLORS.forEach((c, i) => items.push([c, "ring of " + (i + 2) + (i === RING_COLORS.length - 1 ? "+" : "")]));
  items.push(["#8e5ac8", "exposed offload"],
    ["repeating-linear-gradient(45deg,#222 0 2px,#fff 2px 4px)", "exposed communication"],
    ["#e9e9e9", "idle"]);
  for (const [c, name] of items) { const s = htmlEl("span", {}, lg); htmlEl("i", {"style": "background:" + c}, s); s.append(name); }
}

function drawTimeline(parent, tl, stepIdx) {
  const N = tl.drawn_ranks, rowH = N <= 16 ? 22 : N <= 64 ? 12 : N <= 256 ? 5 : 2;
  const left = 46, right = 70, top = 8, W = 1100, H = N * rowH, bottom = 34;
  const tMax = Math.max(tl.makespan, tl.lower_bound, 1e-12);
  const X = t => left + (t / tMax) * W;
  const svg = svgEl("svg", {"width": left + W + right, "height": top + H + bottom, "class": "timeline",
    "data-policy": tl.label, "data-step": stepIdx, "data-ranks": tl.ranks}, parent);
  const labelEvery = Math.max(1, Math.ceil(N / 32));
  const busy = new Array(N).fill(0);
  for (let r = 0; r < N; r++) {
    const y = top + r * rowH;
    svgEl("rect", {"class": "idle", "x": left, "y": y + 1, "width": X(tl.makespan) - left,
      "height": Math.max(rowH - 2, 1), "data-rank": r}, svg);
    if (r % labelEvery === 0)
      svgEl("text", {"class": "rank-label", "x": left - 6, "y": y + rowH / 2 + 3, "text-anchor": "end"}, svg, String(r));
  }
  const M = tl.start.length;
  for (let m = 0; m < M; m++) {
    const lo = tl.group_offsets[m], hi = tl.group_offsets[m + 1], k = hi - lo;
    const x0 = X(tl.start[m]), w = Math.max(X(tl.start[m] + tl.dur[m]) - x0, 0.5);
    const off = tl.offload[m];
    const tip = "slot " + m + (k > 1 ? ", ring of " + k + " (ranks " + tl.group_ranks.slice(lo, hi).join(",") + ")" : ", local") +
      ", " + tl.pieces[m] + " piece(s), " + tl.tokens[m] + " tokens, capacity " + tl.capacity[m] +
      ", " + fmtS(tl.start[m]) + " s + " + fmtS(tl.dur[m]) + " s" + (off > 0 ? ", offload ratio " + off.toFixed(2) : "");
    let ymin = 1e9, ymax = -1;
    for (let j = lo; j < hi; j++) {
      const r = tl.group_ranks[j];
      if (r >= N) continue;
      busy[r] += tl.dur[m];
      const y = top + r * rowH + 1, h = Math.max(rowH - 2, 1);
      ymin = Math.min(ymin, y); ymax = Math.max(ymax, y + h);
      const g = svgEl("g", {}, svg);
      const a = {"class": "mb " + (k > 1 ? "ring" : "local"), "x": x0, "y": y, "width": w, "height": h,
        "data-slot": m, "data-rank": r, "data-k": k, "data-offload": off};
      if (k > 1) a.fill = ringColor(k);
      svgEl("rect", a, g);
      const wc = w * tl.comm_frac[m], wo = w * tl.offload_frac[m];
      if (wc > 0.3) svgEl("rect", {"class": "comm", "x": x0 + w - wc, "y": y, "width": wc, "height": h}, g);
      if (wo > 0.3) svgEl("rect", {"class": "offload", "x": x0 + w - wc - wo, "y": y, "width": wo, "height": h}, g);
      if (off > 0 && rowH >= 12 && w > 34)
        svgEl("text", {"class": "offload-label", "x": x0 + 3, "y": y + h - 3}, g, "r=" + String(+off.toFixed(3)));
      svgEl("title", {}, g, tip);
    }
    if (k > 1 && ymax > ymin)
      svgEl("line", {"class": "ring-link", "x1": x0 + 1, "x2": x0 + 1, "y1": ymin, "y2": ymax, "data-slot": m}, svg);
  }
  for (let r = 0; r < N; r++) {
    if (r % labelEvery !== 0) continue;
    const idle = tl.makespan > 0 ? 1 - busy[r] / tl.makespan : 0;
    svgEl("text", {"class": "idle-label", "x": left + W + 4, "y": top + r * rowH + rowH / 2 + 3}, svg,
      "idle " + (100 * Math.max(idle, 0)).toFixed(0) + "%");
  }
  svgEl("line", {"class": "bound", "x1": X(tl.lower_bound), "x2": X(tl.lower_bound), "y1": top, "y2": top + H}, svg);
  svgEl("line", {"class": "makespan", "x1": X(tl.makespan), "x2": X(tl.makespan), "y1": top, "y2": top + H}, svg);
  const step = niceStep(tMax, 8);
  for (let t = 0; t <= tMax * 1.0001; t += step) {
    svgEl("line", {"x1": X(t), "x2": X(t), "y1": top + H, "y2": top + H + 4, "stroke": "#333"}, svg);
    svgEl("text", {"class": "time-tick", "x": X(t), "y": top + H + 15, "text-anchor": "middle"}, svg, fmtS(t));
  }
  svgEl("text", {"class": "axis-title", "x": left + W / 2, "y": top + H + 30, "text-anchor": "middle"}, svg,
    "estimated time (s); dashed: lower bound, red: makespan");
  svgEl("text", {"class": "axis-title", "x": 10, "y": top + H / 2, "transform": "rotate(-90 10 " + (top + H / 2) + ")",
    "text-anchor": "middle"}, svg, "rank");
}

function drawStep(parent, idx) {
  const s = D.steps[idx];
  const box = htmlEl("div", {"class": "step", "data-step": idx}, parent);
  if (D.steps.length > 1) htmlEl("h3", {}, box, "step " + s.step + ": " + s.samples + " samples, " + s.tokens + " tokens");
  for (const tl of s.plans) {
    const offl = tl.offload.filter(x => x > 0);
    htmlEl("h3", {"class": "policy-title"}, box, tl.label + ": makespan " + fmtS(tl.makespan) + " s, lower bound " +
      fmtS(tl.lower_bound) + " s, " + tl.start.length + " micro-batches" +
      (offl.length ? ", " + offl.length + " offloaded (mean ratio " + (offl.reduce((a, b) => a + b, 0) / offl.length).toFixed(2) + ")" : "") +
      (tl.drawn_ranks < tl.ranks ? " (first " + tl.drawn_ranks + " of " + tl.ranks + " ranks drawn)" : ""));
    drawTimeline(box, tl, idx);
  }
}

function show(sel) {
  const box = document.getElementById("timelines");
  box.replaceChildren();
  const info = document.getElementById("step-info");
  if (sel === "all") { D.steps.forEach((_, i) => drawStep(box, i)); info.textContent = D.steps.length + " steps"; return; }
  const i = Math.min(Math.max(parseInt(sel, 10) || 0, 0), D.steps.length - 1);
  drawStep(box, i);
  info.textContent = D.steps[i].samples + " samples, " + D.steps[i].tokens + " tokens";
}

function histogram() {
  const h = D.hist, n = h.counts.length, box = document.getElementById("histogram");
  if (!n) { box.textContent = "no lengths"; return; }
  const left = 56, W = 900, H = 220, top = 10, bw = W / n, cMax = Math.max(...h.counts), sMax = Math.max(...h.token_share);
  const svg = svgEl("svg", {"width": left + W + 60, "height": top + H + 44, "id": "length-histogram", "data-samples": h.samples}, box);
  const pts = [];
  h.counts.forEach((c, i) => {
    const bh = cMax ? (c / cMax) * H : 0, x = left + i * bw;
    const g = svgEl("g", {}, svg);
    svgEl("rect", {"class": "bar", "x": x + 2, "y": top + H - bh, "width": bw - 4, "height": bh, "data-lo": h.lo[i], "data-count": c}, g);
    svgEl("title", {}, g, "[" + h.lo[i] + ", " + 2 * h.lo[i] + "): " + c + " samples, " + (100 * h.token_share[i]).toFixed(1) + "% of tokens");
    if (c) svgEl("text", {"x": x + bw / 2, "y": top + H - bh - 3, "text-anchor": "middle"}, svg, String(c));
    svgEl("text", {"x": x + bw / 2, "y": top + H + 14, "text-anchor": "middle"}, svg, h.lo[i] >= 1024 ? (h.lo[i] / 1024) + "K" : String(h.lo[i]));
    pts.push((x + bw / 2) + "," + (top + H - (sMax ? (h.token_share[i] / sMax) * 0.9 * H : 0)));
  });
  svgEl("polyline", {"class": "share", "points": pts.join(" ")}, svg);
  if (h.capacity) {
    const i = Math.log2(h.capacity) - Math.log2(h.lo[0]);
    if (i >= 0 && i <= n) svgEl("line", {"class": "cap", "x1": left + i * bw, "x2": left + i * bw, "y1": top, "y2": top + H}, svg);
  }
  svgEl("text", {"class": "axis-title", "x": left + W / 2, "y": top + H + 32, "text-anchor": "middle"}, svg,
    "sample length (tokens, bins [2^i, 2^(i+1))); bars: samples; red line: share of tokens (max " + (100 * sMax).toFixed(1) + "%)" +
    (h.capacity ? "; dashed: capacity " + h.capacity : ""));
  svgEl("text", {"class": "axis-title", "x": 12, "y": top + H / 2, "transform": "rotate(-90 12 " + (top + H / 2) + ")", "text-anchor": "middle"}, svg, "samples");
}

header();
const select = document.getElementById("step-select");
D.steps.forEach((s, i) => htmlEl("option", {"value": String(i)}, select, "step " + s.step));
htmlEl("option", {"value": "all"}, select, "all steps");
const m = /step=(all|\d+)/.exec(location.hash);
select.value = m ? (m[1] === "all" ? "all" : String(Math.min(parseInt(m[1], 10), D.steps.length - 1))) : "0";
select.addEventListener("change", () => { show(select.value); location.hash = "step=" + select.value; });
show(select.value);
histogram();
</script>
</body></html>
"""
