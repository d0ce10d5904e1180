"""The critic's rank on real gloo process groups (no Ray): its values and the gradient of
its clipped value loss equal a float64 single-process reference straight from the
formulas, in every aggregation mode and layout (DP, CP, packed, padded, shared prefix);
the planted ``value`` error (rank 0's share doubled) moves the gradient."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rollout.batch import RolloutBatch
from rollout.tiny import create_tiny_checkpoint
from tests.distributed import run_ranks
from tests.trainer.helpers import random_train_batch
from trainer.aggregation import AGGREGATION_MODES, aggregate
from trainer.config import AggregationConfig, LossConfig, ObjectiveConfig, TrainerConfig
from trainer.planted import NOTHING_PLANTED, Planted, PlantedError
from trainer.step_plan import plan_step

VALUE_CLIP = 0.2
DIVISOR = 7.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def critic_batch(seed: int = 0) -> RolloutBatch:
    """Uneven groups with fractional weights, a shared prompt per group, and returns and
    rollout values per token: some within the clip of the critic's values, some far."""
    batch = random_train_batch(vocab_size=40, num_prompts=4, group_size=2, seed=seed,
                               per_token=True)
    gen = torch.Generator().manual_seed(seed + 1)
    response = batch.advantages != 0
    response |= batch.loss_mask > 0
    returns = torch.where(response, torch.randn(batch.loss_mask.shape, generator=gen), 0.0)
    values = torch.where(response, 0.3 * torch.randn(batch.loss_mask.shape, generator=gen), 0.0)
    return dataclasses.replace(batch, returns=returns, values=values)


def _objective(mode: str) -> ObjectiveConfig:
    return ObjectiveConfig(pg=AggregationConfig(
        mode=mode, divisor=DIVISOR if mode == "constant" else None))


def _reference(model_path: str, batch: RolloutBatch) -> dict[str, object]:
    """Every sample through the value model alone (no packing, no padding, float64);
    ℓ = ½ max((V − R)², (V_old + clip(V − V_old, ±ε) − R)²) per token; J of each mode by
    trainer.aggregation.aggregate; its gradient by autograd."""
    from trainer.backends.fsdp.value_model import load_value_model

    torch.manual_seed(0)  # the seed the ranks set before building (TrainerConfig.seed)
    model = load_value_model(model_path, torch.float64, torch.device("cpu"))
    rows = []
    for i in range(batch.num_samples):
        n = int(batch.sequence_lengths[i])
        out = model(input_ids=batch.input_ids[i:i + 1, :n]).logits[0, :, 0]
        row = torch.zeros(batch.loss_mask.shape[1], dtype=torch.float64)
        rows.append(torch.cat([row[:1], out[:n - 1], row[n:]]))  # V of token t at t − 1
    values = torch.stack(rows)
    old, target = batch.values.double(), batch.returns.double()
    clipped = old + (values - old).clamp(-VALUE_CLIP, VALUE_CLIP)
    loss = 0.5 * torch.maximum((values - target) ** 2, (clipped - target) ** 2)
    out: dict[str, object] = {"values": values.detach()}
    for mode in AGGREGATION_MODES:
        model.zero_grad()
        j = aggregate(loss, batch.loss_mask, batch.group_index, mode,
                      DIVISOR if mode == "constant" else None,
                      group_size=batch.samples_per_prompt)
        j.backward(retain_graph=True)
        out[mode] = (float(j.detach()), {name: p.grad.detach().clone()
                                for name, p in model.named_parameters()})
    return out


LAYOUTS = {"dp1-padded": (1, 1, False, False), "dp1-prefix": (1, 1, True, True),
           "dp2-packed": (2, 1, True, False), "dp1cp2-packed": (1, 2, True, False),
           "dp1cp2-padded": (1, 2, False, False)}
PLANTED_LAYOUT = "dp2-packed"
"""The layout whose run also plants ``value`` (after its clean gradients)."""


def _world_size(layout: str) -> int:
    dp, cp, _, _ = LAYOUTS[layout]
    return dp * cp



def _critic_layouts(rank: int, port: int, model_path: str, batch: RolloutBatch,
                    layouts: list[str]) -> dict[str, dict[str, object]]:
    """Layouts of one world size in turn in the same processes (a spawn imports torch and
    transformers anew, most of a layout's cost): each builds its worker and joins a
    process group of its own, torn down before the next. A layout after the first joins
    through the first one's store under a key prefix of its own (the other ranks learn
    rank 0's port once per spawn), so no two groups share a rendezvous key."""
    import torch.distributed as dist

    results, store = {}, None
    for i, layout in enumerate(layouts):
        dp, cp, packed, prefix = LAYOUTS[layout]
        planted = frozenset({PlantedError.VALUE}) if layout == PLANTED_LAYOUT else \
            NOTHING_PLANTED
        joined = None if store is None else dist.PrefixStore(f"layout{i}/", store)
        results[layout], opened = _critic_rank(rank, port, model_path, batch, dp, cp,
                                               packed, prefix, planted, joined)
        store = store or opened
        dist.barrier()  # every rank done with this group before any tears it down
        dist.destroy_process_group()
    return results


def _critic_rank(rank: int, port: int, model_path: str, batch: RolloutBatch, dp: int, cp: int,
                 packed: bool, prefix: bool, planted: Planted = NOTHING_PLANTED,
                 store: object = None) -> tuple[dict[str, object], object]:
    """The values and every mode's gradients, clean; then, with ``planted`` given, the
    first mode's gradient again with it planted (``gradients`` updates nothing, so the
    same process group serves both). Joins through ``store`` when given (else rank 0
    opens one at ``port``); returns the store it joined through too."""
    from trainer.backends.fsdp.critic import FSDPCriticWorker

    config = TrainerConfig(dp_size=dp, cp_size=cp, dtype="float64", packing=packed,
                           shared_prefix=prefix, max_tokens_per_micro_batch=24,
                           loss=LossConfig())
    objectives = [_objective(mode) for mode in AGGREGATION_MODES]
    worker = FSDPCriticWorker(config, objectives[0], model_path, rank, total_steps=1,
                              value_clip=VALUE_CLIP)
    if store is not None:
        worker._store = store  # what setup joins through (trainer/worker.py)
    worker.setup("127.0.0.1", port)

    def plan(objective: ObjectiveConfig):
        return plan_step(batch, objective, dp, cp, 24, packed=packed, shared_prefix=prefix)

    values = worker.values(batch, plan(objectives[0]))
    grads = worker.gradients(batch, [plan(o) for o in objectives], objectives)
    out: dict[str, object] = {"values": values, "grads": grads}
    if planted:
        worker.plant(planted)  # as the verifier injects its errors
        out["planted_grads"] = worker.gradients(batch, [plan(objectives[0])],
                                                objectives[:1])
    return out, worker._store


@pytest.fixture(scope="module")
def reference(tiny_model: str) -> dict[str, object]:
    """The float64 reference on ``critic_batch()``: the same for every test, built once."""
    return _reference(tiny_model, critic_batch())


@pytest.fixture(scope="module")
def layout_results(tiny_model: str):
    """Layout -> rank 0's result, each layout run once per module, all the layouts of a
    world size in one spawn; DP 2 packed also computes the gradient with ``value``
    planted (the planted test's)."""
    results: dict[str, dict[str, object]] = {}

    def result(layout: str) -> dict[str, object]:
        if layout not in results:
            size = _world_size(layout)
            same = [name for name in LAYOUTS if _world_size(name) == size]
            results.update(run_ranks(_critic_layouts, size, tiny_model, critic_batch(),
                                     same)[0])
        return results[layout]

    return result


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_value_loss_gradient_equals_the_float64_reference(
        reference: dict[str, object], layout_results, layout: str) -> None:
    batch = critic_batch()
    result = layout_results(layout)
    valid = batch.loss_mask > 0
    assert torch.allclose(result["values"][valid].double(), reference["values"][valid],
                          atol=1e-6, rtol=0)  # gathered as float32
    assert not result["values"][~valid].any()
    for mode, (sums, grads) in zip(AGGREGATION_MODES, result["grads"], strict=True):
        j, expected = reference[mode]
        assert sums["value_loss"] == pytest.approx(j, rel=1e-10), mode
        assert grads.keys() == expected.keys()
        for name, grad in grads.items():
            assert torch.allclose(grad, expected[name], rtol=1e-8, atol=1e-12), (mode, name)
        assert 0 < sums["clip_fraction"] < 1  # both branches of the clip are exercised


@pytest.mark.slow
def test_planted_value_error_moves_the_gradient(reference: dict[str, object],
                                                layout_results) -> None:
    """Rank 0's share doubled (``value`` planted, injected as the verifier does) under
    DP 2: the gradient is off the reference — what the verifier's ``value`` term must
    catch."""
    _, grads = layout_results(PLANTED_LAYOUT)["planted_grads"][0]
    _, expected = reference[AGGREGATION_MODES[0]]
    worst = max(float((grads[n] - expected[n]).abs().max()) for n in grads)
    assert worst > 1e-4
