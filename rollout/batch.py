"""RolloutBatch: the one schema rollout hands to the trainer — one rollout step's samples.

The trainer splits a rollout into optimizer steps (mini-batches of whole groups,
``trainer/mini_batches.py``); each mini-batch is a RolloutBatch of its own (``select``),
and the aggregation metadata below is always that of the batch at hand (docs/glossary.md).

Shapes: N samples, S = the longest prompt+response in the batch. Every per-token tensor is
aligned with ``input_ids``: position t describes token ``input_ids[i, t]``. The trainer
shifts to next-token prediction itself (the log-prob of token t comes from logits at t−1).

    input_ids          [N, S] int64    prompt then response, right-padded with pad_token_id
    prompt_lengths     [N]    int64    tokens of prompt
    response_lengths   [N]    int64    tokens of response (including EOS when sampled)
    loss_mask          [N, S] float32  m_it in [0, 1] on response tokens (1: counts whole,
                                       a fraction: counts that much), 0 elsewhere
    rollout_log_probs  [N, S] float32  the engine's log-prob of each response token, 0 elsewhere
    rewards            [N]    float32  an unscored sample's (``scored`` False) is 0.0, a fill
                                       value nothing reads as a reward
    advantages         [N, S] float32  A_it of each response token, 0 elsewhere; a per-sample
                                       advantage [N] given to the constructor is a row of
                                       equal values over its response (one code path)
    group_index        [N]    int64    samples of one prompt share it; increases across steps
    old_log_probs      [N, S] float32  optional: the trainer's log-prob of each response token
                                       under the policy at the start of the rollout (set by
                                       the trainer when a rollout has several updates)
    token_rewards      [N, S] float32  optional: the reward placed on tokens (an environment
                                       step's on the last token of its action); None: each
                                       sample's whole reward on its last valid token
    values             [N, S] float32  optional: the critic's V of each response token at
                                       the rollout (PPO with a critic), 0 elsewhere
    returns            [N, S] float32  optional: the critic's targets R_it (GAE), 0 elsewhere
    truncated          [N]    bool     the response was cut at the length limit (the engine
                                       stopped at max_new_tokens; an episode ended by its
                                       token budget, the context or max_turns, not by its
                                       environment); GAE may bootstrap it. None given: none
    scored             [N]    bool     every reward part scored the sample; False: unscored
                                       (a judge's answer that did not parse, a remote call
                                       that failed), missing rather than zero: advantage 0,
                                       out of its group's baseline and statistics
                                       (rollout/advantages/). None given: all scored

Derived on construction (whole-step metadata of the aggregation contract):

    sample_token_counts [N]  M_i = Σ_t m_it (float64; a whole number for a 0/1 mask)
    group_ids           [P]  the step's distinct group_index values, ascending
    prompt_mask_sums    [P]  T_g = Σ_{i∈g} M_i
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from rollout.sample_record import SampleRecord


class RolloutBatchError(ValueError):
    """A RolloutBatch that breaks its own schema."""


def to_wire(value: Any) -> Any:
    """A CPU tensor as a numpy array (what pickle and Ray's object store carry fastest:
    pickle protocol 5 passes its buffer out of band, where a torch tensor is rebuilt
    through its storage, ≈ 10× the time of a small one); anything else as it is."""
    if (isinstance(value, torch.Tensor) and value.device.type == "cpu"
            and value.dtype != torch.bfloat16 and not value.requires_grad):
        return value.numpy()
    return value


def from_wire(value: Any) -> Any:
    """A numpy array of :func:`to_wire` as a tensor again; one mapped read-only from Ray's
    object store is copied, so no holder writes into the store or keeps it pinned."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value if value.flags.writeable else value.copy())
    return value


SPAN_FIELDS = {"input_ids": "sequence", "loss_mask": "response",
               "rollout_log_probs": "response", "old_log_probs": "response",
               "advantages": "response", "token_rewards": "response",
               "values": "response", "returns": "response",
               "token_versions": "response"}
"""[N, S] fields that travel as their rows' spans only (prompt + response, or response),
when everything outside is the padding value: the demo's rollout of 256 samples is then
≈ 40 KB instead of 110, under Ray's 100 KB for objects carried inside a call, so it goes
manager → driver → ranks with no object-store round trip."""


@dataclass(frozen=True)
class _Spans:
    """One [N, S] field of a pickled batch: the values of its rows' spans, row after
    row, and what fills the rest."""

    values: np.ndarray
    fill: float
    dtype: torch.dtype
    width: int
    """S."""


def _span_mask(batch: Any, span: str, width: int) -> torch.Tensor:
    """[N, S] True on each row's span: its prompt and response, or its response."""
    positions = torch.arange(width)
    inside = positions < (batch.prompt_lengths + batch.response_lengths)[:, None]
    return inside & (positions >= batch.prompt_lengths[:, None]) if span == "response" \
        else inside


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """A float tensor's bits (so -0.0 is not the 0.0 padding), others as they are."""
    if tensor.is_floating_point():
        return tensor.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[
            tensor.element_size()])
    return tensor


def _as_spans(value: torch.Tensor, mask: torch.Tensor, fill: float) -> _Spans | None:
    """``value`` as :class:`_Spans`, or None when something outside the spans is not
    exactly ``fill``. Token ids go as int32 when they fit (every vocabulary does)."""
    if not torch.equal(_bits(value.masked_fill(mask, fill)),
                       _bits(torch.full_like(value, fill))):
        return None
    values = value.masked_select(mask)
    if value.dtype == torch.int64 and (values.numel() == 0 or (
            int(values.min()) >= -2**31 and int(values.max()) < 2**31)):
        values = values.to(torch.int32)
    return _Spans(values.numpy(), fill, value.dtype, value.shape[1])


def _from_spans(spans: _Spans, mask: torch.Tensor) -> torch.Tensor:
    wanted = torch.empty((), dtype=spans.dtype).numpy().dtype  # int32 ids back to int64
    values = torch.from_numpy(spans.values.astype(  # a copy when read-only: unpinned
        wanted, copy=not spans.values.flags.writeable))
    return torch.full(mask.shape, spans.fill, dtype=spans.dtype).masked_scatter_(mask, values)


def _rebuild_batch(values: dict[str, Any]) -> RolloutBatch:
    """A pickled RolloutBatch (:meth:`RolloutBatch.__reduce__`), checked once already when
    it was built, so its derived fields travel too and nothing is computed again."""
    batch = object.__new__(RolloutBatch)
    for name, value in values.items():
        if not isinstance(value, _Spans):
            object.__setattr__(batch, name, from_wire(value))
    masks: dict[str, torch.Tensor] = {}
    for name, value in values.items():
        if isinstance(value, _Spans):
            span = SPAN_FIELDS[name]
            if span not in masks:
                masks[span] = _span_mask(batch, span, value.width)
            object.__setattr__(batch, name, _from_spans(value, masks[span]))
    return batch


OPTIONAL_TOKEN_FIELDS = ("old_log_probs", "token_rewards", "values", "returns",
                         "token_versions")
"""The [N, S] fields a batch may carry or not (None)."""


@dataclass(frozen=True)
class RolloutBatch:
    input_ids: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    loss_mask: torch.Tensor
    rollout_log_probs: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    group_index: torch.Tensor
    samples_per_prompt: int
    pad_token_id: int = 0
    metadata: dict[str, float] = field(default_factory=dict)
    """Rollout statistics for the step's metrics (draws, reward errors, tokens/s, ...)."""
    events: list[tuple[str, str]] = field(default_factory=list)
    """(kind, message) the job's events file gets with this rollout (an environment
    that failed in an episode)."""
    samples: list[SampleRecord] = field(default_factory=list)
    """samples.jsonl records of some of the rollout's samples, as text (prompt, response,
    label, rewards; ``index``: the sample's row); a mini-batch carries none."""
    old_log_probs: torch.Tensor | None = None
    token_rewards: torch.Tensor | None = None
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    truncated: torch.Tensor | None = None
    """[N] bool (module docstring); always a tensor once built (None: no sample cut, as
    in a checkpoint written before the field)."""
    scored: torch.Tensor | None = None
    """[N] bool (module docstring); always a tensor once built (None: every sample
    scored, as in a checkpoint written before the field)."""
    token_versions: torch.Tensor | None = None
    """[N, S] int64: the weight version that sampled each response token (0 elsewhere),
    where samples were continued across weight updates (rollout.partial_rollout); None:
    each sample's tokens are of the one version ``metadata["rollout/weight_version"]``."""
    sample_token_counts: torch.Tensor = field(init=False)
    group_ids: torch.Tensor = field(init=False)
    prompt_mask_sums: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        num_samples, seq_len = self.input_ids.shape
        response_span = _span_mask(self, "response", seq_len)
        if self.advantages.dim() == 1 and self.advantages.shape == (num_samples,):
            object.__setattr__(self, "advantages", torch.where(
                response_span, self.advantages[:, None].to(torch.float32), 0.0))
        for name, shape in (
            ("prompt_lengths", (num_samples,)),
            ("response_lengths", (num_samples,)),
            ("loss_mask", (num_samples, seq_len)),
            ("rollout_log_probs", (num_samples, seq_len)),
            ("rewards", (num_samples,)),
            ("advantages", (num_samples, seq_len)),
            ("group_index", (num_samples,)),
        ):
            actual = tuple(getattr(self, name).shape)
            if actual != shape:
                raise RolloutBatchError(f"{name}: expected shape {shape}, got {actual}")
        truncated = (torch.zeros(num_samples, dtype=torch.bool) if self.truncated is None
                     else self.truncated)
        if truncated.dtype != torch.bool or tuple(truncated.shape) != (num_samples,):
            raise RolloutBatchError(f"truncated: expected a bool tensor of shape "
                                    f"{(num_samples,)}, got {truncated.dtype} "
                                    f"{tuple(truncated.shape)}")
        object.__setattr__(self, "truncated", truncated)
        scored = torch.ones(num_samples, dtype=torch.bool) if self.scored is None \
            else self.scored
        if scored.dtype != torch.bool or tuple(scored.shape) != (num_samples,):
            raise RolloutBatchError(f"scored: expected a bool tensor of shape "
                                    f"{(num_samples,)}, got {scored.dtype} "
                                    f"{tuple(scored.shape)}")
        if (self.rewards[~scored] != 0).any():
            raise RolloutBatchError("rewards: an unscored sample's reward is the fill value "
                                    "0.0 (its reward is missing, not a number to train on)")
        object.__setattr__(self, "scored", scored)
        for name in OPTIONAL_TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (num_samples, seq_len):
                raise RolloutBatchError(f"{name}: expected shape {(num_samples, seq_len)}, "
                                        f"got {tuple(value.shape)}")
        for name in ("loss_mask", "rollout_log_probs", "rewards", "advantages",
                     *OPTIONAL_TOKEN_FIELDS):
            if getattr(self, name) is not None and not torch.isfinite(getattr(self, name)).all():
                raise RolloutBatchError(f"{name}: contains NaN or inf")
        if (self.prompt_lengths + self.response_lengths > seq_len).any():
            raise RolloutBatchError("prompt_lengths + response_lengths exceed input_ids width")
        for name in ("loss_mask", "advantages", "token_rewards", "values", "returns",
                     "token_versions"):
            if getattr(self, name) is not None and \
                    ((getattr(self, name) != 0) & ~response_span).any():
                raise RolloutBatchError(f"{name}: is non-zero outside the response tokens")
        if ((self.loss_mask < 0) | (self.loss_mask > 1)).any():
            raise RolloutBatchError("loss_mask: a token's weight m_it must lie in [0, 1]")

        # (kind, message) pairs, also when read back from a checkpoint's JSON as lists
        object.__setattr__(self, "events", [(str(k), str(m)) for k, m in self.events])
        group_ids, dense, counts = torch.unique(
            self.group_index, return_inverse=True, return_counts=True
        )
        incomplete = (counts != self.samples_per_prompt).nonzero().flatten()
        if len(incomplete):
            g = int(incomplete[0])
            raise RolloutBatchError(
                f"group_index: group {int(group_ids[g])} has {int(counts[g])} samples, "
                f"expected {self.samples_per_prompt} (steps hold whole groups)"
            )
        sample_token_counts = self.loss_mask.to(torch.float64).sum(dim=-1)
        prompt_mask_sums = torch.zeros(len(group_ids), dtype=torch.float64)
        prompt_mask_sums.index_add_(0, dense, sample_token_counts)
        object.__setattr__(self, "sample_token_counts", sample_token_counts)
        object.__setattr__(self, "group_ids", group_ids)
        object.__setattr__(self, "prompt_mask_sums", prompt_mask_sums)

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        """Pickled (Ray's object store, actor calls) as numpy arrays, derived fields
        included, the [N, S] fields as their rows' spans (:data:`SPAN_FIELDS`; a field
        with anything but padding outside them goes whole): the manager → driver → rank
        hop of a rollout costs a fraction of a millisecond rather than milliseconds."""
        values: dict[str, Any] = {}
        masks: dict[str, torch.Tensor] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            span = SPAN_FIELDS.get(f.name)
            if span is not None and isinstance(value, torch.Tensor) and \
                    value.device.type == "cpu" and not value.requires_grad:
                if span not in masks:
                    masks[span] = _span_mask(self, span, self.input_ids.shape[1])
                fill = self.pad_token_id if f.name == "input_ids" else 0.0
                value = _as_spans(value, masks[span], fill) or value
            values[f.name] = to_wire(value)
        return _rebuild_batch, (values,)

    @property
    def num_samples(self) -> int:
        """N."""
        return int(self.input_ids.shape[0])

    @property
    def num_prompts(self) -> int:
        """P = N / G."""
        return int(self.group_ids.shape[0])

    @property
    def num_valid_tokens(self) -> int:
        """Tokens with a weight m_it > 0 (Σ M_i for a 0/1 mask)."""
        return int((self.loss_mask > 0).sum())

    @property
    def sequence_lengths(self) -> torch.Tensor:
        return self.prompt_lengths + self.response_lengths

    def with_old_log_probs(self, old_log_probs: torch.Tensor) -> RolloutBatch:
        """The same batch carrying the trainer's start-of-rollout log-probs."""
        return replace(self, old_log_probs=old_log_probs)

    def placed_rewards(self) -> torch.Tensor:
        """The rewards on tokens [N, S] float64: ``token_rewards``, or each sample's
        reward on its last valid token (a sample with none has nowhere to put it)."""
        if self.token_rewards is not None:
            return self.token_rewards.to(torch.float64)
        valid = self.loss_mask > 0
        width = valid.shape[1]
        last = width - 1 - valid.flip(-1).int().argmax(dim=-1)
        placed = torch.zeros(valid.shape, dtype=torch.float64)
        has = valid.any(dim=-1)
        placed[has.nonzero().flatten(), last[has]] = self.rewards[has].to(torch.float64)
        return placed

    def select(self, sample_indices: torch.Tensor | list[int]) -> RolloutBatch:
        """A batch of whole groups picked by sample index (keeps the schema's checks)."""
        index = torch.as_tensor(sample_indices, dtype=torch.int64)
        init_names = [f.name for f in fields(self) if f.init]
        values = {name: getattr(self, name) for name in init_names}
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                values[name] = value[index]
        return RolloutBatch(**{**values, "samples": []})

    @classmethod
    def from_samples(
        cls,
        prompt_ids: list[list[int]],
        response_ids: list[list[int]],
        response_log_probs: list[list[float]],
        rewards: list[float],
        advantages: list[float] | list[list[float]],
        group_index: list[int],
        samples_per_prompt: int,
        pad_token_id: int = 0,
        response_masks: list[list[int]] | None = None,
        metadata: dict[str, float] | None = None,
        events: list[tuple[str, str]] | None = None,
        turn_rewards: list[list[tuple[int, float]]] | None = None,
        samples: list[SampleRecord] | None = None,
        truncated: list[bool] | None = None,
        scored: list[bool] | None = None,
        response_versions: list[list[int]] | None = None,
    ) -> RolloutBatch:
        """Pad ragged per-sample lists into the tensor layout.

        response_masks defaults to all response tokens counting (an episode of an
        environment masks its observation tokens with 0: rollout/episodes.py).
        ``advantages``: one per sample, or one per response token of each sample.
        ``turn_rewards``: per sample, (response position, reward) of each environment
        step, placed there in ``token_rewards`` (they sum to the sample's reward).
        ``truncated``: per sample, whether its response was cut at the length limit.
        ``scored``: per sample, whether every reward part scored it (an unscored one's
        reward is given as 0.0, the fill value).
        ``response_versions``: per sample, the weight version of each response token.
        """
        num_samples = len(prompt_ids)
        for name, values in (
            ("response_ids", response_ids),
            ("response_log_probs", response_log_probs),
            ("rewards", rewards),
            ("advantages", advantages),
            ("group_index", group_index),
            ("truncated", truncated if truncated is not None else group_index),
            ("scored", scored if scored is not None else group_index),
        ):
            if len(values) != num_samples:
                raise RolloutBatchError(f"{name}: {len(values)} entries for {num_samples} samples")
        for i, response in enumerate(response_ids):
            if len(response_log_probs[i]) != len(response):
                raise RolloutBatchError(
                    f"response_log_probs: sample {i} has {len(response_log_probs[i])} "
                    f"log-probs for {len(response)} response tokens"
                )
            if response_masks is not None and len(response_masks[i]) != len(response):
                raise RolloutBatchError(f"response_masks: sample {i} length differs from response")
            if response_versions is not None and len(response_versions[i]) != len(response):
                raise RolloutBatchError(
                    f"response_versions: sample {i} has {len(response_versions[i])} "
                    f"versions for {len(response)} response tokens")
        prompt_lengths = torch.tensor([len(p) for p in prompt_ids], dtype=torch.int64)
        response_lengths = torch.tensor([len(r) for r in response_ids], dtype=torch.int64)
        ends = prompt_lengths + response_lengths
        seq_len = int(ends.max())
        # One tensor per field, filled through masks in row-major order (the order of the
        # concatenated lists), instead of three small tensors per sample.
        position = torch.arange(seq_len)
        filled = position < ends[:, None]
        in_response = filled & (position >= prompt_lengths[:, None])
        input_ids = torch.full((num_samples, seq_len), pad_token_id, dtype=torch.int64)
        input_ids[filled] = torch.tensor([t for p, r in zip(prompt_ids, response_ids, strict=True)
                                          for t in (*p, *r)], dtype=torch.int64)
        loss_mask = torch.zeros(num_samples, seq_len, dtype=torch.float32)
        loss_mask[in_response] = (torch.tensor([m for mask in response_masks for m in mask],
                                               dtype=torch.float32)
                                  if response_masks is not None else 1.0)
        log_probs = torch.zeros(num_samples, seq_len, dtype=torch.float32)
        log_probs[in_response] = torch.tensor([lp for lps in response_log_probs for lp in lps],
                                              dtype=torch.float32)
        per_token = [isinstance(a, list | tuple) for a in advantages]
        if any(per_token):
            for i, response in enumerate(response_ids):
                if not per_token[i] or len(advantages[i]) != len(response):
                    raise RolloutBatchError(
                        f"advantages: sample {i} has "
                        f"{len(advantages[i]) if per_token[i] else 'one'} advantage(s) for "
                        f"{len(response)} response tokens (one per token, in every sample)")
            advantage = torch.zeros(num_samples, seq_len, dtype=torch.float32)
            advantage[in_response] = torch.tensor([a for adv in advantages for a in adv],
                                                  dtype=torch.float32)
        else:
            advantage = torch.tensor(advantages, dtype=torch.float32)
        token_versions = None
        if response_versions is not None:
            token_versions = torch.zeros(num_samples, seq_len, dtype=torch.int64)
            token_versions[in_response] = torch.tensor(
                [v for versions in response_versions for v in versions], dtype=torch.int64)
        token_rewards = None
        if turn_rewards is not None:
            token_rewards = torch.zeros(num_samples, seq_len, dtype=torch.float32)
            for i, placed in enumerate(turn_rewards):
                for position, reward in placed:
                    if not 0 <= position < int(response_lengths[i]):
                        raise RolloutBatchError(
                            f"turn_rewards: sample {i} places a reward at response position "
                            f"{position} of {int(response_lengths[i])}")
                    token_rewards[i, int(prompt_lengths[i]) + position] += reward
        return cls(
            input_ids=input_ids,
            prompt_lengths=prompt_lengths,
            response_lengths=response_lengths,
            loss_mask=loss_mask,
            rollout_log_probs=log_probs,
            rewards=torch.tensor(rewards, dtype=torch.float32),
            advantages=advantage,
            group_index=torch.tensor(group_index, dtype=torch.int64),
            samples_per_prompt=samples_per_prompt,
            pad_token_id=pad_token_id,
            metadata=dict(metadata or {}),
            events=list(events or []),
            token_rewards=token_rewards,
            samples=list(samples or []),
            truncated=(torch.tensor(truncated, dtype=torch.bool) if truncated is not None
                       else None),
            scored=torch.tensor(scored, dtype=torch.bool) if scored is not None else None,
            token_versions=token_versions,
        )
