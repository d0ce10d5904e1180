"""``normalize: true`` logs the raw scores' mean beside the normalised ones (issue 52):
``reward/<name>/raw_mean`` of a step's batch is the mean of the raw scores of the samples
the part scored, before normalisation; ``reward/<name>/mean`` stays the normalised one.
Held to the mean and the normalisation written out here (statistics, float64), through
the function production calls (``build_batch``) and, on Ray, the reward actors' part."""

from __future__ import annotations

import pickle
import random
import statistics

import pytest

from rollout.datasets import PromptRecord
from rollout.engines.base import Generation
from rollout.reward_config import RewardModelConfig
from rollout.reward_parts import RunningMoments
from rollout.reward_parts.base import RewardShard
from rollout.reward_parts.model import ModelPart, NormalizedScore, raw_value
from rollout.rollouts.base import Sample
from rollout.rollouts.step import build_batch, groups_of
from tests.reward_model_folders import save_random_reward_model

G = 4


def _samples(parts: list[dict[str, float | None]]) -> list[Sample]:
    rng = random.Random(0)
    out = []
    for i, values in enumerate(parts):
        response = [rng.randint(3, 30) for _ in range(rng.randint(1, 5))]
        total = sum(v for v in values.values() if v is not None)
        out.append(Sample(PromptRecord(f"p{i // G}", label="x"), [1, 2],
                          Generation(response, [-0.5] * len(response), "stop"), total,
                          f"text {i}", dict(values)))
    return out


def _metrics(parts: list[dict[str, float | None]]) -> dict[str, float]:
    samples = _samples(parts)
    return build_batch(groups_of(samples, G), 0, G, 0, {}, [], []).metadata


def test_raw_mean_is_the_mean_of_the_scores_before_normalisation() -> None:
    rng = random.Random(1)
    earlier = [rng.gauss(-0.4, 0.2) for _ in range(16)]  # the running stats' history
    raw = [rng.gauss(3.1, 0.5) for _ in range(12)]
    unscored = {3, 7}
    moments = RunningMoments()
    moments.update(earlier)
    moments.update([r for i, r in enumerate(raw) if i not in unscored])
    normal = iter(moments.normalize([r for i, r in enumerate(raw) if i not in unscored]))
    rm = [None if i in unscored else next(normal) for i in range(len(raw))]
    metrics = _metrics([{"rule": 1.0, "rm": v} for v in rm])

    kept = [r for i, r in enumerate(raw) if i not in unscored]
    history = earlier + kept
    mu, sigma = statistics.fmean(history), statistics.stdev(history)
    assert metrics["reward/rm/raw_mean"] == pytest.approx(statistics.fmean(kept), abs=1e-12)
    assert metrics["reward/rm/mean"] == pytest.approx(
        statistics.fmean([(r - mu) / sigma for r in kept]), abs=1e-9)
    # the rise a user must see: raw ≈ 3.1 while the normalised mean is near zero's side
    assert metrics["reward/rm/raw_mean"] > 2.5
    assert "reward/rule/raw_mean" not in metrics  # a part that is not normalised


def test_a_planted_error_is_caught() -> None:
    """raw_mean read from the normalised values (what logging them alone amounts to)
    differs from the direct mean of the raw scores."""
    moments = RunningMoments()
    raw = [2.0, 4.0, 6.0, 8.0]
    moments.update(raw)
    values = moments.normalize(raw)
    metrics = _metrics([{"rm": v} for v in values])
    assert metrics["reward/rm/raw_mean"] == pytest.approx(5.0)
    assert metrics["reward/rm/mean"] == pytest.approx(0.0, abs=1e-12)
    planted = _metrics([{"rm": float(v)} for v in values])  # the raw value dropped
    assert "reward/rm/raw_mean" not in planted


def test_a_normalised_score_is_its_float_and_keeps_its_raw() -> None:
    value = NormalizedScore(-0.25, 3.14)
    assert value == -0.25 and isinstance(value, float) and raw_value(value) == 3.14
    again = pickle.loads(pickle.dumps(value))  # across Ray
    assert (float(again), raw_value(again)) == (-0.25, 3.14)
    assert raw_value(1.5) == 1.5


@pytest.mark.slow  # a reward actor on a local Ray head
def test_the_model_part_on_ray_logs_its_raw_mean(
        ray_cluster: None, tmp_path_factory: pytest.TempPathFactory,
        tiny_model_path: str) -> None:
    import ray

    from rollout.reward_model import RewardModel
    from rollout.reward_parts.registry import start_reward_actors

    folder = save_random_reward_model(tmp_path_factory.mktemp("rm") / "rm",
                                      tiny_model_path, seed=3)
    config = RewardModelConfig(path=folder, name="rm", normalize=True, num_cpus=0,
                               num_actors=2, dtype="float32", max_tokens_per_batch=64)
    prompts = [f"add {i} {i + 1}=" for i in range(8)]
    responses = [str(2 * i + 1) * (1 + i % 3) for i in range(8)]
    shard = RewardShard(prompts, prompts, responses, [None] * 8, [{}] * 8)
    part = ModelPart(config)
    actors = start_reward_actors([config], lambda model: model)
    try:
        part.bind(actors["rm"])
        scores = part.collect([part.submit(shard)])
    finally:
        for actor in actors["rm"]:
            ray.kill(actor)
    raw, _, _ = RewardModel(config).score(prompts, responses)  # in process, alone
    assert [raw_value(v) for v in scores.values] == pytest.approx(raw, abs=1e-5)
    mu, sigma = statistics.fmean(raw), statistics.stdev(raw)
    assert scores.values == pytest.approx([(r - mu) / sigma for r in raw], abs=1e-4)
    assert scores.counts["oom_retries"] == 0
    metrics = _metrics([{"rm": v} for v in scores.values])
    assert metrics["reward/rm/raw_mean"] == pytest.approx(statistics.fmean(raw), abs=1e-5)
    assert "reward/rm/raw_mean" in part.metric_names()
