"""The per-token view of a step's logged training samples (``SampleTokens``), filled by
the driver before the step trains: the trainer's numbers are those of the weights the
step trains from.

    manager: record.tokens.text (rollout/sample_tokens.py, the tokenizer's side)
    driver:  the logged rows, each its own group ─► trainer.token_stats ─►
             per response position t of sample i (input_ids[i, P_i + t]):

        observation_t   = the manager's mark (an environment's token, multi-turn)
        advantage_t     = A_it where m_it > 0, else 0 (what the loss weighs)
        engine_t        = batch.rollout_log_probs[i, P_i + t]   None on observations
        trainer_t       = log π_T(token)      (token_stats, the loss's precision and T)
        entropy_t       = H(π_T) = −Σ_v π_T(v) log π_T(v) at the position predicting it
                          (trainer_t and entropy_t None where m_it = 0: not computed)

The gap trainer_t − engine_t is the engine-vs-trainer mismatch of that token (0 up to
precision when the engine sampled with the weights the step trains from). One trainer
call per step, on the logged rows only: a RolloutBatch holds whole groups, so each row
is made a group of one (log π_T and H of a token do not depend on its group).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rollout.batch import RolloutBatch
from rollout.sample_record import SampleRecord, SampleTokens
from services.driver.samples import with_advantages


def logged_samples(batch: RolloutBatch, trainer: Any, sample_tokens: bool
                   ) -> list[SampleRecord]:
    """The step's records as samples.jsonl writes them: each with its advantage
    (services/driver/samples.py) and, when ``sample_tokens`` (logging.sample_tokens),
    its tokens (:func:`with_tokens`); else without tokens."""
    records = with_advantages(batch)
    if not sample_tokens:
        return [dataclasses.replace(r, tokens=None) for r in records]
    return with_tokens(records, batch, trainer)


def with_tokens(records: list[SampleRecord], batch: RolloutBatch, trainer: Any
                ) -> list[SampleRecord]:
    """``records`` with their tokens' numbers filled (module docstring) from ``batch``
    and one ``trainer.token_stats`` call (a TrainerGroup's); a record the manager gave no
    token text stays as it is."""
    rows = [int(r.index) for r in records if r.tokens is not None]
    if not rows:
        return records
    alone = dataclasses.replace(batch, group_index=torch.arange(batch.num_samples),
                                samples_per_prompt=1, samples=[])
    logged = alone.select(rows)
    position = {i: j for j, i in enumerate(rows)}
    stats = trainer.token_stats(logged) if logged.num_valid_tokens else None
    out = []
    for record in records:
        if record.tokens is None:
            out.append(record)
            continue
        i = int(record.index)
        tokens = sample_tokens(record.tokens, batch, i,
                               None if stats is None else (stats[0][position[i]],
                                                           stats[1][position[i]]))
        out.append(dataclasses.replace(record, tokens=tokens))
    return out


def sample_tokens(rollout_side: SampleTokens, batch: RolloutBatch, i: int,
                  stats: tuple[torch.Tensor, torch.Tensor] | None) -> SampleTokens:
    """Sample ``i``'s tokens: the manager's ``rollout_side`` (text and observation marks,
    one per response token), the batch's row and its trainer ``stats`` row (log π_T, H)
    [S]; None: the trainer was not asked."""
    text, observation = rollout_side.text, rollout_side.observation
    start = int(batch.prompt_lengths[i])
    span = slice(start, start + int(batch.response_lengths[i]))
    if len(text) != span.stop - span.start:
        raise ValueError(f"sample {i}: {len(text)} token texts for "
                         f"{span.stop - span.start} response tokens")
    untrained = (batch.loss_mask[i, span] == 0).tolist()  # observations, masked tokens

    def only_where(values: torch.Tensor | None, skip: list[bool]) -> list[float | None]:
        if values is None:
            return [None] * len(skip)
        return [None if off else v for off, v in zip(skip, values[span].tolist(),
                                                    strict=True)]

    advantage = torch.where(batch.loss_mask[i, span] == 0, 0.0, batch.advantages[i, span])
    return SampleTokens(text=list(text), observation=list(observation),
                        advantage=advantage.tolist(),
                        engine_log_prob=only_where(batch.rollout_log_probs[i], observation),
                        trainer_log_prob=only_where(None if stats is None else stats[0],
                                                    untrained),
                        entropy=only_where(None if stats is None else stats[1], untrained))
