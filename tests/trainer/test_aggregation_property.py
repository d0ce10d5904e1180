"""Properties, for random lengths, masks and group layouts (hypothesis):

- the step's weights (``token_weights``, computed once from the whole step) give the
  independent per-sample / per-group reference J (``aggregate``) and its gradient;
- a step split into parts BEFORE planning (each part plans itself: its coefficients from
  its own samples, as each call of the training API does) recombines into the step's J
  with one scalar per part known from counts alone (N_k/N, ΣM_k/ΣM, P_k/P), and each
  part's weights are the step's up to that scalar — while averaging the parts'
  own reductions, what a per-rank mean does, is not the step's J.

Token-level splits of a step planned once (micro-batches, CP shards) are checked on real
ranks in test_aggregation_distributed.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.aggregation import (
    AGGREGATION_MODES,
    aggregate,
    local_weighted_sum,
    sample_coefficients,
    token_weights,
)

DIVISOR = 7.0


@st.composite
def steps(draw: st.DrawFn) -> dict:
    group_size = draw(st.integers(1, 4))
    num_prompts = draw(st.integers(1, 5))
    num_samples = group_size * num_prompts
    max_len = draw(st.integers(1, 8))
    mask = torch.tensor(
        draw(st.lists(st.lists(st.booleans(), min_size=max_len, max_size=max_len),
                      min_size=num_samples, max_size=num_samples)),
        dtype=torch.float64,
    )
    if mask.sum() == 0:
        mask[0, 0] = 1.0  # an empty step is skipped, tested separately
    group_ids = draw(st.permutations(list(range(num_prompts))))
    groups = torch.tensor([g for g in group_ids for _ in range(group_size)])
    groups = groups[torch.tensor(draw(st.permutations(list(range(num_samples)))))]
    # The part (a DP rank, a call) of every sample, and of every group for prompt_mean,
    # whose parts must hold whole groups.
    num_parts = draw(st.integers(1, 4))
    sample_parts = draw(st.lists(st.integers(0, num_parts - 1), min_size=num_samples,
                                 max_size=num_samples))
    group_parts = draw(st.lists(st.integers(0, num_parts - 1), min_size=num_prompts,
                                max_size=num_prompts))
    seed = draw(st.integers(0, 2**16))
    return {"mask": mask, "groups": groups, "group_size": group_size,
            "sample_parts": torch.tensor(sample_parts), "group_parts": torch.tensor(group_parts),
            "seed": seed}


def _loss(step: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(a scalar parameter, a per-token loss [N, T] non-linear in it)."""
    gen = torch.Generator().manual_seed(step["seed"])
    scale = torch.randn(step["mask"].shape, generator=gen, dtype=torch.float64)
    params = torch.ones((), dtype=torch.float64, requires_grad=True)
    return params, (params * scale) ** 2


def _divisor(mode: str) -> float | None:
    return DIVISOR if mode == "constant" else None


@settings(max_examples=150, deadline=None)
@given(step=steps(), mode=st.sampled_from(AGGREGATION_MODES))
def test_step_weights_reproduce_the_reference(step: dict, mode: str) -> None:
    mask, groups = step["mask"], step["groups"]
    params, loss = _loss(step)
    reference = aggregate(loss, mask, groups, mode, _divisor(mode))
    (ref_grad,) = torch.autograd.grad(reference, params, retain_graph=True)
    total = local_weighted_sum(loss, token_weights(mask, groups, mode, _divisor(mode)))
    (grad,) = torch.autograd.grad(total, params)
    torch.testing.assert_close(total.detach(), reference.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


def part_scalar(mode: str, part: torch.Tensor, mask: torch.Tensor, groups: torch.Tensor
                ) -> float:
    """The per-part scalar of the contract, from counts only: what turns a part's own
    reduction into its share of the step's J."""
    if mode in ("sample_mean", "constant"):
        return len(part) / len(mask)  # N_k / N (L is the same for every part)
    if mode == "token_mean":
        return float(mask[part].sum() / mask.sum())  # ΣM_k / ΣM
    return len(groups[part].unique()) / len(groups.unique())  # P_k / P


@settings(max_examples=150, deadline=None)
@given(step=steps(), mode=st.sampled_from(AGGREGATION_MODES))
def test_a_step_split_before_planning_recombines_by_per_part_counts(step: dict, mode: str
                                                                    ) -> None:
    mask, groups = step["mask"], step["groups"]
    params, loss = _loss(step)
    reference = aggregate(loss, mask, groups, mode, _divisor(mode))
    (ref_grad,) = torch.autograd.grad(reference, params, retain_graph=True)
    step_coefficients = sample_coefficients(mask.sum(-1), groups, mode, _divisor(mode),
                                            step["group_size"])
    if mode == "prompt_mean":
        dense = torch.unique(groups, return_inverse=True)[1]
        part_of = step["group_parts"][dense]
    else:
        part_of = step["sample_parts"]
    total = torch.zeros((), dtype=torch.float64)
    for k in part_of.unique():
        part = (part_of == k).nonzero().flatten()
        # The part plans itself: coefficients from its own samples (and whole groups).
        own = sample_coefficients(mask[part].sum(-1), groups[part], mode, _divisor(mode),
                                  step["group_size"])
        scalar = part_scalar(mode, part, mask, groups)
        # Its weights are the step's up to the scalar (a sample without a valid token
        # has none either way).
        torch.testing.assert_close(scalar * own[:, None] * mask[part],
                                   step_coefficients[part, None] * mask[part], rtol=1e-12,
                                   atol=0.0)
        part_j = local_weighted_sum(loss[part], mask[part] * own[:, None])
        total = total + scalar * part_j
    (grad,) = torch.autograd.grad(total, params)
    torch.testing.assert_close(total.detach(), reference.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("mode", "expected"), [("token_mean", 4 / 5), ("sample_mean", 4 / 3)])
def test_averaging_per_part_reductions_is_not_the_step_objective(mode: str, expected: float
                                                                 ) -> None:
    """Part A: one sample, one token of loss 4. Part B: two samples of two tokens of
    loss 0. The step's J: token_mean 4/5 (4 over 5 tokens), sample_mean 4/3 (3 samples,
    one of mean 4); recombined by ΣM_k/ΣM = 1/5, 4/5 or N_k/N = 1/3, 2/3, the parts give
    it back. The mean of the parts' own reductions (4 and 0) is 2 in both modes: it
    weighs A's single token and sample as much as B's four tokens and two samples."""
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    loss = torch.tensor([[4.0, 0.0], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    groups = torch.tensor([0, 1, 2])
    parts = [torch.tensor([0]), torch.tensor([1, 2])]
    step_j = float(aggregate(loss, mask, groups, mode))
    naive = sum(float(aggregate(loss[p], mask[p], groups[p], mode)) for p in parts) / 2
    recombined = sum(part_scalar(mode, p, mask, groups)
                     * float(aggregate(loss[p], mask[p], groups[p], mode)) for p in parts)
    assert step_j == pytest.approx(expected)
    assert recombined == pytest.approx(step_j)
    assert naive == pytest.approx(2.0)  # A's own mean 4, B's 0: averaged, 2
