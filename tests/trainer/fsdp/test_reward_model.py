"""The reward-model rank on real gloo process groups (no Ray): its Bradley–Terry loss and
gradient equal a float64 single-process reference straight from the formula, scored by
transformers' own ``AutoModelForSequenceClassification`` forward, under DP 1-2, packed
and padded, several micro-batches per rank (an empty one included)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollout.tiny import create_tiny_checkpoint
from tests.distributed import run_ranks
from trainer.config import TrainerConfig
from trainer.pair_batch import PairBatch, plan_pairs

PAD = 0
MAX_TOKENS = 48
"""Small enough for several micro-batches per rank (a pair here has 6-38 tokens)."""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def pair_batch(num_pairs: int = 5, seed: int = 3) -> PairBatch:
    """Random sequences of 3-18 tokens, no pad id among them, each pair's two sides one
    prompt and two responses (seed 3: under DP 2 one rank has an empty micro-batch)."""
    gen = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(num_pairs):
        prompt = torch.randint(4, 40, (int(torch.randint(2, 10, (), generator=gen)),),
                               generator=gen).tolist()
        sides = [prompt + torch.randint(4, 40, (int(torch.randint(1, 10, (), generator=gen)),),
                                        generator=gen).tolist() for _ in range(2)]
        pairs.append((sides[0], sides[1]))
    return PairBatch.from_sequences(pairs, PAD)


def reference(model_path: str, batch: PairBatch) -> dict[str, object]:
    """J = −(1/P) Σ log σ(r⁺ − r⁻), each r from transformers' forward on the sequence
    alone (float64), and ∇J by autograd."""
    from trainer.backends.fsdp.reward_model import load_reward_model

    torch.manual_seed(0)  # the seed the ranks set before building (TrainerConfig.seed)
    model = load_reward_model(model_path, torch.float64, torch.device("cpu"), PAD)
    scores = torch.stack([
        model(input_ids=batch.input_ids_NS[i:i + 1, :int(n)]).logits[0, 0]
        for i, n in enumerate(batch.lengths_N.tolist())])
    loss = -F.logsigmoid(scores[0::2] - scores[1::2]).mean()
    loss.backward()
    return {"loss": float(loss.detach()), "scores": scores.detach(),
            "grads": {name: p.grad.clone() for name, p in model.named_parameters()}}


LAYOUTS = {"dp1-packed": (1, True), "dp2-packed": (2, True), "dp2-padded": (2, False)}


def _rank(rank: int, port: int, model_path: str, batch: PairBatch, dp: int, packed: bool
          ) -> dict[str, object]:
    from trainer.backends.fsdp.reward_model import FSDPRewardModelWorker
    from trainer.config import ObjectiveConfig

    config = TrainerConfig(dp_size=dp, dtype="float64", packing=packed, shared_prefix=False,
                           max_tokens_per_micro_batch=MAX_TOKENS)
    worker = FSDPRewardModelWorker(config, ObjectiveConfig(), model_path, rank,
                                   total_steps=1, pad_token_id=PAD)
    worker.setup("127.0.0.1", port)
    plan = plan_pairs(batch.lengths_N, dp, MAX_TOKENS, packed)
    scores = worker.pair_scores(batch, plan)
    metrics, grads = worker.pair_gradients(batch, plan)
    return {"plan": plan, "scores": scores, "metrics": metrics, "grads": grads}


@pytest.mark.slow  # process groups: 7-10 s each here
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bradley_terry_gradient_equals_the_float64_reference(tiny_model: str,
                                                             layout: str) -> None:
    batch = pair_batch()
    expected = reference(tiny_model, batch)
    dp, packed = LAYOUTS[layout]
    result = run_ranks(_rank, dp, tiny_model, batch, dp, packed)[0]
    plan = result["plan"]
    assert all(len(rank) > 1 for rank in plan.micro_batches)  # several micro-batches
    assert (dp == 2) == any(not m for rank in plan.micro_batches for m in rank)  # an empty one
    assert torch.allclose(result["scores"], expected["scores"], rtol=1e-10, atol=1e-12)
    assert result["metrics"]["loss"] == pytest.approx(expected["loss"], rel=1e-10)
    margins = expected["scores"][0::2] - expected["scores"][1::2]
    assert result["metrics"]["accuracy"] == pytest.approx(float((margins > 0).double().mean()))
    assert result["metrics"]["margin"] == pytest.approx(float(margins.mean()), rel=1e-10)
    grads = result["grads"]
    assert grads.keys() == expected["grads"].keys()
    assert "score.weight" in grads
    for name, grad in grads.items():
        assert torch.allclose(grad, expected["grads"][name], rtol=1e-8, atol=1e-12), name
