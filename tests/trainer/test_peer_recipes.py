"""Each row of docs/recipes.md: a peer's named recipe (TRL ``loss_type``, verl
``loss_agg_mode`` × ``policy_loss.loss_mode``, SkyRL ``loss_reduction`` ×
``policy_loss_type``, slime's flag) and the Tally config the table maps it to give the same
J and ∇J on one worked batch, float64, to 1e-10.

(a) Tally: the production path, ``ObjectiveConfig.compose`` → ``plan_step`` (packed rows,
several micro-batches) → ``slice_for_plan`` → ``micro_batch_objective`` summed over the
micro-batches, the log-probs a leaf tensor routed into each row's layout.
(b) The peer: its formula written out below in plain torch on right-padded [N, T]
tensors, as the peer's code computes it on one device with one micro-batch (file and
function of each in the docs table). Where a peer's result depends on the layout, the
table says so; this is its single-device result.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout.batch import RolloutBatch
from trainer.config import AggregationConfig, LossConfig, ObjectiveConfig
from trainer.losses import POLICY_LOSSES
from trainer.micro_batch import slice_for_plan
from trainer.objective import TokenLogProbs, micro_batch_objective
from trainer.step_plan import plan_step

DOCS = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"

# The worked batch: P = 3 groups of G = 2, responses of 3..8 tokens (T = 8 = the budget L),
# one masked token inside sample 2 (an observation), per-sample advantages. Every value is
# a dyadic rational, exact in the batch's float32 fields. log π − log π_old per token:
# sample 0 sums to 0 (a GSPO ratio of exactly 1, inside any band), e^0.21875 lies between
# 1.2 and 1.28 (clip-higher moves it); tokens past ±0.2 clip;
# sample 3 (A < 0) has ρ = e^1.25 > 3 and e^1.75 > 5 (verl's dual clip, CISPO's caps).
LENGTHS = [3, 7, 5, 8, 4, 6]
GROUPS = [0, 0, 1, 1, 2, 2]
ADVANTAGES = [0.75, -0.5, 1.25, -1.0, 0.5, -0.25]
LOG_RATIOS = [[0.21875, -0.4375, 0.21875],
              [0.125, -0.25, 0.0625, 0.5, -0.125, 0.03125, -0.3125],
              [-0.0625, 0.375, 0.5, -0.1875, 0.09375],
              [0.0625, 1.25, -0.125, 0.25, 1.75, -0.375, 0.0, 0.1875],
              [-0.25, -0.03125, 0.125, 0.4375],
              [0.1875, -0.0625, -0.5, 0.3125, 0.15625, -0.09375]]
MASKS = [[1] * n for n in LENGTHS]
MASKS[2][2] = 0
BUDGET = 8  # max_response_len / TRL max_completion_length / verl's padded response width
SKYRL_MAX_SEQ_LEN = 12.0  # SkyRL's own max_seq_len (often the context, not the budget)


def _log_probs() -> torch.Tensor:
    """log π_θ per response token [N, T], float64, 0 past each response."""
    out = torch.zeros(len(LENGTHS), BUDGET, dtype=torch.float64)
    for i, n in enumerate(LENGTHS):
        out[i, :n] = -torch.arange(1, n + 1, dtype=torch.float64) * (i + 1) / 16
    return out


def _tensors() -> dict[str, torch.Tensor]:
    """Right-padded [N, T] tensors as every peer holds them (A per sample [N])."""
    ratios = torch.zeros(len(LENGTHS), BUDGET, dtype=torch.float64)
    mask = torch.zeros_like(ratios)
    for i, n in enumerate(LENGTHS):
        ratios[i, :n] = torch.tensor(LOG_RATIOS[i], dtype=torch.float64)
        mask[i, :n] = torch.tensor(MASKS[i], dtype=torch.float64)
    log_probs = _log_probs()
    return {"old": (log_probs - ratios) * (mask > 0), "mask": mask,
            "adv": torch.tensor(ADVANTAGES, dtype=torch.float64),
            "groups": torch.tensor(GROUPS)}


def tally_objective(aggregation: AggregationConfig, loss: LossConfig, leaf: torch.Tensor
                    ) -> torch.Tensor:
    """J of one step through the production calls, differentiable in ``leaf`` [N, T]."""
    num_samples = len(LENGTHS)
    prompts = [[5 + g] * (2 + g) for g in GROUPS]  # uneven prompts: rows start anywhere
    responses = [[7 + t for t in range(n)] for n in LENGTHS]
    t = _tensors()
    batch = RolloutBatch.from_samples(
        prompts, responses, [t["old"][i, :n].tolist() for i, n in enumerate(LENGTHS)],
        [0.0] * num_samples, [[a] * n for a, n in zip(ADVANTAGES, LENGTHS, strict=True)],
        GROUPS, 2, response_masks=MASKS)
    width = batch.input_ids.shape[1]
    # response token k of sample i sits at [i, prompt_i + k] of the [N, S] layout
    rows = torch.tensor([i for i, n in enumerate(LENGTHS) for _ in range(n)])
    ks = torch.tensor([k for n in LENGTHS for k in range(n)])
    cols = torch.tensor([len(prompts[i]) for i in rows.tolist()]) + ks
    old = torch.zeros(num_samples, width, dtype=torch.float64)
    old[rows, cols] = t["old"][rows, ks]
    # each token's 1-based index, so a micro-batch's slice says which leaf entry it holds
    flat_index = torch.zeros(num_samples, width, dtype=torch.float64)
    flat_index[rows, cols] = torch.arange(1, len(rows) + 1, dtype=torch.float64)
    leaf_tokens = torch.cat([leaf.new_zeros(1), leaf[rows, ks]])
    objective = ObjectiveConfig.compose(aggregation, loss, BUDGET, 1.0)
    batch = batch.with_old_log_probs(old)
    plan = plan_step(batch, objective, 1, 1, max_tokens_per_micro_batch=16)
    assert len(plan.micro_batches[0]) > 1  # several micro-batches add up
    total = leaf.new_zeros(())
    for samples in plan.micro_batches[0]:
        micro = slice_for_plan(batch, plan, samples, 1, 0)
        where = slice_for_plan(batch.with_old_log_probs(flat_index), plan, samples, 1, 0)
        log_probs = leaf_tokens[where.old_log_probs.long()]  # index 0: no token, value 0
        token = TokenLogProbs(log_probs, torch.zeros_like(log_probs.detach()))
        j, _ = micro_batch_objective(token, micro, loss, plan.mode_metric_names)
        total = total + j
    return total


# ---- the peers' formulas (plain torch; ℓ per token, then the peer's reduction) ----

def _ppo(ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float,
         dual_c: float | None = None) -> torch.Tensor:
    """max(−Aρ, −A·clip(ρ)) and, with dual_c, min(·, −A·c) where A < 0."""
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - low, 1 + high))
    if dual_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_c), loss)
    return loss


def _gspo_token_ratio(lp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl/SkyRL's GSPO-token ratio sg[s_i] · π_t / sg[π_t], s_i = exp(mean_t log ρ)
    (both clamp its log at 10)."""
    seq = ((lp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return torch.exp(torch.clamp(lp - lp.detach() + seq.detach()[:, None], max=10.0))


def trl(loss_type: str, level: str = "token", eps: float = 0.2, eps_high: float | None = None
        ) -> Callable[..., torch.Tensor]:
    """trl/trainer/grpo_trainer.py GRPOTrainer._compute_loss, one process, one micro-batch."""
    eps_high = eps if eps_high is None else eps_high

    def j(lp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor,
          **_: Any) -> torch.Tensor:
        adv, log_ratio = adv[:, None], lp - old
        if level == "sequence":
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
        coef_1 = torch.exp(log_ratio)
        if loss_type == "cispo":
            per_token = -torch.clamp(coef_1, max=eps_high).detach() * adv * lp
        else:
            coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps_high)
            per_token = -torch.min(coef_1 * adv, coef_2 * adv)
        per_token = per_token.expand_as(mask)
        if loss_type == "grpo":
            return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        if loss_type == "dr_grpo":
            return (per_token * mask).sum() / (per_token.size(0) * BUDGET)
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)  # bnpo, dapo, cispo
    return j


def verl(agg_mode: str, loss_mode: str = "vanilla", low: float = 0.2, high: float = 0.2
         ) -> Callable[..., torch.Tensor]:
    """verl/trainer/ppo/core_algos.py compute_policy_loss_{vanilla,gspo,cispo} + agg_loss,
    one device, one micro-batch (clip_ratio_c = 3: vanilla's dual clip is always on)."""
    def j(lp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor,
          **_: Any) -> torch.Tensor:
        adv = adv[:, None].expand_as(mask)
        ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
        mode = agg_mode
        if loss_mode == "vanilla":
            loss = _ppo(ratio, adv, low, high, dual_c=3.0)
        elif loss_mode == "gspo":
            loss, mode = _ppo(_gspo_token_ratio(lp, old, mask), adv, low, high), \
                "seq-mean-token-mean"  # compute_policy_loss_gspo ignores loss_agg_mode
        else:  # cispo
            loss = -ratio.clamp(1 - low, 1 + high).detach() * adv * lp
        seq_sum, counts = (loss * mask).sum(-1), mask.sum(-1)
        if mode == "token-mean":
            return seq_sum.sum() / counts.sum()
        if mode == "seq-mean-token-sum":
            return seq_sum.sum() / (counts > 0).sum()
        if mode == "seq-mean-token-mean":
            # verl divides by counts + 1e-8; that guard moves J by ~1e-9 (relative), so
            # it is left out here: it is not part of the objective, and 1e-10 is the bar
            return (seq_sum / counts).sum() / (counts > 0).sum()
        return seq_sum.sum() / mask.shape[-1]  # seq-mean-token-sum-norm
    return j


def skyrl(reduction: str, loss_type: str = "regular", low: float = 0.2, high: float = 0.2
          ) -> Callable[..., torch.Tensor]:
    """skyrl/backends/skyrl_train/utils/ppo_utils.py: advantages scaled by
    apply_loss_reduction_to_advantages_minibatch, then the policy loss summed (reduce_loss)."""
    def j(lp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor,
          groups: torch.Tensor) -> torch.Tensor:
        adv, n = adv[:, None].expand_as(mask), mask.shape[0]
        if reduction == "token_mean":
            adv = adv / mask.sum().clamp(min=1)
        elif reduction == "sequence_mean":
            adv = adv / (n * mask.sum(-1, keepdim=True).clamp(min=1))
        elif reduction == "seq_mean_token_sum_norm":
            adv = adv / (n * SKYRL_MAX_SEQ_LEN)
        else:  # prompt_mean: 1 / (num_prompts · tokens of the prompt's group)
            totals = torch.zeros(int(groups.max()) + 1, dtype=mask.dtype).index_add(
                0, groups, mask.sum(-1))
            adv = adv / (len(totals) * totals[groups].clamp(min=1))[:, None]
        ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
        if loss_type in ("regular", "dual_clip"):
            loss = _ppo(ratio, adv, low, high, 3.0 if loss_type == "dual_clip" else None)
        elif loss_type == "gspo":
            loss = _ppo(_gspo_token_ratio(lp, old, mask), adv, low, high)
        else:  # cispo (cispo_anchor: old)
            loss = -adv * ratio.clamp(1 - low, 1 + high).detach() * lp
        return (loss * mask).sum()
    return j


def slime(per_token: bool, eps: float = 0.2) -> Callable[..., torch.Tensor]:
    """slime/utils/ppo_utils.py compute_policy_loss, reduced by
    slime/backends/megatron_utils/cp_utils.py get_sum_of_sample_mean and scaled in
    loss.py (per sample: × 1 / step_global_batch_size; per token: Megatron ÷ Σ tokens)."""
    def j(lp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor,
          **_: Any) -> torch.Tensor:
        loss = _ppo(torch.exp(lp - old), adv[:, None].expand_as(mask), eps, eps)
        seq_sum = (loss * mask).sum(-1)
        if per_token:
            return seq_sum.sum() / mask.sum(-1).clamp(min=1).sum()
        return (seq_sum / mask.sum(-1).clamp(min=1)).sum() / mask.shape[0]
    return j


@dataclass(frozen=True)
class Row:
    id: str
    """The row's id in docs/recipes.md."""
    peer: Callable[..., torch.Tensor]
    aggregation: dict[str, Any] = field(default_factory=dict)
    loss: dict[str, Any] = field(default_factory=dict)

    @property
    def policy_loss(self) -> str:
        return self.loss.get("policy_loss", "ppo")


GSPO = {"policy_loss": "gspo"}  # ε_low, ε_high = 3e-4, 4e-4: its defaults, as the peers set
ROWS = [
    Row("trl-grpo", trl("grpo"), {"mode": "sample_mean"}),
    Row("trl-bnpo", trl("bnpo"), {"mode": "token_mean"}),
    Row("trl-dapo", trl("dapo", eps_high=0.28), {"mode": "token_mean"}, {"eps_clip_high": 0.28}),
    Row("trl-dr_grpo", trl("dr_grpo"), {"mode": "constant", "divisor": "max_response_len"}),
    Row("trl-cispo", trl("cispo", eps_high=5.0), {"mode": "token_mean"},
        {"policy_loss": "cispo", "eps_clip_high": 4.0}),
    Row("trl-gspo", trl("grpo", "sequence", 3e-4, 4e-4), {"mode": "sample_mean"}, GSPO),
    Row("verl-token-mean", verl("token-mean"), {"mode": "token_mean"}, {"dual_clip_c": 3.0}),
    Row("verl-seq-mean-token-mean", verl("seq-mean-token-mean"), {"mode": "sample_mean"},
        {"dual_clip_c": 3.0}),
    Row("verl-seq-mean-token-sum", verl("seq-mean-token-sum"),
        {"mode": "constant", "divisor": 1.0}, {"dual_clip_c": 3.0}),
    Row("verl-seq-mean-token-sum-norm", verl("seq-mean-token-sum-norm"),
        {"mode": "constant", "divisor": BUDGET / len(LENGTHS)}, {"dual_clip_c": 3.0}),
    Row("verl-gspo", verl("token-mean", "gspo", 3e-4, 4e-4), {"mode": "sample_mean"}, GSPO),
    Row("verl-cispo", verl("token-mean", "cispo", 1.0, 0.28), {"mode": "token_mean"},
        {"policy_loss": "cispo", "eps_clip_high": 0.28}),
    Row("skyrl-token_mean", skyrl("token_mean"), {"mode": "token_mean"}),
    Row("skyrl-sequence_mean", skyrl("sequence_mean"), {"mode": "sample_mean"}),
    Row("skyrl-prompt_mean", skyrl("prompt_mean"), {"mode": "prompt_mean"}),
    Row("skyrl-seq_mean_token_sum_norm", skyrl("seq_mean_token_sum_norm"),
        {"mode": "constant", "divisor": SKYRL_MAX_SEQ_LEN}),
    Row("skyrl-dual_clip", skyrl("token_mean", "dual_clip"), {"mode": "token_mean"},
        {"dual_clip_c": 3.0}),
    Row("skyrl-gspo", skyrl("sequence_mean", "gspo", 3e-4, 4e-4), {"mode": "sample_mean"}, GSPO),
    Row("skyrl-cispo", skyrl("token_mean", "cispo", 1.0, 4.0), {"mode": "token_mean"},
        {"policy_loss": "cispo", "eps_clip_high": 4.0}),
    Row("slime-default", slime(per_token=False), {"mode": "sample_mean"}),
    Row("slime-calculate-per-token-loss", slime(per_token=True),
        {"calculate_per_token_loss": True}),
]


def _both(row: Row, aggregation: dict[str, Any] | None = None,
          loss: dict[str, Any] | None = None) -> tuple[torch.Tensor, ...]:
    """(J_tally, J_peer, ∇J_tally, ∇J_peer) wrt the same leaf log-probs."""
    t = _tensors()
    leaf = _log_probs().requires_grad_(True)
    j_tally = tally_objective(
        AggregationConfig(**(row.aggregation if aggregation is None else aggregation)),
        LossConfig(**(row.loss if loss is None else loss)), leaf)
    (g_tally,) = torch.autograd.grad(j_tally, leaf)
    j_peer = row.peer(leaf, t["old"], t["mask"], t["adv"], groups=t["groups"])
    (g_peer,) = torch.autograd.grad(j_peer, leaf)
    return j_tally.detach(), j_peer.detach(), g_tally, g_peer


@pytest.mark.parametrize("row", [pytest.param(row, id=row.id) for row in ROWS])
def test_peer_recipe_is_the_mapped_tally_config(row: Row) -> None:
    j_tally, j_peer, g_tally, g_peer = _both(row)
    torch.testing.assert_close(j_tally, j_peer, rtol=0, atol=1e-10)
    torch.testing.assert_close(g_tally, g_peer, rtol=0, atol=1e-10)
    assert g_peer.abs().sum() > 0


def test_the_worked_batch_tells_the_configs_apart() -> None:
    """The comparison can fail: one row's peer against each neighbouring config differs,
    so each mode, divisor and the dual clip are seen by the batch."""
    row = next(r for r in ROWS if r.id == "verl-token-mean")
    wrong = [({"mode": "sample_mean"}, row.loss), ({"mode": "prompt_mean"}, row.loss),
             ({"mode": "constant", "divisor": 1.0}, row.loss), (row.aggregation, {}),
             (row.aggregation, {**row.loss, "eps_clip_high": 0.28})]
    for aggregation, loss in wrong:
        _, _, g_tally, g_peer = _both(row, aggregation, loss)
        assert (g_tally - g_peer).abs().max() > 1e-4, (aggregation, loss)
    ratio = torch.exp(_log_probs() - _tensors()["old"])[_tensors()["mask"] > 0]
    assert ((ratio < 0.8) | (ratio > 1.2)).sum() >= 5 and (ratio > 5).any()


@pytest.mark.parametrize(("row_id", "wrong"), [
    ("trl-gspo", {"policy_loss": "ppo", "eps_clip": 3e-4, "eps_clip_high": 4e-4}),
    ("trl-cispo", {"policy_loss": "cispo", "eps_clip_high": 5.0}),  # TRL's ε as Tally's
    ("verl-cispo", {"policy_loss": "ppo", "eps_clip_high": 0.28}),
])
def test_the_worked_batch_tells_the_policy_losses_apart(row_id: str, wrong: dict[str, Any]
                                                        ) -> None:
    """A token ratio where the row needs the sequence one, a cap one off, PPO for CISPO:
    each gives another gradient on this batch."""
    row = next(r for r in ROWS if r.id == row_id)
    assert row.policy_loss in POLICY_LOSSES
    _, _, g_tally, g_peer = _both(row, loss=wrong)
    assert (g_tally - g_peer).abs().max() > 1e-4


def _docs_ids(text: str) -> list[str]:
    """The id in the first column of every row of docs/recipes.md's tables."""
    return re.findall(r"^\| `([a-z]+-[\w-]+)` \|", text, flags=re.MULTILINE)


def _table_drift(text: str) -> str | None:
    """What keeps the page's rows and the tests' rows apart, or None."""
    ids = _docs_ids(text)
    if len(ids) != len(set(ids)):
        return "a row id appears twice"
    missing = sorted({row.id for row in ROWS} - set(ids))
    extra = sorted(set(ids) - {row.id for row in ROWS})
    return f"untested rows {extra}, undocumented tests {missing}" if missing or extra else None


def test_every_docs_row_has_its_test_and_every_test_its_row() -> None:
    text = DOCS.read_text(encoding="utf-8")
    assert _table_drift(text) is None, _table_drift(text)
    # the check fails on a planted drift: a row dropped, a row added, a row twice
    line = next(x for x in text.splitlines() if x.startswith("| `trl-dapo` |"))
    assert _table_drift(text.replace(line + "\n", "")) is not None
    assert _table_drift(text + "\n| `trl-sapo` | x | x | x | x |\n") is not None
    assert _table_drift(text + "\n" + line + "\n") is not None
