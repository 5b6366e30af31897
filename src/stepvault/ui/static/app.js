// stepvault dashboard: charts (uPlot), live refresh and confirmed actions. No framework,
// no network beyond this server. Data comes from the JSON endpoints under /api/.
"use strict";

const COLORS = {kept: "#2f6fde", pinned: "#8a3ffc", registered: "#0f9d58", best: "#f29d0b",
                damaged: "#d93025", tier: "#6b7385", stall: "#d93025", write: "#2f6fde", rate: "#0f9d58"};

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

async function getJSON(url) {
  const r = await fetch(url, {headers: {"Accept": "application/json"}, credentials: "same-origin"});
  if (!r.ok) throw new Error(url + ": " + r.status);
  return r.json();
}

function width(box) { return Math.max(320, box.clientWidth - 12); }

function markers(label, color, values) {
  return {label, stroke: color, fill: color, paths: () => null,
          points: {show: true, size: 8, stroke: color, fill: color}, values};
}

// -- run page -----------------------------------------------------------------------------
function renderTimeline(box, doc) {
  box.textContent = "";
  const cps = doc.checkpoints;
  if (!cps.length) { box.append(el("p", {}, "no checkpoints")); return; }
  const t0 = Math.min(...cps.filter(c => !c.error).map(c => c.created).concat([Infinity]));
  const x = cps.map(c => c.step);
  const span = Math.max(...cps.filter(c => !c.error).map(c => c.created - t0).concat([0]));
  const [unit, div] = span < 120 ? ["s", 1] : span < 7200 ? ["min", 60] : ["h", 3600];
  let last = 0;
  const y = cps.map(c => { if (!c.error) last = (c.created - t0) / div; return last; });
  const pick = test => cps.map((c, i) => (test(c) ? y[i] : null));
  const tiers = [...new Set(cps.flatMap(c => c.tiers))].filter(t => t !== "hot");
  const series = [{label: "step"},
    {label: unit + " since first", stroke: "#c5cbd6", width: 1,
     points: {show: true, size: 5, stroke: COLORS.kept, fill: COLORS.kept}},
    markers("pinned", COLORS.pinned, pick(c => c.pinned)),
    markers("registered", COLORS.registered, pick(c => c.registered.length > 0)),
    markers("best", COLORS.best, pick(c => c.best.length > 0)),
    markers("damaged", COLORS.damaged, pick(c => !!c.error))];
  const data = [x, pick(c => !c.error), series[2].values, series[3].values, series[4].values,
                series[5].values];
  for (const t of tiers) {
    series.push(markers("on " + t, COLORS.tier, pick(c => c.tiers.includes(t))));
    data.push(series[series.length - 1].values);
  }
  for (const s of series) delete s.values;
  new uPlot({width: width(box), height: 220, series,
             scales: {x: {time: false}},
             axes: [{label: "step"}, {label: "wall time (" + unit + ")"}]}, data, box);
}

function renderMetrics(box, doc) {
  box.textContent = "";
  const names = Object.keys(doc.metrics);
  if (!names.length) { box.append(el("p", {}, "no metrics recorded")); return; }
  const byStep = Object.fromEntries(doc.checkpoints.map(c => [c.step, c]));
  for (const name of names) {
    const pts = doc.metrics[name];
    const chart = el("div", {"class": "chart metric-chart", "data-metric": name});
    chart.append(el("h3", {}, name + " (best: " + doc.best_modes[name] + ")"));
    box.append(chart);
    const x = pts.map(p => p[0]), y = pts.map(p => p[1]);
    const pick = test => pts.map((p, i) => (byStep[p[0]] && test(byStep[p[0]]) ? y[i] : null));
    new uPlot({width: width(chart), height: 200,
               scales: {x: {time: false}},
               axes: [{label: "step"}, {}],
               series: [{label: "step"}, {label: name, stroke: COLORS.kept, width: 1.5},
                        markers("pinned", COLORS.pinned), markers("registered", COLORS.registered),
                        markers("best", COLORS.best)]},
              [x, y, pick(c => c.pinned), pick(c => c.registered.length > 0),
               pick(c => c.best.includes(name))], chart);
  }
}

function renderSaves(box, doc) {
  const saves = doc.saves.filter(s => s.step !== null && s.step !== undefined);
  if (!saves.length) return;
  box.textContent = "";
  const mb = v => (v === null || v === undefined ? null : v / 1e6);
  new uPlot({width: width(box), height: 200,
             scales: {x: {time: false}},
             axes: [{label: "step"}, {label: "seconds", scale: "s"},
                    {label: "MB/s", scale: "rate", side: 1, grid: {show: false}}],
             series: [{label: "step"},
                      {label: "stall s", stroke: COLORS.stall, scale: "s"},
                      {label: "write s", stroke: COLORS.write, scale: "s"},
                      {label: "throughput MB/s", stroke: COLORS.rate, scale: "rate"}]},
            [saves.map(s => s.step), saves.map(s => s.stall_seconds ?? null),
             saves.map(s => s.write_seconds ?? null), saves.map(s => mb(s.throughput_bytes_per_s))],
            box);
}

async function renderRetention(box) {
  const plan = await getJSON(box.dataset.api + location.search);
  box.textContent = "";
  box.append(el("p", {"class": "sub"}, "policy: " + plan.policy + " · would delete: " +
                (plan.delete.length ? plan.delete.join(", ") : "nothing")));
  const table = el("table", {id: "retention-table"});
  const head = el("tr");
  for (const h of ["step", "verdict", "why"]) head.append(el("th", {}, h));
  table.append(head);
  for (const e of plan.entries.slice().reverse()) {
    const tr = el("tr", {"class": "keep-" + e.keep});
    tr.append(el("td", {}, String(e.step)), el("td", {}, e.keep ? "keep" : "delete next"),
              el("td", {}, e.reasons.join("; ")));
    table.append(tr);
  }
  box.append(table);
}

async function renderPage() {
  const timeline = document.getElementById("timeline-chart");
  if (timeline) {
    const doc = await getJSON(timeline.dataset.api);
    renderTimeline(timeline, doc);
    renderMetrics(document.getElementById("metric-charts"), doc);
    renderSaves(document.getElementById("save-chart"), doc);
  }
  const retention = document.getElementById("retention");
  if (retention) await renderRetention(retention);
  bindActions();
}

// -- live refresh: poll a cheap token, re-render the page when the store changed ------------
let token = null;
async function poll() {
  const live = document.getElementById("live");
  try {
    const now = (await getJSON("/api/changes")).token;
    if (token !== null && now !== token) {
      const r = await fetch(location.href, {credentials: "same-origin"});
      const html = new DOMParser().parseFromString(await r.text(), "text/html");
      const fresh = html.getElementById("main");
      if (fresh) {
        document.getElementById("main").replaceChildren(...fresh.childNodes);
        await renderPage();
      }
    }
    token = now;
    live.textContent = "live · " + new Date().toLocaleTimeString();
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
        if (!body.keep_last && !body.keep_best && !body.keep_every) body.keep_last = "3";
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
