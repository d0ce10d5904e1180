"""The colocated fast path (verl's hybrid engine): a torch engine inside a trainer rank's
process that generates from the rank's own parameters.

    separate engine:  rank 0 packs buckets ─► object store ─► engine actor copies them
    colocated:        stage(v): every rank gathers each tensor once ──► a set for v
                      serve(v): in the manager's order, the serving model takes v

Three ways to hold the weights, chosen when the engine starts (services/driver/colocated.py):

- **alias** (one rank, the engine's dtype is the trainer's, ``rollout.async_steps: 0``):
  the serving model's tensors *are* the rank's parameters, so nothing is copied, ever.
  Exact because a synchronous rollout is generated between two optimizer steps, when the
  parameters are those of the version the rollout asks for.
- **in_place** (``async_steps: 0`` otherwise: several ranks or another dtype): ``stage``
  copies version v into the served tensors themselves, one set held (at 7 B in bf16,
  15 GB less than a copy). Exact for the same reason: nothing generates between a
  synchronous stage and its serve. A stage that fails part way leaves parts of two
  versions there, so the engine refuses to generate until a later stage is whole.
- **copy** (the async pipeline, where rollout s + 1 may run while step s trains):
  ``stage`` fills a reused buffer set (services/driver/weight_staging.py: the model's own tensors
  first, then one spare, a third only while two versions wait) and ``serve`` swaps its
  storage in (no second copy); the set it replaces is the next spare. A stage that fails
  leaves the served set untouched.

Every mode flips to v only when every tensor of v is in, each once with its shape; a
stage reads the whole stream before it raises, so the other ranks finish the gathers.
What is served is always a whole version, the one the manager's queue reached, as with a
separate engine (services/driver/pipeline.py). On CUDA the copies run on a side stream
and a version's event is what its serve waits on (weight_staging.StreamCopy).

The decode loop is the torch engine's own (rollout/engines/torch_engine.py), so the
log-prob convention, stop rules and seeds are the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from rollout.config import SamplingConfig, TorchEngineConfig
from rollout.engines.base import EpisodeTurn, Generation
from rollout.engines.torch_engine import TorchEngine
from services.driver.weight_staging import BufferSets, StreamCopy, TensorSet

StageMode = Literal["alias", "in_place", "copy"]


def serving_model(model_path: str, dtype: torch.dtype, device: torch.device
                  ) -> torch.nn.Module:
    """An empty HF model of ``model_path``'s architecture (no weights read: they come
    from the trainer), with the checkpoint's generation config (its EOS ids)."""
    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty gives a tied head a tensor of its own
    with contextlib.suppress(OSError):  # no generation_config.json: the config's ids stand
        model.generation_config = GenerationConfig.from_pretrained(model_path)
    return model.eval().requires_grad_(False)


@dataclass
class Staged:
    """One version staged, not served yet."""

    tensors: TensorSet | None
    """Its tensors by name (copy: a buffer set; alias: the trainer's); None in place."""
    done: torch.cuda.Event | None
    """Its copies' end on the side stream (CUDA only)."""


class ColocatedEngine:
    """One rank's engine: the torch decode loop over a model fed from the trainer."""

    def __init__(self, config: TorchEngineConfig, model_path: str, tokenizer_path: str | None,
                 rank: int, device: torch.device, mode: StageMode) -> None:
        if mode not in get_args(StageMode):
            raise ValueError(f"colocated engine: mode {mode!r}, not one of "
                             f"{get_args(StageMode)}")
        self.mode, self.dtype = mode, getattr(torch, config.dtype)
        self.model = serving_model(model_path, self.dtype, device)
        self.tensors = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        self.engine = TorchEngine(config, model_path, tokenizer_path, rank, model=self.model)
        self.buffers = BufferSets(self.tensors) if mode == "copy" else None
        self.copier = StreamCopy(device)
        self.staged: dict[int, Staged] = {}
        self.served: TensorSet | None = None  # copy mode: the buffer set the model holds
        self.torn: int | None = None  # in place: the version whose stage failed part way
        self.weight_version = -1  # nothing served until the first serve

    @property
    def alias(self) -> bool:
        return self.mode == "alias"

    @property
    def num_buffer_sets(self) -> int:
        """Full sets of weights this engine holds (served, staged, spare); aliased: 0."""
        return 0 if self.alias else self.buffers.num_held if self.buffers else 1

    def check_names(self, names: list[str]) -> None:
        """The trainer holds exactly the tensors the serving model needs."""
        if set(names) != set(self.tensors):
            missing, extra = set(self.tensors) - set(names), set(names) - set(self.tensors)
            raise ValueError(f"colocated engine: the trainer's tensors differ from the "
                             f"model's (missing {sorted(missing)[:3]}, "
                             f"extra {sorted(extra)[:3]})")

    @torch.no_grad()
    def stage(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Keep weights ``version`` (every full tensor by name, as the trainer yields them)
        to serve later; the bytes copied (0 when aliased: the trainer's own storage).
        Raises, staging nothing, unless every tensor came, each once, in its shape."""
        if self.alias:
            staged: TensorSet = {}
            for name, full, own in self._checked(version, tensors):
                if full.dtype != own.dtype:
                    raise ValueError(f"colocated engine: {name} cannot be aliased "
                                     f"({full.dtype} for {own.dtype})")
                staged[name] = full
            self.staged[version] = Staged(staged, None)
            return 0
        if self.mode == "in_place":
            # Every version staged in place lives in the served tensors: v replaces them.
            self.staged.clear()
            self.torn = version
            target = {name: tensor.detach() for name, tensor in self.tensors.items()}
        else:
            assert self.buffers is not None
            target = self.buffers.take()
        copied = 0
        try:
            for name, full, _ in self._checked(version, tensors):
                self.copier.copy(target[name], full)
                copied += target[name].numel() * target[name].element_size()
        except BaseException:
            if self.buffers is not None:  # copy mode: the served set was never touched
                self.buffers.give_back(target)
            raise
        self.torn = None
        self._drop(version)  # staged again: the newer copy stands
        self.staged[version] = Staged(None if self.mode == "in_place" else target,
                                      self.copier.done())
        return copied

    def _checked(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """(name, the trainer's tensor, the model's) for each tensor of the stream that
        fits; after the first that does not, the rest of the stream is read (the gathers
        are collectives: the other ranks finish them) and the stage fails, naming it."""
        seen: set[str] = set()
        problem = ""
        for name, full in tensors:
            if problem:
                continue
            own = self.tensors.get(name)
            if own is None:
                problem = f"unknown tensor {name!r}"
            elif name in seen:
                problem = f"{name} sent twice"
            elif tuple(full.shape) != tuple(own.shape):
                problem = (f"{name} has shape {tuple(full.shape)}, expected "
                           f"{tuple(own.shape)}")
            else:
                seen.add(name)
                yield name, full, own
        missing = sorted(set(self.tensors) - seen)
        if not problem and missing:
            problem = f"{len(missing)} tensors never came ({missing[:3]})"
        if problem:
            raise ValueError(f"colocated engine: weights {version} not staged: {problem}")

    def fence(self) -> None:
        """The caller's stream waits (on the GPU) for every copy staged so far: for a
        stage that read the trainer's own storage, which its next optimizer step writes."""
        self.copier.wait(self.copier.done())

    @torch.no_grad()
    def serve(self, version: int) -> None:
        """Serve the weights staged as ``version`` (older staged versions are dropped)."""
        if version not in self.staged:
            raise KeyError(f"colocated engine: weights {version} were never staged "
                           f"(staged: {sorted(self.staged)})")
        staged = self.staged.pop(version)
        self.copier.wait(staged.done)
        if staged.tensors is not None:
            for name, tensor in staged.tensors.items():
                self.tensors[name].data = tensor  # a swap of storage, not a copy
            self._give_back(self.served)
            self.served = staged.tensors
        for older in [v for v in self.staged if v < version]:
            self._drop(older)
        self.weight_version = self.engine.weight_version = version

    def _drop(self, version: int) -> None:
        """Forget staged ``version`` (if staged), its buffer set back to the spares."""
        dropped = self.staged.pop(version, None)
        if dropped is not None:
            self.copier.wait(dropped.done)  # its copies are done before it can be freed
            self._give_back(dropped.tensors)

    def _give_back(self, tensors: TensorSet | None) -> None:
        if self.buffers is not None and tensors is not None:
            self.buffers.give_back(tensors)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig, seed: int,
                 turn: EpisodeTurn | None = None) -> list[Generation]:
        if self.torn is not None:
            raise RuntimeError(
                f"colocated engine: staging weights {self.torn} in place failed part way, "
                f"so the served tensors hold parts of two versions; this engine generates "
                f"again once a later stage has copied every tensor")
        if self.mode == "in_place" and self.staged:
            raise RuntimeError(f"colocated engine: weights {sorted(self.staged)} are staged "
                               f"in place but not served yet")
        return self.engine.generate(prompt_ids, sampling, seed, turn)
