"""``tally verify-aggregation`` as a program: one rollout drawn by the job's own rollout
manager, then every optimizer step of it under each layout against the first layout
(trainer/verify.py), for every aggregation mode; 0 when every comparison is within
tolerance, 1 otherwise. A test hands in the errors it plants (``planted``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from trainer.planted import Planted
from trainer.verify import Layout

if TYPE_CHECKING:
    from rollout.batch import RolloutBatch
    from rollout.config import AdvantageConfig, RolloutConfig
    from services.config.job import JobConfig

Echo = Callable[[str], None]


ROLLOUT_PLANTED = "rollout"
"""The ``planted`` key of the errors planted in the rollout manager's pool, not a layout's."""


def needs_reward_spread(advantage: AdvantageConfig) -> bool:
    """Whether a group whose rewards are all equal gets advantage 0 (a group baseline:
    grpo, reinforce_pp, …), so the verifier wants spread in its rollout: the estimator
    says so itself (``needs_reward_spread``, rollout/advantages/base.py), a user's class
    included; the verifier never asks by name."""
    from rollout.advantages.registry import estimator_class

    return estimator_class(advantage).needs_reward_spread


def spread_rollout(rollout: RolloutConfig) -> RolloutConfig:
    """The rollout config the verifier draws its batch with: DAPO's dynamic sampling on (8
    draws), since under a group baseline (grpo, reinforce_pp) a group whose rewards are
    all equal has advantage 0 and no pg gradient, and a pg row comparing zeros shows
    nothing."""
    from rollout.config import RolloutConfig

    if (rollout.dynamic_sampling.enabled or not needs_reward_spread(rollout.advantage)
            or rollout.n_samples_per_prompt < 2):  # spread is beside the point there
        return rollout
    return RolloutConfig.model_validate({**rollout.model_dump(),
                                         "dynamic_sampling": {"enabled": True,
                                                              "max_draws": 8}})


def parse_layouts(text: str) -> list[Layout]:
    """``--layouts``: comma-separated names, the first the reference (ValueError naming
    the entry when one is not a layout)."""
    return [Layout.parse(name) for name in text.split(",") if name]


def planted_by_layout(planted: Mapping[str, Planted], layouts: list[Layout]
                      ) -> dict[str, Planted]:
    """{layout name as the verifier prints it: its errors}; a layout that is not among
    ``layouts`` is refused (ValueError): errors planted where nothing runs would pass."""
    compared = {str(layout) for layout in layouts}
    by_name: dict[str, Planted] = {}
    for text, errors in planted.items():
        name = str(Layout.parse(text))
        if name not in compared:
            raise ValueError(f"planted: layout {name} is not among --layouts")
        by_name[name] = by_name.get(name, frozenset()) | errors
    return by_name


@contextlib.contextmanager
def rollout_manager(rollout: RolloutConfig, model_path: str) -> Iterator[Any]:
    """The verifier's rollout manager actor, handed its engines, teachers and reward
    actors (services/runtime/gang.py), every one stopped after."""
    import ray

    from rollout.manager import RolloutManagerActor
    from services.runtime.gang import count_starts, start_rollout_actors

    actors = start_rollout_actors(rollout, model_path)
    try:
        manager = RolloutManagerActor.remote(
            rollout, model_path, engines=actors.engines, owns_engines=True,
            teachers=actors.teachers, reward_actors=actors.reward_actors)
        count_starts("manager")
        try:
            yield manager
        finally:
            ray.get(manager.shutdown.remote())
    finally:
        actors.stop()  # what the manager stopped already is a no-op


def draw_rollout(job: JobConfig, model_path: str) -> RolloutBatch:
    """The verifier's one rollout (:func:`spread_rollout`), drawn by the job's rollout
    manager (:func:`rollout_manager`)."""
    import ray

    with rollout_manager(spread_rollout(job.rollout), model_path) as manager:
        return ray.get(manager.generate_batch.remote(0))


def verify_aggregation(job: JobConfig, layouts: list[Layout], rtol: float | None = None,
                       atol: float | None = None, planted: Mapping[str, Planted] | None = None,
                       echo: Echo = print) -> int:
    """Draw the rollout, compare every layout with ``layouts[0]`` and print the table
    (``echo``); 0 when every row is within tolerance, else 1. ``planted``: {layout: the
    errors its ranks make} (a test's; trainer/planted.py), and under the key ``rollout``
    the errors planted in the rollout manager's pool (partial rollouts). A job with
    ``rollout.partial_rollout`` is verified on a batch whose samples span two and three
    weight versions, with a spans row and each token's behaviour log-prob checked first
    (services/verify/partial.py)."""
    from services.driver.job import job_model_path
    from services.runtime.gang import count_starts, ray_started
    from services.runtime.quiet import quiet_transformers
    from services.verify.critic import critic_check
    from trainer.mini_batches import rollout_updates
    from trainer.verify import default_tolerance, format_rows, verify_layouts

    planted = dict(planted or {})
    rollout_planted = frozenset(planted.pop(ROLLOUT_PLANTED, frozenset()))
    planted = planted_by_layout(planted, layouts)
    needed = max(lay.dp_size * lay.cp_size * job.trainer.tp_size for lay in layouts) + 2
    with ray_started(max(os.cpu_count() or 1, needed)):
        quiet_transformers()
        model_path = job_model_path(job, log=lambda *_: None)
        partial_rows = []
        if job.rollout.partial_rollout:
            from services.verify.partial import behaviour_row, draw_partial_rollout, spans_row

            batch, weights = draw_partial_rollout(spread_rollout(job.rollout), model_path,
                                                  rollout_planted)
            partial_rows = [spans_row(batch), behaviour_row(
                batch, weights, model_path, job.rollout.sampling.temperature)]
        else:
            batch = draw_rollout(job, model_path)
        if (needs_reward_spread(job.rollout.advantage)
                and batch.metadata["rollout/zero_spread_filled"] == batch.num_prompts):
            echo("warning: no group of the rollout has reward spread, so every pg "
                 "gradient is 0 and the pg rows compare zeros")
        default_rtol, default_atol = default_tolerance(job.trainer)
        tolerance = (rtol if rtol is not None else default_rtol,
                     atol if atol is not None else default_atol)
        echo(f"batch: {batch.num_samples} samples, {batch.num_valid_tokens} valid tokens; "
             f"reference layout {layouts[0]}; rtol {tolerance[0]:.0e}, "
             f"atol {tolerance[1]:.0e}")
        updates = rollout_updates(batch, job.rollout.global_batch_size,
                                  job.trainer.ppo_epochs, job.trainer.seed, rollout_index=0)
        echo(f"{len(updates)} optimizer step(s) per rollout, each compared")
        rows = [*partial_rows, *verify_layouts(
            job.trainer, job.objective_config(), model_path, batch, layouts,
            tolerance=tolerance, planted=planted, updates=updates,
            critic=critic_check(job, model_path, batch, planted), on_start=count_starts)]
        for line in format_rows(rows):
            echo(line)
        failed = [row for row in rows if not row.ok]
        echo(f"{len(rows) - len(failed)}/{len(rows)} comparisons within tolerance")
        return 1 if failed else 0
