r"""The loss in megatron-core's contract, on vocab-parallel logits.

**Vocab-parallel log-probs and entropy.** TP rank r holds logits z for vocabulary rows
[r·V/TP, (r+1)·V/TP) of the padded vocabulary; padded rows (≥ the real vocab size) are
dropped. With m = max over all ranks (a constant shift, all-reduce MAX) and
S = Σ_v exp(z_v − m) (all-reduce SUM):

    log p(t) = (z_t − m) − log S        z_t from the rank owning t, zero elsewhere, summed
    H        = log S − Σ_v p_v (z_v − m)

The sums use Megatron's ``reduce_from_tensor_model_parallel_region`` (forward all-reduce,
backward identity: every TP rank computes the same loss), so no rank ever holds the full
vocabulary.

**The single SUM factor.** The forward-step loss function returns ``(loss, reported)``,
Megatron's two-tuple contract: its schedule multiplies ``loss`` by the CP size and
divides it by the number of micro-batches K; the backend's data-parallel gradient
reduction (:func:`trainer.backends.megatron.worker.average_gradients`, Megatron DDP's
semantics) averages over the DP·CP ranks. The gradient that reaches the optimizer is

    Σ_ranks ∇(loss · cp / K) / (dp · cp) = Σ_ranks ∇loss / (dp · K)

so the local Σ w·ℓ is multiplied by ``sum_reduction_factor(dp, K)`` = dp·K, here and
nowhere else, and the optimizer sees ∇J = Σ over ranks and micro-batches of ∇(Σ w·ℓ).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.aggregation import local_weighted_sum, sum_reduction_factor
from trainer.backends.megatron.model import ModelShape
from trainer.config import LossConfig
from trainer.losses import kl_penalty, policy_gradient_loss
from trainer.worker import MicroBatch

REPORTED = ("pg_loss", "kl", "entropy", "clipped_tokens", "valid_tokens",
            "log_prob_abs_diff")


def megatron_sum_factor(dp_size: int, num_micro_batches: int) -> int:
    """THE factor (see the module docstring): Megatron's ·cp/K and the DP·CP gradient mean
    leave ∇J / (dp·K); scaling the local loss by dp·K restores the plain SUM."""
    return sum_reduction_factor(num_averaging_ranks=dp_size,
                                num_micro_batches_divided=num_micro_batches)


def _tp_sum(x: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x.contiguous())


def vocab_parallel_log_probs(logits: torch.Tensor, targets: torch.Tensor, shape: ModelShape,
                             entropy: bool | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and the entropy per position from this rank's logit columns.

    logits: [b, s, V_padded/TP] (vocab-parallel), targets: [b, s] (full vocabulary ids).
    entropy: None skips it, False computes it without a graph, True differentiably.
    """
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    vocab_start = tp_rank * shape.vocab_per_rank
    num_valid = max(0, min(shape.vocab_per_rank, shape.vocab_size - vocab_start))
    z = logits[..., :num_valid].float()
    with torch.no_grad():
        shift = (z.amax(dim=-1) if num_valid else z.new_full(z.shape[:-1], -torch.inf))
        if shape.tp_size > 1:
            dist.all_reduce(shift, op=dist.ReduceOp.MAX,
                            group=parallel_state.get_tensor_model_parallel_group())
    z = z - shift.unsqueeze(-1)
    log_normaliser = _tp_sum(z.exp().sum(dim=-1)).log()
    local_target = targets - vocab_start
    owned = (local_target >= 0) & (local_target < num_valid)
    if num_valid:
        picked = z.gather(-1, local_target.clamp(0, num_valid - 1).unsqueeze(-1)).squeeze(-1)
        target_logit = torch.where(owned, picked, 0.0)
    else:
        target_logit = z.new_zeros(targets.shape)
    log_probs = _tp_sum(target_logit) - log_normaliser
    if entropy is None:
        return log_probs, None
    with torch.set_grad_enabled(entropy and torch.is_grad_enabled()):
        probs = torch.exp(z - log_normaliser.unsqueeze(-1))
        return log_probs, log_normaliser - _tp_sum((probs * z).sum(dim=-1))


def loss_func(micro: MicroBatch, ref_log_probs: torch.Tensor | None, loss_cfg: LossConfig,
              shape: ModelShape, scale: int, mode_names: list[str],
              logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's loss function of one micro-batch: ``(scale · Σ w·ℓ, reported sums)``.

    ``reported["sums"]`` holds this rank's unscaled sums of the logged terms (REPORTED,
    then one per aggregation mode), added up over micro-batches and DP×CP by the worker.
    """
    log_probs, entropy = vocab_parallel_log_probs(logits, micro.targets, shape,
                                                  entropy=loss_cfg.entropy_coef > 0)
    old = log_probs.detach() if loss_cfg.old_log_probs == "trainer" else micro.rollout_log_probs
    terms = policy_gradient_loss(log_probs, old, micro.advantages, loss_cfg,
                                 micro.rollout_log_probs)
    pg = torch.where(micro.loss_mask > 0, terms.pg_loss, 0.0)  # no inf·0 on padding
    pg_sum = local_weighted_sum(pg, micro.weights["pg"])
    objective, kl = pg_sum, pg_sum.new_zeros(())
    if ref_log_probs is not None:
        per_token_kl = kl_penalty(log_probs, ref_log_probs, loss_cfg.kl_estimator)
        kl = local_weighted_sum(torch.where(micro.loss_mask > 0, per_token_kl, 0.0),
                                micro.weights["kl"])
        objective = objective + loss_cfg.kl_coef * kl
    entropy_sum = local_weighted_sum(entropy, micro.weights["entropy"])
    if loss_cfg.entropy_coef > 0:
        objective = objective - loss_cfg.entropy_coef * entropy_sum
    with torch.no_grad():
        sums = torch.stack([
            pg_sum, kl, entropy_sum, (terms.clipped * micro.loss_mask).sum(),
            micro.loss_mask.sum(),
            ((log_probs - micro.rollout_log_probs).abs() * micro.loss_mask).sum(),
            *[local_weighted_sum(pg, micro.weights[k]) for k in mode_names],
        ]).double()
    return objective * scale, {"sums": sums}
