"""The verifier's rank groups: each started once per role and world size, and rebuilt in
place for every later layout of that size (trainer/verify.py).

A rank actor's process costs its start and its imports of torch and transformers (2.5–4
CPU-s each); a layout's model, optimizer and process group cost far less. So the pool
keeps one group alive and, for a layout of the same role and world size, rebuilds it
(``RankGroup.rebuild``: every rank leaves its process group, forgets all it built or was
planted with and is set up anew, as a new group's rank would be); any other layout stops
it and starts one of its own. One group at a time: the cluster needs room for the
largest layout only, as with a group per layout. The verifier orders its layouts so that
each world size's come together (:func:`run_order`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.config import ObjectiveConfig, TrainerConfig
    from trainer.group import RolloutGroup

OnStart = Callable[[str, int], None]
"""Called with (role, number of rank actors) whenever the pool starts a group (the
services layer counts actor starts with it: services/runtime/gang.py ``count_starts``)."""


def run_order(world_sizes: Sequence[int]) -> list[int]:
    """The order in which to run layouts of these world sizes (indices): the reference
    (index 0) first, then the others of its world size, then each other world size's
    together, smallest first, the given order kept within one size, so a pool starts
    one group per world size."""
    first = world_sizes[0]
    return [0, *sorted(range(1, len(world_sizes)),
                       key=lambda i: (world_sizes[i] != first, world_sizes[i]))]


class RankPool:
    """The one live rank group of a verification, rebuilt for each layout it can serve;
    :meth:`close` (or leaving the ``with`` block) stops it."""

    def __init__(self, on_start: OnStart | None = None) -> None:
        self._group: RolloutGroup | None = None
        self._key: tuple[object, ...] | None = None
        self._on_start = on_start
        self.groups_started: Counter[str] = Counter()
        """Groups started, by role (``policy``, ``critic``)."""
        self.ranks_started: Counter[str] = Counter()
        """Rank actors started, by role."""

    def group(self, config: TrainerConfig, objective: ObjectiveConfig, model_path: str,
              total_steps: int, critic: bool = False, value_clip: float | None = None
              ) -> RolloutGroup:
        """A group of ``config``'s layout with fresh ranks' state: the live one rebuilt
        when it has this role, world size, rank resources and backend (and the critic's
        ``value_clip``, a rank's constructor argument), else a new one."""
        from trainer.group import CriticGroup, RankGroup, TrainerGroup

        role = "critic" if critic else "policy"
        key = (role, config.world_size, tuple(sorted(config.rank_bundle.items())),
               config.backend, value_clip)
        if self._group is not None and key == self._key and RankGroup.rebuilds_in_place(config):
            self._group.rebuild(config, objective, model_path, total_steps)
            return self._group
        self.close()
        group: RolloutGroup = (
            CriticGroup(config, objective, model_path, total_steps=total_steps,
                        value_clip=value_clip) if critic else
            TrainerGroup(config, objective, model_path, total_steps=total_steps))
        self._group, self._key = group, key
        self.groups_started[role] += 1
        self.ranks_started[role] += config.world_size
        if self._on_start is not None:
            self._on_start(role, config.world_size)
        return group

    def close(self) -> None:
        """Stop the live group, if any (its ranks killed: RankGroup.shutdown)."""
        group, self._group, self._key = self._group, None, None
        if group is not None:
            group.shutdown()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()
