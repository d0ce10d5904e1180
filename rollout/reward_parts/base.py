"""What every reward part offers (:class:`RewardPart`), so callers iterate parts and ask
them instead of testing their type.

    build (controller or job: imports nothing heavy, never user code)
      name, weight, actor_bundles()        placement: one bundle per actor in the gang
      check(field)                         preflight: folders, models (no user import)
      user_code()                          preflight: a ``module:attr`` to locate / load
    in the job
      start_actors(resolve, options)       the gang starts them, in part order
      bind(actors)                         the manager: its actors, the user's class
      submit(shard) -> handle              as soon as a shard is generated
      collect(handles) -> PartScores       values None (unscored) or finite floats; a
                                           judge's raw answers beside them
      check_errors(...)                    a rollout's error budget
      metric_names(), state_dict()         logged metrics; running state for resume
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class RewardShard:
    """The samples a part scores: each one's prompt as the policy saw it (decoded ids)
    and as its record holds it (text or chat messages), its response, label and
    metadata."""

    policy_prompts: list[str]
    raw_prompts: list[Any]
    responses: list[str]
    labels: list[str | None]
    metadata: list[dict[str, Any]]

    def __len__(self) -> int:
        return len(self.responses)


@dataclass
class PartScores:
    """One part's scores of some samples and what it cost."""

    values: list[float | None]
    """Per sample: a finite float, or None when the part could not score it (the sample
    is then unscored: missing, never a zero reward; rollout/reward_parts/rewarder.py)."""
    busy_s: float = 0.0
    """Seconds its actors (or server) spent."""
    num_errors: int = 0
    """Samples whose scoring raised and fell back on ``default_on_error`` (rules)."""
    first_error: str | None = None
    counts: dict[str, int] = field(default_factory=dict)
    """Counts logged as ``reward/<name>/<key>`` (a judge's ``unparsed``; a part that may
    leave samples unscored counts them as ``unscored``)."""
    answers: list[str | None] | None = None
    """Per sample, the text its value was read from (a judge's raw answer, None where the
    call failed), kept in samples.jsonl; None: the part has none."""

    def __add__(self, other: PartScores) -> PartScores:
        counts = dict(self.counts)
        for key, count in other.counts.items():
            counts[key] = counts.get(key, 0) + count
        answers = None
        if self.answers is not None or other.answers is not None:
            answers = [*(self.answers or [None] * len(self.values)),
                       *(other.answers or [None] * len(other.values))]
        return PartScores(self.values + other.values, self.busy_s + other.busy_s,
                          self.num_errors + other.num_errors,
                          self.first_error or other.first_error, counts, answers)


class RewardPart(ABC):
    """One part of ``rollout.reward``, built from its config block. Building imports
    nothing heavy and no user code (the controller builds parts to place and check
    them); what runs in the job happens in :meth:`start_actors` and :meth:`bind`."""

    count_names: ClassVar[tuple[str, ...]] = ()
    """Keys of :attr:`PartScores.counts` this part always reports."""

    def __init__(self, config: Any) -> None:
        self.config = config

    @property
    def name(self) -> str:
        return str(self.config.part_name)

    @property
    def weight(self) -> float:
        return float(self.config.weight)

    def actor_bundles(self) -> list[dict[str, float]]:
        """One bundle per actor it needs in the job's gang (``{}``: an actor that needs
        no resource); empty when it scores in the manager's process."""
        return []

    def start_actors(self, resolve: Callable[[str], str],
                     options: list[dict[str, Any]]) -> list[Any]:
        """Its actors started (not waited for), one per :meth:`actor_bundles` entry with
        that entry's Ray ``options``; ``resolve``: a model name to its folder."""
        return []

    def check(self, field: str) -> None:
        """Preflight (controller and job): what pydantic cannot see, ValueError or
        RuntimeError naming ``field`` (``rollout.reward[1]``). Imports no user code."""
        return None  # the default: nothing to do

    def user_code(self) -> tuple[str, str] | None:
        """(``module:attr``, its key) of the user's code it runs, or None."""
        return None

    def check_user_code(self, field: str) -> None:
        """In the job's preflight: the user's code imports and is what this part needs
        (PluginError naming ``field``)."""
        return None  # the default: nothing to do

    def bind(self, actors: list[Any]) -> None:
        """In the job, before scoring: the actors :meth:`start_actors` gave."""
        return None  # the default: nothing to do

    @abstractmethod
    def submit(self, shard: RewardShard) -> Any:
        """Start scoring ``shard``; the handle goes back to :meth:`collect`. A part that
        scores in this process returns its :class:`PartScores` at once."""

    @abstractmethod
    def collect(self, handles: list[Any], update_stats: bool = True) -> PartScores:
        """The scores of the shards behind ``handles``, in their order; ``update_stats``:
        a training rollout (an evaluation leaves running statistics alone)."""

    def check_errors(self, num_errors: int, first_error: str | None, num_samples: int,
                     step: int) -> None:
        """Raise RewardError when a rollout's errors exceed what this part allows."""
        return None  # the default: nothing to do

    def metric_names(self) -> list[str]:
        """What it logs each rollout."""
        return [f"reward/{self.name}/{key}" for key in ("mean", "std", *self.count_names)]

    def state_dict(self) -> Any:
        """Running state a resume continues; None: it has none."""
        return None

    def load_state_dict(self, state: Any) -> None:
        """Restore what :meth:`state_dict` gave."""
        return None  # the default: nothing to do
