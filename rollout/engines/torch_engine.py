"""TorchEngine: a HF causal LM in-process, decoded by our own batched KV-cache loop.

Why our own loop rather than ``model.generate``: it reports the exact log-prob of every
sampled token under the convention of engines/base.py, applies our stop rules, and drops
finished rows from the batch (and the KV cache) so short answers stop costing compute.

Prompts of one chunk are left-padded; position ids count real tokens only
(cumsum(mask) − 1), so a padded row computes the same logits as the row alone. The
distinct prompts of a chunk are prefilled once each (a group's G samples share theirs)
and their KV-cache rows repeated; each step keeps tokens and log-probs on the device. A
call that plays an environment turn (``EpisodeTurn``) prefills each context only past the
longest prefix whose KV an earlier turn kept (prefix_cache.py; layout in kv_rows.py), and
keeps each response's KV for the next turn. A
response ends after EOS or a stop string (both kept: they were sampled), or after
``max_new_tokens`` tokens. Stop strings are matched on the decoded text of the last
tokens, not on token ids: a BPE model spells a string with many token sequences (" apples"
is one token, "apples" another), and any of them ends the response.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DynamicCache

from rollout.adapters import EngineAdapters, adapter_factors, is_adapter_sync
from rollout.config import SamplingConfig, TorchEngineConfig
from rollout.engines.base import Engine, EpisodeTurn, Generation, as_tensors
from rollout.engines.kv_rows import merged, plain_layers, prefill_groups, read_rows, seeded_cache
from rollout.engines.prefix_cache import KeptKV, LayerKV, PrefixCache
from rollout.engines.sampling import sample_next_tokens
from rollout.tokenizer import eos_token_ids, load_tokenizer
from rollout.weight_bucket import WeightBucket, check_buckets, iter_tensors, resolve


@dataclass
class PrefillStats:
    """What this engine's prefills cost, summed over its calls."""

    num_prefilled_tokens: int = 0
    """Context tokens run through the model before decoding (padding not counted)."""
    num_kept_tokens: int = 0
    """Context tokens whose KV the prefix cache held instead."""


class TorchEngine(Engine):
    """Samples from a local HF checkpoint with torch; one instance per Ray actor."""

    def __init__(
        self,
        config: TorchEngineConfig,
        model_path: str,
        tokenizer_path: str | None = None,
        rank: int = 0,
        model: torch.nn.Module | None = None,
    ) -> None:
        """``model``: decode this module (already on its device) instead of loading one
        from ``model_path``, leaving the process's threads alone: the colocated fast path
        (services/driver/colocated_engine.py) serves a trainer rank's own weights through it."""
        if model is None:
            torch.set_num_threads(config.num_threads or 1)  # the driver resolves None
            model = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=getattr(torch, config.dtype)).to(torch.device(config.device))
        self.config = config
        self.rank = rank
        self.model = model
        self.device = next(model.parameters()).device
        self.model.eval()
        self.model.requires_grad_(False)
        self.tokenizer = load_tokenizer(tokenizer_path or model_path)
        self.eos_ids = eos_token_ids(self.tokenizer, self.model.generation_config.eos_token_id)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.eos_ids[0])
        self.weight_version = 0
        self.adapters = EngineAdapters(self.model)
        """LoRA adapters served on top of the weights (trainer.lora; none until a sync)."""
        self.prefix_cache = PrefixCache(config.prefix_cache_mb * 2**20)
        """Episodes' KV between their turns (rollout/engines/prefix_cache.py)."""
        self.keeps_kv = self.prefix_cache.enabled and plain_layers(self.model.config)
        self.stats = PrefillStats()

    def _ends_with_stop(self, tokens: list[int], stops: list[str]) -> bool:
        """Whether a stop string ends in the last token. The tail decoded is long enough
        to hold the longest stop whatever the tokenization (a token is at least one
        character, a multi-byte character at most four byte tokens). Special tokens are
        not text (as in SGLang and vLLM): ``<bos>`` never matches the stop "o"."""
        if not stops:
            return False
        window = 4 * max(len(s) for s in stops) + 1
        tail = self.tokenizer.decode(tokens[-window:], skip_special_tokens=True)
        before = self.tokenizer.decode(tokens[-window:-1], skip_special_tokens=True)
        return any(s in tail and s not in before for s in stops)

    @torch.inference_mode()
    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, seed: int,
        turn: EpisodeTurn | None = None,
    ) -> list[Generation]:
        """One response per prompt, decoded `batch_size` prompts at a time. ``turn``: the
        prompts are episodes' contexts, prefilled past what the prefix cache kept of them;
        each response's KV is kept for the next turn (unless ``turn.last``)."""
        if any(not p for p in prompt_ids):
            raise ValueError("prompt_ids: every prompt needs at least one token")
        if turn is not None and self.keeps_kv:
            self.prefix_cache.begin_turn(turn.episodes, turn.turn, self.weight_version)
        else:
            turn = None  # nothing kept: every context prefilled whole, as without a cache
        generator = torch.Generator(device=self.device).manual_seed(seed)
        stops = list(sampling.stop)
        out: list[Generation] = []
        size = self.config.batch_size
        for start in range(0, len(prompt_ids), size):
            out.extend(self._generate_chunk(prompt_ids[start : start + size], sampling, stops,
                                            generator, turn))
        return out

    @staticmethod
    def _distinct(prompts: list[list[int]]) -> tuple[list[tuple[int, ...]], list[int]]:
        """(a chunk's distinct prompts, each row's among them). A group's G samples share
        their prompt: its prefill is computed once and its KV cache rows repeated
        (SmolLM2, 8 prompts × 4: a quarter of the prefill work)."""
        unique = list(dict.fromkeys(tuple(p) for p in prompts))
        first_row = {prompt: i for i, prompt in enumerate(unique)}
        return unique, [first_row[tuple(p)] for p in prompts]

    def _prefill(self, unique: list[tuple[int, ...]], reuse: bool, max_new: int
                 ) -> tuple[torch.Tensor, DynamicCache, torch.Tensor, torch.Tensor]:
        """(last logits [U, V], the batch cache with room for ``max_new`` tokens, its
        mask [U, L], each context's row in them [U]) for distinct contexts, each
        prefilled past its longest kept prefix (``reuse``) and at least its last token
        (whose logits start the response)."""
        matches = (self.prefix_cache.longest(unique) if reuse
                   else [(0, None)] * len(unique))
        kept = [min(n, len(context) - 1) for (n, _), context in zip(matches, unique,
                                                                   strict=True)]
        suffixes = [len(context) - n for context, n in zip(unique, kept, strict=True)]
        self.stats.num_prefilled_tokens += sum(suffixes)
        self.stats.num_kept_tokens += sum(kept)
        groups = prefill_groups(suffixes) if reuse else [list(range(len(unique)))]
        parts = [self._prefill_group([unique[i] for i in group], [kept[i] for i in group],
                                     [matches[i][1] for i in group], max_new)
                 for group in groups]
        if reuse:
            self.prefix_cache.take(matches)  # copied into the batch; their episodes move on
        order = [i for group in groups for i in group]
        row_U = torch.empty(len(unique), dtype=torch.long)
        row_U[torch.tensor(order)] = torch.arange(len(unique))
        if len(parts) == 1:
            logits_UV, cache, mask_UL = parts[0]
        else:
            cache, mask_UL = merged(self.model.config, [c for _, c, _ in parts],
                                    [m for _, _, m in parts], max_new)
            logits_UV = torch.cat([logits for logits, _, _ in parts])
        return logits_UV, cache, mask_UL, row_U.to(self.device)

    def _prefill_group(self, contexts: list[tuple[int, ...]], kept: list[int],
                       entries: list[KeptKV | None], max_new: int
                       ) -> tuple[torch.Tensor, DynamicCache, torch.Tensor]:
        """One forward over contexts' tokens past their kept prefixes (kv_rows layout)."""
        kept_width = max(kept)
        width = max(len(c) - n for c, n in zip(contexts, kept, strict=True))
        input_ids_GS = torch.full((len(contexts), width), self.pad_id, dtype=torch.long)
        mask_GL = torch.zeros((len(contexts), kept_width + width), dtype=torch.long)
        for i, (context, n) in enumerate(zip(contexts, kept, strict=True)):
            suffix = context[n:]
            input_ids_GS[i, width - len(suffix):] = torch.tensor(suffix)
            mask_GL[i, kept_width - n : kept_width] = 1
            mask_GL[i, kept_width + width - len(suffix):] = 1
        input_ids_GS, mask_GL = input_ids_GS.to(self.device), mask_GL.to(self.device)
        positions_GS = (mask_GL.cumsum(-1) - 1).clamp(min=0)[:, kept_width:]
        cache = seeded_cache(self.model.config, [
            (None if entry is None else entry.layers, n)
            for entry, n in zip(entries, kept, strict=True)], kept_width, width + max_new)
        logits_GV = self.model(
            input_ids=input_ids_GS,
            attention_mask=mask_GL,
            position_ids=positions_GS,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        return logits_GV, cache, mask_GL

    def _generate_chunk(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        stops: list[str],
        generator: torch.Generator,
        turn: EpisodeTurn | None,
    ) -> list[Generation]:
        unique, prompt_rows = self._distinct(prompts)
        prompt_B = torch.tensor(prompt_rows, device=self.device)
        num_rows = len(prompts)
        logits_UV, cache, mask_UL, row_U = self._prefill(unique, turn is not None,
                                                         sampling.max_new_tokens)
        row_prompt_B = row_U[prompt_B]  # each row's context in the prefill's order
        if not torch.equal(row_prompt_B, torch.arange(num_rows, device=self.device)):
            cache.batch_select_indices(row_prompt_B)  # repeated rows: copies, then apart
        keep = turn is not None and not turn.last
        kept_B: dict[int, LayerKV] = {}  # each row's KV once it has ended (``keep``)

        # Every row's tokens and log-probs stay on the device until the end: a step costs
        # no Python per row (only stop strings need a row's text).
        max_new = sampling.max_new_tokens
        tokens_BT = torch.zeros((num_rows, max_new), dtype=torch.long, device=self.device)
        log_probs_BT = torch.zeros((num_rows, max_new), dtype=torch.float32, device=self.device)
        lengths_B = torch.zeros(num_rows, dtype=torch.long, device=self.device)
        stopped_B = torch.zeros(num_rows, dtype=torch.bool, device=self.device)
        active_A = torch.arange(num_rows, device=self.device)  # rows still decoding
        eos_E = torch.tensor(self.eos_ids, device=self.device)
        logits_AV, mask_BL = logits_UV[row_prompt_B], mask_UL[row_prompt_B]
        next_positions_A = mask_BL.sum(-1) - 1
        for step in range(max_new):
            next_A, next_log_probs_A = sample_next_tokens(logits_AV, sampling, generator)
            tokens_BT[active_A, step] = next_A
            log_probs_BT[active_A, step] = next_log_probs_A.float()
            lengths_B[active_A] += 1
            ends_A = torch.isin(next_A, eos_E)
            if stops:
                ends_A |= self._stop_string_ends(tokens_BT, active_A, ends_A, step, stops)
            stopped_B[active_A[ends_A]] = True
            keep_K = (~ends_A).nonzero().flatten()
            done = keep_K.numel() == 0 or step + 1 == max_new
            if keep and (done or keep_K.numel() < active_A.numel()):
                # The cache holds context + response[:-1] of an ending row: kept as is.
                ending = range(active_A.numel()) if done else ends_A.nonzero().flatten().tolist()
                rows = active_A.tolist()
                kept_B.update(zip([rows[a] for a in ending],
                                  read_rows(cache, mask_BL, list(ending)), strict=True))
            if done:
                break
            if keep_K.numel() < active_A.numel():
                # Drop finished rows everywhere, so they cost nothing from here on.
                cache.batch_select_indices(keep_K)
                next_A, mask_BL = next_A[keep_K], mask_BL[keep_K]
                next_positions_A, active_A = next_positions_A[keep_K], active_A[keep_K]
            mask_BL = torch.cat([mask_BL, mask_BL.new_ones((active_A.numel(), 1))], dim=1)
            next_positions_A = next_positions_A + 1
            logits_AV = self.model(
                input_ids=next_A[:, None],
                attention_mask=mask_BL,
                position_ids=next_positions_A[:, None],
                cache=cache,
                use_cache=True,
            ).logits[:, -1]
        tokens, log_probs = tokens_BT.tolist(), log_probs_BT.tolist()
        out = [
            Generation(tokens[i][:n], log_probs[i][:n], "stop" if stop else "length")
            for i, (n, stop) in enumerate(zip(lengths_B.tolist(), stopped_B.tolist(),
                                              strict=True))
        ]
        if keep:
            assert turn is not None
            for row, layers in kept_B.items():
                context = tuple(prompts[row])
                assert layers[0][0].shape[1] == len(context) + len(out[row].token_ids) - 1
                self.prefix_cache.put(KeptKV(context + tuple(out[row].token_ids[:-1]), layers,
                                             turn.episodes, turn.turn, len(context)))
        return out

    def _stop_string_ends(self, tokens_BT: torch.Tensor, active_A: torch.Tensor,
                          ends_A: torch.Tensor, step: int, stops: list[str]) -> torch.Tensor:
        """Which active rows a stop string ends at this step (rows ending on EOS skipped)."""
        window = 4 * max(len(s) for s in stops) + 1
        tails = tokens_BT[active_A, max(0, step + 1 - window):step + 1].tolist()
        return torch.tensor([not ended and self._ends_with_stop(tail, stops)
                             for tail, ended in zip(tails, ends_A.tolist(), strict=True)],
                            dtype=torch.bool, device=ends_A.device)

    @torch.no_grad()
    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy new weights in place (same names and shapes as the model's state_dict)."""
        own = self.model.state_dict()  # tied weights appear under both names; either works
        state_dict = as_tensors(state_dict)  # numpy views of Ray's shared memory, in place
        unknown = sorted(set(state_dict) - set(own))
        if unknown:
            raise KeyError(f"update_weights: unknown parameter names {unknown[:5]}")
        for name, tensor in state_dict.items():
            if own[name].shape != tensor.shape:
                raise ValueError(
                    f"update_weights: {name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(own[name].shape)}"
                )
            own[name].copy_(tensor)
        self.prefix_cache.clear()  # KV of the old weights
        self.weight_version += 1

    @torch.no_grad()
    def load_weight_buckets(self, buckets: Sequence[WeightBucket | Any], version: int) -> None:
        """Every bucket mapped in place from the object store and checked (names,
        shapes, sizes) before any weight is copied, so a bad version leaves the old one
        serving; then each tensor copied and cast to the engine's dtype. A sync of LoRA
        adapters (rollout/adapters.py) swaps in the new factors, leaving the weights."""
        buckets = resolve(buckets)
        if is_adapter_sync([spec.name for bucket in buckets for spec in bucket.specs]):
            self.adapters.load(adapter_factors(buckets))  # checked whole, then swapped
            self.prefix_cache.clear()  # KV of the old adapters
            self.weight_version = version
            return
        own = self.model.state_dict()  # tied weights appear under both names; either works
        check_buckets(buckets, {name: tuple(t.shape) for name, t in own.items()})
        self.prefix_cache.clear()  # from the first copy on, kept KV is of no weights served
        for name, tensor in iter_tensors(buckets):
            own[name].copy_(tensor)
        self.weight_version = version

    def update_weights_from_disk(self, path: str) -> None:
        """Load every *.safetensors file of a checkpoint directory."""
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"update_weights_from_disk: no *.safetensors in {path}")
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file)))
        self.update_weights(state)
