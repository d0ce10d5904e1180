"""The reward-model rank's margin and centring terms on real gloo process groups (no Ray):
−(1/P) Σ log σ(r⁺ − r⁻ − m) + c · (1/P) Σ (r⁺ + r⁻)² and its gradient equal a float64
single-process reference straight from the formula (scores from transformers' own
forward) under DP 1 and 2, packed and padded; DP 2 packed equals DP 1 packed to 1e-10;
the centring term averaged over each rank's own pairs (a planted error) is caught."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from rollout.tiny import create_tiny_checkpoint
from tests.distributed import run_ranks
from tests.trainer.fsdp.test_reward_model import MAX_TOKENS, PAD, pair_batch
from trainer.config import TrainerConfig
from trainer.pair_batch import PairBatch, plan_pairs

CENTER = 0.3
"""c: large enough that the centring term moves the gradient well past 1e-10."""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def margin_batch() -> PairBatch:
    """test_reward_model's pairs (several micro-batches per rank, an empty one under DP 2)
    with margins in [−0.5, 1.5)."""
    plain = pair_batch()
    gen = torch.Generator().manual_seed(11)
    margins = torch.rand(plain.num_pairs, generator=gen, dtype=torch.float64) * 2 - 0.5
    return PairBatch(plain.input_ids_NS, plain.lengths_N, margins)


def reference(model_path: str, batch: PairBatch) -> dict[str, Any]:
    """J = mean over the P pairs of −log σ(r⁺ − r⁻ − m) + c (r⁺ + r⁻)², each r from
    transformers' forward on the sequence alone (float64); ∇J by autograd."""
    from trainer.backends.fsdp.reward_model import load_reward_model

    torch.manual_seed(0)  # the seed the ranks set before building (TrainerConfig.seed)
    model = load_reward_model(model_path, torch.float64, torch.device("cpu"), PAD)
    scores = torch.stack([
        model(input_ids=batch.input_ids_NS[i:i + 1, :int(n)]).logits[0, 0]
        for i, n in enumerate(batch.lengths_N.tolist())])
    chosen, rejected = scores[0::2], scores[1::2]
    loss = (-F.logsigmoid(chosen - rejected - batch.margin_P)
            + CENTER * (chosen + rejected) ** 2).mean()
    loss.backward()
    with torch.no_grad():
        terms = {"loss/bradley_terry": -F.logsigmoid(chosen - rejected - batch.margin_P),
                 "score/centring": (chosen + rejected) ** 2,
                 "plain": -F.logsigmoid(chosen - rejected)}
    return {"loss": float(loss.detach()), **{k: float(v.mean()) for k, v in terms.items()},
            "grads": {name: p.grad.clone() for name, p in model.named_parameters()}}


def _plant_centring_per_rank(own_pairs: int) -> None:
    """Planted error: each rank's centring term a mean over its own pairs, not the step's."""
    import trainer.backends.fsdp.reward_model as rank_module
    from trainer.bradley_terry import pair_objective

    def per_rank(chosen: torch.Tensor, rejected: torch.Tensor, num_pairs: int,
                 weight: float = 1.0, margin: torch.Tensor | None = None,
                 center_coefficient: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        objective, sums = pair_objective(chosen, rejected, num_pairs, weight, margin)
        centring = ((chosen + rejected) ** 2).sum() * (weight / own_pairs)
        return objective + center_coefficient * centring, sums

    rank_module.pair_objective = per_rank


def _rank(rank: int, port: int, model_path: str, batch: PairBatch, dp: int, packed: bool,
          planted: bool) -> dict[str, Any]:
    from trainer.backends.fsdp.reward_model import FSDPRewardModelWorker
    from trainer.config import ObjectiveConfig

    config = TrainerConfig(dp_size=dp, dtype="float64", packing=packed, shared_prefix=False,
                           max_tokens_per_micro_batch=MAX_TOKENS)
    worker = FSDPRewardModelWorker(config, ObjectiveConfig(), model_path, rank,
                                   total_steps=1, pad_token_id=PAD,
                                   center_rewards_coefficient=CENTER)
    worker.setup("127.0.0.1", port)
    plan = plan_pairs(batch.lengths_N, dp, MAX_TOKENS, packed)
    if planted:
        _plant_centring_per_rank(sum(len(m) for m in plan.micro_batches[rank]))
    metrics, grads = worker.pair_gradients(batch, plan)
    return {"plan": plan, "metrics": metrics, "grads": grads}


def assert_same_objective(result: dict[str, Any], expected: dict[str, Any], rtol: float
                          ) -> None:
    """The checker: the same loss and every parameter's gradient, to ``rtol``."""
    assert result["metrics"]["loss"] == pytest.approx(expected["loss"], rel=rtol)
    assert result["grads"].keys() == expected["grads"].keys()
    for name, grad in result["grads"].items():
        assert torch.allclose(grad, expected["grads"][name], rtol=rtol, atol=1e-14), name


RUNS = {"dp1-packed": (1, True, False), "dp2-packed": (2, True, False),
        "dp2-padded": (2, False, False), "dp2-packed-planted": (2, True, True)}


@pytest.fixture(scope="module")
def run(tiny_model: str) -> Callable[[str], dict[str, Any]]:
    """Rank 0's result of a layout in RUNS, run once when a test first asks for it."""
    done: dict[str, dict[str, Any]] = {}

    def result(name: str) -> dict[str, Any]:
        if name not in done:
            dp, packed, planted = RUNS[name]
            done[name] = run_ranks(_rank, dp, tiny_model, margin_batch(), dp, packed,
                                   planted)[0]
        return done[name]

    return result


@pytest.mark.slow  # process groups: 7-10 s each here
@pytest.mark.parametrize("layout", ["dp1-packed", "dp2-packed", "dp2-padded"])
def test_margin_and_centring_gradient_equals_the_float64_reference(
        tiny_model: str, run: Callable[[str], dict[str, Any]], layout: str) -> None:
    batch = margin_batch()
    expected = reference(tiny_model, batch)
    result = run(layout)
    plan = result["plan"]
    assert all(len(rank) > 1 for rank in plan.micro_batches)  # several micro-batches
    assert "score.weight" in result["grads"]
    assert_same_objective(result, expected, rtol=1e-8)
    for name in ("loss/bradley_terry", "score/centring"):
        assert result["metrics"][name] == pytest.approx(expected[name], rel=1e-8)
    # the batch exercises both terms: each moves the loss by far more than the tolerance
    assert abs(expected["loss/bradley_terry"] - expected["plain"]) > 1e-3
    assert CENTER * expected["score/centring"] > 1e-3


@pytest.mark.slow
def test_dp2_packed_equals_dp1_packed(run: Callable[[str], dict[str, Any]]) -> None:
    dp1, dp2 = run("dp1-packed"), run("dp2-packed")
    assert len(dp2["plan"].micro_batches) == 2
    assert any(not m for rank in dp2["plan"].micro_batches for m in rank)  # an empty one
    assert_same_objective(dp2, {"loss": dp1["metrics"]["loss"], "grads": dp1["grads"]},
                          rtol=1e-10)
    for name in ("loss/bradley_terry", "score/centring", "accuracy", "margin"):
        assert dp2["metrics"][name] == pytest.approx(dp1["metrics"][name], rel=1e-10)


@pytest.mark.slow
def test_centring_averaged_per_rank_is_caught(run: Callable[[str], dict[str, Any]]) -> None:
    dp1, planted = run("dp1-packed"), run("dp2-packed-planted")
    with pytest.raises(AssertionError):
        assert_same_objective(planted, {"loss": dp1["metrics"]["loss"],
                                        "grads": dp1["grads"]}, rtol=1e-10)
