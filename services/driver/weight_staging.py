"""Where a colocated engine stages weight versions: buffer sets reused across versions,
and the copy into them on a side stream (CUDA).

    copy mode:   free sets ─take─► filled with version v ─serve─► served ─next serve─► free
                 the model's own tensors are the first set; a second (the spare) is made
                 once; a third only while two versions wait; a free set beyond one spare
                 is dropped, so a job holds 1 + (versions waiting) sets, at least 2
    in place:    version v is copied into the served tensors themselves: one set, ever

At 7 B in bf16 a set is 15.2 GB (docs/rollout.md has the figures): copy mode holds
30.5 GB (45.7 GB while two versions wait), in place 15.2 GB. A fresh set per version
would hold the same peak but make and free 15 GB of device memory every version.

On CUDA each copy is queued on a side stream after what the caller's stream has queued
(so it reads a gathered tensor only once it is gathered, and writes a set only once the
generation reading it is done), each source is marked as used there (``record_stream``:
the allocator keeps a gathered tensor freed meanwhile until the copy has read it), and
the version's event marks the end: serving waits on it on the GPU, never on the host, so
the copy overlaps whatever the host does next (the driver's next phase).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

TensorSet = dict[str, torch.Tensor]


class BufferSets:
    """Sets of tensors shaped as one template (the serving model's, by name), reused."""

    def __init__(self, first: Mapping[str, torch.Tensor], max_free: int = 1) -> None:
        """``first``: the model's own tensors, the first set handed out; a set given back
        beyond ``max_free`` free ones is dropped (its memory freed)."""
        self.template: TensorSet = {name: t.detach() for name, t in first.items()}
        self.free: list[TensorSet] = [dict(self.template)]
        self.max_free = max_free
        self.num_allocated = 0
        """Sets made beyond the model's own, over the engine's life."""
        self.num_held = 1
        """Sets alive now: served, staged and free."""

    def take(self) -> TensorSet:
        """A free set, or a new one (uninitialised) when none is free."""
        if self.free:
            return self.free.pop()
        self.num_allocated += 1
        self.num_held += 1
        return {name: torch.empty_like(t) for name, t in self.template.items()}

    def give_back(self, tensors: TensorSet) -> None:
        """``tensors`` holds nothing anyone reads any more (on CUDA: the caller's stream
        has passed every read of it)."""
        if len(self.free) < self.max_free:
            self.free.append(tensors)
        else:
            self.num_held -= 1  # dropped: the last reference goes with this frame


class StreamCopy:
    """Tensor copies for one device: on a side stream for CUDA, in order elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        """``dest`` ← ``src`` (cast to ``dest``'s dtype), queued after the caller's
        stream's work so far (which produced ``src`` and last read ``dest``)."""
        if self.stream is None:
            dest.copy_(src)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dest.copy_(src, non_blocking=True)
        if src.is_cuda:  # a gathered tensor freed after this stays unused until read
            src.record_stream(self.stream)

    def done(self) -> torch.cuda.Event | None:
        """An event after every copy queued so far (None off CUDA: they are done)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, event: torch.cuda.Event | None) -> None:
        """The caller's stream waits for ``event`` (on the GPU; the host goes on)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

