// The Tally dashboard: job and session list, job page (live charts over SSE), sweep page
// (overlays).
"use strict";

const app = document.getElementById("app");
const conn = document.getElementById("conn");
const ACTIVE = ["queued", "pending", "running"];
let cleanup = [];

// A controller with TALLY_API_TOKEN refuses changes without it: the page asks once, keeps
// it in this browser (localStorage) and sends it as a bearer header; the server never
// hands it out.
const TOKEN_KEY = "tally-api-token";
async function api(path, options = {}, asked = false) {
  const token = localStorage.getItem(TOKEN_KEY);
  const headers = { ...(options.headers || {}), ...(token ? { Authorization: `Bearer ${token}` } : {}) };
  const response = await fetch(path, { ...options, headers });
  const body = await response.json().catch(() => ({}));
  if (response.status === 401 && !asked) {
    const given = window.prompt("This controller needs its API token (TALLY_API_TOKEN):");
    if (given) {
      localStorage.setItem(TOKEN_KEY, given.trim());
      return api(path, options, true);
    }
  }
  if (response.status === 401 && asked) localStorage.removeItem(TOKEN_KEY);
  if (!response.ok) throw new Error(body.detail || `${response.status} ${response.statusText}`);
  return body;
}

const fmt = {
  time: (t) => (t ? new Date(t * 1000).toLocaleString() : "–"),
  num: (v, d = 3) => (v === null || v === undefined ? "–" : Number(v).toFixed(d)),
  step: (j) => `${j.last_step === null ? 0 : j.last_step + 1}/${j.num_steps}`,
};
const badge = (status) => el("span", { class: `badge ${status}`, "data-status": status }, status);
const link = (href, text) => el("a", { href, onclick: (e) => { e.preventDefault(); go(href); } },
  text);
function every(ms, fn) { const id = setInterval(fn, ms); cleanup.push(() => clearInterval(id)); }
const listTable = (id, headers, body) => el("table", { class: "list", id },
  el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))), body);

function go(path) { history.pushState({}, "", path); route(); }
window.addEventListener("popstate", route);

function route() {
  cleanup.forEach((f) => f());
  cleanup = [];
  conn.className = "conn";
  app.replaceChildren();
  const [, kind, id] = location.pathname.split("/");
  if (kind === "jobs" && id) jobPage(decodeURIComponent(id));
  else if (kind === "sweeps" && id) sweepPage(decodeURIComponent(id));
  else listPage();
}

// ---- job list ------------------------------------------------------------------------

function listPage() {
  document.title = "Tally — jobs";
  const jobsBody = el("tbody");
  const sweepsBody = el("tbody");
  const sessionsBody = el("tbody");
  app.append(
    el("h2", {}, "Jobs"),
    listTable("jobs", ["ID", "name", "status", "mode", "reward", "step", "started"], jobsBody),
    el("h2", {}, "Sweeps"),
    listTable("sweeps", ["ID", "name", "status", "runs", "created"], sweepsBody),
    el("h2", {}, "Training sessions"),
    listTable("sessions", SESSION_COLUMNS, sessionsBody));
  async function refresh() {
    const [jobs, sweeps, sessions] = await Promise.all([api("/api/jobs?limit=100"),
      api("/api/sweeps?limit=50"), api("/api/sessions")]);
    jobsBody.replaceChildren(...jobs.items.map((j) => el("tr", { "data-job": j.id },
      el("td", {}, link(`/jobs/${j.id}`, j.id)), el("td", {}, j.name), el("td", {}, badge(j.status)),
      el("td", {}, j.mode), el("td", { class: "num" }, fmt.num(j.reward_mean)),
      el("td", { class: "num" }, fmt.step(j)), el("td", {}, fmt.time(j.started_at)))));
    if (!jobs.items.length) jobsBody.append(el("tr", {}, el("td", { colspan: 7, class: "muted" },
      "No jobs yet: tally submit configs/demo.yaml")));
    sweepsBody.replaceChildren(...sweeps.items.map((s) => el("tr", { "data-sweep": s.id },
      el("td", {}, link(`/sweeps/${s.id}`, s.id)), el("td", {}, s.name), el("td", {},
        badge(s.status)), el("td", { class: "num" }, s.jobs.length),
      el("td", {}, fmt.time(s.created_at)))));
    sessionsBody.replaceChildren(...sessions.items.map(sessionRow));
    if (!sessions.items.length) sessionsBody.append(el("tr", {}, el("td", {
      colspan: SESSION_COLUMNS.length, class: "muted" },
    "No training sessions: POST /api/sessions (docs/training-api.md)")));
  }
  refresh().catch(showError);
  every(3000, () => refresh().catch(() => {}));
}

// A session has no page of its own: its row is all the dashboard shows of it (the numbers
// the controller stored after its last call). A failed one tells why on hover; a queued
// one why it waits, under its status, as a job's page does (p.waiting).
const SESSION_COLUMNS = ["ID", "status", "model", "ranks", "step", "tokens", "loss", "updated"];
const sessionRow = (s) => el("tr", { "data-session": s.id },
  el("td", {}, s.id), el("td", { title: s.error }, badge(s.status),
    s.status === "queued" && s.waiting ? el("p", { class: "waiting" }, s.waiting) : null),
  el("td", {}, s.model),
  el("td", { class: "num" }, s.world_size), el("td", { class: "num" }, s.step),
  el("td", { class: "num" }, s.tokens), el("td", { class: "num" }, fmt.num(s.loss)),
  el("td", {}, fmt.time(s.updated_at)));

function showError(err) {
  app.append(el("p", { class: "error" }, String(err.message || err)));
}

// ---- one job ---------------------------------------------------------------------------

function jobHeader(job) {
  const facts = [["mode", job.mode], ["step", fmt.step(job)], ["reward", fmt.num(job.reward_mean)],
    ["started", fmt.time(job.started_at)], ["finished", fmt.time(job.finished_at)],
    ["source", job.source], ["folder", job.output_dir]];
  const header = el("div", { class: "job-header", id: "job-header" },
    el("h2", {}, job.name, " ", badge(job.status)),
    el("dl", { class: "facts" }, facts.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)])),
    job.sweep_id ? el("p", {}, "part of sweep ", link(`/sweeps/${job.sweep_id}`, job.sweep_id),
      ` (${job.sweep_label})`) : null);
  if (ACTIVE.includes(job.status)) {
    header.append(el("button", { class: "cancel", onclick: async (e) => {
      e.target.disabled = true;
      try { await api(`/api/jobs/${job.id}/cancel`, { method: "POST" }); } catch (err) {
        e.target.replaceWith(el("span", { class: "error" }, `cancel: ${err.message}`));
      }
    } }, "Cancel"));
  }
  const lastEvent = job.events && job.events.length ? job.events[job.events.length - 1] : null;
  if (lastEvent && lastEvent.kind === "waiting" && ACTIVE.includes(job.status)) {
    header.append(el("p", { class: "waiting", id: "waiting" }, lastEvent.message));
  }
  if (job.events && job.events.length) {
    header.append(el("details", { class: "events", id: "events" },
      el("summary", {}, `events (${job.events.filter((e) => e.kind === "restart").length} restarts)`),
      el("ul", {}, ...job.events.map((e) => el("li", {},
        `${new Date(e.time * 1000).toLocaleTimeString()} ${e.kind}: ${e.message}`)))));
  }
  if (job.error || job.log_tail) {
    header.append(el("div", { class: "failure", id: "failure" },
      job.error ? el("p", {}, el("strong", {}, "error: "), job.error) : null,
      job.log_tail ? el("pre", { class: "logs" }, job.log_tail) : null));
  }
  return header;
}

async function jobPage(id) {
  document.title = `Tally — job ${id}`;
  let job;
  try { job = await api(`/api/jobs/${id}`); } catch (err) { showError(err); return; }
  let header = jobHeader(job);
  const sections = JOB_SECTIONS.map((s) => ({ ...s, grid: el("div", { class: "grid" }) }));
  for (const s of sections) {
    s.node = el("section", { class: "chart-section", "data-section": s.id, hidden: "" },
      el("h2", {}, s.title), s.grid);
  }
  const samples = samplesPanel(id);
  app.append(header, ...sections.map((s) => s.node), samples.node);
  const charts = JOB_CHARTS.map((c) => new Chart(sections.find((s) => s.id === c.section).grid,
    c.id, c.title, c.seriesOf ? [] : c.series.map((s) => ({ ...s, chosen: s.mode === job.mode,
      dash: s.mode && s.mode !== job.mode, color: s.mode ? MODE_COLOR[s.mode] : undefined })),
    c));
  const cols = new Columns();
  const lastValue = (name) => (cols.series[name] || []).findLast((v) => v !== null);
  const draw = () => {
    charts.forEach((c, i) => {
      const { seriesOf, seriesNote } = JOB_CHARTS[i];
      if (seriesOf) c.useSeries(seriesOf(cols));
      if (seriesNote) c.setNote(seriesNote(c.series));
      c.setData(cols.table(c.series.map((s) => s.name)));
      c.card.hidden = Boolean(JOB_CHARTS[i].feature) && !c.points;
      const note = JOB_CHARTS[i].note;
      if (note) c.setNote(lastValue(note.name) === undefined ? "" : note.text(lastValue(note.name)));
    });
    // A section shows once one of its charts has points; a core one also before any step.
    for (const s of sections) {
      s.node.hidden = !(charts.some((c, i) => JOB_CHARTS[i].section === s.id && c.points)
        || (s.core && !cols.steps.length));
    }
  };
  const first = await api(`/api/jobs/${id}/metrics?names=${namesParam(JOB_METRICS)}&max_points=5000`);
  const last = first.steps.length ? first.steps[first.steps.length - 1] : -1;
  const parts = rewardPartSeries(first.names).map((s) => s.name);
  if (parts.length) {  // the parts' names come with the first answer: their series next
    const more = await api(`/api/jobs/${id}/metrics?names=${namesParam(parts)}&end=${last}&max_points=5000`);
    const at = new Map(more.steps.map((step, i) => [step, i]));
    for (const name of parts) {
      first.series[name] = first.steps.map((step) => (more.series[name] || [])[at.get(step)] ?? null);
    }
  }
  cols.append(first.steps, first.series);
  draw();
  samples.refresh();
  const events = new EventSource(`/api/jobs/${id}/events?after=${last}`);
  cleanup.push(() => events.close());
  events.onopen = () => { conn.className = "conn live"; };
  events.onerror = () => { conn.className = "conn"; };
  events.addEventListener("metrics", (e) => { const d = JSON.parse(e.data);
    cols.append(d.steps, d.series); draw(); samples.refresh(); });
  events.addEventListener("status", async (e) => {
    const state = JSON.parse(e.data);
    if (!state) return;
    const full = state.status !== job.status ? await api(`/api/jobs/${id}`) : { ...job, ...state };
    job = full;
    const fresh = jobHeader(job);
    header.replaceWith(fresh);
    header = fresh;
  });
  events.addEventListener("end", () => {
    events.close();
    conn.className = "conn";
    samples.refresh();
  });
}

// ---- one sweep -------------------------------------------------------------------------

async function sweepPage(id) {
  document.title = `Tally — sweep ${id}`;
  const head = el("div", { class: "job-header" });
  const runsBody = el("tbody");
  const grid = el("div", { class: "grid" });
  app.append(head, listTable("runs", ["run", "job", "status", "step", "reward"], runsBody), grid);
  const charts = {};
  const held = {};  // job id -> {steps, series}: what the page has; refreshes add to it
  async function refresh() {
    const after = Object.entries(held).filter(([, r]) => r.steps.length)
      .map(([job, r]) => `&after=${job}:${r.steps[r.steps.length - 1]}`).join("");
    const [sweep, data] = await Promise.all([api(`/api/sweeps/${id}`),
      api(`/api/sweeps/${id}/metrics?names=${namesParam(SWEEP_METRICS)}${after}`)]);
    for (const r of data.runs) {  // only the steps after `after` came: append them
      const run = held[r.job_id] ||= { steps: [], series: {} };
      for (const name of SWEEP_METRICS) {
        const values = r.series[name] || r.steps.map(() => null);
        run.series[name] = (run.series[name] || run.steps.map(() => null)).concat(values);
      }
      run.steps = run.steps.concat(r.steps);
      Object.assign(r, run);
    }
    head.replaceChildren(el("h2", {}, `sweep ${sweep.name} `, badge(sweep.status)),
      el("p", { class: "muted" }, `${sweep.jobs.length} runs varying ${sweep.axis === "modes"
        ? "the aggregation mode" : "overrides"}; one series per run in each chart`));
    runsBody.replaceChildren(...sweep.jobs.map((j) => el("tr", {},
      el("td", {}, j.sweep_label), el("td", {}, link(`/jobs/${j.id}`, j.id)),
      el("td", {}, badge(j.status)), el("td", { class: "num" }, fmt.step(j)),
      el("td", { class: "num" }, fmt.num(j.reward_mean)))));
    const runs = data.runs;
    for (const name of SWEEP_METRICS) {
      if (!charts[name]) {
        charts[name] = new Chart(grid, name, name, runs.map((r, i) => ({ name: r.job_id,
          metric: name, label: r.label, mode: r.mode, color: sweep.axis === "modes"
            ? MODE_COLOR[r.mode] : PALETTE[i % PALETTE.length] })));
      }
      const tables = runs.map((r) => [r.steps, r.series[name] || r.steps.map(() => null)]);
      charts[name].setData(tables.length ? uPlot.join(tables) : [[]]);
    }
    return ACTIVE.includes(sweep.status);
  }
  let active;
  try { active = await refresh(); } catch (err) { showError(err); return; }
  if (active) {
    conn.className = "conn live";
    every(3000, async () => {
      if (!(await refresh().catch(() => true))) conn.className = "conn";
    });
  }
}

route();
