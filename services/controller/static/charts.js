// Charts of the dashboard: thin helpers over uPlot (vendored, static/uPlot.iife.min.js).
"use strict";

const MODES = ["sample_mean", "token_mean", "prompt_mean", "constant"];
const PALETTE = ["#4269d0", "#efb118", "#ff725c", "#6cc5b0", "#3ca951", "#ff8ab7",
  "#a463f2", "#97bbf5", "#9c6b4e", "#9498a0"];
const MODE_COLOR = Object.fromEntries(MODES.map((m, i) => [m, PALETTE[i]]));
const PHASES = ["train", "sync", "checkpoint"]; // of a rank's perf/peak_mem_gb/<phase>
const STEP_INCRS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000, 10000,
  20000, 50000, 100000, 200000, 500000, 1000000];

// Metrics logged only on some steps (evaluation, a checkpoint's memory): drawn with their
// points, lines across the steps between them.
const SPARSE_METRICS = new Set(["eval/accuracy", "eval/pass@k", "perf/peak_mem_gb/checkpoint"]);

// Metrics that are fractions: a chart of only these keeps its y-axis inside [0, 1].
const FRACTION_METRICS = new Set(["clip_fraction", "clip_fraction/min", "clip_fraction/max",
  "padding_fraction", "eval/accuracy", "eval/pass@k", "env/policy_token_share",
  "env/done_fraction", "rollout/partial_fraction"]);

// The y-range a chart draws from its data's [min, max]: uPlot's padded range of the data,
// a flat series ±10 % of its value (±0.1 at 0: uPlot alone draws 0 on 0–100), and
// inside `bounds` when given (a fraction's [0, 1]). No data: `bounds`, else [0, 1].
function fitRange(min, max, bounds) {
  if (!Number.isFinite(min) || !Number.isFinite(max)) return bounds ? [...bounds] : [0, 1];
  const half = min === 0 ? 0.1 : Math.abs(min) * 0.1; // of a flat series
  const [lo, hi] = max > min ? uPlot.rangeNum(min, max, 0.1, true) : [min - half, max + half];
  return bounds ? [Math.max(lo, bounds[0]), Math.min(hi, bounds[1])] : [lo, hi];
}

// Shares of the step's pg weight per mode on one third of its responses by valid tokens
// (trainer/aggregation.py: length_bias); token_mean and constant coincide by design.
const lengthBias = (bucket, which) => ({ id: `length_bias_${bucket}`,
  title: `length bias: share of the step's weight on the ${which} third of responses`,
  yRange: [0, 1], hint: "token_mean and constant coincide: both weigh a response by its tokens M_i",
  series: MODES.map((m) => ({ name: `length_bias/${m}/${bucket}`, label: m, mode: m })) });

// What an environment chart says on a job without one.
const NO_ENVIRONMENT = "no environment (rollout.environment)";
// What a critic chart says on a job without one.
const NO_CRITIC = "no critic (critic.enabled)";
// What a partial-rollout chart says on an asynchronous job without them.
const NO_PARTIAL = "no partial rollouts (rollout.partial_rollout)";

// Staleness in weight versions (step − version): with partial rollouts each response
// token keeps the version that sampled it, so the step logs the mean and max over its
// tokens; without, only the rollout's (services/driver/pipeline.py). A synchronous job's
// rollouts all come from their step's own weights (0 at every step): nothing to chart.
const TOKEN_STALENESS = [{ name: "rollout/staleness_mean", label: "mean over tokens" },
  { name: "rollout/staleness_max", label: "max over tokens" }];
const ROLLOUT_STALENESS = [{ name: "rollout/staleness", label: "rollout" }];
const stalenessSeries = (cols) => {
  if (TOKEN_STALENESS.some((s) => cols.logged(s.name).length)) return TOKEN_STALENESS;
  return cols.logged("rollout/staleness").some((v) => v > 0) ? ROLLOUT_STALENESS : [];
};

// The job page's sections, in page order: each a heading over its charts. A section none
// of whose charts has points is hidden (a feature the job does not use: its critic, its
// environment); a `core` one shows its empty charts until the job's first step.
const JOB_SECTIONS = [
  { id: "loss", title: "Loss and aggregation", core: true },
  { id: "rewards", title: "Rewards", core: true },
  { id: "critic", title: "Critic" },
  { id: "environment", title: "Environment" },
  { id: "async", title: "Asynchrony" },
  { id: "system", title: "System", core: true },
];

// What a job page charts, section by section (JOB_SECTIONS, in page order): title ->
// series (metric name, label); `seriesOf(cols)` picks those drawn from what the job
// logged (Columns; `series` then lists what to ask for), `seriesNote(series)` what the
// title says of them; `note` names a metric whose last value the title shows, `hint` a
// line under it, `empty` what a chart without points says, `feature` a chart hidden while
// it has none (a feature the job may not use).
const JOB_CHARTS = [
  { section: "loss", id: "pg_loss_modes", title: "pg loss under each aggregation mode",
    series: MODES.map((m) => ({ name: `pg_loss/${m}`, label: m, mode: m })) },
  { section: "loss", ...lengthBias("long", "longest") },
  { section: "loss", ...lengthBias("short", "shortest") },
  { section: "loss", id: "kl", title: "KL", series: [{ name: "kl", label: "kl" }] },
  { section: "loss", id: "entropy", title: "entropy",
    series: [{ name: "entropy", label: "entropy" }] },
  { section: "loss", id: "clip_fraction",
    title: "clip fraction (mean, min, max over a rollout's updates)",
    series: [{ name: "clip_fraction", label: "mean" },
      { name: "clip_fraction/min", label: "min" },
      { name: "clip_fraction/max", label: "max" }] },
  { section: "loss", id: "grad_norm", title: "grad norm",
    series: [{ name: "grad_norm", label: "grad norm" }] },
  // on-policy distillation (rollout/teacher.py)
  { section: "loss", id: "distill", title: "distillation: reverse KL to the teacher per token",
    empty: "no teacher (rollout.teacher)", feature: true,
    series: [{ name: "distill/reverse_kl", label: "reverse KL" }] },
  { section: "rewards", id: "reward", title: "reward (mean, std)",
    series: [{ name: "reward/mean", label: "mean" }, { name: "reward/std", label: "std" }] },
  // rollout.reward's parts (rollout/manager.py: reward/<name>/mean); series come with the
  // metrics, one per part the job logged (rewardPartSeries); a job with one part says so
  // (its mean is the reward's, times its weight)
  { section: "rewards", id: "reward_parts", title: "reward parts (mean per step)",
    empty: "no reward parts logged", series: [],
    seriesOf: (cols) => rewardPartSeries(Object.keys(cols.series)),
    seriesNote: (series) => (series.length === 1 ? `one part: ${series[0].label}` : "") },
  { section: "rewards", id: "eval", title: "evaluation on held-out prompts", yRange: [0, 1],
    empty: "no evaluation logged",
    note: { name: "eval/k", text: (k) => `k = ${k}` },
    series: [{ name: "eval/accuracy", label: "greedy accuracy" },
      { name: "eval/pass@k", label: "pass@k" }] },
  { section: "rewards", id: "response_length", title: "response length (mean)",
    series: [{ name: "response_length/mean", label: "tokens" }] },
  // PPO with a critic (trainer/value_loss.py, rollout/advantages.py: GAE)
  { section: "critic", id: "critic_loss", title: "critic: value loss (and its clip fraction)",
    empty: NO_CRITIC,
    series: [{ name: "critic/value_loss", label: "value loss" },
      { name: "critic/clip_fraction", label: "clip fraction" }] },
  { section: "critic", id: "critic_fit", title: "critic: explained variance of the returns",
    empty: NO_CRITIC, hint: "1: V predicts every return; 0: no better than their mean",
    series: [{ name: "critic/explained_variance", label: "explained variance" }] },
  { section: "critic", id: "critic_values",
    title: "critic: values and returns (mean per token)", empty: NO_CRITIC,
    series: [{ name: "critic/values_mean", label: "values" },
      { name: "critic/returns_mean", label: "returns" },
      { name: "critic/grad_norm", label: "grad norm" }] },
  // rollout/manager.py: a job with rollout.environment plays multi-turn episodes
  { section: "environment", id: "env_turns", title: "environment: per episode",
    empty: NO_ENVIRONMENT,
    series: [{ name: "env/turns_mean", label: "policy turns" },
      { name: "env/observations_mean", label: "observations read" },
      { name: "env/tool_calls_mean", label: "tool calls" }] },
  { section: "environment", id: "env_tokens",
    title: "environment: policy's share of response tokens, episodes it ended",
    empty: NO_ENVIRONMENT, hint: "only the policy's tokens count in the loss",
    series: [{ name: "env/policy_token_share", label: "policy token share" },
      { name: "env/done_fraction", label: "ended by the environment" }] },
  { section: "environment", id: "env_seconds",
    title: "environment seconds per rollout (and failed episodes)", empty: NO_ENVIRONMENT,
    series: [{ name: "env/seconds", label: "seconds" },
      { name: "env/failures", label: "failed episodes" }] },
  // rollout.async_steps, rollout.partial_rollout (docs/rollout.md)
  { section: "async", id: "staleness", title: "staleness: weight versions behind the step",
    empty: "no staleness: every rollout sampled from its step's own weights",
    hint: "step − the version that sampled it: each response token's with partial "
      + "rollouts (mean, max), else the rollout's",
    series: [...TOKEN_STALENESS, ...ROLLOUT_STALENESS], seriesOf: stalenessSeries },
  { section: "async", id: "partial_fraction",
    title: "partial rollouts: share of samples whose tokens span versions", empty: NO_PARTIAL,
    series: [{ name: "rollout/partial_fraction", label: "spanning versions" }] },
  { section: "async", id: "stale_dropped",
    title: "samples dropped: a token past rollout.max_staleness", empty: NO_PARTIAL,
    series: [{ name: "rollout/stale_dropped", label: "dropped" }] },
  { section: "system", id: "tokens_per_s", title: "tokens / s",
    series: [{ name: "perf/tokens_per_s", label: "tokens/s" }] },
  { section: "system", id: "padding_fraction", title: "padding fraction",
    series: [{ name: "padding_fraction", label: "padding" }] },
  // trainer/memory.py; a checkpoint is written only every checkpoint_every steps
  { section: "system", id: "peak_mem", title: "peak memory (GB) per phase",
    empty: "no memory logged",
    hint: "each rank's peak: resident anonymous memory on CPU, max_memory_allocated on GPU",
    series: PHASES.map((p) => ({ name: `perf/peak_mem_gb/${p}`, label: p })) },
];
const JOB_METRICS = [...new Set(JOB_CHARTS.flatMap((c) => [...c.series.map((s) => s.name),
  ...(c.note ? [c.note.name] : [])]))];

// A reward part's mean per step: reward/<name>/mean (not reward/mean, the weighted sum).
const REWARD_PART = /^reward\/(.+)\/mean$/;
const rewardPartSeries = (names) => names.flatMap((name) => {
  const part = REWARD_PART.exec(name);
  return part ? [{ name, label: part[1] }] : [];
});

// What a sweep page overlays, one chart per metric, one series per run.
const SWEEP_METRICS = ["pg_loss", "reward/mean", "reward/std", "eval/accuracy", "kl", "entropy",
  "clip_fraction", "grad_norm", "response_length/mean", "perf/tokens_per_s",
  "padding_fraction", "critic/value_loss", "critic/explained_variance"];

// `names=` of a metrics request: each name encoded (`eval/pass@k`), commas between.
const namesParam = (names) => names.map(encodeURIComponent).join(",");

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined) continue;
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) {
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
  }
  return node;
}

// One chart card: a title, a uPlot, and data-* attributes a test (or a person) can read
// (data-y-min / data-y-max: the y-axis drawn). options: yRange (fixed y scale), hint (a
// line under the title), empty (what it says without points).
class Chart {
  constructor(parent, id, title, series, options = {}) {
    this.yRange = options.yRange;
    this.note = el("span", { class: "note" });
    this.card = el("section", { class: "card chart empty", "data-chart": id,
      "data-points": "0" },
    el("h3", {}, title, this.note), options.hint ? el("p", { class: "hint" }, options.hint)
      : null, el("p", { class: "no-data" }, options.empty || "no data"));
    this.body = el("div", { class: "plot" });
    this.card.append(this.body);
    parent.append(this.card);
    this.plot = null;
    this.points = 0;
    this.setSeries(series);
    new ResizeObserver(() => {
      const w = Math.max(260, this.body.clientWidth);
      if (this.plot && Math.abs(w - this.plot.width) > 2) {
        this.plot.setSize({ width: w, height: 210 });
      }
    }).observe(this.body);
  }

  // The series picked from what a job logged (JOB_CHARTS' seriesOf): set anew only when
  // they change.
  useSeries(series) {
    if (series.map((s) => s.name).join() !== this.series.map((s) => s.name).join()) {
      this.setSeries(series);
    }
  }

  // New series (a job's reward parts, known from its metrics): the plot is drawn anew by
  // the next setData.
  setSeries(series) {
    this.series = series;
    this.bounds = series.length && series.every((s) => FRACTION_METRICS.has(s.metric || s.name))
      ? [0, 1] : undefined;
    this.card.dataset.series = String(series.length);
    if (this.plot) { this.plot.destroy(); this.plot = null; }
  }

  options(width) {
    return {
      width, height: 210, legend: { live: true },
      cursor: { drag: { x: true, y: false } },
      scales: { x: { time: false },
        y: { range: this.yRange || ((_u, min, max) => fitRange(min, max, this.bounds)) } },
      hooks: { setScale: [(u, key) => {
        if (key === "y") {
          Object.assign(this.card.dataset, { yMin: String(u.scales.y.min),
            yMax: String(u.scales.y.max) });
        }
      }] },
      axes: [{ label: "step", size: 36, incrs: STEP_INCRS }, { size: 56 }],
      series: [{ label: "step" }, ...this.series.map((s, i) => ({
        label: s.chosen ? `${s.label} (chosen)` : s.label,
        stroke: s.color || PALETTE[i % PALETTE.length],
        width: s.chosen ? 3.2 : 1.4,
        dash: s.dash ? [5, 4] : undefined,
        spanGaps: true, // a step without the metric (sparse eval, a resume) is bridged
        points: { show: SPARSE_METRICS.has(s.metric || s.name) },
      }))],
    };
  }

  setNote(text) { this.note.textContent = text ? ` (${text})` : ""; }

  // data = [steps, ys1, ys2, ...] (uPlot's aligned columns)
  setData(data) {
    const points = data.slice(1).reduce((n, ys) => n + ys.filter((v) => v !== null
      && v !== undefined).length, 0);
    this.points = points;
    this.card.dataset.points = String(points);
    this.card.classList.toggle("empty", points === 0);
    const width = Math.max(260, this.body.clientWidth || 400);
    if (!this.plot) {
      this.plot = new uPlot(this.options(width), data, this.body);
    } else {
      this.plot.setData(data);
    }
  }
}

// Column store of one job: steps and series by name, appended to by SSE events.
class Columns {
  constructor() { this.steps = []; this.series = {}; }

  append(steps, series) {
    for (let i = 0; i < steps.length; i++) {
      const step = steps[i];
      let at = this.steps.length;
      if (at && step <= this.steps[at - 1]) { // a resumed job repeats steps: replace them
        at = this.steps.findIndex((s) => s >= step);
        this.steps.length = at;
        for (const ys of Object.values(this.series)) ys.length = at;
      }
      this.steps.push(step);
      const names = new Set([...Object.keys(this.series), ...Object.keys(series)]);
      for (const name of names) {
        if (!this.series[name]) this.series[name] = new Array(at).fill(null);
        const ys = series[name];
        this.series[name].push(ys ? ys[i] ?? null : null);
      }
    }
  }

  // A metric's values on the steps that have it: [] for one the job never logged.
  logged(name) { return (this.series[name] || []).filter((v) => v !== null); }

  table(names) {
    return [this.steps, ...names.map((n) => this.series[n] || this.steps.map(() => null))];
  }
}
