"""``rollout.advantage.bootstrap_truncated``: a response cut at the length limit is
bootstrapped with the critic's value at its last token (V_{K+1} = V_K) instead of 0.

From the played samples (the engine's finish reason; an episode's ending) through
``build_batch`` (what the manager calls) to ``driver_advantages`` (what the driver
calls) with the registry's estimator, against GAE's recursion written out here in
float64 loops, apart from production. Off (the default), the advantages are bit for bit
those of a batch with no cut flag. The flag survives what a batch goes through: selection
into mini-batches, the wire, the checkpoint of rollouts in flight."""

from __future__ import annotations

import dataclasses
import math
import pickle
import random
from pathlib import Path

import pytest
import torch

from rollout.advantages import GAE, build_estimator
from rollout.advantages.gae import with_gae
from rollout.batch import RolloutBatch, RolloutBatchError
from rollout.config import AdvantageConfig, TorchEngineConfig
from rollout.datasets import PromptRecord
from rollout.engines.base import Generation
from rollout.engines.torch_engine import TorchEngine
from rollout.rollouts.base import Sample
from rollout.rollouts.episodic import cut_short
from rollout.rollouts.step import build_batch, groups_of
from rollout.turns import TurnFormat
from services.driver.advantages import driver_advantages
from services.driver.checkpoint import DriverState, load_driver_state, save_driver_state
from tests.rollout.episode_play import play

FINISH = ["stop", "length", "length", "abort", "stop", "length", "length", "stop", "stop"]
"""The engine's finish reason of each of three groups of three samples."""


class Critic:
    """The critic's group as the driver calls it: fixed values."""

    def __init__(self, values: torch.Tensor) -> None:
        self._values = values

    def values(self, batch: RolloutBatch) -> torch.Tensor:
        return self._values


def _played(seed: int = 0) -> tuple[list[Sample], list[list[int]]]:
    """Nine scored samples as a rollout plays them (ragged), and each one's response."""
    rng = random.Random(seed)
    samples, responses = [], []
    for i, finish in enumerate(FINISH):
        response = [rng.randint(3, 30) for _ in range(rng.randint(1, 7))]
        generation = Generation(response, [rng.uniform(-2.0, -0.1) for _ in response],
                                finish)  # type: ignore[arg-type]
        samples.append(Sample(PromptRecord(f"p{i // 3}"), [1] * rng.randint(1, 4),
                              generation, rng.choice([0.0, 1.0, -0.5, 2.0]), "text"))
        responses.append(response)
    return samples, responses


def _batch(seed: int = 0) -> tuple[RolloutBatch, torch.Tensor]:
    """``build_batch`` of :func:`_played`, and the critic's values (noise off the
    response too: production must ignore it)."""
    samples, _ = _played(seed)
    batch = build_batch(groups_of(samples, 3), 7, 3, 0, {}, [], [])
    gen = torch.Generator().manual_seed(seed)
    return batch, torch.randn(batch.loss_mask.shape, generator=gen)


def reference(samples: list[Sample], prompt_lengths: list[int], width: int,
              values: torch.Tensor, gamma: float, lam: float, critic_lam: float,
              normalize: bool, eps: float, bootstrap: bool
              ) -> tuple[list[list[float]], list[list[float]]]:
    """(A, R) [N][S] in float64 by loops: sample i's response tokens k = 1 … K (every one
    counts), its reward on token K, δ_k = r_k + γ V_{k+1} − V_k with V_{K+1} = V_K when
    ``bootstrap`` and its finish reason is "length", else 0; A_k = δ_k + γλ A_{k+1};
    R = A(critic_lam) + V; A whitened by the valid tokens' mean and std (n − 1)."""
    v_rows = values.double().tolist()
    adv = [[0.0] * width for _ in samples]
    ret = [[0.0] * width for _ in samples]
    for i, sample in enumerate(samples):
        cols = [prompt_lengths[i] + k for k in range(len(sample.generation.token_ids))]
        v = [v_rows[i][t] for t in cols]
        r = [0.0] * (len(cols) - 1) + [sample.reward]
        cut = bootstrap and sample.generation.finish_reason == "length"
        for lam_, out, plus_v in ((lam, adv, False), (critic_lam, ret, True)):
            running, next_value = 0.0, (v[-1] if cut else 0.0)
            for k in range(len(cols) - 1, -1, -1):
                running = r[k] + gamma * next_value - v[k] + gamma * lam_ * running
                out[i][cols[k]] = running + (v[k] if plus_v else 0.0)
                next_value = v[k]
    if normalize:
        valid = [(i, prompt_lengths[i] + k) for i, s in enumerate(samples)
                 for k in range(len(s.generation.token_ids))]
        flat = [adv[i][t] for i, t in valid]
        mean = sum(flat) / len(flat)
        std = math.sqrt(sum((x - mean) ** 2 for x in flat) / (len(flat) - 1))
        for i, t in valid:
            adv[i][t] = (adv[i][t] - mean) / (std + eps)
    return adv, ret


def _f64(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_a_sample_is_cut_when_the_engine_stopped_at_the_length_limit() -> None:
    samples, _ = _played()
    assert [s.truncated for s in samples] == [f == "length" for f in FINISH]  # "abort": no
    batch, _ = _batch()
    assert batch.truncated is not None and batch.truncated.dtype == torch.bool
    assert batch.truncated.tolist() == [f == "length" for f in FINISH]
    assert batch.metadata["rollout/truncated_fraction"] == pytest.approx(4 / 9)


@pytest.mark.parametrize("normalize", [False, True])
def test_driver_advantages_bootstrap_cut_responses_as_the_recursion_written_out(
        normalize: bool) -> None:
    samples, _ = _played(1)
    batch = build_batch(groups_of(samples, 3), 0, 3, 0, {}, [], [])
    values = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(1))
    config = AdvantageConfig(type="gae", gamma=0.9, lam=0.7, critic_lam=1.0,
                             normalize=normalize, bootstrap_truncated=True)
    out = driver_advantages(batch, build_estimator(config), None, None, Critic(values),
                            several_updates=False)
    assert out is not None and out.returns is not None
    want_a, want_r = reference(samples, batch.prompt_lengths.tolist(),
                               batch.loss_mask.shape[1], values, 0.9, 0.7, 1.0, normalize,
                               config.eps, bootstrap=True)
    torch.testing.assert_close(out.advantages.double(), _f64(want_a),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.returns.double(), _f64(want_r),
                               rtol=1e-5, atol=1e-6)
    # the check has teeth: the recursion without the bootstrap is another answer, on the
    # cut samples' targets exactly
    plain_a, plain_r = reference(samples, batch.prompt_lengths.tolist(),
                                 batch.loss_mask.shape[1], values, 0.9, 0.7, 1.0, normalize,
                                 config.eps, bootstrap=False)
    moved = (_f64(want_r) - _f64(plain_r)).abs().amax(dim=1) > 1e-6
    assert moved.tolist() == [f == "length" for f in FINISH]
    assert not torch.allclose(out.advantages.double(), _f64(plain_a), atol=1e-3)


def test_with_gae_the_verifiers_path_reads_the_setting_too() -> None:
    batch, values = _batch(2)
    config = AdvantageConfig(type="gae", gamma=0.95, lam=0.9, bootstrap_truncated=True)
    out = with_gae(batch, values, config)
    by_hand = GAE(gamma=0.95, lam=0.9, normalize=True).apply(
        batch, truncated=batch.truncated, values=values)
    assert torch.equal(out.advantages, by_hand.advantages)
    assert out.returns is not None and by_hand.returns is not None
    assert torch.equal(out.returns, by_hand.returns)


def test_off_by_default_nothing_changes_bit_for_bit() -> None:
    batch, values = _batch(3)
    assert bool(batch.truncated.any())  # type: ignore[union-attr]
    never_cut = dataclasses.replace(batch, truncated=None)
    assert not bool(never_cut.truncated.any())  # type: ignore[union-attr]
    for normalize in (False, True):
        estimator = build_estimator(AdvantageConfig(type="gae", normalize=normalize))
        assert not estimator.needs_truncation
        got = driver_advantages(batch, estimator, None, None, Critic(values), False)
        want = GAE(normalize=normalize).apply(never_cut, values=values)
        assert got is not None and got.returns is not None and want.returns is not None
        assert torch.equal(got.advantages, want.advantages)
        assert torch.equal(got.returns, want.returns)
        assert got.metadata["critic/explained_variance"] == \
            want.metadata["critic/explained_variance"]


@pytest.mark.parametrize("kind", ["grpo", "reinforce_pp", "reward"])
def test_the_setting_is_refused_outside_gae_naming_it(kind: str) -> None:
    with pytest.raises(ValueError, match=f"bootstrap_truncated: only applies to type=gae, "
                                         f"not type={kind}"):
        AdvantageConfig(type=kind, bootstrap_truncated=True)
    dumped = AdvantageConfig(type="gae", bootstrap_truncated=True).model_dump()
    assert AdvantageConfig.model_validate(dumped).bootstrap_truncated  # a dump validates


def test_the_flags_survive_selection_the_wire_and_a_checkpoint(tmp_path: Path) -> None:
    batch, _ = _batch(4)
    flags = batch.truncated
    assert flags is not None
    part = batch.select([3, 4, 5])
    assert part.truncated is not None and part.truncated.tolist() == flags[3:6].tolist()
    for loaded in (pickle.loads(pickle.dumps(batch)),
                   pickle.loads(pickle.dumps(batch, protocol=5))):
        assert loaded.truncated.dtype == torch.bool and torch.equal(loaded.truncated, flags)
    save_driver_state(tmp_path, DriverState(3, {}, {4: batch, 5: part}))
    restored = load_driver_state(tmp_path).in_flight
    assert torch.equal(restored[4].truncated, flags)  # type: ignore[arg-type]
    assert torch.equal(restored[5].truncated, part.truncated)  # type: ignore[arg-type]


def test_a_batch_without_flags_has_none_cut_and_bad_flags_are_refused() -> None:
    batch, _ = _batch(5)
    plain = dataclasses.replace(batch, truncated=None)  # a checkpoint before the field
    assert plain.truncated is not None and plain.truncated.tolist() == [False] * 9
    with pytest.raises(RolloutBatchError, match="truncated: expected a bool tensor"):
        dataclasses.replace(batch, truncated=torch.ones(9))
    with pytest.raises(RolloutBatchError, match="truncated: expected a bool tensor"):
        dataclasses.replace(batch, truncated=torch.ones(8, dtype=torch.bool))
    with pytest.raises(RolloutBatchError, match="truncated: 2 entries for 1 samples"):
        RolloutBatch.from_samples([[1]], [[2]], [[-0.5]], [1.0], [0.0], [0], 1,
                                  truncated=[True, False])


def test_an_episode_is_cut_by_its_limits_not_by_its_environment_or_a_failure(
        tiny_model_path: str, turns: TurnFormat) -> None:
    engine = TorchEngine(TorchEngineConfig(batch_size=8), tiny_model_path)
    cut, _ = play(engine, turns, ["a"], "Countdown", max_turns=2, kwargs={"turns": 5})
    done, _ = play(engine, turns, ["a"], "Countdown", max_turns=4, kwargs={"turns": 1})
    ok, reset, step, _ = play(engine, turns, ["ok", "reset", "step", "malformed"],
                              "RaisesOnLabel")[0]
    assert (cut[0].env_done, cut[0].failure) == (False, None)  # max_turns ended it
    assert cut_short(cut[0]) and not cut_short(done[0]) and not cut_short(ok)
    assert not cut_short(reset) and not cut_short(step)  # failed: reward 0 by rule
