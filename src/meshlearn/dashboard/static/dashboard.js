// meshlearn's live dashboard: renders the state the server pushes (network, run or experiment).
// Text goes in with textContent only: nothing received is ever parsed as HTML.
"use strict";

const PHASES = ["train", "encode", "comm", "average", "eval"];
const PHASE_COLOURS = { train: "#3f6fd8", encode: "#9c27b0", comm: "#f5a623", average: "#2e7d32", eval: "#7a8294" };
const PALETTE = ["#3f6fd8", "#e8710a", "#2e7d32", "#b3261e", "#9c27b0", "#00838f", "#795548", "#c2185b"];
const charts = new Map(); // key -> {plot, names}

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

function splitBar(phases) {
  const total = PHASES.reduce((sum, p) => sum + (phases[p] || 0), 0);
  const bar = el("span", { class: "split", title: PHASES.map((p) => `${p} ${fmt(1000 * (phases[p] || 0), 1)} ms`).join(", ") });
  for (const p of PHASES) {
    const part = el("span");
    part.style.width = total ? (100 * (phases[p] || 0) / total).toFixed(2) + "%" : "0";
    part.style.background = PHASE_COLOURS[p];
    bar.append(part);
  }
  return bar;
}

function phaseLegend() {
  return el("div", { class: "muted" }, "iteration time: ",
    ...PHASES.flatMap((p) => { const key = el("span", { class: "legend-key" }); key.style.background = PHASE_COLOURS[p]; return [key, p]; }));
}

// One line chart, kept across updates (created once per key, then given new data).
function lineChart(key, holder, title, xLabel, names, xs, columns) {
  const points = xs.length;
  const box = el("div", { class: "chart", "data-chart": key, "data-points": points });
  holder.append(box);
  const width = Math.max(320, Math.min(720, (holder.clientWidth || 800) / 2 - 20));
  let entry = charts.get(key);
  const data = [xs, ...columns];
  if (!entry || entry.names.join("\u0000") !== names.join("\u0000")) {
    if (entry) entry.plot.destroy();
    const series = [{ label: xLabel }, ...names.map((name, i) => ({ label: name, stroke: PALETTE[i % PALETTE.length], width: 1.5, spanGaps: true, points: { show: points < 60 } }))];
    const plot = new uPlot({ title, width, height: 220, series, scales: { x: { time: false } }, axes: [{ label: xLabel }, {}] }, data, box);
    entry = { plot, names };
    charts.set(key, entry);
  } else {
    entry.plot.setData(data);
    box.append(entry.plot.root);
  }
  return box;
}

function dropStaleCharts(keep) {
  for (const [key, entry] of charts) {
    if (!keep.has(key)) { entry.plot.destroy(); charts.delete(key); }
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
    const rows = task.providers.map((id) => {
      const p = (task.progress || {})[id] || {};
      return el("tr", { "data-id": id }, el("td", { text: id }), el("td", {}, status(p.state || "claimed")),
        el("td", {}, progressBar(p.iteration || 0, p.iterations || 0), ` ${p.iteration || 0} / ${p.iterations || "?"}`),
        el("td", { text: fmt(p.train_loss) }), el("td", { text: pct(p.test_acc) }));
    });
    box.append(table(["provider", "state", "progress", "train loss", "test accuracy"], rows));
    const curve = task.curve || { iteration: [], series: [] };
    const holder = el("div", { class: "charts" });
    box.append(holder);
    const names = curve.series.map((s) => s.provider);
    keep.add(`acc-${task.id}`); keep.add(`loss-${task.id}`);
    lineChart(`acc-${task.id}`, holder, "test accuracy", "iteration", names, curve.iteration, curve.series.map((s) => s.test_acc));
    lineChart(`loss-${task.id}`, holder, "train loss", "iteration", names, curve.iteration, curve.series.map((s) => s.train_loss));
    if (task.faults && task.faults.length) {
      box.append(el("ul", { class: "faults" }, ...task.faults.map((f) => el("li", { text: `${when(f.at)} ${f.text}` }))));
    }
    if (task.result) box.append(el("p", { class: "result", text: `result: test accuracy ${pct(task.result.accuracy)}` }));
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
  section.append(el("p", { class: "muted", text: `traffic ${bytes(t.bytes_sent)} sent · timeouts ${t.timeouts || 0} · lost chunks ${t.chunks_missing || 0}` + (run.eval.iteration.length ? ` · mean test accuracy ${pct(run.eval.acc_mean[run.eval.acc_mean.length - 1])}` : "") }));
  const holder = el("div", { class: "charts" });
  section.append(holder);
  keep.add(`${prefix}acc`); keep.add(`${prefix}loss`);
  const accNames = ["mean", "mean - std", "mean + std"], e = run.eval;
  const lo = e.acc_mean.map((m, i) => m - e.acc_std[i]), hi = e.acc_mean.map((m, i) => m + e.acc_std[i]);
  const accColumns = [e.acc_mean, lo, hi];
  if (e.attackers_acc) { accNames.push("bad nodes"); accColumns.push(e.attackers_acc); }
  lineChart(`${prefix}acc`, holder, "test accuracy (honest nodes)", "iteration", accNames, e.iteration, accColumns);
  lineChart(`${prefix}loss`, holder, "loss", "iteration", ["train (mean)"], run.train.iteration, [run.train.loss]);
  section.append(el("h3", { text: "Iteration time (median over nodes, latest iteration)" }), splitBar(run.phases || {}), phaseLegend());
  if (run.nodes) {
    const rows = run.nodes.map((n) => el("tr", { "data-rank": n.rank },
      el("td", { text: n.rank + (n.bad ? ` (${n.bad})` : "") }), el("td", { text: n.iteration }),
      el("td", { text: pct(n.test_acc) }), el("td", { text: fmt(n.test_loss) }), el("td", { text: fmt(n.train_loss) }),
      el("td", {}, splitBar(n.phases || {})), el("td", { text: bytes(n.bytes_sent) }),
      el("td", { text: n.timeouts }), el("td", { text: n.chunks_missing })));
    section.append(el("h3", { text: "Nodes" }),
      table(["node", "iteration", "test acc", "test loss", "train loss", "time split", "sent", "timeouts", "lost chunks"], rows, { class: "nodes" }));
  }
  if (run.distribution) {
    const d = run.distribution;
    section.append(el("h3", { text: `Test accuracy across ${d.count} nodes` }),
      table(["min", "10%", "median", "90%", "max"], [el("tr", {}, ...d.quantiles.map((q) => el("td", { text: pct(q) })))], { class: "distribution" }));
    keep.add(`${prefix}hist`);
    const centres = d.histogram.edges.slice(0, -1).map((edge, i) => (edge + d.histogram.edges[i + 1]) / 2);
    lineChart(`${prefix}hist`, section, "nodes per accuracy bin", "test accuracy", ["nodes"], centres, [d.histogram.counts]);
  }
  main.append(section);
}

function renderExperiment(state, main, keep) {
  const rows = state.runs.map((r) => el("tr", { "data-name": r.name }, el("td", { text: r.name }), el("td", {}, status(r.status)),
    el("td", { text: pct(r.accuracy) })));
  main.append(el("section", { id: "runs" }, el("h2", { text: `Runs (${state.runs.filter((r) => r.status === "done").length} / ${state.runs.length} done)` }),
    table(["run", "status", "final accuracy"], rows)));
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
