"""SampleRecord: one line of samples.jsonl, a sample as text for a person to read.

    training   {"step", "index", "group", "prompt", "record_prompt", "response", "label",
                "reward", "rewards": {part: value}, "response_tokens", "judge_answers",
                "advantage", "tokens": {"text", "observation", "advantage",
                "engine_log_prob", "trainer_log_prob", "entropy"}}
    evaluation {"step", "eval": true, "greedy", "group", "prompt", "record_prompt",
                "response", "label", "reward", "rewards", "response_tokens",
                "judge_answers"}

An unscored sample (a reward part's value None) writes ``null`` for that part and for
its training ``reward``; ``judge_answers`` ({part: the judge's raw answer}, null where
the call failed) is written only for samples a judge graded.

Made in rollout (the manager's training samples, an evaluation's every sample); the
driver adds a training sample's advantage and writes the line (services/driver/
samples.py); the controller and ``tally samples`` read the lines back as JSON objects.
:meth:`SampleRecord.to_json` is the one place the line's keys and their order are
spelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SampleTokens:
    """A training sample's response token by token (the per-token view): one entry per
    response position, from its first generated token to its last (a multi-turn
    episode's observation tokens included, marked). Lists, not tensors: a line of JSON.

    The trainer-vs-engine gap of a token is ``trainer_log_prob − engine_log_prob``."""

    text: list[str]
    """Each position's token decoded alone (special tokens kept)."""
    observation: list[bool]
    """True: an environment's observation (multi-turn), not written by the policy."""
    advantage: list[float]
    """A_t the step trained with (0 on observations)."""
    engine_log_prob: list[float | None]
    """The engine's (behaviour) log-prob of the token; None on observations."""
    trainer_log_prob: list[float | None]
    """log π_T of the token under the weights the step trains from; None on observations
    or when the trainer was not asked."""
    entropy: list[float | None]
    """The entropy of π_T at the position (nats); None where trainer_log_prob is."""

    def to_json(self) -> dict[str, list[Any]]:
        return {"text": self.text, "observation": self.observation,
                "advantage": self.advantage, "engine_log_prob": self.engine_log_prob,
                "trainer_log_prob": self.trainer_log_prob, "entropy": self.entropy}

    @classmethod
    def from_json(cls, row: dict[str, list[Any]]) -> SampleTokens:
        count = len(row["text"])
        for key in ("observation", "advantage", "engine_log_prob", "trainer_log_prob",
                    "entropy"):
            if len(row.get(key) or []) != count:
                raise ValueError(f"tokens.{key}: {len(row.get(key) or [])} entries for "
                                 f"{count} tokens")
        return cls(text=list(row["text"]), observation=[bool(o) for o in row["observation"]],
                   advantage=list(row["advantage"]),
                   engine_log_prob=list(row["engine_log_prob"]),
                   trainer_log_prob=list(row["trainer_log_prob"]),
                   entropy=list(row["entropy"]))


@dataclass(frozen=True)
class SampleRecord:
    """One sample as samples.jsonl shows it."""

    step: int
    """The rollout step (training) or the weight version evaluated."""
    group: int
    """Training: the group index in the batch; evaluation: the held-out prompt's number."""
    prompt: str
    """The prompt as the policy saw it (its chat template's text)."""
    record_prompt: Any
    """The prompt as the dataset holds it (a string or chat messages)."""
    response: str
    label: str | None
    reward: float | None
    """The sample's reward; None: unscored (missing, not zero)."""
    rewards: dict[str, float | None] = field(default_factory=dict)
    """Each reward part's value, None where it left the sample unscored ({} when an
    environment scores)."""
    response_tokens: int = 0
    index: int | None = None
    """Training: the sample's row in its RolloutBatch; None for an evaluation's."""
    greedy: bool | None = None
    """Evaluation: the greedy response (else sampled); None for training's."""
    advantage: float | None = None
    """Training: mean of A_it over the sample's valid tokens, added by the driver."""
    judge_answers: dict[str, str | None] = field(default_factory=dict)
    """A judge part's name -> its raw answer (None: the call failed); {}: no judge."""
    tokens: SampleTokens | None = None
    """Training: the response token by token, added by the driver; None: not recorded."""

    @property
    def evaluation(self) -> bool:
        return self.greedy is not None

    def to_json(self) -> dict[str, Any]:
        """The samples.jsonl object, keys in their written order."""
        head: dict[str, Any] = ({"step": self.step, "eval": True, "greedy": self.greedy}
                                if self.evaluation else {"step": self.step, "index": self.index})
        row = {**head, "group": self.group, "prompt": self.prompt,
               "record_prompt": self.record_prompt, "response": self.response,
               "label": self.label, "reward": self.reward, "rewards": self.rewards,
               "response_tokens": self.response_tokens}
        if self.judge_answers:
            row["judge_answers"] = self.judge_answers
        if self.advantage is not None:
            row["advantage"] = self.advantage
        if self.tokens is not None:
            row["tokens"] = self.tokens.to_json()
        return row

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> SampleRecord:
        """A samples.jsonl object read back (a written ``null`` stays None)."""
        evaluation = bool(row.get("eval"))
        return cls(step=row["step"], group=row["group"], prompt=row["prompt"],
                   record_prompt=row.get("record_prompt"), response=row["response"],
                   label=row.get("label"), reward=row["reward"],
                   rewards=dict(row.get("rewards") or {}),
                   response_tokens=row.get("response_tokens", 0),
                   index=None if evaluation else row.get("index"),
                   greedy=bool(row.get("greedy")) if evaluation else None,
                   advantage=row.get("advantage"),
                   judge_answers=dict(row.get("judge_answers") or {}),
                   tokens=SampleTokens.from_json(row["tokens"]) if row.get("tokens")
                   else None)
