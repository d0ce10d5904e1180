"""TorchEngine: a HF causal LM in-process, decoded by our own batched KV-cache loop.

Why our own loop rather than ``model.generate``: it reports the exact log-prob of every
sampled token under the convention of engines/base.py, applies our stop rules, and drops
finished rows from the batch (and the KV cache) so short answers stop costing compute.

Prompts of one chunk are left-padded; position ids count real tokens only
(cumsum(mask) − 1), so a padded row computes the same logits as the row alone. A
response ends after EOS or a stop string (both kept: they were sampled), or after
``max_new_tokens`` tokens. Stop strings are matched on the decoded text of the last
tokens, not on token ids: a BPE model spells a string with many token sequences (" apples"
is one token, "apples" another), and any of them ends the response.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DynamicCache

from rollout.config import SamplingConfig, TorchEngineConfig
from rollout.engines.base import Engine, Generation, as_tensors
from rollout.engines.sampling import sample_next_tokens
from rollout.tokenizer import eos_token_ids, load_tokenizer


class TorchEngine(Engine):
    """Samples from a local HF checkpoint with torch; one instance per Ray actor."""

    def __init__(
        self,
        config: TorchEngineConfig,
        model_path: str,
        tokenizer_path: str | None = None,
        rank: int = 0,
    ) -> None:
        torch.set_num_threads(config.num_threads or 1)  # the driver resolves None per phase
        self.config = config
        self.rank = rank
        self.device = torch.device(config.device)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, config.dtype)
        ).to(self.device)
        self.model.eval()
        self.model.requires_grad_(False)
        self.tokenizer = load_tokenizer(tokenizer_path or model_path)
        self.eos_ids = eos_token_ids(self.tokenizer, self.model.generation_config.eos_token_id)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.eos_ids[0])
        self.weight_version = 0

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
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, seed: int
    ) -> list[Generation]:
        """One response per prompt, decoded `batch_size` prompts at a time."""
        if any(not p for p in prompt_ids):
            raise ValueError("prompt_ids: every prompt needs at least one token")
        generator = torch.Generator(device=self.device).manual_seed(seed)
        stops = list(sampling.stop)
        out: list[Generation] = []
        size = self.config.batch_size
        for start in range(0, len(prompt_ids), size):
            out.extend(
                self._generate_chunk(prompt_ids[start : start + size], sampling, stops, generator)
            )
        return out

    def _generate_chunk(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        stops: list[str],
        generator: torch.Generator,
    ) -> list[Generation]:
        num_rows, width = len(prompts), max(len(p) for p in prompts)
        input_ids_BL = torch.full((num_rows, width), self.pad_id, dtype=torch.long)
        mask_BL = torch.zeros((num_rows, width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            input_ids_BL[i, width - len(prompt) :] = torch.tensor(prompt)
            mask_BL[i, width - len(prompt) :] = 1
        input_ids_BL, mask_BL = input_ids_BL.to(self.device), mask_BL.to(self.device)
        positions_BL = (mask_BL.cumsum(-1) - 1).clamp(min=0)

        tokens: list[list[int]] = [[] for _ in prompts]
        log_probs: list[list[float]] = [[] for _ in prompts]
        finish: list[str] = ["length"] * num_rows
        active = list(range(num_rows))  # chunk rows still decoding, in cache order
        cache = DynamicCache(config=self.model.config)
        logits_BV = self.model(
            input_ids=input_ids_BL,
            attention_mask=mask_BL,
            position_ids=positions_BL,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        next_positions_B = positions_BL[:, -1]
        for step in range(sampling.max_new_tokens):
            next_B, next_log_probs_B = sample_next_tokens(logits_BV, sampling, generator)
            keep: list[int] = []
            for slot, (row, token, lp) in enumerate(
                zip(active, next_B.tolist(), next_log_probs_B.tolist(), strict=True)
            ):
                tokens[row].append(token)
                log_probs[row].append(lp)
                if token in self.eos_ids or self._ends_with_stop(tokens[row], stops):
                    finish[row] = "stop"
                else:
                    keep.append(slot)
            if not keep or step + 1 == sampling.max_new_tokens:
                break
            if len(keep) < len(active):
                # Drop finished rows everywhere, so they cost nothing from here on.
                index_K = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index_K)
                next_B, mask_BL = next_B[index_K], mask_BL[index_K]
                next_positions_B = next_positions_B[index_K]
                active = [active[slot] for slot in keep]
            mask_BL = torch.cat([mask_BL, mask_BL.new_ones((len(active), 1))], dim=1)
            next_positions_B = next_positions_B + 1
            logits_BV = self.model(
                input_ids=next_B[:, None],
                attention_mask=mask_BL,
                position_ids=next_positions_B[:, None],
                cache=cache,
                use_cache=True,
            ).logits[:, -1]
        return [
            Generation(tokens[i], log_probs[i], finish[i])  # type: ignore[arg-type]
            for i in range(num_rows)
        ]

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
        self.weight_version += 1

    def update_weights_from_disk(self, path: str) -> None:
        """Load every *.safetensors file of a checkpoint directory."""
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"update_weights_from_disk: no *.safetensors in {path}")
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file)))
        self.update_weights(state)
