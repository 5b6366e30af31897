// stepvault dashboard: charts (uPlot), live updates and confirmed actions. No framework,
// no network beyond this server. Data comes from the JSON endpoints under /api/.
// A run page loads its data once, then asks only for what changed since its cursor
// (/api/runs/RUN?since=CURSOR): new points are appended to the charts, whose zoom stays.
"use strict";

const COLORS = {kept: "#2f6fde", pinned: "#8a3ffc", registered: "#0f9d58", best: "#f29d0b",
                damaged: "#d93025", deleted: "#9aa3b5", tier: "#6b7385", stall: "#d93025",
                write: "#2f6fde", rate: "#0f9d58", compare: "#e8710a"};

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

async function getJSON(url) {
  const r = await fetch(url, {headers: {"Accept": "application/json"}, credentials: "same-origin"});
  if (!r.ok) {
    let why = String(r.status);
    try { why = (await r.json()).error || why; } catch (e) { /* not JSON */ }
    throw new Error(why);
  }
  return r.json();
}

function width(box) { return Math.max(320, box.clientWidth - 12); }

// -- times: every time in the page in the browser's own zone, as the header clock ------------
function two(n) { return String(n).padStart(2, "0"); }
function zone(d) {
  const part = new Intl.DateTimeFormat([], {timeZoneName: "short"}).formatToParts(d)
    .find(p => p.type === "timeZoneName");
  return part ? part.value : "";
}
function fmtTime(ts) {
  if (!ts) return "";
  const d = new Date(ts * 1000);
  return d.getFullYear() + "-" + two(d.getMonth() + 1) + "-" + two(d.getDate()) + " " +
    two(d.getHours()) + ":" + two(d.getMinutes()) + ":" + two(d.getSeconds()) + " " + zone(d);
}
function localTimes(root) {
  for (const t of (root || document).querySelectorAll("time[data-ts]")) {
    t.textContent = fmtTime(Number(t.dataset.ts));
  }
}

// -- numbers: ticks with as many digits as their spacing needs, full precision in legends -----
function tickFormatter(u, splits) {
  if (splits.length < 2) return splits.map(v => (v === null ? "" : String(+v.toPrecision(6))));
  const step = Math.abs(splits[1] - splits[0]) || Math.abs(splits[0]) || 1;
  const big = Math.max(...splits.map(v => Math.abs(v)));
  if (big !== 0 && (big < 1e-3 || big >= 1e6)) return splits.map(v => v.toExponential(2));
  const digits = Math.min(12, Math.max(0, -Math.floor(Math.log10(step)) + 1));
  // trailing zeros of the decimals only: 20 stays 20, 0.500 reads 0.5
  const trim = t => (t.includes(".") ? t.replace(/0+$/, "").replace(/\.$/, "") : t);
  return splits.map(v => trim(v.toFixed(digits)));
}
function fullValue(u, v) { return v === null || v === undefined ? "–" : String(v); }
function xRange(u, min, max) {
  // one point (or none): a sane range around it instead of a zero-width axis
  if (min === null || max === null) return [0, 1];
  if (min === max) return [min - 1, max + 1];
  return [min, max];
}

function markers(label, color, size) {
  return {label, stroke: color, fill: color, paths: () => null, value: fullValue,
          points: {show: true, size: size || 8, stroke: color, fill: color}};
}

// Charts of one run page, kept across live updates.
const charts = {timeline: null, metrics: {}, saves: null};
window.stepvaultCharts = charts;  // for a look from the browser's console (and the tests)
let runDoc = null;        // the run's data as the page has it
let compareDoc = null;    // another run's data, overlaid on the metric curves
let logScale = false;

// A click on a point (not a drag to zoom) opens that checkpoint.
function clickable(u, stepAt) {
  let down = null;
  u.over.addEventListener("mousedown", e => { down = [e.clientX, e.clientY]; });
  u.over.addEventListener("click", e => {
    if (!down || Math.abs(e.clientX - down[0]) + Math.abs(e.clientY - down[1]) > 4) return;
    const idx = u.cursor.idx;
    if (idx === null || idx === undefined) return;
    const step = stepAt(idx);
    if (step !== null && step !== undefined) {
      location.href = "/runs/" + encodeURIComponent(runDoc.run) + "/checkpoints/" + step;
    }
  });
  u.over.style.cursor = "pointer";
}

// Replace a chart's data, keeping the user's zoom (an un-zoomed chart follows new data).
function update(u, data) {
  const xs = u.scales.x, xd = u.data[0];
  const zoomed = xd.length > 1 && xs.min !== null &&
    (xs.min > xd[0] || xs.max < xd[xd.length - 1]);
  if (zoomed) {
    const [min, max] = [xs.min, xs.max];
    u.setData(data, false);
    u.setScale("x", {min, max});
  } else {
    u.setData(data, true);
  }
}

// -- run page -------------------------------------------------------------------------------
function timelineData(doc) {
  const cps = doc.checkpoints;
  const good = cps.filter(c => !c.error);
  const t0 = good.length ? Math.min(...good.map(c => c.created)) : 0;
  const span = good.length ? Math.max(...good.map(c => c.created - t0)) : 0;
  const [unit, div] = span < 120 ? ["s", 1] : span < 7200 ? ["min", 60] : ["h", 3600];
  let last = 0;
  const y = cps.map(c => { if (!c.error) last = (c.created - t0) / div; return last; });
  const pick = test => cps.map((c, i) => (test(c) ? y[i] : null));
  const tiers = [...new Set(cps.flatMap(c => c.tiers))].filter(t => t !== "hot").sort();
  const data = [cps.map(c => c.step), pick(c => !c.error), pick(c => c.pinned),
                pick(c => c.registered.length > 0), pick(c => c.best.length > 0),
                pick(c => !!c.error)];
  for (const t of tiers) data.push(pick(c => c.tiers.includes(t)));
  return {unit, tiers, data};
}

function renderTimeline(box, doc) {
  const {unit, tiers, data} = timelineData(doc);
  const key = unit + "|" + tiers.join(",");
  if (charts.timeline && charts.timeline._key === key) { update(charts.timeline, data); return; }
  box.textContent = "";
  if (charts.timeline) charts.timeline.destroy();
  charts.timeline = null;
  if (!doc.checkpoints.length) { box.append(el("p", {}, "no checkpoints")); return; }
  // marks of different sizes, biggest first: overlapping marks all stay visible
  const series = [{label: "step", value: fullValue},
    {label: unit + " since first", stroke: "#c5cbd6", width: 1, value: fullValue,
     points: {show: true, size: 5, stroke: COLORS.kept, fill: COLORS.kept}},
    markers("pinned", COLORS.pinned, 15), markers("registered", COLORS.registered, 12),
    markers("best", COLORS.best, 9), markers("damaged", COLORS.damaged, 9)];
  for (const t of tiers) series.push(markers("on " + t, COLORS.tier, 4));
  const u = new uPlot({width: width(box), height: 220, series,
                       scales: {x: {time: false, range: xRange}},
                       cursor: {sync: {key: "run-" + doc.run}},
                       axes: [{label: "step", values: tickFormatter},
                              {label: "wall time (" + unit + ")", values: tickFormatter}]},
                      data, box);
  u._key = key;
  charts.timeline = u;
  clickable(u, i => runDoc.checkpoints[i] && runDoc.checkpoints[i].step);
}

function metricData(doc, name) {
  const pts = doc.metrics[name] || [];
  const byStep = new Map(doc.checkpoints.map(c => [c.step, c]));
  const deleted = new Set(doc.deleted_steps || []);
  const x = pts.map(p => p[0]), y = pts.map(p => p[1]);
  const pick = test => pts.map((p, i) => (byStep.has(p[0]) && test(byStep.get(p[0])) ? y[i] : null));
  const data = [x, y, pts.map((p, i) => (deleted.has(p[0]) ? y[i] : null)),
                pick(c => c.pinned), pick(c => c.registered.length > 0),
                pick(c => c.best.includes(name))];
  if (compareDoc) {
    // the other run's curve on this run's steps where both have one (uPlot shares one x)
    const other = new Map((compareDoc.metrics[name] || []).map(p => [p[0], p[1]]));
    const steps = [...new Set([...x, ...other.keys()])].sort((a, b) => a - b);
    const mine = new Map(pts.map(p => [p[0], p[1]]));
    const col = (m) => steps.map(s => (m.has(s) ? m.get(s) : null));
    return [steps, col(mine), col(new Map(pts.filter(p => deleted.has(p[0])).map(p => [p[0], p[1]]))),
            col(new Map(pts.filter(p => byStep.has(p[0]) && byStep.get(p[0]).pinned).map(p => [p[0], p[1]]))),
            col(new Map(pts.filter(p => byStep.has(p[0]) && byStep.get(p[0]).registered.length).map(p => [p[0], p[1]]))),
            col(new Map(pts.filter(p => byStep.has(p[0]) && byStep.get(p[0]).best.includes(name)).map(p => [p[0], p[1]]))),
            col(other)];
  }
  return data;
}

function renderMetrics(box, doc) {
  const names = Object.keys(doc.metrics).sort();
  if (!names.length) { box.textContent = ""; box.append(el("p", {}, "no metrics recorded")); return; }
  // a chart of one point has a fixed x-range around it: drawn anew when a second comes
  const single = names.filter(n => (doc.metrics[n] || []).length === 1).join(",");
  const shape = names.join(",") + "|" + logScale + "|" + (compareDoc ? compareDoc.run : "") +
    "|" + single;
  if (box._shape === shape) {
    for (const name of names) update(charts.metrics[name], metricData(doc, name));
    return;
  }
  for (const u of Object.values(charts.metrics)) u.destroy();
  charts.metrics = {};
  box.textContent = "";
  box._shape = shape;
  for (const name of names) {
    const chart = el("div", {"class": "chart metric-chart", "data-metric": name});
    const mode = doc.best_modes[name];
    chart.append(el("h3", {}, name + (mode ? " (best: " + mode + ", as the run declares)" : "")));
    box.append(chart);
    const data = metricData(doc, name);
    const positive = data[1].every(v => v === null || v > 0);
    const series = [{label: "step", value: fullValue},
      {label: name, stroke: COLORS.kept, width: 1.5, value: fullValue, spanGaps: true},
      markers("deleted", COLORS.deleted, 6), markers("pinned", COLORS.pinned, 14),
      markers("registered", COLORS.registered, 11), markers("best", COLORS.best, 8)];
    if (compareDoc) {
      series.push({label: compareDoc.run, stroke: COLORS.compare, width: 1.5, dash: [6, 3],
                   value: fullValue, spanGaps: true});
    }
    const y = {distr: logScale && positive ? 3 : 1};
    const one = data[0].length === 1 ? [data[0][0] - 1, data[0][0] + 1] : null;
    const u = new uPlot({width: width(chart), height: 200,
                         scales: {x: one ? {time: false, auto: false, range: one}
                                         : {time: false, range: xRange}, y},
                         cursor: {sync: {key: "run-" + doc.run}},
                         axes: [{label: "step", values: tickFormatter},
                                {values: tickFormatter, size: 70}],
                         series}, data, chart);
    if (logScale && !positive) chart.append(el("p", {"class": "sub"}, "log scale needs positive values"));
    charts.metrics[name] = u;
    clickable(u, i => u.data[0][i]);
  }
}

function saveData(doc) {
  const saves = doc.saves.filter(s => s.step !== null && s.step !== undefined);
  const mb = v => (v === null || v === undefined ? null : v / 1e6);
  return [saves.map(s => s.step), saves.map(s => s.stall_seconds ?? null),
          saves.map(s => s.write_seconds ?? null), saves.map(s => mb(s.throughput_bytes_per_s))];
}

function renderSaves(box, doc) {
  const data = saveData(doc);
  if (!data[0].length) return;
  if (charts.saves) { update(charts.saves, data); return; }
  box.textContent = "";
  charts.saves = new uPlot({width: width(box), height: 200,
             scales: {x: {time: false, range: xRange}},
             cursor: {sync: {key: "run-" + doc.run}},
             axes: [{label: "step", values: tickFormatter},
                    {label: "seconds", scale: "s", values: tickFormatter},
                    {label: "MB/s", scale: "rate", side: 1, grid: {show: false}, values: tickFormatter}],
             series: [{label: "step", value: fullValue},
                      {label: "stall s", stroke: COLORS.stall, scale: "s", value: fullValue},
                      {label: "write s", stroke: COLORS.write, scale: "s", value: fullValue},
                      {label: "throughput MB/s", stroke: COLORS.rate, scale: "rate", value: fullValue}]},
            data, box);
}

async function renderRetention(box) {
  let plan;
  try {
    plan = await getJSON(box.dataset.api + location.search);
  } catch (err) {
    box.textContent = "";
    box.append(el("p", {"class": "bad", id: "retention-error"}, String(err.message)));
    return;
  }
  box.textContent = "";
  const head = plan.policy ? "policy: " + plan.policy + (plan.source === "configured" ? " (the run's own)" : " (typed)") : "policy: none";
  box.append(el("p", {"class": "sub", id: "retention-summary"}, head + " · would delete: " +
                (plan.summary || "nothing")));
  if (plan.note) box.append(el("p", {"class": "sub"}, plan.note));
  if (plan.command) box.append(el("pre", {id: "retention-command"}, plan.command));
  if (!plan.rows || !plan.rows.length) return;
  const table = el("table", {id: "retention-table"});
  const tr0 = el("tr");
  for (const h of ["step", "verdict", "why"]) tr0.append(el("th", {}, h));
  table.append(tr0);
  for (const e of plan.rows) {
    const tr = el("tr", {"class": "keep-" + e.keep});
    const steps = e.count > 1 ? e.first + "–" + e.step + " (" + e.count + ")" : String(e.step);
    tr.append(el("td", {}, steps), el("td", {}, e.keep ? "keep" : "delete next"),
              el("td", {}, e.reasons.join("; ")));
    table.append(tr);
  }
  box.append(table);
}

function drawRun() {
  renderTimeline(document.getElementById("timeline-chart"), runDoc);
  renderMetrics(document.getElementById("metric-charts"), runDoc);
  renderSaves(document.getElementById("save-chart"), runDoc);
}

// -- the run table's newest page follows the run -----------------------------------------------
function rowOf(c) {
  const tr = el("tr", {"class": c.error ? "damaged" : "", "data-step": String(c.step)});
  const a = el("a", {href: "/runs/" + encodeURIComponent(runDoc.run) + "/checkpoints/" + c.step}, String(c.step));
  const td = el("td"); td.append(a); tr.append(td);
  const num = v => (typeof v === "number" && !Number.isInteger(v) ? String(+v.toPrecision(6)) : String(v));
  const bytes = n => { const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
    while (Math.abs(n) >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : String(n)) + " " + u[i]; };
  if (c.error) {
    tr.append(el("td", {colspan: "6", "class": "bad"}, "DAMAGED: " + c.error));
  } else {
    tr.append(el("td", {}, c.epoch === null ? "" : String(c.epoch)), el("td", {}, fmtTime(c.created)),
              el("td", {}, bytes(c.logical_bytes)), el("td", {}, bytes(c.stored_bytes)),
              el("td", {}, bytes(c.new_bytes)),
              el("td", {}, Object.entries(c.metrics).map(([k, v]) => k + "=" + num(v)).join(" ")));
  }
  const marks = el("td");
  if (c.pinned) marks.append(el("span", {"class": "tag pinned"}, "pinned"));
  for (const r of c.registered) marks.append(el("span", {"class": "tag registered"}, r));
  for (const b of c.best) marks.append(el("span", {"class": "tag best"}, "best " + b));
  tr.append(marks, el("td", {}, c.tiers.join(", ")));
  return tr;
}

function redrawTable() {
  const params = new URLSearchParams(location.search);
  if ((params.get("page") && params.get("page") !== "0") || params.get("step")) return;
  const body = document.querySelector("#checkpoints tbody");
  if (!body) return;
  const rows = runDoc.checkpoints.slice(-body.children.length - 1).reverse()
    .slice(0, Math.max(body.children.length, 1));
  body.replaceChildren(...rows.map(rowOf));
  const count = document.getElementById("run-count");
  if (count) count.textContent = String(runDoc.checkpoints.length);
}

function applyDelta(delta) {
  if (delta.unchanged) return false;
  const removed = new Set(delta.removed || []);
  const fresh = new Map((delta.checkpoints || []).map(c => [c.step, c]));
  let cps = runDoc.checkpoints.filter(c => !removed.has(c.step) && !fresh.has(c.step));
  cps = cps.concat([...fresh.values()]).sort((a, b) => a.step - b.step);
  const marks = delta.marks || {};
  const pinned = new Set(marks.pinned || []);
  for (const c of cps) {
    c.pinned = pinned.has(c.step);
    c.registered = (marks.registered || {})[c.step] || [];
    c.best = (marks.best || {})[c.step] || [];
  }
  runDoc.checkpoints = cps;
  for (const [name, pts] of Object.entries(delta.metrics || {})) {
    const merged = new Map((runDoc.metrics[name] || []).map(p => [p[0], p[1]]));
    for (const [s, v] of pts) merged.set(s, v);
    runDoc.metrics[name] = [...merged.entries()].sort((a, b) => a[0] - b[0]);
  }
  runDoc.deleted_steps = [...new Set([...(runDoc.deleted_steps || []), ...(delta.deleted_steps || [])])]
    .filter(s => !fresh.has(s)).sort((a, b) => a - b);
  runDoc.best_modes = delta.best_modes || runDoc.best_modes;
  runDoc.saves = runDoc.saves.concat(delta.saves || []);
  runDoc.cursor = delta.cursor;
  return true;
}

async function refreshRun() {
  const box = document.getElementById("timeline-chart");
  const delta = await getJSON(box.dataset.api + "?since=" + encodeURIComponent(runDoc.cursor));
  if (delta.reload) { runDoc = await getJSON(box.dataset.api); }
  else if (!applyDelta(delta)) return;
  drawRun();
  redrawTable();
  const retention = document.getElementById("retention");
  if (retention) await renderRetention(retention);
}

async function compareWith(other) {
  compareDoc = other ? await getJSON("/api/runs/" + encodeURIComponent(other)) : null;
  drawRun();
}

async function renderPage() {
  localTimes();
  const timeline = document.getElementById("timeline-chart");
  if (timeline) {
    runDoc = await getJSON(timeline.dataset.api);
    drawRun();
    const log = document.getElementById("log-scale");
    if (log) log.onchange = () => { logScale = log.checked; drawRun(); };
    const pick = document.getElementById("compare-run");
    if (pick) {
      const store = await getJSON("/api/runs");
      for (const r of store.runs) if (r !== runDoc.run) pick.append(el("option", {value: r}, r));
      pick.onchange = () => compareWith(pick.value).catch(err => console.warn("compare", err));
    }
  }
  const retention = document.getElementById("retention");
  if (retention) await renderRetention(retention);
  const usage = document.querySelector("#usage[data-pending]");
  if (usage) await swapMain(location.pathname + "?usage=1");
  bindActions();
}

// Replace the page's main part with the same page fetched again (``url``).
async function swapMain(url) {
  const r = await fetch(url, {credentials: "same-origin"});
  const html = new DOMParser().parseFromString(await r.text(), "text/html");
  const fresh = html.getElementById("main");
  if (fresh) {
    document.getElementById("main").replaceChildren(...fresh.childNodes);
    await renderPage();
  }
}

// -- live refresh: poll a cheap token; a run page asks for what changed, others re-render ------
let token = null;
async function poll() {
  const live = document.getElementById("live");
  try {
    const now = (await getJSON("/api/changes")).token;
    if (token !== null && now !== token) {
      if (runDoc) {
        await refreshRun();
      } else {
        await swapMain(location.href);
      }
    }
    token = now;
    live.textContent = "live · " + new Date().toLocaleTimeString([], {timeZoneName: "short"});
    live.classList.remove("stale");
  } catch (err) {
    live.textContent = "offline";
    live.classList.add("stale");
  }
}

// -- actions (only rendered with --allow-actions): confirm, then POST ------------------------
function bindActions() {
  for (const b of document.querySelectorAll("button.action")) {
    b.onclick = async () => {
      const d = b.dataset, body = {run: d.run, step: d.step};
      const what = d.run ? d.run + (d.step ? "@" + d.step : "") : d.model + "@" + d.alias;
      if (d.action === "annotate") {
        const text = prompt("metrics for " + what + " (NAME=VALUE, space separated)");
        if (!text) return;
        body.metrics = Object.fromEntries(text.trim().split(/\s+/).map(p => {
          const [k, v] = p.split("="); return [k, Number(v)]; }));
      } else if (d.action === "promote") {
        body.model = prompt("model name"); if (!body.model) return;
        body.alias = prompt("alias", "candidate"); if (!body.alias) return;
        body.target = what;
      } else if (d.action === "rollback") {
        body.model = d.model; body.alias = d.alias;
      } else if (d.action === "gc-preview") {
        for (const [k, v] of new URLSearchParams(location.search)) body[k] = v;
      }
      if (!confirm(d.action + " " + what + "?")) return;
      const r = await fetch("/api/actions/" + d.action, {method: "POST", credentials: "same-origin",
        headers: {"Content-Type": "application/json", "X-Stepvault-Action": "confirm"},
        body: JSON.stringify(body)});
      const result = await r.json();
      const out = document.getElementById("gc-result");
      if (out && d.action === "gc-preview") out.textContent = JSON.stringify(result, null, 2);
      else if (!r.ok) alert(result.error);
      else location.reload();
    };
  }
}

document.addEventListener("DOMContentLoaded", () => {
  renderPage().catch(err => console.warn("render", err));
  poll();
  const every = Number(document.body.dataset.refresh || 2);
  if (every > 0) setInterval(poll, every * 1000);
});
