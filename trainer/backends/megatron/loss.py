r"""The loss in megatron-core's contract, on vocab-parallel logits.

**Vocab-parallel log-probs and entropy of π_T.** TP rank r holds logits for vocabulary
rows [r·V/TP, (r+1)·V/TP) of the padded vocabulary; padded rows (≥ the real vocab size)
are dropped. With z = logits / T in fp32 (T the sampling temperature, divided before the
shift, whatever the compute dtype), m = max over all ranks (a constant shift, all-reduce
MAX) and S = Σ_v exp(z_v − m) (all-reduce SUM):

    log p(t) = (z_t − m) − log S        z_t from the rank owning t, zero elsewhere, summed
    H        = log S − U / S,    U = Σ_v exp(z_v − m) (z_v − m)   (all-reduce SUM)

H is written through the two all-reduced sums S and U, never as a sum of per-rank terms
that each depend on the reduced log S: the reduction's backward is the identity, so a
rank's ∂/∂z of such a term would miss the other ranks' dependence on log S (the entropy
gradient was wrong at TP > 1 that way; tests/trainer/megatron/test_temperature.py).

NaN safety: a logit of −inf (a masked vocabulary entry) has p = 0 and contributes
p·(z − m) := 0 to H; the plain product would be 0·(−inf) = NaN, in the forward and,
through the backward, in every gradient. Finite logits give bit-identical results.

The sums use Megatron's ``reduce_from_tensor_model_parallel_region`` (forward all-reduce,
backward identity: every TP rank computes the same loss), so no rank ever holds the full
vocabulary.

**The single SUM factor.** The forward-step loss function returns ``(loss, reported)``,
Megatron's two-tuple contract: its schedule multiplies ``loss`` by the CP size and
divides it by the number of micro-batches K; the backend's data-parallel gradient
reduction (:func:`trainer.backends.megatron.main_params.average_gradients`, Megatron
DDP's semantics) averages over the DP·CP ranks. The gradient that reaches the optimizer is

    Σ_ranks ∇(loss · cp / K) / (dp · cp) = Σ_ranks ∇loss / (dp · K)

so the local Σ w·ℓ is multiplied by ``sum_reduction_factor(dp, K)`` = dp·K, here and
nowhere else, and the optimizer sees ∇J = Σ over ranks and micro-batches of ∇(Σ w·ℓ).

The objective itself (pg, KL, entropy and the logged sums) is the shared one of
``trainer/objective.py``; this module only produces its inputs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.aggregation import sum_reduction_factor
from trainer.backends.megatron.model import ModelShape
from trainer.config import LossConfig, ObjectiveConfig
from trainer.micro_batch import MicroBatch
from trainer.objective import TokenLogProbs, micro_batch_objective, term_coefficients


def megatron_sum_factor(dp_size: int, num_micro_batches: int) -> int:
    """THE factor (see the module docstring): Megatron's ·cp/K and the DP·CP gradient mean
    leave ∇J / (dp·K); scaling the local loss by dp·K restores the plain SUM."""
    return sum_reduction_factor(num_averaging_ranks=dp_size,
                                num_micro_batches_divided=num_micro_batches)


def _tp_sum(x: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x.contiguous())


def _shifted_logits(logits: torch.Tensor, num_valid: int, temperature: float,
                    shape: ModelShape) -> torch.Tensor:
    """z / T − m over this rank's real vocabulary columns, fp32 (fp64 stays fp64)."""
    from megatron.core import parallel_state

    z = logits[..., :num_valid].to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        z = z / temperature
    with torch.no_grad():
        shift = z.amax(dim=-1) if num_valid else z.new_full(z.shape[:-1], -torch.inf)
        if shape.tp_size > 1:
            dist.all_reduce(shift, op=dist.ReduceOp.MAX,
                            group=parallel_state.get_tensor_model_parallel_group())
    return z - shift.unsqueeze(-1)


def vocab_parallel_log_probs(logits: torch.Tensor, targets: torch.Tensor, shape: ModelShape,
                             temperature: float = 1.0, entropy: bool | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π_T(target) and H(π_T) per position from this rank's logit columns.

    logits: [b, s, V_padded/TP] (vocab-parallel), targets: [b, s] (full vocabulary ids).
    entropy: None skips it, False computes it without a graph, True differentiably.
    """
    from megatron.core import parallel_state

    vocab_start = parallel_state.get_tensor_model_parallel_rank() * shape.vocab_per_rank
    num_valid = max(0, min(shape.vocab_per_rank, shape.vocab_size - vocab_start))
    z = _shifted_logits(logits, num_valid, temperature, shape)
    normaliser = _tp_sum(z.exp().sum(dim=-1))
    log_normaliser = normaliser.log()
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
        finite = torch.isfinite(z)  # where twice: no 0·(−inf) forward or backward
        safe_z = torch.where(finite, z, 0.0)
        weighted = _tp_sum((torch.where(finite, safe_z.exp(), 0.0) * safe_z).sum(dim=-1))
        return log_probs, log_normaliser - weighted / normaliser


def _cp_group() -> object | None:
    """The CP group a sample's sequence sums (GSPO, sequence corrections) are reduced
    over, None without CP (trainer/objective.py: ``sample_sums``)."""
    from megatron.core import parallel_state

    if parallel_state.get_context_parallel_world_size() == 1:
        return None
    return parallel_state.get_context_parallel_group()


def loss_func(micro: MicroBatch, ref_log_probs: torch.Tensor | None, loss_cfg: LossConfig,
              objective: ObjectiveConfig, shape: ModelShape, scale: int, mode_names: list[str],
              planted_terms: frozenset[str], logits: torch.Tensor
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's loss function of one micro-batch: ``(scale · Σ w·ℓ, reported sums)``.

    ``reported["sums"]`` holds this rank's unscaled logged sums (``objective.LOGGED_SUMS``,
    then one per aggregation mode), added up over micro-batches and DP×CP by the worker.
    """
    entropy_grad = term_coefficients(loss_cfg, objective.gradient_of)["entropy"] > 0
    log_probs, entropy = vocab_parallel_log_probs(logits, micro.targets, shape,
                                                  objective.temperature, entropy=entropy_grad)
    token = TokenLogProbs(log_probs, entropy, ref_log_probs)
    loss, sums = micro_batch_objective(token, micro, loss_cfg, mode_names, planted_terms,
                                       objective.gradient_of, _cp_group())
    return loss * scale, {"sums": sums}
