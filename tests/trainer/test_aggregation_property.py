"""Property: for random lengths, masks, group layouts and token splits, the split sums of
w·ℓ (and their gradients) equal the whole-step reference J."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.aggregation import AGGREGATION_MODES, aggregate, local_weighted_sum, token_weights


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
    # Assign every token to one of k parts: an arbitrary micro-batch × DP × CP split.
    num_parts = draw(st.integers(1, 6))
    parts = torch.tensor(
        draw(st.lists(st.integers(0, num_parts - 1), min_size=num_samples * max_len,
                      max_size=num_samples * max_len))
    ).reshape(num_samples, max_len)
    seed = draw(st.integers(0, 2**16))
    return {"mask": mask, "groups": groups, "parts": parts, "num_parts": num_parts, "seed": seed}


@settings(max_examples=150, deadline=None)
@given(step=steps(), mode=st.sampled_from(AGGREGATION_MODES))
def test_any_split_sums_to_reference(step: dict, mode: str) -> None:
    gen = torch.Generator().manual_seed(step["seed"])
    mask, groups = step["mask"], step["groups"]
    divisor = 7.0 if mode == "constant" else None
    scale = torch.randn(mask.shape, generator=gen, dtype=torch.float64)

    params = torch.ones((), dtype=torch.float64, requires_grad=True)
    reference = aggregate((params * scale) ** 2, mask, groups, mode, divisor)
    (ref_grad,) = torch.autograd.grad(reference, params)

    weights = token_weights(mask, groups, mode, divisor)
    params = torch.ones((), dtype=torch.float64, requires_grad=True)
    total = torch.zeros((), dtype=torch.float64)
    for part in range(step["num_parts"]):
        owned = step["parts"] == part
        total = total + local_weighted_sum((params * scale[owned]) ** 2, weights[owned])
    (grad,) = torch.autograd.grad(total, params)
    torch.testing.assert_close(total.detach(), reference.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
