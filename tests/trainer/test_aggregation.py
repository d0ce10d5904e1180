"""The four modes against hand-computed values, edge cases and the per-mode helper."""

from __future__ import annotations

import pytest
import torch

from trainer.aggregation import (
    EmptyStepError,
    IncompleteGroupError,
    aggregate,
    aggregate_all_modes,
    call_coefficients,
    custom_reducer_weights,
    local_weighted_sum,
    sample_coefficients,
    sum_reduction_factor,
    token_weights,
)

# Four samples in two groups of two; lengths 2, 4, 0 and 1 valid tokens.
LOSS = torch.tensor(
    [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [1.0, 1.0, 1.0, 1.0], [2.0, 4.0, 6.0, 8.0]],
    dtype=torch.float64,
)
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.float64)
GROUPS = torch.tensor([0, 0, 1, 1])

# Sample sums 3, 26, 0, 2; M = 2, 4, 0, 1; T_g = 6, 1.
EXPECTED = {
    "sample_mean": (3 / 2 + 26 / 4 + 0 + 2 / 1) / 4,
    "token_mean": 31 / 7,
    "prompt_mean": (29 / 6 + 2 / 1) / 2,
    "constant": 31 / (4.0 * 4),
}


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_aggregate_matches_hand_computed_values(mode: str) -> None:
    value = aggregate(LOSS, MASK, GROUPS, mode, divisor=4.0 if mode == "constant" else None)
    assert float(value) == pytest.approx(EXPECTED[mode], rel=1e-12)


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_token_weights_sum_to_the_same_objective(mode: str) -> None:
    divisor = 4.0 if mode == "constant" else None
    weights = token_weights(MASK, GROUPS, mode, divisor)
    assert float(local_weighted_sum(LOSS, weights)) == pytest.approx(EXPECTED[mode], rel=1e-12)
    # No weight on masked tokens: padding is never a phantom token.
    assert (weights[MASK == 0] == 0).all()


def test_zero_token_sample_still_counts_in_n_and_zero_token_group_in_p() -> None:
    mask = MASK.clone()
    mask[3] = 0  # group 1 now has no valid token at all
    assert float(aggregate(LOSS, mask, GROUPS, "sample_mean")) == pytest.approx((1.5 + 6.5) / 4)
    assert float(aggregate(LOSS, mask, GROUPS, "prompt_mean")) == pytest.approx((29 / 6) / 2)
    assert float(aggregate(LOSS, mask, GROUPS, "token_mean")) == pytest.approx(29 / 6)
    weights = token_weights(mask, GROUPS, "prompt_mean")
    assert torch.isfinite(weights).all()
    assert float(local_weighted_sum(LOSS, weights)) == pytest.approx((29 / 6) / 2)


def test_empty_step_is_reported_not_nan() -> None:
    empty = torch.zeros_like(MASK)
    with pytest.raises(EmptyStepError, match="no valid token"):
        aggregate(LOSS, empty, GROUPS, "token_mean")
    for mode in ("sample_mean", "token_mean", "prompt_mean"):
        weights = token_weights(empty, GROUPS, mode)
        assert torch.isfinite(weights).all() and float(weights.sum()) == 0.0


def test_prompt_mean_with_incomplete_group_names_the_group() -> None:
    groups = torch.tensor([0, 0, 7, 1])
    with pytest.raises(IncompleteGroupError, match="group 1 has 1 of 2 samples"):
        aggregate(LOSS, MASK, groups, "prompt_mean")
    with pytest.raises(IncompleteGroupError, match="group 0 has 2 of 3 samples"):
        token_weights(MASK, GROUPS, "prompt_mean", group_size=3)


def test_packed_layout_equals_padded_layout() -> None:
    lengths = [2, 4, 1, 3]
    cu_seqlens = torch.tensor([0, 2, 6, 7, 10])
    packed_loss = torch.cat([LOSS[i, :n] for i, n in enumerate(lengths)])
    packed_mask = torch.cat([MASK[i, :n] for i, n in enumerate(lengths)])
    for mode, expected in EXPECTED.items():
        divisor = 4.0 if mode == "constant" else None
        value = aggregate(packed_loss, packed_mask, GROUPS, mode, divisor, cu_seqlens=cu_seqlens)
        assert float(value) == pytest.approx(expected, rel=1e-12)
        weights = token_weights(packed_mask, GROUPS, mode, divisor, cu_seqlens=cu_seqlens)
        assert float(local_weighted_sum(packed_loss, weights)) == pytest.approx(expected)


def test_all_modes_helper_and_default_constant_divisor() -> None:
    values = aggregate_all_modes(LOSS, MASK, GROUPS)
    assert set(values) == set(EXPECTED)
    # Without a configured divisor, constant divides by the padded length T = 4.
    assert values == pytest.approx(EXPECTED)
    values = aggregate_all_modes(LOSS, MASK, GROUPS, divisor=8.0)
    assert values["constant"] == pytest.approx(31 / 32)


def test_custom_reducer_weights(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_reducers.py").write_text(
        "import torch\n"
        "def first_token_only(loss_mask, group_index):\n"
        "    w = torch.zeros_like(loss_mask, dtype=torch.float64)\n"
        "    w[:, 0] = loss_mask[:, 0]\n"
        "    loss_mask.zero_()  # a copy: the batch is unharmed\n"
        "    return w\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    mask = MASK.clone()
    weights = custom_reducer_weights("my_reducers:first_token_only", mask, GROUPS)
    assert float(local_weighted_sum(LOSS, weights)) == 1.0 + 5.0 + 2.0
    assert torch.equal(mask, MASK)


def test_custom_reducer_errors_name_the_field(tmp_path, monkeypatch) -> None:
    (tmp_path / "bad_reducers.py").write_text(
        "import torch\n"
        "def wrong_shape(loss_mask, group_index):\n    return loss_mask[:, :1]\n"
        "def a_list(loss_mask, group_index):\n    return loss_mask.tolist()\n"
        "def integers(loss_mask, group_index):\n    return loss_mask.long()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"custom_reducer: .* must return finite weights"):
        custom_reducer_weights("bad_reducers:wrong_shape", MASK, GROUPS)
    with pytest.raises(ValueError, match=r"custom_reducer: .* must return a torch.Tensor, got li"):
        custom_reducer_weights("bad_reducers:a_list", MASK, GROUPS)
    with pytest.raises(ValueError, match=r"custom_reducer: .* floating-point weights"):
        custom_reducer_weights("bad_reducers:integers", MASK, GROUPS)
    with pytest.raises(ValueError, match="custom_reducer: cannot import module"):
        custom_reducer_weights("no_such_module:f", MASK, GROUPS)


def test_sum_reduction_factor_undoes_averaging() -> None:
    # A framework averaging over 4 ranks and dividing by 3 micro-batches scales by 1/12.
    assert sum_reduction_factor(4, 3) == 12
    assert sum_reduction_factor() == 1


# Deferred steps (module docstring, "Deferred"): several calls, one denominator.

MODES = ("sample_mean", "token_mean", "prompt_mean", "constant")
DIVISOR = 6.0


def random_step(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A step of P whole groups of G samples: per-token loss and mask [N, T] (some samples
    without a valid token), group ids in shuffled order and G."""
    gen = torch.Generator().manual_seed(seed)
    num_prompts, group_size = (int(x) for x in torch.randint(1, 6, (2,), generator=gen))
    num_samples, width = num_prompts * group_size, 7
    loss = torch.randn(num_samples, width, generator=gen, dtype=torch.float64)
    mask = (torch.rand(num_samples, width, generator=gen) < 0.6).to(torch.float64)
    mask[torch.rand(num_samples, generator=gen) < 0.25] = 0.0  # M_i = 0 for some samples
    mask[0, 0] = 1.0  # never an empty step
    group_ids = torch.randperm(100, generator=gen)[:num_prompts]
    groups = group_ids.repeat_interleave(group_size)[torch.randperm(num_samples, generator=gen)]
    return loss, mask, groups, group_size


def random_split(groups: torch.Tensor, mode: str, seed: int) -> list[torch.Tensor]:
    """The step's sample indices cut into 1–4 non-empty calls (whole groups for
    prompt_mean), in shuffled order."""
    gen = torch.Generator().manual_seed(seed + 1000)
    units = ([(groups == g).nonzero().flatten() for g in groups.unique()]
             if mode == "prompt_mean" else list(torch.arange(len(groups))[:, None]))
    units = [units[k] for k in torch.randperm(len(units), generator=gen)]
    num_calls = min(len(units), int(torch.randint(1, 5, (1,), generator=gen)))
    cuts = sorted(torch.randperm(len(units) - 1, generator=gen)[:num_calls - 1].add(1).tolist())
    return [torch.cat(units[a:b]) for a, b in zip([0, *cuts], [*cuts, len(units)],
                                                  strict=True)]


def deferred_objective(loss: torch.Tensor, mask: torch.Tensor, groups: torch.Tensor,
                       calls: list[torch.Tensor], mode: str) -> tuple[torch.Tensor, float]:
    """(c'_i / ΣD per sample, Σ_k S_k / Σ_k D_k) of a step made of ``calls``."""
    divisor = DIVISOR if mode == "constant" else None
    coefficients = torch.zeros(len(groups), dtype=torch.float64)
    weighted_sum, denominator = 0.0, 0.0
    for idx in calls:
        per_call, share = call_coefficients(mask[idx].sum(-1), groups[idx], mode, divisor)
        coefficients[idx] = per_call
        weighted_sum += float((per_call * (loss[idx] * mask[idx]).sum(-1)).sum())
        denominator += share
    return coefficients / denominator, weighted_sum / denominator


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(12))
def test_calls_of_a_deferred_step_compose_to_the_union(mode: str, seed: int) -> None:
    loss, mask, groups, group_size = random_step(seed)
    calls = random_split(groups, mode, seed)
    assert sorted(torch.cat(calls).tolist()) == list(range(len(groups)))  # a partition
    coefficients, objective = deferred_objective(loss, mask, groups, calls, mode)
    divisor = DIVISOR if mode == "constant" else None
    union = sample_coefficients(mask.sum(-1), groups, mode, divisor, group_size)
    torch.testing.assert_close(coefficients, union, rtol=0, atol=1e-12)
    expected = float(aggregate(loss, mask, groups, mode, divisor, group_size=group_size))
    assert objective == pytest.approx(expected, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("mode", ["sample_mean", "token_mean", "prompt_mean"])
def test_averaging_calls_each_normalised_alone_is_not_the_union(mode: str) -> None:
    """What a naive service does (J_k = S_k / D_k per call, then the mean over calls)
    misses the union's J on uneven calls (one group, then two), while the deferred sum
    meets it: the comparison of the test above can fail."""
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0],
                         [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 1, 0, 0]],
                        dtype=torch.float64)
    groups = torch.tensor([5, 5, 2, 2, 8, 8])
    calls = [torch.tensor([0, 1]), torch.tensor([2, 3, 4, 5])]
    naive = []
    for idx in calls:
        per_call, share = call_coefficients(mask[idx].sum(-1), groups[idx], mode)
        naive.append(float((per_call * (loss[idx] * mask[idx]).sum(-1)).sum()) / share)
    expected = float(aggregate(loss, mask, groups, mode))
    assert abs(sum(naive) / len(naive) - expected) > 1e-6
    _, deferred = deferred_objective(loss, mask, groups, calls, mode)
    assert deferred == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_call_coefficients_refuse_uneven_groups_and_a_constant_without_divisor() -> None:
    counts = torch.tensor([2.0, 3.0, 1.0])
    with pytest.raises(IncompleteGroupError, match="group 9 has 1 of 2 samples"):
        call_coefficients(counts, torch.tensor([4, 4, 9]), "prompt_mean")
    with pytest.raises(ValueError, match="divisor"):
        call_coefficients(counts, torch.arange(3), "constant")


@pytest.mark.parametrize(("mode", "whole_sample", "whole_group", "beside_full"), [
    ("sample_mean", 1.0, 1.0, 1.0),
    ("token_mean", 0.5, 0.5, 0.5),
    ("prompt_mean", 2 / 3, 1.0, 0.5),
    ("constant", 0.5, 0.5, 0.5),
])
def test_what_a_fraction_of_a_token_does_in_each_mode(
        mode: str, whole_sample: float, whole_group: float, beside_full: float) -> None:
    """What docs/loss-aggregation.md says a weight of 0.5 does: inside a sample, half a
    full token's say in every mode; a whole sample (or group) of halves loses say only
    where the mode does not divide by that sample's (group's) own token count."""
    groups = torch.tensor([0, 0, 1, 1])

    def say(mask: torch.Tensor) -> torch.Tensor:
        """Each sample's share of J's weight, over samples 0, 1 and 2 (group 1)."""
        return token_weights(mask, groups, mode, divisor=4.0).sum(dim=-1)

    full = torch.ones(4, 4, dtype=torch.float64)
    inside = full.clone()
    inside[0, :2] = 0.5
    weights = token_weights(inside, groups, mode, divisor=4.0)
    assert weights[0, 0] / weights[0, 2] == pytest.approx(0.5)  # every mode
    one = full.clone()
    one[0] = 0.5  # sample 0 all at 0.5; sample 2 (other group) full
    shares = say(one)
    assert shares[0] / shares[2] == pytest.approx(whole_sample)
    assert shares[0] / shares[1] == pytest.approx(beside_full)  # its full group mate
    group = full.clone()
    group[:2] = 0.5  # group 0 all at 0.5
    shares = say(group)
    assert (shares[0] + shares[1]) / (shares[2] + shares[3]) == pytest.approx(whole_group)
