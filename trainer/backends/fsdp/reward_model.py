"""One FSDP2 rank of a reward model being trained (``tally train-rm``): the score head on
``FSDPRank`` (backends/fsdp/rank.py: process group, sharding, attention, optimizer,
schedule) around an
``AutoModelForSequenceClassification`` with one label, trained on preference pairs.

The model is the base causal LM's decoder and a fresh ``score`` head (bias-free Linear,
hidden → 1, initialised by the seed set before it is built), with ``pad_token_id`` in
its config, exactly what ``AutoModelForSequenceClassification.from_pretrained`` builds.
transformers' own forward pools the head's output at one position per row; to score
packed rows the rank runs the same decoder and head and reads every sequence's last
token itself (:func:`token_scores`): the same number, r(x) of rollout/reward_text.py.

Verbs: ``pair_train_step`` (the Bradley–Terry loss of trainer/bradley_terry.py, with each
pair's margin and the centring term c · mean (r⁺ + r⁻)² over the step's pairs,
backpropagated, gradients summed over DP, one optimizer step), ``pair_scores`` (every
sequence's score, no update), ``pair_gradients`` (tests: the summed gradients) and
``save_reward_model`` (a Hugging Face folder).
"""

from __future__ import annotations

import copy
import time
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from trainer.aggregation import sum_reduction_factor
from trainer.backends.fsdp import model as fsdp
from trainer.backends.fsdp.rank import FSDPRank
from trainer.bradley_terry import PAIR_SUMS, pair_metrics, pair_objective
from trainer.config import ObjectiveConfig, TrainerConfig
from trainer.memory import PeakMemory, phase_metrics
from trainer.pair_batch import PairBatch, PairMicroBatch, PairPlan, slice_pairs
from trainer.rank import master_dtype
from trainer.worker import in_eval_mode

WEIGHTS_FILE = "model.safetensors"


def load_reward_model(model_path: str, compute_dtype: torch.dtype, device: torch.device,
                      pad_token_id: int) -> Any:
    """``AutoModelForSequenceClassification`` with one label from a local folder (a causal
    LM's: its decoder and a fresh head; a reward model's: its own head), master-weight
    dtype, ``pad_token_id`` set (the id transformers pools by)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(model_path, num_labels=1)
    config.pad_token_id = pad_token_id
    model = AutoModelForSequenceClassification.from_pretrained(
        model_path, config=config, dtype=master_dtype(compute_dtype))
    model.config.use_cache = False
    if compute_dtype == torch.float64:
        fsdp.keep_norms_in_float64(model)
    return model.to(device)


def token_scores(self: Any, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 **kwargs: Any) -> torch.Tensor:
    """[b, s, 1]: the score head at every position — the tensor transformers'
    ``*ForSequenceClassification.forward`` computes before pooling one position per row.
    Installed as the model's own forward, so FSDP's root hooks (gathering the embeddings,
    the final norm and the head) run around it."""
    decoder = getattr(self, self.base_model_prefix)
    hidden = decoder(input_ids=input_ids, position_ids=position_ids, **kwargs)
    return self.score(hidden.last_hidden_state)


class FSDPRewardModelWorker(FSDPRank):
    """A reward-model rank: ``FSDPRank`` with a one-label sequence classifier and the
    Bradley–Terry loss on whole pairs; its verbs are the pair verbs only."""

    def __init__(self, config: TrainerConfig, objective: ObjectiveConfig, model_path: str,
                 rank: int, total_steps: int, pad_token_id: int = 0,
                 center_rewards_coefficient: float = 0.0) -> None:
        if config.lora is not None or config.loss.kl_coef > 0 or config.cp_size != 1:
            raise ValueError("reward model: its trainer config has no LoRA, no KL term and "
                             "cp_size 1")
        super().__init__(config, objective, model_path, rank, total_steps)
        self.pad_token_id = pad_token_id
        self.center_rewards_coefficient = center_rewards_coefficient
        """c of the centring term (trainer/bradley_terry.py)."""

    def _build(self) -> torch.nn.Module:
        model = load_reward_model(self.model_path, self.compute_dtype, self.device,
                                  self.pad_token_id)
        self.architecture = type(model).__name__  # before FSDP renames the class
        self.attention = fsdp.configure_attention(model, self.config, self.compute_dtype)
        model.forward = types.MethodType(token_scores, model)
        return fsdp.shard_model(model, self.compute_dtype, self.config.world_size)

    def _scores(self, micro: PairMicroBatch) -> torch.Tensor:
        """Each sequence's score [2k] (chosen₀, rejected₀, …), float32 or better. The
        micro-batch has the rows ``_forward`` reads (input_ids, position_ids, layout)."""
        out = self._forward(self.model, micro)  # type: ignore[arg-type]
        scores = out[micro.score_rows, micro.score_cols, 0]
        return scores if scores.dtype == torch.float64 else scores.float()

    def _pair_sums(self, batch: PairBatch, plan: PairPlan, backward: bool) -> torch.Tensor:
        """PAIR_SUMS over every rank's pairs; with ``backward`` each micro-batch's
        w · Σ ℓ_p backpropagated (gradients summed over DP); ℓ_p holds the pair's margin
        and the centring term, both divided by the step's P (never this rank's count)."""
        scale = sum_reduction_factor(self.config.world_size)  # FSDP averages; we SUM
        totals = torch.zeros(len(PAIR_SUMS), dtype=torch.float64)
        for pairs in plan.micro_batches[self.dp_rank]:
            micro = slice_pairs(batch, pairs, plan.packed).to(self.device)
            scores = self._scores(micro)
            objective, sums = pair_objective(scores[0::2], scores[1::2], plan.num_pairs,
                                             micro.weight, micro.margin,
                                             self.center_rewards_coefficient)
            if backward:
                (objective * scale).backward()
            totals += sums.cpu()
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # every pair is on one rank
        return totals

    def pair_train_step(self, batch: PairBatch, plan: PairPlan) -> dict[str, float]:
        """Collective: one optimizer step on ``plan``'s pairs; the step's exact metrics
        (loss, accuracy, margin, mean scores), grad norm, lr, this rank's compute time and
        peak memory."""
        started = time.perf_counter()
        self.model.train()
        with PeakMemory(self.device) as peak:
            sums = self._pair_sums(batch, plan, backward=True)
            step = self.optimizer_step()
        return {**pair_metrics(sums, plan.num_pairs), **step,
                "perf/compute_s": time.perf_counter() - started,
                **phase_metrics("train", peak)}

    @torch.no_grad()
    @in_eval_mode
    def pair_scores(self, batch: PairBatch, plan: PairPlan) -> torch.Tensor | None:
        """Collective, no update: the score of every sequence [2P] (float64), on rank 0."""
        out = torch.zeros(2 * batch.num_pairs, dtype=torch.float64)
        for pairs in plan.micro_batches[self.dp_rank]:
            # an empty micro-batch runs too: FSDP's collectives stay in step
            scores = self._scores(slice_pairs(batch, pairs, plan.packed).to(self.device))
            index = torch.tensor([s for p in pairs for s in (2 * p, 2 * p + 1)],
                                 dtype=torch.int64)
            out[index] = scores[:len(index)].double().cpu()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)  # each sequence scored by one rank
        return out if self.rank == 0 else None

    def pair_gradients(self, batch: PairBatch, plan: PairPlan
                       ) -> tuple[dict[str, float], dict[str, torch.Tensor] | None]:
        """Collective, no update: the step's metrics and, on rank 0, every parameter's
        gradient summed over DP (float64, by Hugging Face name); gradients zeroed after."""
        self.model.train()
        sums = self._pair_sums(batch, plan, backward=True)
        return pair_metrics(sums, plan.num_pairs), self._summed_gradients()

    def save_reward_model(self, path: str) -> None:
        """Collective: rank 0 writes the weights (float32 safetensors, Hugging Face names)
        and config.json (the sequence classifier's architecture, one label,
        ``pad_token_id``) into ``path``; the tokenizer is the caller's to add."""
        state = fsdp.export_full_state_dict(self.model)
        if self.rank == 0:
            folder = Path(path)
            folder.mkdir(parents=True, exist_ok=True)
            weights = folder / WEIGHTS_FILE
            save_file({name: t.float().contiguous() for name, t in state.items()},
                      str(weights), metadata={"format": "pt"})
            weights.chmod(0o644)  # safetensors writes 0600: others may serve the folder
            config = copy.deepcopy(self.model.config)
            config.architectures = [self.architecture]
            config.use_cache, config.dtype = True, "float32"
            config.save_pretrained(str(folder))
        dist.barrier()
