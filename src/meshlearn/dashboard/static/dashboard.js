// meshlearn's live dashboard: renders the state the server pushes (network, run or experiment).
// Text goes in with textContent only: nothing received is ever parsed as HTML.
"use strict";

const PHASES = ["train", "encode", "comm", "average", "eval"];
const PHASE_COLOURS = { train: "#3f6fd8", encode: "#9c27b0", comm: "#f5a623", average: "#2e7d32", eval: "#7a8294" };
const PALETTE = ["#3f6fd8", "#e8710a", "#2e7d32", "#b3261e", "#9c27b0", "#00838f", "#795548", "#c2185b"];
const STD_STROKE = "rgba(63, 111, 216, 0.55)", STD_BAND = "rgba(63, 111, 216, 0.12)";  // the mean's colour, lighter
const BAR_FILL = "rgba(63, 111, 216, 0.55)";
const charts = new Map(); // key -> {plot, signature, box}
const CHART_HEIGHT = 220;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined) continue;
    if (name === "text") node.textContent = String(value);
    else node.setAttribute(name, String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function fmt(value, digits = 3) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  return typeof value === "number" ? value.toFixed(digits) : String(value);
}

function pctAxis(value) { return value === null || value === undefined ? "–" : +(100 * value).toFixed(2) + "%"; }

function pct2(value) { return (100 * value).toFixed(2) + "%"; }

function pct(value) { return value === null || value === undefined ? "–" : (100 * value).toFixed(1) + "%"; }

function bytes(value) {
  if (value === null || value === undefined) return "–";
  const units = ["B", "kB", "MB", "GB", "TB"];
  let v = value, i = 0;
  while (v >= 1000 && i < units.length - 1) { v /= 1000; i++; }
  return v.toFixed(i ? 1 : 0) + " " + units[i];
}

function ago(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  return seconds < 90 ? seconds.toFixed(0) + " s ago" : (seconds / 60).toFixed(0) + " min ago";
}

function when(epoch) { return epoch ? new Date(epoch * 1000).toLocaleTimeString() : "–"; }

function status(value) { return el("span", { class: "status", "data-status": value, text: value }); }

function table(headers, rows, attrs) {
  return el("table", attrs || {}, el("thead", {}, el("tr", {}, ...headers.map((h) => el("th", { text: h })))),
    el("tbody", {}, ...rows));
}

function progressBar(done, total) {
  const share = total ? Math.min(1, done / total) : 0;
  const inner = el("span");
  inner.style.width = (100 * share).toFixed(1) + "%";
  return el("span", { class: "bar", title: `${done} / ${total}` }, inner);
}

// A duration in seconds with its unit: ms under a second, s from one second on.
function duration(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return "–";
  if (seconds >= 1) return seconds.toFixed(2) + " s";
  const ms = 1000 * seconds;
  return (ms >= 1 ? ms.toFixed(1) : ms >= 0.01 ? ms.toPrecision(2) : ms > 0 ? "<0.01" : "0") + " ms";
}

// Each phase's share of an iteration, stacked; with ``labels`` each wide enough part says its time.
function splitBar(phases, labels) {
  const total = PHASES.reduce((sum, p) => sum + (phases[p] || 0), 0);
  const bar = el("span", { class: labels ? "split split-main" : "split",
    title: PHASES.map((p) => `${p} ${duration(phases[p] || 0)}`).join(", ") });
  for (const p of PHASES) {
    const share = total ? (phases[p] || 0) / total : 0;
    const part = el("span", { "data-phase": p }, labels && share >= 0.12 ? `${p} ${duration(phases[p])}` : null);
    part.style.width = (100 * share).toFixed(2) + "%";
    part.style.background = PHASE_COLOURS[p];
    bar.append(part);
  }
  return bar;
}

// The phases' colours, each with its time and unit, and the whole iteration's.
function phaseLegend(phases) {
  const total = PHASES.reduce((sum, p) => sum + (phases[p] || 0), 0);
  return el("div", { class: "phase-legend" },
    ...PHASES.map((p) => {
      const key = el("span", { class: "legend-key" });
      key.style.background = PHASE_COLOURS[p];
      return el("span", { class: "phase", "data-phase": p }, key, `${p} ${duration(phases[p] || 0)}`);
    }),
    el("span", { class: "phase total", text: `= ${duration(total)} per iteration` }));
}

// ``object`` without its undefined values (uPlot would take them over its defaults).
function defined(object) {
  return Object.fromEntries(Object.entries(object).filter(([, value]) => value !== undefined));
}

function totalTime(phases) {
  return el("span", { class: "muted", text: duration(PHASES.reduce((sum, p) => sum + (phases[p] || 0), 0)) });
}

// The latest value of a column that is not null (what a legend shows while the cursor is away).
function latest(column) {
  for (let i = column.length - 1; i >= 0; i--) if (column[i] !== null && column[i] !== undefined) return column[i];
  return null;
}

// A chart's legend value: the hovered point's, or the latest one while the cursor is not over it.
function legendValue(format) {
  return (u, value, sidx, idx) => {
    const shown = idx === null || idx === undefined ? latest(u.data[sidx] || []) : value;
    return shown === null || shown === undefined ? "–" : format(shown, u);
  };
}

const resizes = new ResizeObserver((entries) => {
  for (const entry of entries) {
    const chart = entry.target.chart;
    const width = Math.floor(entry.contentRect.width);
    if (chart && width > 0 && width !== chart.width) chart.setSize({ width, height: CHART_HEIGHT });
  }
});

// One chart, kept across updates (created once per key, then given new data) in a box that keeps
// its place in the page's flow; the chart is as wide as its box, and follows it when it resizes.
// ``series``: [{label, stroke, width, dash, fill, bars}] drawn in this order (the last on top);
// ``options``: {bands, xFormat and yFormat (axis values), xLegend and yLegend (the legend's), xRange}.
function chart(key, holder, title, xLabel, series, xs, columns, options = {}) {
  const points = xs.length;
  let entry = charts.get(key);
  const data = [xs, ...columns];
  const signature = series.map((s) => s.label).join("\u0000");
  if (!entry || entry.signature !== signature) {
    if (entry) { resizes.unobserve(entry.box); entry.plot.destroy(); }
    const box = entry ? entry.box : el("div", { class: "chart", "data-chart": key });
    const xFormat = options.xLegend || options.xFormat || ((v) => fmt(v, Number.isInteger(v) ? 0 : 3));
    const yFormat = options.yLegend || options.yFormat || ((v) => fmt(v));
    const config = [{ label: xLabel, value: legendValue(xFormat) }, ...series.map((s) => defined({
      label: s.label, stroke: s.stroke, width: s.width || 1.5, dash: s.dash, fill: s.fill, spanGaps: true,
      value: legendValue(yFormat),
      paths: s.bars ? uPlot.paths.bars({ size: [0.9, Infinity], align: 0 }) : undefined,
      points: { show: s.bars || s.dash ? false : (u) => u.data[0].length < 60 } }))];  // dots while few
    const axis = (format) => (format ? { values: (u, values) => values.map(format) } : {});
    const plot = new uPlot(defined({ title, width: box.clientWidth || 480, height: CHART_HEIGHT, series: config,
      bands: options.bands, scales: { x: defined({ time: false, range: options.xRange }) },
      axes: [{ label: xLabel, ...axis(options.xFormat) }, axis(options.yFormat)] }), data, box);
    entry = { plot, signature, box };
    box.chart = plot;
    charts.set(key, entry);
    resizes.observe(box);
  } else {
    entry.plot.setData(data);
  }
  entry.box.dataset.points = points;
  holder.append(entry.box);
  return entry.box;
}

// Every chart as wide as its box: once the page is laid out (the boxes get their width only then).
function fitCharts() {
  for (const { plot, box } of charts.values()) {
    const width = Math.floor(box.getBoundingClientRect().width);
    if (width > 0 && width !== plot.width) plot.setSize({ width, height: CHART_HEIGHT });
  }
}

function lineChart(key, holder, title, xLabel, names, xs, columns, options) {
  const series = names.map((name, i) => ({ label: name, stroke: PALETTE[i % PALETTE.length] }));
  return chart(key, holder, title, xLabel, series, xs, columns, options);
}

function dropStaleCharts(keep) {
  for (const [key, entry] of charts) {
    if (!keep.has(key)) { resizes.unobserve(entry.box); entry.plot.destroy(); charts.delete(key); }
  }
}

// ---- the network (a bootstrap) ----------------------------------------------------------------

function renderNetwork(state, main, keep) {
  const providers = state.providers.map((p) => el("tr", { "data-id": p.id, "data-status": p.status },
    el("td", { text: p.id }), el("td", {}, status(p.status)), el("td", { text: p.task || "" }),
    el("td", { text: p.device }), el("td", { text: p.cores }), el("td", { text: fmt(p.ram_gb, 1) + " GB" }),
    el("td", { text: p.location || "–" }), el("td", { text: p.reachable ? "direct" : "relay" }),
    el("td", { text: ago(p.seen_s) }), el("td", { text: p.key || "–", title: p.key_full || "" })));
  main.append(el("section", { id: "providers" },
    el("h2", { text: `Providers (${state.providers.length})` }),
    state.providers.length ? table(["id", "status", "task", "device", "cores", "RAM", "location", "reached", "last heartbeat", "key"], providers)
      : el("p", { class: "muted", text: "no provider has registered yet" })));

  const tasks = el("section", { id: "tasks" }, el("h2", { text: `Tasks (${state.tasks.length})` }));
  if (!state.tasks.length) tasks.append(el("p", { class: "muted", text: "no task yet" }));
  for (const task of state.tasks) {
    const box = el("div", { class: "task", "data-id": task.id, "data-status": task.status });
    box.append(el("h3", {}, `task ${task.id} `, status(task.status), el("span", { class: "muted", text: ` requested by ${task.requester}, ${when(task.created)}` + (task.leader ? `, leader ${task.leader}` : "") })));
    if (task.live === false) {  // reported to an earlier run of this bootstrap: the registry's record is all there is
      const released = task.released ? ` · released ${when(task.released.at)} (${task.released.detail})` : "";
      box.append(el("p", { class: "muted no-live" },
        `registry status ${task.status} · providers ${task.providers.join(", ") || "none"}${released}`),
        el("p", { class: "muted no-live", text: task.note }));
      tasks.append(box);
      continue;
    }
    const rows = task.providers.map((id) => {
      const p = (task.progress || {})[id];
      if (!p) {  // claimed, no report about it yet
        return el("tr", { "data-id": id }, el("td", { text: id }), el("td", {}, status("claimed")),
          el("td", { class: "muted", text: "no report yet" }), el("td", { text: "–" }), el("td", { text: "–" }));
      }
      return el("tr", { "data-id": id }, el("td", { text: id }), el("td", {}, status(p.state || "claimed")),
        el("td", {}, progressBar(p.iteration || 0, p.iterations || 0), ` ${p.iteration || 0} / ${p.iterations || "?"}`),
        el("td", { text: fmt(p.train_loss) }), el("td", { text: pct(p.test_acc) }));
    });
    box.append(table(["provider", "state", "progress", "train loss", "test accuracy"], rows));
    const curve = task.curve || { iteration: [], series: [] };
    if (curve.iteration.length) {
      const holder = el("div", { class: "charts" });
      box.append(holder);
      const names = curve.series.map((s) => s.provider);
      keep.add(`acc-${task.id}`); keep.add(`loss-${task.id}`);
      lineChart(`acc-${task.id}`, holder, "test accuracy", "iteration", names, curve.iteration,
        curve.series.map((s) => s.test_acc), { yFormat: pctAxis, yLegend: pct2 });
      lineChart(`loss-${task.id}`, holder, "train loss", "iteration", names, curve.iteration,
        curve.series.map((s) => s.train_loss));
    }
    if (task.faults && task.faults.length) {
      box.append(el("ul", { class: "faults" }, ...task.faults.map((f) => el("li", { text: `${when(f.at)} ${f.text}` }))));
    }
    if (task.result) {
      const perplexity = task.result.perplexity !== null && task.result.perplexity !== undefined;
      box.append(el("p", { class: "result", text: perplexity ? `result: test perplexity ${fmt(task.result.perplexity, 2)}, next-token accuracy ${pct(task.result.accuracy)}`
        : `result: test accuracy ${pct(task.result.accuracy)}` }));
    }
    tasks.append(box);
  }
  main.append(tasks);

  const history = state.history.map((h) => el("tr", {}, el("td", { text: when(h.at) }), el("td", { text: h.kind }),
    el("td", { text: h.subject }), el("td", { text: h.detail || "" })));
  main.append(el("section", { id: "history" }, el("h2", { text: "Registry history" }),
    history.length ? table(["time", "event", "who", "detail"], history) : el("p", { class: "muted", text: "nothing yet" })));
}

// ---- a run (simulate) and an experiment -------------------------------------------------------

function renderRun(run, main, keep, prefix) {
  const c = run.config || {};
  const section = el("section", { class: "run", "data-name": run.name, "data-status": run.status });
  section.append(el("h2", {}, `${run.name} `, status(run.status),
    el("span", { class: "muted", text: ` ${c.algorithm || ""} · ${c.nodes || "?"} nodes · ${c.topology || ""} · ${c.dataset || ""} · ${c.engine || ""} · iteration ${run.iteration} / ${c.iterations || "?"}` })));
  const t = run.totals || {};
  // the task's own metric leads: a language model's perplexity (lower is better), else accuracy
  const lm = run.metric === "perplexity", e = run.eval, mean = PALETTE[0];
  const headline = lm ? { name: "test perplexity", mean: e.ppl_mean, std: e.ppl_std, show: (v) => fmt(v, 2), axis: (v) => fmt(v, 2) }
    : { name: "test accuracy", mean: e.acc_mean, std: e.acc_std, show: pct, axis: pctAxis, legend: pct2 };
  section.append(el("p", { class: "muted", text: `traffic ${bytes(t.bytes_sent)} sent · timeouts ${t.timeouts || 0} · lost chunks ${t.chunks_missing || 0}` + (e.iteration.length ? ` · mean ${headline.name} ${headline.show(headline.mean[headline.mean.length - 1])}` : "") }));
  if (run.privacy) section.append(el("p", { class: "privacy", text: `DP-SGD: epsilon ${Number(run.privacy.epsilon).toPrecision(3)} spent at delta ${run.privacy.delta} (the most of any node)` }));
  const holder = el("div", { class: "charts" });
  section.append(holder);
  keep.add(`${prefix}acc`); keep.add(`${prefix}loss`);
  // the mean is drawn last (on top), its std as a light band between thin dashed lines
  const lo = headline.mean.map((m, i) => (m === null ? null : m - (headline.std[i] || 0)));
  const hi = headline.mean.map((m, i) => (m === null ? null : m + (headline.std[i] || 0)));
  const accSeries = [{ label: "mean - std", stroke: STD_STROKE, width: 1, dash: [4, 3] },
    { label: "mean + std", stroke: STD_STROKE, width: 1, dash: [4, 3] }];
  const accColumns = [lo, hi];
  if (e.attackers_acc && !lm) { accSeries.push({ label: "bad nodes", stroke: PALETTE[3] }); accColumns.push(e.attackers_acc); }
  accSeries.push({ label: "mean", stroke: mean, width: 2.5 });
  accColumns.push(headline.mean);
  chart(`${prefix}acc`, holder, `${headline.name} (honest nodes)`, "iteration", accSeries, e.iteration, accColumns,
    defined({ bands: [{ series: [2, 1], fill: STD_BAND }], yFormat: headline.axis, yLegend: headline.legend }));
  lineChart(`${prefix}loss`, holder, "loss", "iteration", ["train (mean)"], run.train.iteration, [run.train.loss]);
  const modelled = run.clock === "modelled" ? ", modelled by the batched engine's cost model" : "";
  section.append(el("h3", { text: `Iteration time (mean over nodes and iterations so far${modelled})` }),
    el("div", { class: "iteration-time" }, splitBar(run.phases || {}, true), phaseLegend(run.phases || {})));
  if (run.nodes) {
    const rows = run.nodes.map((n) => el("tr", { "data-rank": n.rank },
      el("td", { text: n.rank + (n.bad ? ` (${n.bad})` : "") }), el("td", { text: n.iteration }),
      el("td", { text: lm ? fmt(n.test_perplexity, 2) : pct(n.test_acc) }), el("td", { text: fmt(n.test_loss) }), el("td", { text: fmt(n.train_loss) }),
      el("td", {}, splitBar(n.phases || {}), " ", totalTime(n.phases || {})), el("td", { text: bytes(n.bytes_sent) }),
      el("td", { text: n.timeouts }), el("td", { text: n.chunks_missing })));
    section.append(el("h3", { text: "Nodes" }),
      table(["node", "iteration", lm ? "test ppl" : "test acc", "test loss", "train loss", "time split (per iteration)", "sent",
        "timeouts", "lost chunks"], rows, { class: "nodes" }));
  }
  if (run.distribution) {
    const d = run.distribution;
    section.append(el("h3", { text: `${lm ? "Test perplexity" : "Test accuracy"} across ${d.count} nodes` }),
      table(["min", "10%", "median", "90%", "max"], [el("tr", {}, ...d.quantiles.map((q) => el("td", { text: headline.show(q) })))], { class: "distribution" }));
    keep.add(`${prefix}hist`);
    const histogram = el("div", { class: "charts" });
    section.append(histogram);
    // a bar per bin, centred on it; the x range spans the bins' edges (bins move as the run goes)
    const edges = d.histogram.edges;
    const centres = edges.slice(0, -1).map((edge, i) => (edge + edges[i + 1]) / 2);
    const half = (u) => (u.data[0].length > 1 ? (u.data[0][1] - u.data[0][0]) / 2 : 0.005);
    chart(`${prefix}hist`, histogram, `nodes per ${lm ? "perplexity" : "accuracy"} bin`, headline.name,
      [{ label: "nodes", stroke: PALETTE[0], fill: BAR_FILL, bars: true }], centres, [d.histogram.counts],
      { xFormat: headline.axis, yFormat: (v) => fmt(v, 0),
        xRange: (u) => (u.data[0].length ? [u.data[0][0] - half(u), u.data[0][u.data[0].length - 1] + half(u)]
          : [0, 1]),
        xLegend: (v, u) => `${headline.axis(v - half(u))} to ${headline.axis(v + half(u))}` });
  }
  main.append(section);
}

function renderExperiment(state, main, keep) {
  const lm = state.runs.some((r) => r.perplexity !== null && r.perplexity !== undefined);  // language models
  const rows = state.runs.map((r) => el("tr", { "data-name": r.name }, el("td", { text: r.name }), el("td", {}, status(r.status)),
    el("td", { text: lm ? fmt(r.perplexity, 2) : pct(r.accuracy) })));
  main.append(el("section", { id: "runs" }, el("h2", { text: `Runs (${state.runs.filter((r) => r.status === "done").length} / ${state.runs.length} done)` }),
    table(["run", "status", lm ? "final perplexity" : "final accuracy"], rows)));
  if (state.current) renderRun(state.current, main, keep, "current-");
}

function render(state) {
  document.getElementById("title").textContent = state.title || "meshlearn";
  document.title = (state.title || "meshlearn") + " · meshlearn";
  const main = document.getElementById("main");
  const scrolled = window.scrollY;
  const fresh = el("main", { id: "main", "data-kind": state.kind });
  main.replaceWith(fresh);
  const keep = new Set();
  if (state.kind === "network") renderNetwork(state, fresh, keep);
  else if (state.kind === "experiment") renderExperiment(state, fresh, keep);
  else if (state.kind === "run") renderRun(state, fresh, keep, "");
  else if (state.kind === "error") fresh.append(el("p", { class: "faults", text: `the service could not say its state: ${state.message}` }));
  else fresh.append(el("p", { class: "muted", text: `unknown view ${state.kind}` }));
  dropStaleCharts(keep);
  fitCharts();
  window.scrollTo(0, scrolled);
}

function connect() {
  const badge = document.getElementById("connection");
  const events = new EventSource("/api/events");
  events.onopen = () => { badge.dataset.state = "live"; badge.textContent = "live"; };
  events.onmessage = (message) => render(JSON.parse(message.data));
  events.onerror = () => { badge.dataset.state = "lost"; badge.textContent = "reconnecting"; };
}

const first = document.getElementById("state");  // the state when the page was served
if (first) render(JSON.parse(first.textContent));
connect();
