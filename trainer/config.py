"""Configuration schemas of the trainer. Imports only pydantic, so a job can be
validated (by the controller, at submit time) without torch or Ray."""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.terms import POLICY_TERM_NAMES  # the term registry: standard library only

AggregationMode = Literal["sample_mean", "token_mean", "prompt_mean", "constant"]
AGGREGATION_MODES: tuple[AggregationMode, ...] = (
    "sample_mean",
    "token_mean",
    "prompt_mean",
    "constant",
)
MAX_RESPONSE_LEN = "max_response_len"
GradientOf = Literal[("all", *POLICY_TERM_NAMES)]  # type: ignore[valid-type]
"""``all``, or one policy term (trainer/terms.py) the verifier isolates."""
CUSTOM_POLICY_LOSS = "custom"
"""`trainer.loss.policy_loss` of a user's own class (`trainer.loss.class_path`)."""
POLICY_LOSS_CLASS_PATH_FIELD = "trainer.loss.class_path"
POLICY_LOSS_KWARGS_FIELD = "trainer.loss.kwargs"
_REDUCER_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class TermAggregationConfig(BaseModel):
    """How the per-token values of one term (KL, entropy) become its J for a step.

    See docs/loss-aggregation.md for the formulas of each mode.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    mode: AggregationMode = "sample_mean"
    """Aggregation mode: sample_mean (default), token_mean, prompt_mean or constant."""
    divisor: float | Literal["max_response_len"] | None = None
    """Constant L for mode=constant: a finite number > 0, or `max_response_len`
    (Dr. GRPO's generation budget, resolved against the rollout's max new tokens)."""

    @model_validator(mode="after")
    def _divisor_matches_mode(self) -> TermAggregationConfig:
        if self.mode == "constant":
            if self.divisor is None:
                raise ValueError(
                    "divisor: mode=constant needs a divisor (a finite number > 0, or "
                    "'max_response_len')"
                )
            if isinstance(self.divisor, float) and not (
                math.isfinite(self.divisor) and self.divisor > 0
            ):
                raise ValueError(
                    f"divisor: must be finite and > 0 for mode=constant, got {self.divisor}"
                )
        elif self.divisor is not None:
            raise ValueError(
                f"divisor: only mode=constant takes a divisor, but mode={self.mode}"
            )
        return self

    def resolved(self, max_response_len: int) -> TermAggregationConfig:
        """A copy whose divisor is a number: `max_response_len` becomes the budget."""
        if self.divisor == MAX_RESPONSE_LEN:
            return self.model_copy(update={"divisor": float(max_response_len)})
        return self

    @property
    def numeric_divisor(self) -> float | None:
        """L as a number; a divisor still spelled `max_response_len` is a bug upstream."""
        if self.divisor == MAX_RESPONSE_LEN:
            raise ValueError("divisor: 'max_response_len' must be resolved when the job "
                             "config is composed")
        return self.divisor


class AggregationConfig(TermAggregationConfig):
    """How per-token losses of one optimizer step become one scalar objective J.

    See docs/loss-aggregation.md for the formulas of each mode.
    """

    calculate_per_token_loss: bool = False
    """Legacy spelling of mode=token_mean (slime's --calculate-per-token-loss)."""
    custom_reducer: str | None = None
    """`module:function` returning per-token weights; overrides `mode` for the pg term."""

    @model_validator(mode="before")
    @classmethod
    def _legacy_per_token_flag(cls, data: object) -> object:
        """`calculate_per_token_loss: true` alone means token_mean; with prompt_mean or
        constant it is a contradiction the user must resolve."""
        if not isinstance(data, dict) or not data.get("calculate_per_token_loss"):
            return data
        mode = data.get("mode", "token_mean")
        if mode in ("prompt_mean", "constant"):
            raise ValueError(
                f"calculate_per_token_loss: true is the legacy spelling of mode=token_mean "
                f"and conflicts with mode={mode}; remove calculate_per_token_loss or set "
                f"mode: token_mean"
            )
        return {**data, "mode": "token_mean"}

    @model_validator(mode="after")
    def _reducer_path(self) -> AggregationConfig:
        if self.custom_reducer is not None and not _REDUCER_PATH.match(self.custom_reducer):
            raise ValueError(
                f"custom_reducer: expected 'module:function', got {self.custom_reducer!r}"
            )
        return self


class KLControllerConfig(BaseModel):
    r"""β of the KL in the reward (``kl_placement: reward``).

    fixed: β = kl_coef throughout. adaptive (Ziegler et al. 2019, as TRL's and verl's
    AdaptiveKLController), after each step with mean per-sample KL e over n samples:

        β ← β · (1 + clip((e − target) / target, −0.2, 0.2) · n / horizon)
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    type: Literal["fixed", "adaptive"] = "fixed"
    """fixed β, or Ziegler et al.'s proportional controller toward ``target``."""
    target: float = Field(default=6.0, gt=0)
    """The KL per sample (nats, summed over its response tokens) the adaptive β aims at."""
    horizon: int = Field(default=10000, gt=0)
    """Samples over which the adaptive β closes the gap to ``target``."""


class RolloutCorrectionConfig(BaseModel):
    r"""Off-policy correction of π_old/π_rollout (trainer/losses/rollout_correction.py).

    The engine's sampler π_rollout is not the trainer's π_old. With δ_t = log π_old(a_t)
    − log π_rollout(a_t) over a sample's valid tokens, the weight w is

        token: w_t = exp(δ_t)    sequence: w_i = exp(Σ_t δ_t)    geometric: w_i = exp(mean_t δ_t)

    truncate: ℓ_t ← sg(min(w, high))·ℓ_t (TIS); mask: ℓ_t ← 1[low ≤ w ≤ high]·ℓ_t, a token
    (token level) or a whole sample (sequence, geometric) outside [low, high] gets weight 0
    (IcePop). importance_sampling's own ratio is π_θ/π_rollout: there π_old is π_θ."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    level: Literal["token", "sequence", "geometric"] = "token"
    """token: each token's ratio; sequence: the product over the sample's valid tokens
    (verl's rollout_corr sequence mode); geometric: its geometric mean (GSPO's)."""
    mode: Literal["truncate", "mask"] = "truncate"
    """truncate: multiply ℓ by min(w, high) (detached); mask: multiply ℓ by w where
    low ≤ w ≤ high and by 0 elsewhere (IcePop)."""
    low: float | None = Field(default=None, ge=0)
    """mode: mask only, the smallest weight kept; default 1 / high."""
    high: float = Field(default=2.0, gt=0)
    """truncate: the cap on w; mask: the largest weight kept."""

    @model_validator(mode="after")
    def _bounds(self) -> RolloutCorrectionConfig:
        if self.low is not None and self.mode != "mask":
            raise ValueError(f"low: only mode: mask takes a lower bound, but mode={self.mode}")
        if self.mode == "mask" and self.lower_bound >= self.high:
            raise ValueError(f"low: must be below high ({self.high:g}), got "
                             f"{self.lower_bound:g}")
        return self

    @property
    def lower_bound(self) -> float:
        """The smallest weight mode mask keeps (low, or 1 / high)."""
        return self.low if self.low is not None else 1.0 / self.high


PROXIMAL = "proximal"
"""`trainer.loss.old_log_probs` of decoupled PPO, resolved by LossConfig to `trainer`."""
PROXIMAL_POLICY_LOSSES = ("ppo", "gspo", "cispo")
"""The policy losses with an old (proximal) policy in their ratio."""
PROXIMAL_CORRECTION = {"level": "token", "mode": "truncate"}
"""The behaviour weight of `old_log_probs: proximal` when the user sets none: each token's
sg(min(π_prox/π_behav, high)) at RolloutCorrectionConfig's default high."""

GSPO_EPS_CLIP = (3e-4, 4e-4)
"""(eps_clip, eps_clip_high) of policy_loss: gspo when neither is set (the GSPO paper's)."""


class LossConfig(BaseModel):
    """The per-token loss terms and how each is aggregated."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    policy_loss: Literal["ppo", "gspo", "cispo", "importance_sampling", "cross_entropy",
                         "custom"] = "ppo"
    """The pg term's per-token loss (trainer/losses/, one file each): ppo (the clipped
    surrogate), gspo (PPO's clip on the sequence ratio exp(mean_t log π/π_old), GSPO's
    token form; eps_clip/eps_clip_high default 3e-4/4e-4), cispo (REINFORCE weighted by
    the detached ratio π/π_old truncated at 1 + eps_clip_high: every token keeps a
    gradient), importance_sampling (REINFORCE weighted by π/π_rollout, which
    rollout_correction truncates or masks), cross_entropy (−log π of the target: SFT,
    advantages unused, never corrected) or custom (your own class, `class_path`)."""
    class_path: str | None = None
    """With policy_loss: custom, `module:Class` of your policy loss, a subclass of
    trainer.losses.PolicyLoss (docs/extending.md); imported in the job only."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the custom policy loss's constructor (policy_loss: custom)."""
    eps_clip: float = Field(default=0.2, gt=0)
    """PPO/GSPO lower clip: the ratio is kept ≥ 1 − eps_clip (gspo's default 3e-4 when
    neither eps_clip nor eps_clip_high is set)."""
    eps_clip_high: float | None = Field(default=None, gt=0)
    """PPO/GSPO upper clip (DAPO's clip-higher), CISPO's truncation 1 + eps_clip_high;
    defaults to eps_clip (gspo's to 4e-4 when neither is set)."""
    dual_clip_c: float | None = Field(default=None, gt=1)
    """Dual-clip constant c > 1 bounding the loss for negative advantages (ppo); off when
    unset."""
    old_log_probs: Literal["trainer", "rollout", "proximal"] = "trainer"
    """Denominator of the PPO ratio: the trainer's own log-probs before the update, or the
    rollout engine's (then the ratio also absorbs engine/trainer mismatch); proximal:
    decoupled PPO (AReaL), the trainer's, each token weighted by sg(π_prox/π_behav) of
    its own behaviour log-prob (ppo, gspo, cispo; resolved to trainer with a token
    truncation unless rollout_correction or tis_cap says otherwise:
    trainer/losses/rollout_correction.py)."""
    tis_cap: float | None = Field(default=None, gt=0)
    """Truncated importance sampling, the legacy spelling of rollout_correction {level:
    token, mode: truncate, high: tis_cap}: weight each token by min(π_old/π_rollout, cap)."""
    rollout_correction: RolloutCorrectionConfig | None = None
    """Off-policy correction of the engine/trainer gap π_old/π_rollout per token, per
    sequence or by its geometric mean, truncated or masked (IcePop); off when unset
    (and tis_cap unset)."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Coefficient of the KL-to-reference loss term; 0 disables the reference model."""
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl", "k3+"] = "k3+"
    """KL estimator (Schulman's k1/k2/k3; low_var_kl is k3 clamped to [-10, 10]; k3+ is
    k3's value with k2's gradient). As a loss (kl_coef > 0) only k2 and k3+ descend
    KL(π‖ref): k1's expected gradient is 0, k3's is the forward KL's (trainer/losses/kl.py)."""
    allow_biased_kl_gradient: bool = False
    """Accept k3/low_var_kl as a loss term although its expected gradient is ∇KL(ref‖π),
    not ∇KL(π‖ref) (parity with DeepSeek-style GRPO recipes)."""
    kl_placement: Literal["loss", "reward"] = "loss"
    """Where the KL to the reference enters: ``loss``, a term of the objective with
    coefficient kl_coef (estimator kl_estimator); ``reward``, −β·k1 per token added to the
    token rewards before advantages, so GAE and the critic see it (β starts at kl_coef and
    follows kl_controller; kl_estimator does not apply there)."""
    kl_controller: KLControllerConfig = Field(default_factory=lambda: KLControllerConfig())
    """How β moves with kl_placement: reward (fixed, or Ziegler et al.'s adaptive rule)."""
    kl_aggregation: TermAggregationConfig | None = None
    """Aggregation of the KL term; defaults to the pg term's built-in mode and divisor."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Coefficient of the entropy bonus (subtracted from the loss)."""
    entropy_aggregation: TermAggregationConfig | None = None
    """Aggregation of the entropy term; defaults to the pg term's built-in mode and
    divisor."""

    @model_validator(mode="before")
    @classmethod
    def _gspo_clip_defaults(cls, data: object) -> object:
        """policy_loss: gspo clips a sequence ratio, whose spread is far smaller than a
        token's: the paper's ε_low = 3e-4, ε_high = 4e-4 unless the user set either."""
        if (isinstance(data, dict) and data.get("policy_loss") == "gspo"
                and "eps_clip" not in data and "eps_clip_high" not in data):
            low, high = GSPO_EPS_CLIP
            return {**data, "eps_clip": low, "eps_clip_high": high}
        return data

    @model_validator(mode="before")
    @classmethod
    def _proximal_is_decoupled_ppo(cls, data: object) -> object:
        """``old_log_probs: proximal`` is a recipe, resolved here: π_prox is what
        ``trainer`` already computes (the policy at the step's start) and the behaviour
        weight sg(π_prox/π_behav) per token is the rollout correction of π_old/π_rollout,
        so it is stored as ``trainer`` with the correction {level: token, mode: truncate}
        (rollout_correction's default cap) unless rollout_correction or tis_cap is set.
        The formula: trainer/losses/rollout_correction.py."""
        if not isinstance(data, dict) or data.get("old_log_probs") != PROXIMAL:
            return data
        policy_loss = data.get("policy_loss", "ppo")
        if policy_loss not in PROXIMAL_POLICY_LOSSES:
            raise ValueError(
                f"old_log_probs: proximal (decoupled PPO) needs a loss with an old policy "
                f"({', '.join(PROXIMAL_POLICY_LOSSES)}), but policy_loss={policy_loss}")
        correction, cap = data.get("rollout_correction"), data.get("tis_cap")
        if correction is None and cap is None:
            if "tis_cap" in data or "rollout_correction" in data:
                field = "tis_cap" if "tis_cap" in data else "rollout_correction"
                raise ValueError(
                    f"{field}: old_log_probs: proximal always weights each token by its "
                    "behaviour ratio π_prox/π_behav; set a cap (tis_cap) or a "
                    "rollout_correction, or old_log_probs: trainer for no weight")
            data = {**data, "rollout_correction": dict(PROXIMAL_CORRECTION)}
        return {**data, "old_log_probs": "trainer"}

    @model_validator(mode="after")
    def _one_rollout_correction(self) -> LossConfig:
        if self.tis_cap is not None and self.rollout_correction is not None:
            raise ValueError("rollout_correction: tis_cap is the legacy spelling of "
                             "rollout_correction {level: token, mode: truncate, high: "
                             f"{self.tis_cap:g}}}; set one of them")
        if self.dual_clip_c is not None and self.policy_loss in ("gspo", "cispo"):
            raise ValueError(f"dual_clip_c: only policy_loss: ppo has a dual clip, but "
                             f"policy_loss={self.policy_loss}")
        if self.rollout_correction is not None and self.policy_loss == "cross_entropy":
            raise ValueError("rollout_correction: policy_loss: cross_entropy (SFT) has no "
                             "behaviour policy to correct; remove rollout_correction")
        return self

    @property
    def correction(self) -> RolloutCorrectionConfig | None:
        """The off-policy correction in force: rollout_correction, or tis_cap's
        {level: token, mode: truncate, high: tis_cap}, or None."""
        if self.tis_cap is not None:
            return RolloutCorrectionConfig(level="token", mode="truncate", high=self.tis_cap)
        return self.rollout_correction

    @model_validator(mode="after")
    def _custom_policy_loss(self) -> LossConfig:
        custom = self.policy_loss == CUSTOM_POLICY_LOSS
        if custom and self.class_path is None:
            raise ValueError("class_path: policy_loss: custom needs class_path "
                             "('module:Class', a subclass of trainer.losses.PolicyLoss)")
        if not custom and self.class_path is not None:
            raise ValueError(f"class_path: names a custom policy loss, but policy_loss="
                             f"{self.policy_loss}; set policy_loss: custom or remove it")
        if not custom and self.kwargs:
            raise ValueError(f"kwargs: only a custom policy loss takes kwargs, but "
                             f"policy_loss={self.policy_loss}")
        if self.class_path is not None and not _REDUCER_PATH.match(self.class_path):
            raise ValueError(f"class_path: expected 'module:Class', got {self.class_path!r}")
        return self

    @model_validator(mode="after")
    def _kl_estimator_descends_reverse_kl(self) -> LossConfig:
        if self.kl_placement == "reward":
            if self.kl_coef == 0:
                raise ValueError("kl_coef: kl_placement: reward needs kl_coef > 0 (the "
                                 "initial β of the per-token reward −β·k1)")
            return self
        if self.kl_controller.type != "fixed":
            raise ValueError("kl_controller: an adaptive β moves the KL in the reward; set "
                             "kl_placement: reward or kl_controller.type: fixed")
        if self.kl_coef == 0 or self.kl_estimator in ("k2", "k3+"):
            return self
        if self.kl_estimator == "k1":
            raise ValueError("kl_estimator: k1 as a loss term (kl_coef > 0) has expected "
                             "gradient 0, no regularisation; use k3+ or k2")
        if not self.allow_biased_kl_gradient:
            raise ValueError(f"kl_estimator: {self.kl_estimator} as a loss term (kl_coef > 0) "
                             "has the expected gradient of the forward KL(ref‖π), not of "
                             "KL(π‖ref); use k3+ (its value, k2's gradient) or set "
                             "allow_biased_kl_gradient: true")
        return self


class OptimizerConfig(BaseModel):
    """Optimizer and learning-rate schedule."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    type: Literal["adamw", "sgd"] = "adamw"
    """AdamW for training; plain SGD makes gradient-scale bugs visible in the weights."""
    lr: float = Field(default=1e-5, gt=0)
    """Peak learning rate."""
    weight_decay: float = Field(default=0.0, ge=0)
    """Decoupled weight decay (AdamW)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = Field(default=1e-8, gt=0)
    """AdamW epsilon."""
    grad_clip: float | None = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this value; off when unset."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warm-up from 0 to lr over this many optimizer steps."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning rate after warm-up."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Floor of the cosine schedule as a fraction of lr."""


class WeightSyncConfig(BaseModel):
    """How the trained weights reach the rollout engines after each rollout step."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    bucket_mb: float = Field(default=256.0, gt=0, le=65536)
    """Size of one bucket in the engine's dtype: a rank gathers, casts and sends one bucket
    at a time, so it never holds more than its shard plus one bucket."""
    transport: Literal["auto", "in_process", "object_store", "disk", "nccl",
                       "cuda_ipc"] = "auto"
    """in_process: the colocated fast path, torch engines inside the trainer ranks'
    processes generating from the ranks' own weights (one rank, same dtype, synchronous:
    no copy at all; else one gather per sync, copied in place into the served weights when
    synchronous, into reused buffer sets with the async pipeline); object_store: Ray's
    object store (torch engine actors, any node); nccl: a broadcast from trainer rank 0
    to SGLang servers (update_weights_from_distributed); cuda_ipc: CUDA IPC handles to an
    SGLang server on rank 0's GPU (update_weights_from_tensor); disk: safetensors files an
    SGLang server reloads (the fallback). auto: for torch engines in_process when
    colocated with the FSDP trainer, else object_store; for SGLang, cuda_ipc when
    colocated, nccl with GPU trainer ranks, else disk."""


LORA_ALL_LINEAR = "all-linear"


class LoraConfig(BaseModel):
    """Low-rank adapters (LoRA, via peft) trained on a frozen base model.

    Each target module computes W x + (alpha / rank) · B A x, B starting at 0. Only A and
    B are trained (fp32 masters, AdamW state); the base stays frozen in the compute dtype
    and, with its adapters disabled, is the KL reference model."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    rank: int = Field(default=16, gt=0)
    """r: the adapters' inner dimension (A is [r, in], B is [out, r])."""
    alpha: float = Field(default=32.0, gt=0)
    """Scale numerator: the update is (alpha / rank) · B A."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training (0: the old and reference log-probs
    and the loss see the same function; verify-aggregation needs 0)."""
    target_modules: list[str] | Literal["all-linear"] = Field(default=LORA_ALL_LINEAR,
                                                              min_length=1)
    """Names (suffixes) of the Linear modules to adapt, e.g. [q_proj, v_proj]; all-linear:
    every Linear of the decoder but the output head."""


class TrainerConfig(BaseModel):
    """Trainer actors: backend, parallel layout, micro-batching, loss and optimizer."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    backend: Literal["fsdp", "megatron"] = "fsdp"
    """torch FSDP2 (default) or Megatron-core."""
    dp_size: int = Field(default=1, ge=1)
    """Data-parallel ranks (one Ray actor per DP × CP rank)."""
    cp_size: int = Field(default=1, ge=1)
    """Context-parallel ranks per sequence (Megatron's zigzag layout)."""
    tp_size: int = Field(default=1, ge=1)
    """Tensor-parallel ranks (Megatron backend only)."""
    num_cpus_per_rank: float = Field(default=1.0, gt=0)
    """Ray CPUs reserved for each trainer rank."""
    num_threads: int | None = Field(default=None, ge=1)
    """Torch intra-op threads per rank on CPU; None: the cores its phase has
    (services/placement.phase_threads)."""
    num_gpus_per_rank: float = Field(default=0.0, ge=0)
    """Ray GPUs per trainer rank; 0 trains on CPU with gloo."""
    resources: dict[str, float] = Field(default_factory=dict, max_length=32)
    """Extra Ray resources per rank bundle (e.g. a node label resource to pin placement)."""
    allow_cross_node: bool = False
    """Let the ranks' placement group straddle nodes (PACK); default keeps them on one
    node (STRICT_PACK)."""
    collective_timeout_s: float = Field(default=300.0, gt=0)
    """torch.distributed timeout: a rank waiting on a dead peer gives up after this."""
    call_timeout_s: float = Field(default=1800.0, gt=0)
    """The driver fails a trainer verb (a step, a checkpoint) that takes longer than this."""
    max_tokens_per_micro_batch: int = Field(default=4096, gt=0)
    """Token budget of one micro-batch, per DP rank: real tokens of a packed row (each
    sample rounded up to 2·cp), or padded tokens when not packing."""
    packing: bool = True
    """Pack each micro-batch's samples back to back into one row (attention never crosses
    a sample; no padding). Megatron packs only with TransformerEngine's THD rows (GPU,
    TE installed, bf16): elsewhere the default pads and says so, and an explicit true is
    refused naming this field. False pads every micro-batch to its longest sample."""
    shared_prefix: bool | None = None
    """Train each group's shared prompt once (arXiv 2506.05433): a packed row holds
    [prompt, response₁ … response_G], each response attending to the prompt and to itself,
    so J and ∇J are those of the unshared layout. None (default): on where it applies —
    FSDP, packing, cp_size 1, and groups whose prompt tokens are identical (others are
    packed as before). true insists (refused under CP, padding or Megatron)."""
    dtype: Literal["auto", "float32", "bfloat16", "float64"] = "auto"
    """Compute dtype of the forward and backward (auto: fp32 on CPU, bf16 on GPU).
    Parameters, reduced gradients and optimizer state stay fp32 whatever it is (fp64
    with float64, which `verify-aggregation` uses on FSDP); log-probs and the loss are
    computed from logits in fp32 or better."""
    loss: LossConfig = LossConfig()
    """Loss terms and their aggregation."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """Optimizer and schedule."""
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over each rollout (verl's ppo_epochs, TRL's num_iterations); each pass
    reshuffles the order of whole groups."""
    seed: int = 0
    """Seed of the trainer's RNG (and of the order of groups within a rollout)."""
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    """Weight sync to the rollout engines (buckets, transport)."""
    lora: LoraConfig | None = None
    """Train low-rank adapters instead of every weight (absent: full fine-tuning). The
    engines receive the adapters only; checkpoints hold the adapters and their optimizer
    state; `tally export` writes the adapter folder or the merged model."""

    @model_validator(mode="after")
    def _backend_layout(self) -> TrainerConfig:
        if self.backend == "fsdp" and self.tp_size != 1:
            raise ValueError("tp_size: tensor parallelism needs backend=megatron")
        if self.shared_prefix:
            if self.cp_size > 1:
                raise ValueError("shared_prefix: a shared prompt cannot be split across "
                                 f"context-parallel ranks (trainer.cp_size={self.cp_size}); "
                                 "set shared_prefix: false or cp_size: 1")
            if not self.packing:
                raise ValueError("shared_prefix: needs packed rows (trainer.packing: true)")
            if self.backend != "fsdp":
                raise ValueError("shared_prefix: backend=megatron packs only THD rows, which "
                                 "cannot share a prompt; set shared_prefix: false")
        if self.lora is not None:
            if self.backend != "fsdp":
                raise ValueError(f"lora: LoRA adapters are trained by backend=fsdp only "
                                 f"(trainer.backend={self.backend}); remove trainer.lora or "
                                 "set trainer.backend: fsdp")
            if self.weight_sync.transport in ("in_process", "nccl", "cuda_ipc"):
                raise ValueError(f"weight_sync.transport: {self.weight_sync.transport} sends "
                                 "whole weights; with trainer.lora the engines receive "
                                 "adapters (transport auto, object_store or disk)")
        return self

    @property
    def shares_prefix(self) -> bool:
        """Whether packed rows share each group's prompt (``shared_prefix`` resolved)."""
        if self.shared_prefix is not None:
            return self.shared_prefix
        return self.packing and self.cp_size == 1 and self.backend == "fsdp"

    @property
    def world_size(self) -> int:
        return self.dp_size * self.cp_size * self.tp_size

    @property
    def rank_bundle(self) -> dict[str, float]:
        """The Ray resources of one rank's placement bundle (a fresh dict: callers may
        change theirs); the trainer's own group and the job's placement both use it."""
        bundle = {"CPU": self.num_cpus_per_rank, **self.resources}
        if self.num_gpus_per_rank:
            bundle["GPU"] = self.num_gpus_per_rank
        return bundle


class ObjectiveConfig(BaseModel):
    """The step objective exactly as the trainer runs it, composed once from the job
    (``services/config/job.py``): every divisor is a number and the temperature is the one
    the rollout samples at."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    pg: AggregationConfig = AggregationConfig()
    """Aggregation of the pg term (the job's top-level `aggregation`)."""
    kl: TermAggregationConfig = TermAggregationConfig()
    """Aggregation of the KL term."""
    entropy: TermAggregationConfig = TermAggregationConfig()
    """Aggregation of the entropy term."""
    metric_divisor: float = Field(default=1.0, gt=0)
    """L of the logged `pg_loss/constant` when the pg term is not constant (the budget)."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature T: log-probs and entropy are taken of softmax(logits / T)."""
    gradient_of: GradientOf = "all"
    """Terms the backward takes: all (training), or one term with coefficient 1 (the
    verifier compares each term's gradient on its own)."""

    @property
    def mode_metric_divisor(self) -> float:
        """L of the per-mode metrics (`pg_loss/constant`, the length-bias view): the pg
        term's own divisor when it is constant, else `metric_divisor`."""
        return self.pg.numeric_divisor or self.metric_divisor

    @model_validator(mode="after")
    def _divisors_are_numbers(self) -> ObjectiveConfig:
        for name in POLICY_TERM_NAMES:
            if getattr(self, name).divisor == MAX_RESPONSE_LEN:
                raise ValueError(f"{name}.divisor: resolve 'max_response_len' to a number "
                                 "before building the objective")
        return self

    @classmethod
    def compose(cls, pg: AggregationConfig, loss: LossConfig, max_response_len: int,
                temperature: float) -> ObjectiveConfig:
        """Each term's aggregation (KL and entropy default to the pg mode) with
        `max_response_len` resolved against the rollout's budget, once."""

        def built_in(term: TermAggregationConfig | None) -> TermAggregationConfig:
            if term is None:
                term = TermAggregationConfig(mode=pg.mode, divisor=pg.divisor)
            return term.resolved(max_response_len)

        return cls(pg=pg.resolved(max_response_len), kl=built_in(loss.kl_aggregation),
                   entropy=built_in(loss.entropy_aggregation),
                   metric_divisor=float(max_response_len), temperature=temperature)


class CriticConfig(BaseModel):
    """PPO's learned value model (trainer/backends/fsdp/critic.py): a trainer group of its
    own in the job's gang whose values become per-token advantages through GAE
    (``rollout.advantage.type: gae``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    enabled: bool = False
    """Train a critic beside the policy (needs rollout.advantage.type: gae)."""
    # The path mark of rollout/config_paths.py, spelled out: the trainer does not import
    # rollout (ARCHITECTURE.md), and the controller confines every field marked so.
    model: str | None = Field(default=None, json_schema_extra={"x-tally-path": "model"})
    """As ``rollout.model`` (a local Hugging Face folder, ``tiny``, ``smollm2-135m-instruct``);
    None: the policy's model, its decoder with a fresh scalar value head. A folder saved
    from a critic keeps its head. Its tokenizer must be the policy's (the tokens are
    shared)."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """The critic's optimizer and schedule (its own: critics usually take a larger lr)."""
    value_clip: float | None = Field(default=0.2, gt=0)
    """ε of the clipped value loss: V may move at most ε from its value at the rollout
    before the clipped branch takes over (null: the plain squared error)."""
    dp_size: int | None = Field(default=None, ge=1)
    """Data-parallel ranks of the critic; None: the policy's trainer.dp_size."""
    cp_size: int | None = Field(default=None, ge=1)
    """Context-parallel ranks of the critic; None: the policy's trainer.cp_size."""
    warmup_steps: int = Field(default=0, ge=0)
    """The first this many rollout steps train the critic only (the policy waits for
    values worth following); with ``warmup_until_explained_variance``, at most this many
    (0: no bound)."""
    warmup_until_explained_variance: float | None = Field(default=None, le=1.0,
                                                          allow_inf_nan=False)
    """The policy waits (critic-only rollout steps) until a rollout's logged
    ``critic/explained_variance`` reaches this, then trains from that rollout on for
    good; ``warmup_steps`` > 0 bounds the wait. None: ``warmup_steps`` alone decides."""
    aggregation: AggregationMode | None = None
    """How the value loss of a step is aggregated; None: the job's aggregation.mode."""
    custom_reducer: str | None = None
    """The critic's own `module:function` returning per-token weights of the value loss
    (as aggregation.custom_reducer does for pg); None: ``aggregation``'s mode. The
    policy's aggregation.custom_reducer never reaches the critic."""

    @model_validator(mode="after")
    def _critic_reducer_path(self) -> CriticConfig:
        if self.custom_reducer is not None and not _REDUCER_PATH.match(self.custom_reducer):
            raise ValueError(
                f"custom_reducer: expected 'module:function', got {self.custom_reducer!r}")
        return self

    def trainer_config(self, policy: TrainerConfig) -> TrainerConfig:
        """The critic group's trainer config: the policy's layout defaults, devices,
        micro-batching and timeouts, its own optimizer, no LoRA, no KL or entropy."""
        data = policy.model_dump()
        data.update(dp_size=self.dp_size or policy.dp_size,
                    cp_size=self.cp_size or policy.cp_size, tp_size=1, lora=None,
                    loss=LossConfig().model_dump(), optimizer=self.optimizer.model_dump())
        if data["cp_size"] > 1 and policy.shared_prefix:
            data["shared_prefix"] = None
        return TrainerConfig.model_validate(data)

    def aggregation_config(self, job: AggregationConfig) -> AggregationConfig:
        """The value loss's aggregation: the job's mode, or ``aggregation``'s (constant
        divides by max_response_len), with the critic's own ``custom_reducer`` — never
        the job's."""
        if self.aggregation is None or self.aggregation == job.mode:
            return job.model_copy(update={"custom_reducer": self.custom_reducer})
        return AggregationConfig(mode=self.aggregation, divisor=MAX_RESPONSE_LEN
                                 if self.aggregation == "constant" else None,
                                 custom_reducer=self.custom_reducer)
