"""A packed shared-prefix step on one GPU in bf16 through the kernel the trainer picks
there (``configure_attention``: FlexAttention for a shared prefix; flash varlen or
FlexAttention without one) against the fp32 CPU reference (each sample alone through
Hugging Face's own attention): log-probs and gradients close, and the step's tokens/s
and peak memory with and without the shared prefix, into run.sh's table.

The model is a random GQA Qwen2 from a config (no download) whose upper half slides a
256-token window over rows of ~2k tokens, so the window's mask is exercised too. Under
``TALLY_GPU_CHECKS_ON=cpu`` the same code runs on the CPU in fp32 (the trainer's CPU
kernel; FlexAttention has no backward there), which is how it is checked off a GPU."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rollout.batch import RolloutBatch
from tests.gpu.needs import DEVICE, needs
from trainer.config import AggregationConfig, LossConfig, ObjectiveConfig, TrainerConfig

pytestmark = pytest.mark.gpu
CONFIG = Qwen2Config(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=2, vocab_size=4096,
                     max_position_embeddings=4096, use_sliding_window=True,
                     sliding_window=256, max_window_layers=4, initializer_range=0.05)
ON_GPU = DEVICE == "cuda"
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
NUM_GROUPS, GROUP_SIZE, PROMPT = (4, 8, 192) if ON_GPU else (2, 4, 48)


def _batch() -> RolloutBatch:
    gen = torch.Generator().manual_seed(0)
    prompts, responses, groups = [], [], []
    for g in range(NUM_GROUPS):
        prompt = torch.randint(3, CONFIG.vocab_size, (PROMPT,), generator=gen).tolist()
        for _ in range(GROUP_SIZE):
            n = int(torch.randint(PROMPT // 4, 2 * PROMPT, (1,), generator=gen))
            prompts.append(prompt)
            responses.append(torch.randint(3, CONFIG.vocab_size, (n,), generator=gen).tolist())
            groups.append(g)
    n = len(prompts)
    return RolloutBatch.from_samples(prompts, responses, [[-1.0] * len(r) for r in responses],
                                     [0.0] * n, [0.5] * n, groups, GROUP_SIZE)


def _reference(model: torch.nn.Module, batch: RolloutBatch
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """fp32 CPU, each sample alone (Hugging Face's sdpa and sliding-window masks):
    log-probs [N, S] at the loss mask (0 elsewhere) and ∇ Σ log-probs."""
    model.zero_grad(set_to_none=True)
    out = torch.zeros(batch.input_ids.shape)
    for i in range(batch.num_samples):
        n = int(batch.sequence_lengths[i])
        ids = batch.input_ids[i:i + 1, :n]
        logp = model(input_ids=ids).logits[0, :-1].log_softmax(-1).gather(
            -1, ids[0, 1:, None])[:, 0] * batch.loss_mask[i, 1:n]
        logp.sum().backward()
        out[i, 1:n] = logp.detach()
    return out, {k: p.grad.clone() for k, p in model.named_parameters()}


def _packed_step(model: torch.nn.Module, batch: RolloutBatch, shared: bool,
                 device: torch.device) -> tuple[torch.Tensor, float]:
    """One forward + backward of Σ log-probs over the plan's packed rows on ``device``;
    (log-probs [N, S] on the CPU, real tokens)."""
    from trainer.cp_attention import context_parallel
    from trainer.micro_batch import gather_log_probs, slice_packed_row
    from trainer.step_plan import plan_step

    objective = ObjectiveConfig.compose(AggregationConfig(), LossConfig(), 8, 1.0)
    plan = plan_step(batch, objective, 1, 1, 4096, shared_prefix=shared)
    assert (plan.prefix_skip is not None) == shared
    out = torch.zeros(batch.input_ids.shape)
    for samples in plan.micro_batches[0]:
        micro = slice_packed_row(batch, plan, samples, 1, 0).to(device)
        with context_parallel(None, micro.position_ids, micro.layout):
            logits = model(input_ids=micro.input_ids, position_ids=micro.position_ids).logits
            logp = logits[0].float().log_softmax(-1).gather(-1, micro.targets[0, :, None])[:, 0]
            logp = logp * micro.loss_mask[0]
            logp.sum().backward()
        gather_log_probs(batch, samples, logp.detach()[None], out, None, 1, owner=True,
                         packed=True, prefix_skip=plan.prefix_skip)
    return out, float(batch.sequence_lengths.sum())


def _timed_steps(model: torch.nn.Module, batch: RolloutBatch, shared: bool,
                 device: torch.device, steps: int) -> dict[str, float]:
    if ON_GPU:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        _, tokens = _packed_step(model, batch, shared, device)
    if ON_GPU:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    return {"tokens_per_s": tokens * steps / elapsed,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if ON_GPU else 0.0}


@needs(1)
def test_a_bf16_shared_prefix_step_matches_the_fp32_cpu_reference(report) -> None:
    from trainer.backends.fsdp.model import configure_attention

    device = torch.device(DEVICE)
    batch = _batch()
    torch.manual_seed(0)
    reference = Qwen2ForCausalLM(copy.deepcopy(CONFIG)).float()
    reference.set_attn_implementation("sdpa")
    ref_log_probs, ref_grads = _reference(reference, batch)
    results = {}
    for shared in (True, False):
        model = copy.deepcopy(reference).to(device)
        model.zero_grad(set_to_none=True)
        for p in model.parameters():  # as FSDP's mixed precision: weights only, not RoPE's
            p.data = p.data.to(DTYPE)
        choice = configure_attention(model, TrainerConfig(
            num_gpus_per_rank=1 if ON_GPU else 0, shared_prefix=shared), DTYPE)
        if ON_GPU and shared:
            assert choice.implementation == "flex_attention", choice
        started = time.perf_counter()
        log_probs, _ = _packed_step(model, batch, shared, device)
        first_s = time.perf_counter() - started  # compiles FlexAttention on first use
        valid = batch.loss_mask > 0
        diff = (log_probs - ref_log_probs)[valid].abs()
        grad_rel = max(float((p.grad.float().cpu() - ref_grads[k]).norm()
                             / ref_grads[k].norm().clamp(min=1e-12))
                       for k, p in model.named_parameters())
        bound = (0.05, 0.05) if ON_GPU else (1e-4, 1e-4)
        assert float(diff.mean()) < bound[0], (shared, float(diff.mean()))
        assert grad_rel < bound[1], (shared, grad_rel)
        results[shared] = _timed_steps(model, batch, shared, device, steps=3)
        name = "shared prefix" if shared else "packed, no sharing"
        report(f"{name} ({choice.implementation}): mean |Δ log p| vs fp32 CPU",
               f"{float(diff.mean()):.2e}", f"< {bound[0]}")
        report(f"{name}: max relative grad difference (per tensor)", f"{grad_rel:.2e}",
               f"< {bound[1]}")
        report(f"{name}: first step (compiles)", f"{first_s:.1f} s")
        report(f"{name}: tokens/s", f"{results[shared]['tokens_per_s']:.0f}")
        report(f"{name}: peak memory", f"{results[shared]['peak_gib']:.2f} GiB")
    if ON_GPU:  # the prompt computed once for 8 responses: less memory for the same samples
        assert results[True]["peak_gib"] <= results[False]["peak_gib"] * 1.05, results
