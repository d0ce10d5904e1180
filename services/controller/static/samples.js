// A job's samples (its folder's samples.jsonl, GET /api/jobs/{id}/samples): a step
// selector (the steps with samples, newest first, evaluations marked) and a table, one
// row per sample. Prompts and responses are what a model wrote: every value goes in as a
// text node (el), never as markup. Until the user picks a step the panel follows the
// newest one. A training sample with a per-token record (has_tokens) opens, on a click or
// Enter, into its response token by token (tokenView), read then with tokens=true.
"use strict";

const SAMPLES_LIMIT = 200;

function samplesPanel(id) {
  let picked = null;  // "train:3" / "eval:3"; null: the newest
  let shown = "";     // what the table holds, so that a refresh with nothing new keeps it
  const select = el("select", { id: "sample-step", "aria-label": "samples of step",
    onchange: () => { picked = select.value; load().catch(() => {}); } });
  const note = el("p", { class: "muted", id: "samples-note" });
  const table = el("table", { class: "list samples", id: "samples" });
  const opened = { keys: new Set(), records: new Map(), quantity: "advantage" };
  const node = el("section", { class: "card samples-card" },
    el("h3", {}, "Samples ", select), note, el("div", { class: "samples-scroll" }, table));

  async function load() {
    const index = await api(`/api/jobs/${id}/samples?limit=1`);
    const options = [...index.steps.map((step) => ({ step, evaluation: false })),
      ...index.eval_steps.map((step) => ({ step, evaluation: true }))]
      .sort((a, b) => b.step - a.step || a.evaluation - b.evaluation)
      .map((o) => ({ ...o, key: `${o.evaluation ? "eval" : "train"}:${o.step}` }));
    if (!options.length) {
      select.hidden = true;
      note.textContent = index.note || "no samples";
      table.replaceChildren();
      shown = "";
      return;
    }
    const key = options.some((o) => o.key === picked) ? picked : options[0].key;
    const chosen = options.find((o) => o.key === key);
    const data = await api(`/api/jobs/${id}/samples?step=${chosen.step}`
      + `&eval=${chosen.evaluation}&limit=${SAMPLES_LIMIT}`);
    const state = JSON.stringify([options.map((o) => o.key), key, data.samples]);
    if (state === shown) return;
    shown = state;
    select.hidden = false;
    select.replaceChildren(...options.map((o) => el("option", { value: o.key },
      o.evaluation ? `step ${o.step} · evaluation` : `step ${o.step}`)));
    select.value = key;
    note.textContent = `${data.samples.length} of ${data.total} ${chosen.evaluation
      ? "evaluation samples of weight version" : "samples of step"} ${chosen.step}`;
    fillSamples(table, data.samples, id, opened);
  }

  // SSE events come in bursts (a backlog of steps): one read per second at most, the
  // last of a burst included.
  let timer = null;
  let again = false;
  function refresh() {
    if (timer) { again = true; return; }
    load().catch(() => {});
    timer = setTimeout(() => {
      timer = null;
      if (again) { again = false; refresh(); }
    }, 1000);
  }
  return { node, refresh };
}

function fillSamples(table, samples, id, opened) {
  const parts = [...new Set(samples.flatMap((s) => Object.keys(s.rewards || {})))];
  const headers = ["step", "group", "reward", ...parts, "advantage", "tokens", "prompt",
    "response"];
  const num = (v, d = 3) => el("td", { class: "num" }, fmt.num(v, d));
  const rows = samples.map((s) => {
    const row = el("tr", { "data-step": s.step, "data-eval": s.eval ? "true" : "false" },
      el("td", { class: "num" }, String(s.step), s.eval ? el("span", { class: "badge eval" },
        s.greedy ? "eval · greedy" : "eval") : null),
      el("td", { class: "num" }, s.group ?? "–"), num(s.reward),
      parts.map((p) => num((s.rewards || {})[p])),
      num(s.advantage), el("td", { class: "num" }, s.response_tokens ?? "–"),
      el("td", {}, el("div", { class: "text" }, s.prompt ?? "")),
      el("td", {}, el("div", { class: "text" }, s.response ?? "")));
    return s.has_tokens && !s.eval ? openable(row, s, headers.length, id, opened) : row;
  });
  table.replaceChildren(
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows));
  rows.forEach((row) => { if (opened.keys.has(row.dataset.key)) row.toggle(); });
}

// A training sample's row that opens into its tokens: a row under it, filled with the
// sample read with tokens=true (kept: a refresh that redraws the table opens it again).
function openable(row, sample, width, id, opened) {
  const key = `${sample.step}:${sample.index}`;
  Object.assign(row.dataset, { key, index: sample.index });
  row.classList.add("openable");
  row.setAttribute("tabindex", "0");
  row.setAttribute("aria-expanded", "false");
  row.title = "show its tokens";
  let detail = null;
  row.toggle = async () => {
    if (detail) {
      detail.remove();
      detail = null;
      opened.keys.delete(key);
      row.setAttribute("aria-expanded", "false");
      return;
    }
    const cell = el("td", { colspan: width }, el("p", { class: "muted" }, "reading tokens…"));
    detail = el("tr", { class: "tokens-row", "data-key": key }, cell);
    row.after(detail);
    opened.keys.add(key);
    row.setAttribute("aria-expanded", "true");
    try {
      let record = opened.records.get(key);
      if (!record) {
        const data = await api(`/api/jobs/${id}/samples?step=${sample.step}&eval=false`
          + `&index=${sample.index}&tokens=true&limit=1`);
        record = data.samples.length && data.samples[0].tokens;
        if (!record) throw new Error("no per-token record for this sample");
        opened.records.set(key, record);
      }
      cell.replaceChildren(tokenView(record, opened));
    } catch (err) {
      cell.replaceChildren(el("p", { class: "error" }, `tokens: ${err.message || err}`));
    }
  };
  row.addEventListener("click", () => {
    if (!String(window.getSelection() || "")) row.toggle();  // not while selecting text
  });
  row.addEventListener("keydown", (e) => {
    if (e.target === row && (e.key === "Enter" || e.key === " ")) {
      e.preventDefault();
      row.toggle();
    }
  });
  return row;
}

// ---- the per-token view ------------------------------------------------------------
// What a token's background can show: value(record, i) (null: none), a diverging scale
// (negative ends at `low`, positive at `high`, 0 white) or a sequential one (0 white,
// the largest at `high`). Colours: ColorBrewer's RdBu, PuOr and Oranges ends.
const TOKEN_QUANTITIES = {
  advantage: { label: "advantage", diverging: true, low: [202, 0, 32], high: [5, 113, 176],
    value: (t, i) => t.advantage[i],
    hint: "A_t the step trained with: red pushed down, blue pushed up" },
  gap: { label: "trainer − engine log-prob", diverging: true, low: [230, 97, 1],
    high: [94, 60, 153],
    value: (t, i) => (t.trainer_log_prob[i] === null || t.engine_log_prob[i] === null ? null
      : t.trainer_log_prob[i] - t.engine_log_prob[i]),
    hint: "the trainer's log-prob minus the engine's: orange the trainer finds it less "
      + "likely than the engine that sampled it, purple more" },
  entropy: { label: "entropy (nats)", diverging: false, high: [166, 54, 3],
    value: (t, i) => t.entropy[i], hint: "the trainer's entropy at the position" },
};

const WHITE = [255, 255, 255];
const mix = (a, b, f) => a.map((v, k) => Math.round(v + (b[k] - v) * f));
const rgb = (c) => `rgb(${c.join(", ")})`;

// The scale's end: the largest |value| over the policy's tokens (never 0).
function tokenScale(record, quantity) {
  const q = TOKEN_QUANTITIES[quantity];
  let top = 0;
  record.text.forEach((_, i) => {
    const v = record.observation[i] ? null : q.value(record, i);
    if (v !== null && Number.isFinite(v)) top = Math.max(top, Math.abs(v));
  });
  return top || 1;
}

// A value's colour on its quantity's scale (null: not coloured).
function tokenColor(quantity, value, scale) {
  if (value === null || value === undefined || !Number.isFinite(value)) return null;
  const q = TOKEN_QUANTITIES[quantity];
  const f = Math.min(1, Math.abs(value) / scale);
  return mix(WHITE, q.diverging && value < 0 ? q.low : q.high, f);
}

// A token's text made visible: a newline as ⏎ (then the line break), a tab as →, a
// token of spaces only as ·, an empty one as ∅. Text only: the caller puts it in a node.
function visibleToken(text) {
  if (text === "") return "∅";
  if (/^ +$/.test(text)) return "·".repeat(text.length);
  return text.replace(/\t/g, "→").replace(/\r?\n/g, "⏎\n");
}

function tokenTitle(record, i) {
  const n = (v) => (v === null || v === undefined ? "–" : Number(v).toFixed(4));
  const gap = TOKEN_QUANTITIES.gap.value(record, i);
  return [`token ${i}: ${JSON.stringify(record.text[i])}`,
    record.observation[i] ? "observation (the environment's, not trained on)" : null,
    `advantage ${n(record.advantage[i])}`, `engine log-prob ${n(record.engine_log_prob[i])}`,
    `trainer log-prob ${n(record.trainer_log_prob[i])}`, `gap ${n(gap)}`,
    `entropy ${n(record.entropy[i])}`].filter((line) => line !== null).join("\n");
}

// The view of one sample's tokens: a selector of what colours them, the legend of its
// scale, and the tokens, a run of observation tokens boxed apart and never coloured.
function tokenView(record, opened) {
  const select = el("select", { class: "token-quantity", "aria-label": "colour tokens by" },
    Object.entries(TOKEN_QUANTITIES).map(([key, q]) => el("option", { value: key }, q.label)));
  select.value = opened.quantity;
  const legend = el("div", { class: "token-legend" });
  const spans = record.text.map((text, i) => el("span", {
    class: record.observation[i] ? "tok observation" : "tok", "data-i": i,
    title: tokenTitle(record, i) }, visibleToken(text)));
  const body = el("div", { class: "tokens" });
  for (let i = 0; i < spans.length;) {
    if (!record.observation[i]) { body.append(spans[i]); i += 1; continue; }
    const run = el("span", { class: "observation-run" },
      el("span", { class: "observation-label" }, "observation"));
    while (i < spans.length && record.observation[i]) { run.append(spans[i]); i += 1; }
    body.append(run);
  }
  const view = el("div", { class: "token-view" },
    el("div", { class: "token-controls" }, el("label", {}, "colour by ", select), legend),
    body);
  function paint() {
    const quantity = select.value;
    const q = TOKEN_QUANTITIES[quantity];
    const scale = tokenScale(record, quantity);
    view.dataset.quantity = quantity;
    spans.forEach((span, i) => {
      if (record.observation[i]) return;
      const color = tokenColor(quantity, q.value(record, i), scale);
      span.style.backgroundColor = color ? rgb(color) : "";
      span.style.color = color && Math.abs(q.value(record, i)) / scale > 0.6 ? "#fff" : "";
      span.classList.toggle("missing", !color);
    });
    const low = q.diverging ? rgb(q.low) : rgb(WHITE);
    const stops = q.diverging ? [low, rgb(WHITE), rgb(q.high)] : [low, rgb(q.high)];
    const ends = q.diverging ? [-scale, 0, scale] : [0, scale];
    legend.dataset.scale = String(scale);
    legend.replaceChildren(
      el("span", { class: "token-legend-scale" }, el("span", { class: "token-legend-bar",
        style: `background: linear-gradient(to right, ${stops.join(", ")})` }),
      el("span", { class: "token-legend-ticks" }, ends.map((v) => el("span", {},
        fmt.num(v, 3))))),
      el("span", { class: "muted token-legend-hint" }, q.hint),
      el("span", { class: "token-legend-key" }, el("span", { class: "tok observation" },
        "observation"), " the environment's, not coloured; ",
      el("span", { class: "tok missing" }, "·"), " no value"));
  }
  select.addEventListener("change", () => {
    opened.quantity = select.value;
    paint();
  });
  paint();
  return view;
}
