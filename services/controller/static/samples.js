// A job's samples (its folder's samples.jsonl, GET /api/jobs/{id}/samples): a step
// selector (the steps with samples, newest first, evaluations marked) and a table, one
// row per sample. Prompts and responses are what a model wrote: every value goes in as a
// text node (el), never as markup. Until the user picks a step the panel follows the
// newest one.
"use strict";

const SAMPLES_LIMIT = 200;

function samplesPanel(id) {
  let picked = null;  // "train:3" / "eval:3"; null: the newest
  let shown = "";     // what the table holds, so that a refresh with nothing new keeps it
  const select = el("select", { id: "sample-step", "aria-label": "samples of step",
    onchange: () => { picked = select.value; load().catch(() => {}); } });
  const note = el("p", { class: "muted", id: "samples-note" });
  const table = el("table", { class: "list samples", id: "samples" });
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
    fillSamples(table, data.samples);
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

function fillSamples(table, samples) {
  const parts = [...new Set(samples.flatMap((s) => Object.keys(s.rewards || {})))];
  const num = (v, d = 3) => el("td", { class: "num" }, fmt.num(v, d));
  table.replaceChildren(
    el("thead", {}, el("tr", {}, ["step", "group", "reward", ...parts, "advantage", "tokens",
      "prompt", "response"].map((h) => el("th", {}, h)))),
    el("tbody", {}, samples.map((s) => el("tr", { "data-step": s.step,
      "data-eval": s.eval ? "true" : "false" },
    el("td", { class: "num" }, String(s.step), s.eval ? el("span", { class: "badge eval" },
      s.greedy ? "eval · greedy" : "eval") : null),
    el("td", { class: "num" }, s.group ?? "–"), num(s.reward),
    parts.map((p) => num((s.rewards || {})[p])),
    num(s.advantage), el("td", { class: "num" }, s.response_tokens ?? "–"),
    el("td", {}, el("div", { class: "text" }, s.prompt ?? "")),
    el("td", {}, el("div", { class: "text" }, s.response ?? ""))))));
}
