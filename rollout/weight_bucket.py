"""Weights in buckets: the one format the trainer sends and every engine reads.

A weight version travels as an ordered list of buckets. A bucket is one flat byte buffer
holding a few whole tensors back to back, each cast to the engine's dtype, and the specs
that say where each tensor lies in it:

    WeightBucket(specs=(TensorSpec("model.embed_tokens.weight", (V, H), "bfloat16", 0), …),
                 data=np.ndarray[uint8] of Σ numel · itemsize bytes)

The trainer gathers, casts and sends one bucket at a time and frees it, so no rank holds
more than one bucket beyond its own shard (``trainer.weight_sync.bucket_mb``). In Ray's
object store the buffer is a numpy array, which an engine on the same node maps in place;
numpy has no bfloat16, so every tensor is carried as raw bytes and viewed back.

An engine flips to the new version only when every bucket of it is in: it checks every
bucket's names, shapes and dtypes before it copies any (``check_buckets``). Through the
object store a version travels as a :class:`WeightShipment`: its buckets, stamped with
the version by the rank that packed them, so an engine asked to serve v refuses the
buckets of any other version (``for_version``).

This module is one of the shared wire formats (docs/architecture.md): the trainer's
senders (trainer/transports/), the driver's transports (services/driver/transports/)
and the engines (rollout/engines/) import it, and it imports nothing of theirs.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a bucket: its HF name, shape, dtype name and byte offset."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int = 0

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class WeightBucket:
    """Some whole tensors of one weight version in one flat byte buffer."""

    specs: tuple[TensorSpec, ...]
    data: np.ndarray
    """uint8, 1-D: the tensors back to back at their specs' offsets."""

    @property
    def num_bytes(self) -> int:
        return int(self.data.nbytes)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Views of the buffer, one per spec (no copy: read-only when it came from Ray's
        object store, so copy out of it, never into it)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            flat = torch.from_numpy(self.data)
        return {spec.name: flat[spec.offset:spec.offset + spec.num_bytes]
                .view(DTYPES[spec.dtype]).view(spec.shape) for spec in self.specs}


class WeightVersionMismatch(ValueError):
    """Weights were sent as one version and received as another."""


@dataclass(frozen=True)
class WeightShipment:
    """One weight version through the object store: its buckets in send order (Ray
    object refs of :class:`WeightBucket`, or the buckets), stamped with the version by
    the rank that packed them. A few refs: it is cheap to pass from actor to actor."""

    version: int
    buckets: tuple[Any, ...]

    def for_version(self, version: int) -> tuple[Any, ...]:
        """The buckets, if they are weights ``version``; else raise (the receiver was
        told to flip to another version than the one these buckets hold)."""
        if version != self.version:
            raise WeightVersionMismatch(f"weight sync: asked to load weights {version}, "
                                        f"the buckets sent are weights {self.version}")
        return self.buckets


def plan_buckets(shapes: Iterable[tuple[str, tuple[int, ...]]], dtype: str,
                 bucket_bytes: int) -> list[tuple[TensorSpec, ...]]:
    """Group tensors, in the order given, into buckets of at most ``bucket_bytes`` (a
    tensor larger than that gets a bucket of its own); offsets are within the bucket."""
    buckets: list[tuple[TensorSpec, ...]] = []
    current: list[TensorSpec] = []
    used = 0
    for name, shape in shapes:
        size = math.prod(shape) * DTYPES[dtype].itemsize
        if current and used + size > bucket_bytes:
            buckets.append(tuple(current))
            current, used = [], 0
        current.append(TensorSpec(name, tuple(shape), dtype, used))
        used += size
    if current:
        buckets.append(tuple(current))
    return buckets


def pack_flat(specs: Sequence[TensorSpec], tensor: Callable[[str], torch.Tensor],
              device: torch.device | str = "cpu") -> torch.Tensor:
    """One new uint8 buffer on ``device`` holding every spec's tensor cast to the spec's
    dtype; ``tensor(name)`` is asked for one tensor at a time, each dropped once copied,
    so a sender holds the bucket plus one tensor at most."""
    flat = torch.empty(sum(spec.num_bytes for spec in specs), dtype=torch.uint8,
                       device=device)
    for spec in specs:
        view = flat[spec.offset:spec.offset + spec.num_bytes].view(DTYPES[spec.dtype])
        view.copy_(tensor(spec.name).detach().reshape(-1))
    return flat


def pack_bucket(specs: Sequence[TensorSpec],
                tensors: Mapping[str, torch.Tensor] | Callable[[str], torch.Tensor]
                ) -> WeightBucket:
    """A bucket in CPU memory (what Ray's object store carries)."""
    get = tensors.__getitem__ if isinstance(tensors, Mapping) else tensors
    return WeightBucket(tuple(specs), pack_flat(specs, get).numpy())


def resolve(buckets: Sequence[WeightBucket | Any]) -> list[WeightBucket]:
    """Buckets, fetching those given as Ray object refs (mapped in place from the node's
    object store, not copied)."""
    refs = [i for i, bucket in enumerate(buckets) if not isinstance(bucket, WeightBucket)]
    if not refs:
        return list(buckets)
    import ray  # only where refs came: a GPU check without Ray passes buckets
    fetched = dict(zip(refs, ray.get([buckets[i] for i in refs]), strict=True)) if refs else {}
    return [fetched.get(i, bucket) for i, bucket in enumerate(buckets)]


def check_buckets(buckets: Sequence[WeightBucket],
                  expected: Mapping[str, tuple[int, ...]]) -> None:
    """Raise, naming the tensor, unless the buckets carry only known names with the
    expected shapes, each once, and every buffer holds what its specs say."""
    seen: set[str] = set()
    for index, bucket in enumerate(buckets):
        end = max((spec.offset + spec.num_bytes for spec in bucket.specs), default=0)
        if bucket.data.dtype != np.uint8 or bucket.data.ndim != 1 or bucket.num_bytes < end:
            raise ValueError(f"weight bucket {index}: {bucket.num_bytes} bytes of "
                             f"{bucket.data.dtype}, its tensors need {end} bytes of uint8")
        for spec in bucket.specs:
            if spec.name not in expected:
                raise KeyError(f"weight bucket {index}: unknown parameter {spec.name!r}")
            if tuple(expected[spec.name]) != tuple(spec.shape):
                raise ValueError(f"weight bucket {index}: {spec.name} has shape "
                                 f"{tuple(spec.shape)}, expected {tuple(expected[spec.name])}")
            if spec.name in seen:
                raise ValueError(f"weight bucket {index}: {spec.name} sent twice")
            seen.add(spec.name)


def iter_tensors(buckets: Iterable[WeightBucket]) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket in buckets:
        yield from bucket.tensors().items()
