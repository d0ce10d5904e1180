"""``tally samples JOB``: what the policy wrote, as text, from a job's samples.jsonl
(services/driver/samples.py) — read in its folder, or through the controller
(``GET /api/jobs/{id}/samples``) when JOB is a job id.

One block per sample: its step, group, reward and each part, advantage and tokens, then
prompt and response on a line each (newlines as ⏎, long text shortened in the middle;
``--full``: whole). Terminal control characters of a response are shown escaped, never
sent to the terminal. ``--json``: the records, one JSON object per line (a training
sample's per-token record included). ``--tokens``: under each training sample, its
response token by token (rollout/sample_record.SampleTokens):

    pos  token               advantage    engine   trainer        gap  entropy
      0  'The'                  +0.512   -1.2034   -1.2034  +1.19e-07   2.3016
      5  'Obs:'                 +0.000         –         –          –        –  obs

gap = trainer − engine log-prob (the trainer's weights are those the step trained from);
``obs``: an environment's observation (multi-turn), not the policy's token.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import typer

from services.controller.job_samples import SampleIndex, samples_out
from services.controller.schemas import SampleOut, SamplesOut, SampleTokensOut
from services.driver.run_dir import SAMPLES_FILE

PROMPT_CHARS = (60, 140)
"""(head, tail) of a long prompt shown: its end holds the question."""
RESPONSE_CHARS = (300, 200)
"""(head, tail) of a long response shown: its end holds the answer."""
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
"""Characters a terminal acts on (escapes, bidi overrides): shown as \\xNN / \\uNNNN."""
TOKEN_CHARS = 18
"""Width of a token's text (its repr) in the ``--tokens`` table; longer ones shortened."""


class SamplesError(Exception):
    """What the user reads, on one line."""


def escaped(text: str) -> str:
    return CONTROL.sub(lambda m: m[0].encode("unicode_escape").decode("ascii"), text)


def shortened(text: str, head: int, tail: int) -> str:
    """``text`` on one line (newlines as ⏎), the middle of a long one left out."""
    flat = text.replace("\r\n", "\n").replace("\n", "⏎").replace("\t", " ")
    if len(flat) <= head + tail + 40:
        return flat
    return f"{flat[:head]} … [{len(flat) - head - tail:,} characters] … {flat[-tail:]}"


def spans(steps: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    parts: list[str] = []
    start = prev = None
    for step in [*steps, None]:
        if prev is not None and step == prev + 1:
            prev = step
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = step
    return ", ".join(parts)


def _pick(out: SamplesOut, step: int | None, evaluation: bool, where: str) -> int:
    """The step to show: ``step`` when it has samples of the kind asked, else the newest."""
    kind, steps = ("evaluation", out.eval_steps) if evaluation else ("training", out.steps)
    if not steps:
        other = (f"; training samples at steps {spans(out.steps)}: leave out --eval"
                 if evaluation and out.steps else
                 f"; evaluation samples at weight versions {spans(out.eval_steps)}: --eval"
                 if out.eval_steps else "")
        raise SamplesError(f"{where}: no {kind} samples{other}")
    if step is not None and step not in steps:
        raise SamplesError(f"{where}: no {kind} samples at step {step}; steps with "
                           f"{kind} samples: {spans(steps)}")
    return steps[-1] if step is None else step


def read_local(folder: Path, step: int | None, evaluation: bool, limit: int
               ) -> tuple[SamplesOut, int, str]:
    index = SampleIndex(folder / SAMPLES_FILE)
    if not index.refresh():
        raise SamplesError(f"{folder}: no {SAMPLES_FILE} (the job has not finished a "
                           "rollout step yet, or is not a Tally job folder)")
    where = str(folder)
    chosen = _pick(samples_out(where, index, None, evaluation, 1), step, evaluation, where)
    return samples_out(where, index, chosen, evaluation, limit), chosen, where


def read_remote(job_id: str, step: int | None, evaluation: bool, limit: int,
                url: str | None, tokens: bool = False) -> tuple[SamplesOut, int, str]:
    """``tokens``: with each sample's per-token record (the API sends it when asked)."""
    from services.controller.cli_support import checked, client

    where = f"job {job_id}"
    params: dict[str, object] = {"eval": evaluation, "tokens": tokens}
    with client(url) as http:
        def get(**extra: object) -> SamplesOut:
            answer = http.get(f"/api/jobs/{job_id}/samples", params={**params, **extra})
            return SamplesOut.model_validate(checked(answer))

        out = get(limit=1) if step is None else get(step=step, limit=limit)
        if out.note:
            raise SamplesError(f"{where}: {out.note}")
        chosen = _pick(out, step, evaluation, where)
        return (out if step is not None else get(step=chosen, limit=limit)), chosen, where


def describe(sample: SampleOut) -> str:
    """The sample's first line: step, group, reward and its parts, advantage, tokens."""
    head = f"step {sample.step}"
    if sample.eval:
        head = f"eval of weights {sample.step} · {'greedy' if sample.greedy else 'sampled'}"
    facts = [head, f"group {sample.group}" if sample.group is not None else None,
             f"#{sample.index}" if sample.index is not None else None]
    reward = "reward –" if sample.reward is None else f"reward {sample.reward:.3f}"
    parts = ", ".join(f"{name} {'–' if v is None else f'{v:.3f}'}"
                      for name, v in sample.rewards.items())
    facts.append(f"{reward} ({parts})" if parts else reward)
    if sample.advantage is not None:
        facts.append(f"advantage {sample.advantage:+.3f}")
    if sample.response_tokens is not None:
        facts.append(f"{sample.response_tokens} tokens")
    return " · ".join(f for f in facts if f)


def _number(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def token_table(tokens: SampleTokensOut) -> list[str]:
    """The per-token rows (module docstring): position, the token's text as its repr
    (escapes shown, never sent), advantage, engine and trainer log-probs, their gap,
    entropy, and ``obs`` on an observation."""
    rows = [f"  {'pos':>5}  {'token':<{TOKEN_CHARS}}  {'advantage':>9}  {'engine':>8}  "
            f"{'trainer':>8}  {'gap':>9}  {'entropy':>7}"]
    for t, text in enumerate(tokens.text):
        shown = escaped(repr(text))
        if len(shown) > TOKEN_CHARS:
            shown = shown[:TOKEN_CHARS - 1] + "…"
        engine, trainer = tokens.engine_log_prob[t], tokens.trainer_log_prob[t]
        gap = None if engine is None or trainer is None else trainer - engine
        row = (f"  {t:>5}  {shown:<{TOKEN_CHARS}}  {_number(tokens.advantage[t], '+.3f'):>9}"
               f"  {_number(engine, '.4f'):>8}  {_number(trainer, '.4f'):>8}"
               f"  {_number(gap, '+.2e'):>9}  {_number(tokens.entropy[t], '.4f'):>7}")
        rows.append(row + ("  obs" if tokens.observation[t] else ""))
    return rows


def block(sample: SampleOut, full: bool, tokens: bool = False) -> list[str]:
    """The sample's lines; ``tokens``: its per-token table under them (a training
    sample's; one line saying so where none was recorded)."""
    def text(value: str, chars: tuple[int, int]) -> str:
        if full:
            return escaped(value).replace("\n", "\n" + " " * 12)
        return escaped(shortened(value, *chars))

    lines = [describe(sample), f"  prompt    {text(sample.prompt, PROMPT_CHARS)}",
             f"  response  {text(sample.response, RESPONSE_CHARS)}"]
    if sample.label is not None:
        lines.append(f"  label     {text(str(sample.label), PROMPT_CHARS)}")
    if tokens and not sample.eval:
        lines.extend(token_table(sample.tokens) if sample.tokens is not None else
                     ["  tokens    not recorded (logging.sample_tokens was off, or the job "
                      "predates it)"])
    return lines


def print_samples(job: str, step: int | None, evaluation: bool, as_json: bool, full: bool,
                  limit: int, url: str | None, tokens: bool = False) -> None:
    """Print JOB's samples (a job folder, its samples.jsonl, or a controller job id) or
    one line saying why there are none; exit code 1 then. ``tokens``: each training
    sample's per-token table (--json always carries the per-token records)."""
    folder = Path(job)
    if folder.name == SAMPLES_FILE and folder.is_file():
        folder = folder.parent
    try:
        if folder.is_dir():
            out, chosen, where = read_local(folder, step, evaluation, limit)
        elif "/" in job or job.startswith("."):
            raise SamplesError(f"{job}: no such job folder")
        else:
            out, chosen, where = read_remote(job, step, evaluation, limit, url,
                                             tokens=tokens or as_json)
    except SamplesError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        for sample in out.samples:
            typer.echo(json.dumps(sample.model_dump(mode="json", exclude_unset=True,
                                                    exclude={"has_tokens"}),
                                  ensure_ascii=False))  # the line as written
        return
    kind = "evaluation samples of weight version" if evaluation else "training samples of step"
    others = (f"; evaluation at {spans(out.eval_steps)} (--eval)" if not evaluation
              and out.eval_steps else "")
    typer.echo(f"{where}: {kind} {chosen}, {len(out.samples)} of {out.total}; steps with "
               f"samples: {spans(out.eval_steps if evaluation else out.steps)}{others}")
    for sample in out.samples:
        typer.echo("")
        typer.echo("\n".join(block(sample, full, tokens)))
    if out.total > len(out.samples):
        typer.echo(f"\n… {out.total - len(out.samples)} more (--limit, at most 1000)")
