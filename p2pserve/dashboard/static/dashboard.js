// The p2pserve dashboard: polls api/swarm (relative, so it works under /dashboard/ too) and
// draws it. Every string in the document came from the network (peer ids, devices, versions,
// reasons): they reach the page only as text nodes or attribute values (textContent,
// createTextNode, setAttribute on fixed attribute names), never as markup.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const COLORS = ["#1d2330", "#3b6fd8", "#2f9e6b", "#d0562b", "#8a4fc7", "#c9a227", "#1f9fb0", "#b83b7a"];
let renders = 0;

// ---------------------------------------------------------------- DOM helpers (text only)

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  setAttrs(node, attrs);
  for (const c of children) node.appendChild(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function svgEl(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  setAttrs(node, attrs);
  if (text !== undefined) node.textContent = String(text);
  return node;
}

function setAttrs(node, attrs) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== null && v !== undefined) node.setAttribute(k, String(v));
  }
}

function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
}

function isNum(x) {
  return typeof x === "number" && Number.isFinite(x);
}

function fmt(x, digits) {
  return isNum(x) ? x.toFixed(digits === undefined ? 1 : digits) : "–";
}

function str(x) {
  return typeof x === "string" ? x : (x === null || x === undefined ? "–" : String(x));
}

function clip(x, n) {
  const s = str(x);
  return s.length <= n ? s : s.slice(0, n - 1) + "…";
}

function clipCell(x, n) {
  return el("td", {title: str(x)}, clip(x, n));
}

function shortId(id) {
  const s = str(id);
  return s.length <= 12 || s === "source" || s === "sink" ? s : "…" + s.slice(-10);
}

function span(r) {
  return Array.isArray(r) && r.length === 2 ? "[" + fmt(r[0], 0) + ", " + fmt(r[1], 0) + ")" : "–";
}

function peerCell(id) {
  return el("td", {class: "mono", title: str(id)}, shortId(id));
}

function numCell(x, digits) {
  return el("td", {class: "num"}, fmt(x, digits));
}

function fillRows(tableId, rows) {
  const body = document.querySelector("#" + tableId + " tbody");
  clear(body);
  for (const row of rows) body.appendChild(row);
}

function list(x) {
  return Array.isArray(x) ? x : [];
}

// ---------------------------------------------------------------- sections

function renderMeta(d) {
  const meta = document.getElementById("meta");
  const plan = d.plan;
  clear(meta);
  meta.appendChild(document.createTextNode(
    "model " + str(d.model) + " · swarm " + str(d.swarm_id) + " · served by " + str(d.source) +
    " · leader " + shortId(d.leader) + (plan ? " · plan epoch " + fmt(plan.epoch, 0) : " · no plan")));
}

function renderPeers(d) {
  const peers = list(d.peers);
  document.getElementById("peer-count").textContent = "(" + peers.length + ")";
  fillRows("peers", peers.map((p) => {
    const state = str(p.state);
    const tr = el("tr", {"data-peer-id": str(p.peer_id), "data-state": state,
                         class: "state-" + state.split(" ")[0].replace(/[^a-z]/g, "")},
      peerCell(p.peer_id), el("td", {class: "state"}, state), el("td", {}, span(p.serving)),
      el("td", {}, span(p.loading)), el("td", {}, span(p.target)), clipCell(p.device, 24),
      clipCell(p.version || "–", 16), el("td", {}, p.relayed === true ? "relayed" : "direct"),
      numCell(p.kv_free_tokens, 0), numCell(p.queued_tokens, 0), numCell(p.decode_tps),
      el("td", {class: "num", title: "reported by " + fmt(p.observed_by, 0) + " client(s)"},
        isNum(p.observed_tps) ? fmt(p.observed_tps) + " (" + fmt(p.observed_by, 0) + ")" : "–"),
      el("td", {class: "num", title: str(p.claim)}, fmt(p.effective_tps)), numCell(p.age_s, 1));
    return tr;
  }));
}

function renderCoverage(d) {
  const cov = d.coverage || {};
  const serving = list(cov.serving), loading = list(cov.loading), planned = list(cov.planned);
  const chart = document.getElementById("coverage");
  clear(chart);
  const n = serving.length;
  setAttrs(chart, {"data-serving": serving.join(","), "data-loading": loading.join(","),
                   "data-num-layers": n});
  const top = Math.max(1, ...serving.map((s, i) => s + (loading[i] || 0)), ...planned);
  const W = 640, H = 160, left = 28, bottom = 22, bw = (W - left) / Math.max(n, 1);
  chart.setAttribute("viewBox", "0 0 " + W + " " + H);
  const y = (v) => H - bottom - (v / top) * (H - bottom - 14);
  for (let v = 0; v <= top; v += Math.max(1, Math.ceil(top / 4))) {
    chart.appendChild(svgEl("line", {x1: left, x2: W, y1: y(v), y2: y(v), stroke: "#e6e8ee"}));
    chart.appendChild(svgEl("text", {x: left - 6, y: y(v) + 4, "text-anchor": "end", class: "muted"}, v));
  }
  const every = Math.max(1, Math.ceil(n / 32));
  serving.forEach((s, i) => {
    const x = left + i * bw + bw * 0.12, w = bw * 0.76, l = loading[i] || 0;
    chart.appendChild(svgEl("rect", {x: x, width: w, y: y(s), height: y(0) - y(s), fill: "#3b6fd8",
                                     class: "serving-bar", "data-layer": i, "data-count": s}));
    if (l > 0) chart.appendChild(svgEl("rect", {x: x, width: w, y: y(s + l), height: y(s) - y(s + l), fill: "#f0b44c"}));
    if (i < planned.length) {
      chart.appendChild(svgEl("line", {x1: x, x2: x + w, y1: y(planned[i]), y2: y(planned[i]), stroke: "#1d2330",
                                       "stroke-width": 2}));
    }
    if (s === 0) chart.appendChild(svgEl("text", {x: x + w / 2, y: y(0) - 4, "text-anchor": "middle", class: "warn"}, "0"));
    if (i % every === 0) chart.appendChild(svgEl("text", {x: x + w / 2, y: H - 6, "text-anchor": "middle", class: "muted"}, i));
  });
  const uncovered = list(cov.uncovered);
  document.getElementById("coverage-text").textContent = n === 0 ? "no layers known yet" :
    n + " layers; peers serving each: " + serving.join(" ") +
    (uncovered.length ? " — UNCOVERED: " + uncovered.join(", ") : " — every layer served");
}

function columns(ranges) {
  // a layered drawing: one column per distinct first layer (source first, sink last), peers
  // stacked in their column; returns peer id -> [column, row] and the column count
  const starts = [...new Set(ranges.map((r) => r.start))].sort((a, b) => a - b);
  const place = {source: [0, 0]}, height = {};
  for (const r of ranges) {
    const c = starts.indexOf(r.start) + 1;
    height[c] = (height[c] || 0) + 1;
    place[r.peer_id] = [c, height[c] - 1];
  }
  place.sink = [starts.length + 1, 0];
  return [place, starts.length + 2, Math.max(1, ...Object.values(height))];
}

function renderPlanGraph(plan) {
  const g = document.getElementById("plan-graph");
  clear(g);
  if (!plan) return;
  const ranges = list(plan.ranges).filter((r) => isNum(r.start) && isNum(r.end));
  const [place, ncols, nrows] = columns(ranges);
  const W = 640, rowH = 48, H = nrows * rowH + 16, boxW = Math.min(130, (W / ncols) * 0.7);
  const colX = (c) => 8 + boxW / 2 + c * ((W - 16 - boxW) / Math.max(ncols - 1, 1));
  g.setAttribute("viewBox", "0 0 " + W + " " + H);
  const nodes = {};
  for (const [id, [c, row]] of Object.entries(place)) {
    const inCol = Object.values(place).filter(([cc]) => cc === c).length;
    const y = H / 2 + (row - (inCol - 1) / 2) * rowH;
    nodes[id] = {x1: colX(c) - boxW / 2, x2: colX(c) + boxW / 2, y: y};
  }
  const flows = list(plan.flows).filter((f) => nodes[f.src] && nodes[f.dst] && isNum(f.tokens_per_s));
  const maxRate = Math.max(1e-9, ...flows.map((f) => f.tokens_per_s));
  for (const f of flows) {
    const a = nodes[f.src], b = nodes[f.dst], mid = (a.x2 + b.x1) / 2;
    g.appendChild(svgEl("path", {d: "M" + a.x2 + "," + a.y + " C" + mid + "," + a.y + " " + mid + "," + b.y + " " + b.x1 + "," + b.y,
                                 fill: "none", stroke: "#2f9e6b", "stroke-opacity": 0.6,
                                 "stroke-width": 1.5 + 8 * f.tokens_per_s / maxRate, class: "flow",
                                 "data-src": str(f.src), "data-dst": str(f.dst)}));
    g.appendChild(svgEl("text", {x: mid, y: (a.y + b.y) / 2 - 5, "text-anchor": "middle"}, fmt(f.tokens_per_s)));
  }
  for (const [id, n] of Object.entries(nodes)) {
    const isEnd = id === "source" || id === "sink";
    const r = ranges.find((q) => q.peer_id === id);
    g.appendChild(svgEl("rect", {x: n.x1, y: n.y - 17, width: n.x2 - n.x1, height: 34, rx: 5,
                                 fill: isEnd ? "#1d2330" : "#dce6fb", stroke: "#3b6fd8", class: "plan-node",
                                 "data-peer-id": id}));
    const cx = (n.x1 + n.x2) / 2;
    if (isEnd) {
      g.appendChild(svgEl("text", {x: cx, y: n.y + 4, "text-anchor": "middle", class: "on-dark"}, id));
    } else {
      g.appendChild(svgEl("text", {x: cx, y: n.y - 3, "text-anchor": "middle"}, shortId(id)));
      g.appendChild(svgEl("text", {x: cx, y: n.y + 11, "text-anchor": "middle", class: "muted"},
                          "layers [" + r.start + ", " + r.end + ")"));
    }
  }
}

function renderPlan(d) {
  const plan = d.plan;
  const text = document.getElementById("plan-text");
  if (!plan) {
    text.textContent = "no plan published yet";
  } else {
    text.textContent = "epoch " + fmt(plan.epoch, 0) + " by " + shortId(plan.leader) + " (" + str(plan.reason) +
      ", " + fmt(plan.age_s) + " s ago): max-flow " + fmt(plan.max_flow) + " tok/s of an upper bound " +
      fmt(plan.upper_bound) + ", solved in " + fmt(plan.solve_time_s * 1e3) + " ms" +
      (list(plan.defaulted_links).length ? ", " + plan.defaulted_links.length + " links defaulted" : "");
  }
  renderPlanGraph(plan);
  fillRows("flows", list(plan && plan.flows).map((f) =>
    el("tr", {}, peerCell(f.src), peerCell(f.dst), numCell(f.tokens_per_s))));
}

function renderThroughput(d) {
  const h = d.history || {};
  const t = list(h.t);
  const series = [["plan max-flow", list(h.max_flow)], ["served by this process", list(h.served)]];
  for (const [pid, values] of Object.entries(h.observed || {})) series.push(["observed " + shortId(pid), list(values)]);
  const shown = series.filter(([, v]) => v.some(isNum));
  const g = document.getElementById("throughput");
  clear(g);
  const W = 640, H = 180, left = 44, bottom = 20;
  g.setAttribute("viewBox", "0 0 " + W + " " + H);
  const legend = document.getElementById("throughput-legend");
  clear(legend);
  if (t.length < 1 || !shown.length) {
    g.appendChild(svgEl("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "muted"}, "no figures yet"));
    return;
  }
  const t0 = t[0], t1 = Math.max(t[t.length - 1], t0 + 1);
  const top = Math.max(1e-9, ...shown.flatMap(([, v]) => v.filter(isNum)));
  const x = (ti) => left + ((ti - t0) / (t1 - t0)) * (W - left - 8);
  const y = (v) => H - bottom - (v / top) * (H - bottom - 10);
  for (const frac of [0, 0.5, 1]) {
    g.appendChild(svgEl("line", {x1: left, x2: W, y1: y(top * frac), y2: y(top * frac), stroke: "#e6e8ee"}));
    g.appendChild(svgEl("text", {x: left - 4, y: y(top * frac) + 4, "text-anchor": "end", class: "muted"}, fmt(top * frac)));
  }
  g.appendChild(svgEl("text", {x: W - 8, y: H - 4, "text-anchor": "end", class: "muted"},
                      "last " + fmt(t1 - t0, 0) + " s"));
  shown.forEach(([name, values], i) => {
    const pts = values.map((v, j) => (isNum(v) && isNum(t[j]) ? x(t[j]).toFixed(1) + "," + y(v).toFixed(1) : null))
      .filter((p) => p !== null);
    g.appendChild(svgEl("polyline", {points: pts.join(" "), fill: "none", stroke: COLORS[i % COLORS.length],
                                     "stroke-width": i < 2 ? 2.5 : 1.2, "stroke-dasharray": i === 0 ? "6 3" : null}));
    if (pts.length) {  // the newest value as a dot: visible even while a series has one sample
      const [px, py] = pts[pts.length - 1].split(",");
      g.appendChild(svgEl("circle", {cx: px, cy: py, r: 3, fill: COLORS[i % COLORS.length]}));
    }
    legend.appendChild(el("li", {}, el("span", {class: "swatch s" + (i % COLORS.length)}), name));
  });
}

function routeText(hops) {
  return list(hops).map((h) => shortId(h.peer_id) + "[" + fmt(h.start, 0) + ":" + fmt(h.end, 0) + ")").join(" → ");
}

function clockTime(t) {
  return isNum(t) ? new Date(t * 1000).toLocaleTimeString() : "–";
}

function renderRoutes(d) {
  const routes = d.routes;
  document.getElementById("routes-text").textContent = Array.isArray(routes) ?
    (routes.length ? "the last " + routes.length + " requests this process served" : "no request served yet") :
    "this process sends no requests: only an API process (p2pserve api --dashboard) knows its routes; " +
    "below, the peers clients report using";
  fillRows("routes", list(routes).map((r) => el("tr", {class: "route"},
    el("td", {}, clockTime(r.finished_at)), el("td", {class: "mono wrap"}, routeText(r.hops)), numCell(r.tokens, 0),
    numCell(r.tokens_per_s), numCell(r.first_token_s, 3), numCell(isNum(r.routes) ? r.routes - 1 : null, 0),
    clipCell(r.outcome, 24))));
  fillRows("observations", list(d.observations).map((o) => el("tr", {},
    peerCell(o.reporter), el("td", {}, clockTime(o.at)),
    el("td", {class: "mono wrap"}, list(o.peers).map((p) => shortId(p.peer_id) + " (" + fmt(p.layers, 0) + ", " +
                                                     fmt(p.tokens_per_s) + ")").join("  ")))));
}

function renderLinks(d) {
  const links = list(d.links);
  document.getElementById("link-count").textContent = "(" + links.length + ")";
  fillRows("links", links.map((l) => el("tr", {}, peerCell(l.src), peerCell(l.dst),
    numCell(isNum(l.bandwidth_Bps) ? l.bandwidth_Bps / 1e6 : null, 2), numCell(isNum(l.rtt_s) ? l.rtt_s * 1e3 : null, 2))));
  fillRows("coordinators", list(d.coordinators).map((c) => el("tr", {},
    peerCell(c.id), numCell(c.priority, 0), el("td", {}, c.leader === true ? "leader" : ""))));
  fillRows("excluded", list(d.excluded).map((e) => el("tr", {},
    peerCell(e.peer_id), el("td", {}, e.in_plan === true ? "yes" : "no"), clipCell(e.reason, 80))));
}

function setStatus(kind, text) {
  const s = document.getElementById("status");
  s.className = "status " + kind;
  s.textContent = text;
}

function render(d) {
  renderMeta(d);
  renderPeers(d);
  renderCoverage(d);
  renderPlan(d);
  renderThroughput(d);
  renderRoutes(d);
  renderLinks(d);
  const when = isNum(d.generated_at) ? new Date(d.generated_at * 1000).toLocaleTimeString() : "–";
  if (d.error) setStatus("stale", str(d.error));
  else setStatus("live", "live · read " + when);
  renders += 1;
  document.body.setAttribute("data-renders", renders);
}

async function poll() {
  let wait = 2000;
  try {
    const r = await fetch("api/swarm", {cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    const d = await r.json();
    if (isNum(d.refresh_s)) wait = Math.min(Math.max(d.refresh_s * 1000, 500), 60000);
    render(d);
  } catch (e) {
    setStatus("error", "cannot read the swarm: " + str(e && e.message));
  } finally {
    setTimeout(poll, wait);
  }
}

document.addEventListener("DOMContentLoaded", poll);
