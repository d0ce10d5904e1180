"""``tally samples JOB``: what the policy wrote, as text, from a job's samples.jsonl
(services/driver/samples.py) — read in its folder, or through the controller
(``GET /api/jobs/{id}/samples``) when JOB is a job id.

One block per sample: its step, group, reward and each part, advantage and tokens, then
prompt and response on a line each (newlines as ⏎, long text shortened in the middle;
``--full``: whole). Terminal control characters of a response are shown escaped, never
sent to the terminal. ``--json``: the records, one JSON object per line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import typer

from services.controller.job_samples import SampleIndex, samples_out
from services.controller.schemas import SampleOut, SamplesOut
from services.driver.run_dir import SAMPLES_FILE

PROMPT_CHARS = (60, 140)
"""(head, tail) of a long prompt shown: its end holds the question."""
RESPONSE_CHARS = (300, 200)
"""(head, tail) of a long response shown: its end holds the answer."""
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
"""Characters a terminal acts on (escapes, bidi overrides): shown as \\xNN / \\uNNNN."""


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
                url: str | None) -> tuple[SamplesOut, int, str]:
    from services.controller.cli_support import checked, client

    where = f"job {job_id}"
    params: dict[str, object] = {"eval": evaluation}
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


def block(sample: SampleOut, full: bool) -> list[str]:
    def text(value: str, chars: tuple[int, int]) -> str:
        if full:
            return escaped(value).replace("\n", "\n" + " " * 12)
        return escaped(shortened(value, *chars))

    lines = [describe(sample), f"  prompt    {text(sample.prompt, PROMPT_CHARS)}",
             f"  response  {text(sample.response, RESPONSE_CHARS)}"]
    if sample.label is not None:
        lines.append(f"  label     {text(str(sample.label), PROMPT_CHARS)}")
    return lines


def print_samples(job: str, step: int | None, evaluation: bool, as_json: bool, full: bool,
                  limit: int, url: str | None) -> None:
    """Print JOB's samples (a job folder, its samples.jsonl, or a controller job id) or
    one line saying why there are none; exit code 1 then."""
    folder = Path(job)
    if folder.name == SAMPLES_FILE and folder.is_file():
        folder = folder.parent
    try:
        if folder.is_dir():
            out, chosen, where = read_local(folder, step, evaluation, limit)
        elif "/" in job or job.startswith("."):
            raise SamplesError(f"{job}: no such job folder")
        else:
            out, chosen, where = read_remote(job, step, evaluation, limit, url)
    except SamplesError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        for sample in out.samples:
            typer.echo(json.dumps(sample.model_dump(mode="json", exclude_unset=True),
                                  ensure_ascii=False))
        return
    kind = "evaluation samples of weight version" if evaluation else "training samples of step"
    others = (f"; evaluation at {spans(out.eval_steps)} (--eval)" if not evaluation
              and out.eval_steps else "")
    typer.echo(f"{where}: {kind} {chosen}, {len(out.samples)} of {out.total}; steps with "
               f"samples: {spans(out.eval_steps if evaluation else out.steps)}{others}")
    for sample in out.samples:
        typer.echo("")
        typer.echo("\n".join(block(sample, full)))
    if out.total > len(out.samples):
        typer.echo(f"\n… {out.total - len(out.samples)} more (--limit, at most 1000)")
