"""``with_gae`` (what the driver runs on a PPO rollout) against a float64 reference
written here with plain loops, apart from production: GAE over each sample's valid
tokens with ``lam``, the critic's targets with ``critic_lam`` from the raw advantages,
whitening with the whole rollout's Bessel-corrected moments. Each of three realistic
wiring errors, planted by editing one line of production's source, fails the check."""

from __future__ import annotations
import __future__

import importlib
import inspect
import math
import random
import textwrap
from collections.abc import Callable

import pytest
import torch

from rollout.advantages.gae import GAE, with_gae
from rollout.advantages.whitening import token_moments
from rollout.batch import RolloutBatch
from rollout.config import AdvantageConfig

EPS = 1e-6
GAE_MODULE = importlib.import_module("rollout.advantages.gae")  # not the function


def _ppo_batch(seed: int) -> tuple[RolloutBatch, torch.Tensor]:
    """Three groups of three: ragged prompts and responses, environment observations
    (mask 0) inside some responses, per-turn rewards on some, one fractional token
    weight, a teacher's term already in the advantages; the critic's values [N, S] (noise
    off the response too: production must ignore it)."""
    rng = random.Random(seed)
    prompts, responses, masks, turns, rewards, teacher = [], [], [], [], [], []
    for i in range(9):
        length = rng.randint(1, 9)
        prompts.append([1] * rng.randint(1, 4))
        responses.append([rng.randint(3, 30) for _ in range(length)])
        mask = [1] * length
        if length > 5 and i % 2:  # an observation of two tokens
            mask[2] = mask[3] = 0
        masks.append(mask)
        reward = rng.choice([0.0, 1.0, -0.5, 2.0])
        rewards.append(reward)
        valid = [k for k, m in enumerate(mask) if m]
        if i % 3 == 0 and len(valid) > 2:  # a multi-turn episode: two steps' rewards
            turns.append([(valid[1], 0.25), (valid[-1], reward - 0.25)])
        else:
            turns.append([(valid[-1], reward)])
        teacher.append([rng.uniform(-0.1, 0.1) for _ in range(length)])
    batch = RolloutBatch.from_samples(
        prompt_ids=prompts, response_ids=responses,
        response_log_probs=[[-0.5] * len(r) for r in responses], rewards=rewards,
        advantages=teacher, group_index=[i // 3 for i in range(9)], samples_per_prompt=3,
        response_masks=masks, turn_rewards=turns)
    mask = batch.loss_mask.clone()
    row = int((mask[4] > 0).nonzero()[-1])
    mask[4, row] = 0.5  # a fractional weight: still a valid token of the time axis
    batch = RolloutBatch(**{**{f: getattr(batch, f) for f in _INIT_FIELDS}, "loss_mask": mask})
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(batch.loss_mask.shape, generator=generator)
    return batch, values


_INIT_FIELDS = [name for name, f in RolloutBatch.__dataclass_fields__.items() if f.init]


def _reference(batch: RolloutBatch, values: torch.Tensor, gamma: float, lam: float,
               critic_lam: float, normalize: bool, eps: float,
               bootstrap: list[bool] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """(A added to the batch's advantages, R, V, explained variance) in float64 by
    loops: for each sample its valid tokens k = 1 … K, δ_k = r_k + γ V_{k+1} − V_k with
    V_{K+1} = 0 (V_K when ``bootstrap``), A_k = δ_k + γλ A_{k+1}; R = A(critic_lam) + V;
    A whitened by μ, σ (n − 1) of every valid token of the rollout."""
    n, width = batch.loss_mask.shape
    mask = batch.loss_mask.tolist()
    placed = [[0.0] * width for _ in range(n)]
    if batch.token_rewards is not None:
        placed = batch.token_rewards.double().tolist()
    v_rows = values.double().tolist()

    def recursion(rewards: list[float], vals: list[float], lam_: float, last: float
                  ) -> list[float]:
        out, running, next_value = [0.0] * len(vals), 0.0, last
        for k in range(len(vals) - 1, -1, -1):
            delta = rewards[k] + gamma * next_value - vals[k]
            running = delta + gamma * lam_ * running
            out[k], next_value = running, vals[k]
        return out

    adv = [[0.0] * width for _ in range(n)]
    ret = [[0.0] * width for _ in range(n)]
    val = [[0.0] * width for _ in range(n)]
    for i in range(n):
        cols = [t for t in range(width) if mask[i][t] > 0]
        r, v = [placed[i][t] for t in cols], [v_rows[i][t] for t in cols]
        last = v[-1] if bootstrap is not None and bootstrap[i] and v else 0.0
        a, a_critic = recursion(r, v, lam, last), recursion(r, v, critic_lam, last)
        for k, t in enumerate(cols):
            adv[i][t], ret[i][t], val[i][t] = a[k], a_critic[k] + v[k], v[k]
    flat = [adv[i][t] for i in range(n) for t in range(width) if mask[i][t] > 0]
    if normalize:
        mean = sum(flat) / len(flat)
        std = math.sqrt(sum((x - mean) ** 2 for x in flat) / (len(flat) - 1))
        adv = [[(adv[i][t] - mean) / (std + eps) if mask[i][t] > 0 else 0.0
                for t in range(width)] for i in range(n)]
    r_flat = [ret[i][t] for i in range(n) for t in range(width) if mask[i][t] > 0]
    e_flat = [ret[i][t] - val[i][t] for i in range(n) for t in range(width)
              if mask[i][t] > 0]

    def variance(xs: list[float]) -> float:
        mean = sum(xs) / len(xs)
        return sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)

    ev = 1.0 - variance(e_flat) / variance(r_flat)
    as_tensor = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731
    return as_tensor(adv), as_tensor(ret), as_tensor(val), ev


def _check(config: AdvantageConfig, seed: int = 0) -> None:
    """with_gae on a batch against the reference; AssertionError on any difference."""
    batch, values = _ppo_batch(seed)
    out = with_gae(batch, values, config)
    want_a, want_r, want_v, want_ev = _reference(
        batch, values, config.gamma, config.lam, config.critic_lam, bool(config.normalize),
        config.eps)
    torch.testing.assert_close(out.advantages.double(),
                               batch.advantages.double() + want_a, rtol=1e-5, atol=1e-6)
    assert out.returns is not None and out.values is not None
    torch.testing.assert_close(out.returns.double(), want_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.values.double(), want_v, rtol=0, atol=1e-6)
    assert out.metadata["critic/explained_variance"] == pytest.approx(want_ev, abs=1e-5)


DECOUPLED = AdvantageConfig(type="gae", gamma=0.9, lam=0.7, critic_lam=1.0, eps=EPS)


@pytest.mark.parametrize("config", [
    AdvantageConfig(type="gae"),  # the defaults: whitened
    DECOUPLED,
    DECOUPLED.model_copy(update={"normalize": False}),
    AdvantageConfig(type="gae", gamma=1.0, lam=1.0, critic_lam=0.5, eps=0.1),
], ids=["defaults", "decoupled", "unwhitened", "critic-lam-below-lam"])
@pytest.mark.parametrize("seed", [0, 1])
def test_with_gae_matches_the_reference(config: AdvantageConfig, seed: int) -> None:
    _check(config, seed)


def test_gae_whitens_by_default_and_only_for_gae() -> None:
    assert AdvantageConfig(type="gae").normalize is True
    assert AdvantageConfig(type="gae", normalize=False).normalize is False
    assert AdvantageConfig().normalize is False  # grpo: unchanged
    dumped = AdvantageConfig(type="gae").model_dump()  # a job folder's config.json
    assert AdvantageConfig.model_validate(dumped).normalize is True
    with pytest.raises(ValueError, match="normalize: only applies to type=gae"):
        AdvantageConfig(type="reinforce_pp", normalize=True)


def _planted(function: Callable, line: str, replacement: str) -> Callable:
    """``function`` (a method of rollout/advantages/gae.py) with ``line`` of its source
    replaced: a one-line bug in the production code, compiled in its module."""
    source = textwrap.dedent(inspect.getsource(function))
    assert source.count(line) == 1, f"{line!r} is not in {function.__qualname__}"
    namespace = dict(vars(GAE_MODULE))
    code = compile(source.replace(line, replacement), "<planted>", "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, namespace)
    return namespace[function.__name__]


PLANTED = {
    "critic-targets-from-lam": (
        "returns = gae(inputs.token_rewards, values, mask, self.gamma, self.critic_lam,",
        "returns = gae(inputs.token_rewards, values, mask, self.gamma, self.lam,"),
    "normalize-ignored": (
        "advantages = self.checked(self._whitened(raw, mask, rank_moments), mask)",
        "advantages = self.checked(raw, mask)"),
    "returns-from-whitened-advantages": (
        "returns = torch.where(mask > 0, returns + values.double(), 0.0)",
        "returns = torch.where(mask > 0, self._whitened(returns, mask, rank_moments)"
        " + values.double(), 0.0)"),
}


@pytest.mark.parametrize("name", list(PLANTED))
def test_each_planted_wiring_error_is_caught(name: str, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    line, replacement = PLANTED[name]
    _check(DECOUPLED)  # the production code passes ...
    monkeypatch.setattr(GAE, "apply", _planted(GAE.apply, line, replacement))
    with pytest.raises(AssertionError):  # ... and the one-line bug does not
        _check(DECOUPLED)


def test_the_whitening_reduces_the_moments_every_rank_hands() -> None:
    """``rank_moments`` (the verifier's layouts) summed over the ranks gives the whole
    rollout's whitening; one rank's alone (the planted local error) does not."""
    batch, values = _ppo_batch(3)
    whole = with_gae(batch, values, DECOUPLED)

    def halves(raw: torch.Tensor) -> torch.Tensor:
        return torch.stack([token_moments(raw[:4], batch.loss_mask[:4]),
                            token_moments(raw[4:], batch.loss_mask[4:])])

    split = with_gae(batch, values, DECOUPLED, rank_moments=halves)
    torch.testing.assert_close(split.advantages, whole.advantages, rtol=1e-6, atol=1e-6)
    first = with_gae(batch, values, DECOUPLED, rank_moments=lambda raw: halves(raw)[0])
    assert (first.advantages - whole.advantages).abs().max() > 1e-3


def test_a_cut_response_bootstraps_from_its_last_value() -> None:
    """``truncated`` samples take V_{K+1} = V_K (the critic's estimate of what the cut
    took away), in A and in R; the others keep V_{K+1} = 0."""
    batch, values = _ppo_batch(4)
    cut = torch.tensor([i % 2 == 0 for i in range(batch.num_samples)])
    estimator = GAE(gamma=0.9, lam=0.7, critic_lam=1.0, normalize=True, eps=EPS)
    out = estimator.apply(batch, truncated=cut, values=values)
    want_a, want_r, _, _ = _reference(batch, values, 0.9, 0.7, 1.0, True, EPS,
                                      bootstrap=cut.tolist())
    torch.testing.assert_close(out.advantages.double(), batch.advantages.double() + want_a,
                               rtol=1e-5, atol=1e-6)
    assert out.returns is not None
    torch.testing.assert_close(out.returns.double(), want_r, rtol=1e-5, atol=1e-6)
    plain = estimator.apply(batch, values=values)
    moved = (out.returns - plain.returns).abs().amax(dim=1) > 1e-6
    assert moved.tolist() == cut.tolist()  # only the cut samples' targets change
