r"""The checker's world: a tiny float64 policy over a small vocabulary, the policies around
it, and every outcome enumerated so an expectation is an exact sum, never a sample.

The policy is the tiny Qwen2 of rollout/tiny.py (its architecture, narrower, a vocabulary
of ``VOCAB`` tokens, float64 throughout: Qwen2's RMSNorm, which computes in float32, is
swapped for the same norm in float64, since a float32 backward rounds the gradient to
~1e-7, far above the tolerance). Beside it, fixed perturbations of its weights play the old
policy π_old (the policy at the rollout's start), the engine μ (what sampled the tokens)
and the reference π_ref; a token-classification head of the same shape is the critic
(and the reward model's score). An *outcome* of context c is a response y of ``length``
tokens; every one of the V^length responses of every context is one row, in
lexicographic order, so a sum over rows weighted by μ(y) = Π_t μ(y_t | c, y_<t) is
E_{y~μ}, exactly.

The documented formulas (formulas.py) read the outcomes' log-probs computed here by the
checker's own tempered log-softmax over a prefix tree — never production's functions,
which are what is under test (production.py).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field

import torch

VOCAB = 8
"""Tokens of the checker's vocabulary: small, so a sum over outcomes is exact and cheap."""
ARCHITECTURE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
"""rollout/tiny.py's architecture, narrower and one layer: the checker runs in seconds."""
CONTEXT_LEN = 3
NUM_CONTEXTS = 3
INIT_STD = 0.15
"""Initial weight std: large enough that π is far from uniform (logits of std ≈ 1)."""
PERTURBATION_STD = {"old": 0.035, "engine": 0.03, "reference": 0.03}
"""Weight noise of the policies around π: at T = 1 over half the ratios π/π_old leave
[0.8, 1.2] and some pass 2 (a dual clip bites); π_old/μ leaves [0.5, 2] for about a fifth
of the tokens and more of the sequences (truncation and masking bite); no k3 reaches
low_var_kl's clamp at 10."""


@dataclass(frozen=True)
class Outcomes:
    """Every response of ``length`` tokens to every context, one row each, [R = P·V^L]."""

    input_ids: torch.Tensor
    """[R, C + L] the context then the response."""
    targets: torch.Tensor
    """[R, C + L] next-token targets (position t predicts token t + 1; the last is 0)."""
    loss_mask: torch.Tensor
    """[R, C + L] float64, 1 at the L positions that predict the response's tokens."""
    length: int
    """L, the response's tokens."""

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]


def enumerate_outcomes(contexts: torch.Tensor, length: int) -> Outcomes:
    """All V^length responses after each context, context-major, responses lexicographic."""
    responses = torch.tensor(list(itertools.product(range(VOCAB), repeat=length)))
    num_contexts, context_len = contexts.shape
    input_ids = torch.cat([contexts.repeat_interleave(len(responses), dim=0),
                           responses.repeat(num_contexts, 1)], dim=1)
    targets = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
    loss_mask = torch.zeros(input_ids.shape, dtype=torch.float64)
    loss_mask[:, context_len - 1:context_len - 1 + length] = 1.0
    return Outcomes(input_ids, targets, loss_mask, length)


def tempered_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(z / T), written out: z/T − log Σ_v exp(z_v/T) (the checker's own)."""
    scaled = logits / temperature
    return scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)


def outcome_log_probs(model: torch.nn.Module, contexts: torch.Tensor, length: int,
                      temperature: float) -> torch.Tensor:
    """[P, V^L, L]: log π_T(y_t | c, y_<t) of each token of every outcome, by one forward
    per prefix depth (the prefix tree), in the order of :func:`enumerate_outcomes`."""
    num_contexts = contexts.shape[0]
    prefixes = contexts[:, None, :]  # [P, V^(t-1), C + t - 1]
    per_token = torch.zeros(num_contexts, 1, 0, dtype=torch.float64)  # [P, V^(t-1), t-1]
    for _ in range(length):
        flat = prefixes.reshape(-1, prefixes.shape[-1])
        log_p = tempered_log_softmax(model(flat).logits[:, -1].double(), temperature)
        log_p = log_p.reshape(num_contexts, -1, VOCAB)  # [P, V^(t-1), V]
        width = prefixes.shape[1]
        per_token = torch.cat([per_token.repeat_interleave(VOCAB, dim=1),
                               log_p.reshape(num_contexts, width * VOCAB, 1)], dim=-1)
        tokens = torch.arange(VOCAB).repeat(width)[None, :, None].expand(num_contexts, -1, 1)
        prefixes = torch.cat([prefixes.repeat_interleave(VOCAB, dim=1), tokens], dim=-1)
    return per_token


def _qwen2_config(num_labels: int = 1):
    from transformers import Qwen2Config

    from rollout.tiny import TINY_ARCHITECTURE

    config = Qwen2Config(vocab_size=VOCAB, pad_token_id=0, num_labels=num_labels,
                         initializer_range=INIT_STD, attention_dropout=0.0,
                         **{**TINY_ARCHITECTURE, **ARCHITECTURE, "max_position_embeddings": 16})
    # sdpa computes in float64; eager's softmax runs in float32 and its backward rounds
    # the gradient to ~1e-7, far above the checker's tolerance
    config._attn_implementation = "sdpa"
    return config


class RMSNorm64(torch.nn.Module):
    """Qwen2's RMSNorm, w · x / sqrt(mean(x²) + ε), in the input's dtype (float64)."""

    def __init__(self, weight: torch.nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)


def in_float64(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in float64, every RMSNorm computing in float64 too."""
    model = model.double().eval()
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child).__name__.endswith("RMSNorm"):
                setattr(module, name, RMSNorm64(child.weight, child.variance_epsilon))
    return model


@dataclass
class Setting:
    """The models and the data both sides of a check share (float64, fixed by ``seed``)."""

    policy: torch.nn.Module
    """π_θ: the parameters every gradient is taken for."""
    others: dict[str, torch.nn.Module]
    """``old``, ``engine``, ``reference``: π_θ with fixed weight noise, no gradient."""
    critic: torch.nn.Module
    """V_φ (and the reward model's score): a token-classification head, one label."""
    contexts: torch.Tensor
    """[P, C] token ids."""
    seed: int
    cache: dict[tuple[object, ...], torch.Tensor] = field(default_factory=dict)
    """Forwards shared by the rows (a policy's graph is kept: rows take grads with
    retain_graph)."""

    def logits(self, model: str, outcomes: Outcomes) -> torch.Tensor:
        """[R, S, V] ``model``'s logits on the outcomes' rows (the policy's with a graph)."""
        key = ("logits", model, outcomes.length)
        if key not in self.cache:
            net = self.policy if model == "policy" else self.others[model]
            with torch.set_grad_enabled(model == "policy"):
                self.cache[key] = net(outcomes.input_ids).logits
        return self.cache[key]

    def outcome_log_probs(self, model: str, length: int, temperature: float) -> torch.Tensor:
        """:func:`outcome_log_probs` of ``model``, cached (the policy's with a graph)."""
        key = ("outcomes", model, length, temperature)
        if key not in self.cache:
            net = self.policy if model == "policy" else self.others[model]
            with torch.set_grad_enabled(model == "policy"):
                self.cache[key] = outcome_log_probs(net, self.contexts, length, temperature)
        return self.cache[key]

    def data(self, shape: tuple[int, ...], salt: int, std: float = 1.0) -> torch.Tensor:
        """Fixed float64 N(0, std²) data (advantages, returns, utilities) for ``salt``."""
        gen = torch.Generator().manual_seed(self.seed * 1000 + salt)
        return std * torch.randn(shape, generator=gen, dtype=torch.float64)


def build_setting(seed: int = 0) -> Setting:
    """The tiny policy, its perturbations and the critic, float64, eval mode (no dropout)."""
    from transformers import Qwen2ForCausalLM, Qwen2ForTokenClassification

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        policy = in_float64(Qwen2ForCausalLM(_qwen2_config()))
        critic = in_float64(Qwen2ForTokenClassification(_qwen2_config(num_labels=1)))
        contexts = torch.randint(1, VOCAB, (NUM_CONTEXTS, CONTEXT_LEN))
    others = {}
    for index, (name, std) in enumerate(PERTURBATION_STD.items()):
        other = copy.deepcopy(policy).requires_grad_(False)
        gen = torch.Generator().manual_seed(seed * 1000 + 100 + index)
        with torch.no_grad():
            for parameter in other.parameters():
                parameter.add_(std * torch.randn(parameter.shape, generator=gen,
                                                 dtype=parameter.dtype))
        others[name] = other
    return Setting(policy, others, critic, contexts, seed)
