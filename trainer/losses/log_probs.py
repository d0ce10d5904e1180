r"""Log-probs and entropy of the sampling distribution π_T = softmax(z / T), per position.

In fp32 whatever the compute dtype (fp64 stays fp64): the samples come from π_T, so the
PPO ratio, TIS, KL and the gradient must be taken for it too.

    entropy   H_t = −Σ_v p_v log p_v, with p log p := 0 where p = 0 (logits of −inf)
"""

from __future__ import annotations

import torch


def tempered_log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(z / T) in fp32 (fp64 stays fp64): [.., V] -> [.., V]."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)


def entropy_from_log_probs(log_p: torch.Tensor) -> torch.Tensor:
    """H = −Σ p log p over the last dim, with p log p := 0 where p = 0 (log p = −inf)."""
    finite = torch.isfinite(log_p)
    safe_log_p = torch.where(finite, log_p, torch.zeros_like(log_p))
    return -(torch.where(finite, safe_log_p.exp() * safe_log_p, 0.0)).sum(dim=-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-token entropy of softmax(z / T): [.., T, V] -> [.., T]."""
    return entropy_from_log_probs(tempered_log_softmax(logits, temperature))


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor,
                    temperature: float = 1.0) -> torch.Tensor:
    """log π_T(target) per position: logits [.., T, V], targets [.., T] -> [.., T]."""
    log_p = tempered_log_softmax(logits, temperature)
    return log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def log_probs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                          with_entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One log-softmax for both: log π_T(target) and H(π_T) per position."""
    log_p = tempered_log_softmax(logits, temperature)
    token = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(with_entropy_grad and torch.is_grad_enabled()):
        entropy = entropy_from_log_probs(log_p if with_entropy_grad else log_p.detach())
    return token, entropy


def loss_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Where a backend computes logits: the loss mask's positions [b, s] (bool). A shard
    with none keeps its first position, so its backward still reaches every parameter
    (FSDP's reduce-scatter needs every rank) with a zero gradient."""
    keep = loss_mask > 0
    if not keep.any():
        keep = keep.clone()
        keep.view(-1)[0] = True
    return keep


def spread(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Values [n] at the n positions ``keep`` [b, s] marks, 0 elsewhere: [b, s]."""
    return values.new_zeros(keep.shape).masked_scatter(keep, values)
