"""The engine contract: token ids in, sampled token ids with their log-probs out.

Log-prob convention (both engines): the log-prob of a sampled token is taken under the
temperature-scaled model distribution, log softmax(logits / T), *before* top-k / top-p
truncation — what a teacher-forced forward pass of the same weights computes with
logits / T, so the trainer can recompute it exactly (slime and verl do the same). Greedy
decoding (T = 0) reports log softmax(logits), i.e. T = 1.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from rollout.config import SamplingConfig
from rollout.weight_bucket import WeightBucket, WeightShipment

FinishReason = Literal["stop", "length", "abort"]


def as_tensors(state_dict: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """A state dict of tensors from one of tensors or numpy arrays; arrays from Ray's
    shared memory are read-only views, read in place (no copy), never written."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {name: torch.as_tensor(value) for name, value in state_dict.items()}


@dataclass(frozen=True)
class Generation:
    """One sampled response.

    token_ids   the response, ending with the EOS / stop tokens when finish_reason="stop"
    log_probs   one per token (see the module docstring for the convention)
    finish_reason  "stop" (EOS or stop string), "length" (max_new_tokens) or "abort"
    versions    the weight version that sampled each token, where a response was
                continued across weight updates (rollout/partial.py); None: one call's
    """

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: FinishReason
    versions: list[int] | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.log_probs):
            raise ValueError(
                f"Generation: {len(self.token_ids)} tokens but {len(self.log_probs)} log-probs"
            )
        if self.versions is not None and len(self.versions) != len(self.token_ids):
            raise ValueError(
                f"Generation: {len(self.token_ids)} tokens but {len(self.versions)} versions")


@dataclass(frozen=True)
class EpisodeTurn:
    """Said with a generate call that plays one turn of a set of episodes
    (rollout/episodes.py): each prompt is an episode's context so far, which its next
    turn extends. An engine may keep each response's KV for that turn and prefill only
    what follows it (the torch engine's prefix cache; SGLang's radix cache does so on
    its own, unasked). Never changes what is sampled."""

    episodes: str
    """Which set of episodes (one rollout's draw, one evaluation): what one set kept is
    of no use to another."""
    turn: int
    """The turn this call generates (0: the first observation is the prompt)."""
    last: bool
    """No turn follows (rollout.environment.max_turns): keep nothing for one."""


class Engine(ABC):
    """An inference engine; one instance lives in one Ray actor."""

    @abstractmethod
    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, seed: int,
        turn: EpisodeTurn | None = None,
    ) -> list[Generation]:
        """One response per prompt, in prompt order; same inputs and seed, same output.
        ``turn``: the prompts are episodes' contexts at that turn (None: plain prompts)."""

    @abstractmethod
    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load new policy weights (names as in the HF model's state_dict)."""

    @abstractmethod
    def update_weights_from_disk(self, path: str) -> None:
        """Load new policy weights from a saved HF checkpoint directory."""

    @abstractmethod
    def load_weight_buckets(self, buckets: Sequence[WeightBucket], version: int) -> None:
        """Load weights ``version`` sent as buckets (rollout/weight_bucket.py; given as
        Ray object refs from the trainer, resolved with ``weight_bucket.resolve``), and
        serve it only once every bucket is in."""

    def receive_weights(self, version: int, shipment: WeightShipment) -> None:
        """The engines' half of the object-store transport
        (services/driver/transports/object_store.py): load weights ``version`` from the
        shipment the trainer's rank 0 stamped, refusing one of another version
        (``WeightVersionMismatch``) before any weight is touched."""
        self.load_weight_buckets(shipment.for_version(version), version)

    weight_version: int = 0
    """How many weight updates this engine has loaded."""

    def ping(self) -> int:
        """The weight version; also a cheap "is the actor up" call."""
        return self.weight_version

    def node_id(self) -> str:
        """The Ray node this engine runs on (placement reports)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def shutdown(self) -> None:  # noqa: B027 -- optional hook, a no-op by default
        """Release what the engine owns (servers, memory)."""
