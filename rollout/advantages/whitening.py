r"""Statistics over a rollout's valid tokens (m > 0) that add up across shards exactly:
the moments (n, Σ x, Σ x²), from which

    μ = Σ x / n,   σ² = (Σ x² − n μ²) / (n − 1),   whiten(x) = (x − μ) / (σ + ε)

so GAE's whitening uses the whole rollout's statistics, never one rank's or one
mini-batch's (a rollout split over ranks reduces its moments by a sum:
:func:`whiten_over_ranks`, which production's GAE and the verifier's layouts both call).
"""

from __future__ import annotations

import torch


def token_moments(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """(n, Σ x, Σ x²) float64 over the valid tokens (m > 0)."""
    valid = loss_mask > 0
    x = values.to(torch.float64)[valid]
    return torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64), x.sum(),
                        (x * x).sum()])


def moments_mean_std(moments: torch.Tensor) -> tuple[float, float]:
    """(μ, σ) of (n, Σ x, Σ x²): σ Bessel-corrected, 0 for fewer than two tokens."""
    n, total, squares = (float(v) for v in moments)
    if n == 0:
        return 0.0, 0.0
    mean = total / n
    variance = max(squares - n * mean * mean, 0.0) / (n - 1) if n > 1 else 0.0
    return mean, variance ** 0.5


def whiten(advantages: torch.Tensor, loss_mask: torch.Tensor, moments: torch.Tensor,
           eps: float) -> torch.Tensor:
    """(A − μ) / (σ + ε) on the valid tokens, 0 elsewhere, with μ and σ of ``moments``
    (:func:`token_moments` of the whole rollout)."""
    mean, std = moments_mean_std(moments)
    return torch.where(loss_mask > 0, (advantages.to(torch.float64) - mean) / (std + eps),
                       0.0)


def whiten_over_ranks(advantages: torch.Tensor, loss_mask: torch.Tensor,
                      rank_moments: torch.Tensor, eps: float) -> torch.Tensor:
    """GAE's whitening: :func:`whiten` by the moments of every rank summed.
    ``rank_moments`` [..., 3]: each rank's (n, Σ A, Σ A²) of the tokens it holds (the
    driver's whole rollout is one rank: ``token_moments(A, m)``; a verifier's layout
    [dp, cp, 3]). Summing, never one rank's own, is what makes μ and σ the rollout's."""
    return whiten(advantages, loss_mask, rank_moments.reshape(-1, 3).sum(dim=0), eps)


def explained_variance(returns: torch.Tensor, values: torch.Tensor,
                       loss_mask: torch.Tensor) -> float:
    """1 − Var(R − V) / Var(R) over the valid tokens: 1 when the critic predicts every
    return, 0 when it does no better than their mean, negative when worse (0 when the
    returns do not vary)."""
    _, spread = moments_mean_std(token_moments(returns, loss_mask))
    _, error = moments_mean_std(token_moments(returns.double() - values.double(), loss_mask))
    return 1.0 - (error / spread) ** 2 if spread > 0 else 0.0
