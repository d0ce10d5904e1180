"""The rollout interface: what the manager asks to play, and what comes back.

    Play(requests × G, sampling, seed key, draw) ─► Rollout.play ─► [Sample] (request order)
                                                        │
                       single_turn.py: one response per request, scored by rollout.reward
                       episodic.py:    one episode per request, scored by its environment

Training and evaluation call the same :meth:`Rollout.play`: a training rollout is one
play (each record G times, seed key = the step), an evaluation two (greedy and sampled,
seed keys ``eval:<step>:greedy`` / ``eval:<step>:sampled``). The seed of each engine call
is the manager's hash of (seed, key, draw, engine rank), so which implementation plays
never moves a seed.

Why single-turn is not an episode of one turn: routing it through the episode loop would
change what a job writes. The loop takes its prompt from an environment's first
observation, reports "stop" only when the environment ended the episode (the engine's
own finish reason is lost, and with it rollout/truncated_fraction), gives every sample a
loss-mask list and per-turn rewards (a different RolloutBatch), and scores after the
whole turn instead of each engine's shard as it finishes (reward actors would no longer
overlap generation). So both are implementations of this one interface instead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from rollout.config import SamplingConfig
from rollout.datasets import PromptRecord
from rollout.engines.base import EpisodeTurn, Generation
from rollout.episodes import Episode
from rollout.reward_parts import RewardScores

Generate = Callable[[list[list[int]], SamplingConfig, "int | str", int, "EpisodeTurn | None"],
                    list[Generation]]
"""(prompts, sampling, seed key, draw, turn) -> one response per prompt, in order, from
the engines (the manager's fan-out; every seed from its hash)."""

ShardsAsDone = Callable[[list[list[int]], SamplingConfig, "int | str", int],
                        Iterator[tuple[tuple[int, int], list[Generation]]]]
"""The same call, each engine's shard as it finishes with its (start, end) bounds."""


@dataclass(frozen=True)
class Request:
    """One sample to play: a dataset record and the prompt ids the policy reads."""

    record: PromptRecord
    ids: list[int]
    """Its prompt within the budget; [] when the rollout writes its own (an environment's
    first observation)."""
    number: int = 0
    """The record's number where an error names it (its index in its dataset)."""


@dataclass(frozen=True)
class Play:
    """Requests played with one sampling under one seed key."""

    requests: list[Request]
    sampling: SamplingConfig
    key: int | str
    """The seed key: the rollout step, or ``eval:<step>:greedy`` / ``:sampled``."""
    draw: int = 0
    """Dynamic sampling's round within the step (part of the seed)."""


@dataclass(frozen=True)
class Sample:
    """One played request: the policy's sequence, its reward and how it was scored."""

    record: PromptRecord
    prompt_ids: list[int]
    generation: Generation
    reward: float
    text: str
    """The response as the rewards read it."""
    parts: dict[str, float | None] = field(default_factory=dict)
    """Each reward part's value (rollout.reward), None where it left the sample unscored;
    {} when an environment scores."""
    mask: list[int] | None = None
    """Per response token: 1 the policy's, 0 the environment's; None: all the policy's."""
    turn_rewards: list[tuple[int, float]] | None = None
    """(response position, reward) of each environment step; None: one reward."""
    answers: dict[str, str | None] = field(default_factory=dict)
    """A judge part's raw answer by part name (samples.jsonl keeps it); {} without one."""
    truncated: bool | None = None
    """The response was cut at the length limit, not ended by the policy or its
    environment (GAE's ``bootstrap_truncated`` reads it). None: the engine's finish
    reason says, "length" (max_new_tokens) being a cut; an episode's is set by
    episodic.py (its ending by a budget, the context or max_turns). Resolved on
    construction, a bool after."""

    def __post_init__(self) -> None:
        if self.truncated is None:
            object.__setattr__(self, "truncated",
                               self.generation.finish_reason == "length")

    @property
    def scored(self) -> bool:
        """Every reward part scored it (a part's None: unscored); an environment's always."""
        return all(value is not None for value in self.parts.values())

    @property
    def policy_tokens(self) -> int:
        """Tokens the policy generated (an environment's observations excluded)."""
        return len(self.generation.token_ids) if self.mask is None else sum(self.mask)


@dataclass
class Played:
    """What one call of :meth:`Rollout.play` produced, with its costs."""

    samples: list[Sample]
    """Every play's samples, plays in order, each in request order."""
    gen_time_s: float = 0.0
    """Seconds generating (an environment's own time excluded)."""
    reward_s: float = 0.0
    """Seconds waiting for rewards after the last response was generated."""
    env_seconds: float = 0.0
    scores: RewardScores | None = None
    """The reward parts' scores (errors, counts, busy time); None: an environment's."""
    episodes: list[Episode] = field(default_factory=list)


@dataclass
class StepStats:
    """One rollout step's counts over its draws (dynamic sampling draws again)."""

    num_draws: int = 0
    num_samples: int = 0
    gen_tokens: int = 0
    gen_time_s: float = 0.0
    all_rewards: list[float] = field(default_factory=list)
    prompts_truncated: int = 0
    prompts_dropped: int = 0
    episodes: list[Episode] = field(default_factory=list)
    env_seconds: float = 0.0
    reward_s: float = 0.0
    """Seconds the rollout waited for rewards after its last response was generated."""
    reward_busy_s: float = 0.0
    reward_counts: dict[str, int] = field(default_factory=dict)
    """``reward/<name>/<key>`` -> count over the rollout's draws (a judge's unparsed)."""
    errors: dict[str, tuple[int, str | None]] = field(default_factory=dict)

    @property
    def reward_mean(self) -> float:
        """The mean reward of every scored sample drawn (0 with none)."""
        rewards = self.all_rewards
        return float(sum(rewards) / len(rewards)) if rewards else 0.0

    def add(self, played: Played) -> None:
        """Count one draw."""
        self.num_draws += 1
        self.num_samples += len(played.samples)
        self.gen_tokens += sum(s.policy_tokens for s in played.samples)
        self.gen_time_s += played.gen_time_s
        self.all_rewards += [s.reward for s in played.samples if s.scored]
        self.episodes += played.episodes
        self.env_seconds += played.env_seconds
        self.reward_s += played.reward_s
        if played.scores is not None:
            self._add_scores(played.scores)

    def _add_scores(self, scores: RewardScores) -> None:
        self.reward_busy_s += scores.busy_s
        for name, count in scores.counts.items():
            self.reward_counts[name] = self.reward_counts.get(name, 0) + count
        for name, (count, first) in scores.errors.items():
            had, first_had = self.errors.get(name, (0, None))
            self.errors[name] = (had + count, first_had or first)


class Rollout(ABC):
    """Plays requests on the engines and scores them: the one way the manager samples,
    for training and for evaluation."""

    writes_prompts: bool = False
    """True: it writes each sample's prompt itself (an environment), so requests carry no
    prompt ids and the manager encodes none."""

    @abstractmethod
    def play(self, plays: list[Play], training: bool) -> Played:
        """Every play's samples, scored. ``training``: a rollout step (reward parts'
        running statistics move); else an evaluation, which leaves every state as it
        is."""

    def finish(self, stats: StepStats, step: int
               ) -> tuple[dict[str, float], list[tuple[str, str]]]:
        """A rollout step's own metrics and events after its draws; raises when more
        went wrong than the config allows."""
        return {}, []
