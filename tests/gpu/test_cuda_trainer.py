"""The trainer on one CUDA GPU without Ray: each rank a plain spawned process in a
world-size-1 process group (``tests.distributed.run_ranks``), as on the lent GPU machine
(no Ray, no SGLang there). Each check adds its figure to the table ``tests/gpu/run.sh``
prints (tests/gpu/conftest.py).

- an FSDP2 step in bf16 keeps fp32 masters that move at lr 1e-6;
- the trainer's log-probs at T = 0.7 are the torch engine's (both bf16 on CUDA);
- packed rows (SDPA block-diagonal, or the varlen kernel where transformers has it) give
  padding's gradients in bf16, and the verifier's float64 comparison holds on CUDA;
- a Megatron TP 1 step on the local spec;
- weight buckets packed on the GPU (what NCCL and CUDA IPC send) and a sharded
  checkpoint written and read back on CUDA;
- the train-step tokens/s and MFU of SmolLM2-135M's architecture (random weights: the
  GGUF does not fit in what travels to the GPU machine, and speed does not need them).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from rollout.batch import RolloutBatch
from rollout.tiny import create_tiny_checkpoint
from tests.distributed import run_ranks
from tests.gpu.needs import DEVICE, needs
from tests.trainer.helpers import random_train_batch, sampled_train_batch
from trainer.config import (
    AggregationConfig,
    LossConfig,
    ObjectiveConfig,
    OptimizerConfig,
    TrainerConfig,
)

pytestmark = pytest.mark.gpu
H200_BF16_DENSE_FLOPS = 989e12
"""The H200's dense bf16 peak (NVIDIA's figure, without sparsity): MFU's denominator."""
SMOLLM2_135M = {
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
    "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
}
"""SmolLM2-135M-Instruct's LlamaConfig (as the imported GGUF gives it)."""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def _cuda_config(**update: object) -> TrainerConfig:
    """A rank on the GPU (``num_gpus_per_rank`` > 0 is what puts it there)."""
    return TrainerConfig(num_gpus_per_rank=1 if DEVICE == "cuda" else 0, **update)


def _worker(config: TrainerConfig, objective: ObjectiveConfig, model_path: str, port: int,
            total_steps: int = 4):
    if config.backend == "megatron":
        from trainer.backends.megatron.worker import MegatronWorker as Worker
    else:
        from trainer.backends.fsdp.worker import FSDPWorker as Worker
    worker = Worker(config, objective, model_path, 0, total_steps)
    worker.setup("127.0.0.1", port)
    return worker


def _plan(batch: RolloutBatch, objective: ObjectiveConfig, config: TrainerConfig,
          packed: bool | None = None):
    from trainer.step_plan import packs, plan_step

    return plan_step(batch, objective, 1, 1, config.max_tokens_per_micro_batch,
                     packed=packs(config) if packed is None else packed)


def _buckets_and_checkpoint(rank: int, port: int, model_path: str, batch: RolloutBatch,
                            path: str) -> dict[str, object]:
    from trainer.memory import PeakMemory

    config = _cuda_config(optimizer=OptimizerConfig(lr=1e-3))
    objective = ObjectiveConfig.compose(AggregationConfig(), config.loss, 10, 1.0)
    worker = _worker(config, objective, model_path, port)
    worker.train_step(batch, _plan(batch, objective, config))
    full = worker.export_weights()
    device = str(worker.device)
    with PeakMemory(worker.device) as peak:
        buckets = list(zip(worker.weight_bucket_specs("bfloat16", 0.05),
                           worker.weight_buckets("bfloat16", 0.05, device=device),
                           strict=True))
    exact = all(torch.equal(flat[spec.offset:spec.offset + spec.num_bytes].cpu()
                            .view(torch.bfloat16).view(spec.shape), full[spec.name].bfloat16())
                for specs, flat in buckets for spec in specs)
    saved = worker.checkpoint(path)
    worker.train_step(batch, _plan(batch, objective, config))  # moves away from the save
    worker.load_checkpoint(path)
    reloaded = worker.export_weights()
    return {"num_buckets": len(buckets), "exact": exact,
            "bucket_device": buckets[0][1].device.type,
            "bytes": sum(flat.numel() for _, flat in buckets),
            "params": sum(p.numel() for p in worker.model.parameters()),
            "sync_peak_gb": peak.extra_gb, "checkpoint_s": saved["perf/checkpoint_s"],
            "same_after_load": all(torch.equal(reloaded[n], t) for n, t in full.items())}


@needs(1)
def test_weight_buckets_on_the_gpu_and_a_sharded_checkpoint(tiny_model: str, tmp_path: Path,
                                                            report) -> None:
    """The NCCL and CUDA IPC transports send what ``weight_buckets`` packs on the GPU:
    bf16, bit-exact, 2 bytes per parameter; DCP's shards write and read back on CUDA."""
    batch = sampled_train_batch(tiny_model, temperature=1.0)
    result = run_ranks(_buckets_and_checkpoint, 1, tiny_model, batch,
                       str(tmp_path / "step"))[0]
    assert result["exact"] and result["num_buckets"] > 1, result
    assert result["bucket_device"] == DEVICE
    assert result["same_after_load"]
    report("weight buckets on the GPU: bytes per parameter (bf16)",
           f"{result['bytes'] / result['params']:.2f}", "2.00")
    report("  peak extra GPU memory packing them (GB)", f"{result['sync_peak_gb']:.3f}",
           "≈ one bucket")
    report("sharded checkpoint save on CUDA (s), reloads equal", f"{result['checkpoint_s']:.2f}",
           "equal")


def _bf16_step(rank: int, port: int, model_path: str, batch: RolloutBatch
               ) -> dict[str, object]:
    config = _cuda_config(dtype="bfloat16", optimizer=OptimizerConfig(lr=1e-6, grad_clip=None),
                          loss=LossConfig(old_log_probs="rollout"))
    objective = ObjectiveConfig.compose(AggregationConfig(), config.loss, 10, 1.0)
    worker = _worker(config, objective, model_path, port, total_steps=3)
    before = {k: v.clone() for k, v in worker.export_weights().items()}
    losses = [worker.train_step(batch, _plan(batch, objective, config))["pg_loss"]
              for _ in range(3)]
    after = worker.export_weights()
    layers = [k for k in before if ".layers." in k]
    changed = sum(int((after[k] != before[k]).sum()) for k in layers)
    return {"changed": changed / sum(before[k].numel() for k in layers),
            "param_dtypes": sorted({str(p.dtype) for p in worker.model.parameters()}),
            "device": str(next(worker.model.parameters()).device), "losses": losses}


@needs(1)
def test_fsdp_bf16_step_keeps_fp32_masters_that_move_at_lr_1e_6(tiny_model: str, report
                                                                ) -> None:
    batch = sampled_train_batch(tiny_model, temperature=1.0)
    result = run_ranks(_bf16_step, 1, tiny_model, batch)[0]
    report("FSDP2 bf16 step: layer weights moved at lr 1e-6", f"{result['changed']:.3f}",
           "> 0.5")
    assert result["device"].startswith(DEVICE), result
    assert result["param_dtypes"] == ["torch.float32"], result
    assert all(math.isfinite(x) for x in result["losses"]), result
    assert result["changed"] > 0.5, result


def _mismatch(rank: int, port: int, model_path: str, batch: RolloutBatch,
              temperatures: list[float]) -> list[float]:
    config = _cuda_config(dtype="bfloat16", loss=LossConfig(old_log_probs="rollout"))
    worker = _worker(config, ObjectiveConfig(), model_path, port)
    out = []
    for temperature in temperatures:
        objective = ObjectiveConfig(temperature=temperature)
        worker.objective = objective
        (sums, _), = worker.gradients(batch, [_plan(batch, objective, config)], [objective])
        out.append(sums["mismatch/log_prob_abs_diff"])
    return out


@needs(1)
def test_trainer_log_probs_match_the_cuda_engine_at_its_temperature(tiny_model: str, report
                                                                   ) -> None:
    from rollout.config import TorchEngineConfig

    engine = TorchEngineConfig(batch_size=8, device=DEVICE, dtype="bfloat16")
    batch = sampled_train_batch(tiny_model, temperature=0.7, engine_config=engine)
    at_sampling, at_one = run_ranks(_mismatch, 1, tiny_model, batch, [0.7, 1.0])[0]
    report("log-prob mismatch trainer vs engine, bf16, T=0.7", f"{at_sampling:.2e}", "< 1e-3")
    report("  the same read at T=1 (a trainer ignoring T)", f"{at_one:.2e}", "> 1e-2")
    assert at_sampling < 1e-3
    assert at_one > 1e-2


def _packed_vs_padded(rank: int, port: int, model_path: str, batch: RolloutBatch,
                      dtype: str) -> dict[str, object]:
    from trainer.verify import (
        TERMS,
        TermResult,
        compare,
        default_tolerance,
        mode_objectives,
        perturbed,
    )

    config = _cuda_config(dtype=dtype, packing=True, max_tokens_per_micro_batch=24,
                          loss=LossConfig(kl_coef=0.1, entropy_coef=0.01,
                                          old_log_probs="rollout"))
    base = ObjectiveConfig.compose(AggregationConfig(), config.loss, 8, 0.7)
    worker = _worker(config, base, model_path, port)
    worker.load_weights(perturbed(worker.export_weights()))  # KL ≠ 0
    checked = mode_objectives(base, ("sample_mean", "token_mean", "prompt_mean", "constant"))
    objectives = [objective for *_, objective in checked]
    padded = worker.gradients(batch, [_plan(batch, base, config, False)] * len(objectives),
                              objectives)
    packed = worker.gradients(batch, [_plan(batch, base, config, True)] * len(objectives),
                              objectives)
    rtol, atol = (default_tolerance(config) if dtype == "float64" else (2e-2, 2e-2))
    rows = []
    for (mode, term, _), (ref_sums, ref_grads), (sums, grads) in zip(
            checked, padded, packed, strict=True):
        logged = TERMS[term]
        ref = TermResult(ref_sums[logged], ref_sums[f"magnitude/{logged}"], ref_grads)
        got = TermResult(sums[logged], sums[f"magnitude/{logged}"], grads)
        rows.append((mode, term, *compare(ref, got, rtol, atol)))
    varlen = worker.attention.implementation == "flash_attention_2"
    return {"rows": rows, "attention": worker.attention.implementation, "varlen": varlen}


@needs(1)
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_packed_rows_give_paddings_gradients_on_cuda(tiny_model: str, dtype: str, report
                                                     ) -> None:
    """float64: the verifier's own comparison at its tolerance (SDPA: the varlen kernel
    takes 16-bit inputs only); bf16: the GPU attention the trainer picks, at bf16
    tolerance, for every mode and term."""
    from transformers import AutoConfig

    batch = random_train_batch(AutoConfig.from_pretrained(tiny_model).vocab_size,
                               num_prompts=4, group_size=3, seed=2)
    result = run_ranks(_packed_vs_padded, 1, tiny_model, batch, dtype)[0]
    worst = max(r[3] for r in result["rows"])
    bound = "≤ 1e-7 (verifier)" if dtype == "float64" else "≤ 2e-2 (bf16)"
    report(f"packed vs padded ∇, {dtype}, {result['attention']}", f"{worst:.1e}", bound)
    assert len(result["rows"]) == 12
    if dtype == "float64":
        assert not result["varlen"]  # FA2 takes fp16/bf16 only
    bad = [r for r in result["rows"] if not r[-1]]
    assert not bad, bad


def _megatron_step(rank: int, port: int, model_path: str, batch: RolloutBatch
                   ) -> dict[str, object]:
    config = _cuda_config(backend="megatron", dtype="bfloat16", packing=False,
                          optimizer=OptimizerConfig(lr=1e-6, grad_clip=None),
                          loss=LossConfig(old_log_probs="rollout"))
    objective = ObjectiveConfig.compose(AggregationConfig(), config.loss, 10, 1.0)
    worker = _worker(config, objective, model_path, port, total_steps=2)
    before = worker.export_weights()
    metrics = [worker.train_step(batch, _plan(batch, objective, config)) for _ in range(2)]
    after = worker.export_weights()
    layers = [k for k in before if ".layers." in k]
    changed = sum(int((after[k] != before[k]).sum()) for k in layers)
    return {"changed": changed / sum(before[k].numel() for k in layers),
            "losses": [m["pg_loss"] for m in metrics],
            "grad_norms": [m["grad_norm"] for m in metrics]}


@needs(1, ("megatron.core",))
def test_megatron_tp1_step_on_the_local_spec(tiny_model: str, report) -> None:
    batch = sampled_train_batch(tiny_model, temperature=1.0)
    result = run_ranks(_megatron_step, 1, tiny_model, batch)[0]
    report("Megatron TP1 bf16 step: layer weights moved", f"{result['changed']:.3f}", "> 0.5")
    assert all(math.isfinite(x) for x in result["losses"] + result["grad_norms"]), result
    assert result["changed"] > 0.5, result


def _smollm2_architecture(path: Path) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device(DEVICE):
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M))
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def _long_batch(num_prompts: int, group_size: int, prompt_len: int, response_len: int
                ) -> RolloutBatch:
    gen = torch.Generator().manual_seed(0)
    vocab = SMOLLM2_135M["vocab_size"]
    prompts, responses, log_probs = [], [], []
    for _ in range(num_prompts):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
        for _ in range(group_size):
            prompts.append(prompt)
            responses.append(torch.randint(3, vocab, (response_len,), generator=gen).tolist())
            log_probs.append([-1.0] * response_len)
    rewards = torch.rand(len(prompts), generator=gen)
    return RolloutBatch.from_samples(prompts, responses, log_probs, rewards.tolist(),
                                     (rewards - rewards.mean()).tolist(),
                                     [i // group_size for i in range(len(prompts))],
                                     group_size)


def _throughput(rank: int, port: int, model_path: str, batch: RolloutBatch, steps: int
                ) -> dict[str, float]:
    config = _cuda_config(dtype="bfloat16", max_tokens_per_micro_batch=16384,
                          loss=LossConfig(old_log_probs="rollout"))
    objective = ObjectiveConfig.compose(AggregationConfig(), config.loss,
                                        batch.input_ids.shape[1], 1.0)
    worker = _worker(config, objective, model_path, port, total_steps=steps + 1)
    plan = _plan(batch, objective, config)
    cuda = DEVICE == "cuda"
    worker.train_step(batch, plan)  # warm-up: kernels, allocator
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        worker.train_step(batch, plan)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    params = sum(p.numel() for p in worker.model.parameters())
    tokens = int(batch.sequence_lengths.sum()) * steps
    return {"tokens_per_s": tokens / elapsed, "params": params, "step_s": elapsed / steps,
            "memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
            "varlen": float(worker.attention.implementation == "flash_attention_2")}


@needs(1)
def test_smollm2_train_step_tokens_per_second_and_mfu(tmp_path: Path, report) -> None:
    """MFU = 6·N·tokens/s / peak: the dense matmul FLOPs of forward + backward (attention's
    quadratic part left out, so it is a lower bound), N the trained parameters."""
    model_path = _smollm2_architecture(tmp_path / "smollm2-arch")
    shape = (8, 8, 256, 768) if DEVICE == "cuda" else (1, 2, 16, 16)  # CPU: a smoke run
    batch = _long_batch(*shape)
    result = run_ranks(_throughput, 1, model_path, batch, 5 if DEVICE == "cuda" else 1)[0]
    mfu = 6 * result["params"] * result["tokens_per_s"] / H200_BF16_DENSE_FLOPS
    report(f"SmolLM2-135M train step, {shape[0] * shape[1]}×{shape[2] + shape[3]} tokens, "
           f"bf16, {DEVICE}",
           f"{result['tokens_per_s']:,.0f} tok/s", f"{result['step_s']:.2f} s/step")
    report(f"  MFU (6N, peak 989 TFLOP/s), varlen={bool(result['varlen'])}",
           f"{100 * mfu:.1f} %", f"{result['memory_gib']:.1f} GiB peak")
    assert result["tokens_per_s"] > 0 and 0 < mfu < 1


def _lora_bf16(rank: int, port: int, model_path: str, batch: RolloutBatch
               ) -> dict[str, object]:
    """LoRA in bf16 on the GPU: two steps, the adapters through GPU-packed buckets into a
    bf16 torch engine on the same device, a batch it samples, the trainer's mismatch."""
    from rollout.config import TorchEngineConfig
    from rollout.engines.torch_engine import TorchEngine
    from rollout.weight_bucket import WeightBucket
    from trainer.config import LoraConfig

    config = _cuda_config(dtype="bfloat16", lora=LoraConfig(rank=8),
                          optimizer=OptimizerConfig(lr=2e-2),
                          loss=LossConfig(old_log_probs="rollout", kl_coef=0.1))
    objective = ObjectiveConfig.compose(AggregationConfig(), config.loss, 10, 0.7)
    worker = _worker(config, objective, model_path, port, total_steps=2)
    for _ in range(2):
        metrics = worker.train_step(batch, _plan(batch, objective, config))
    specs = worker.weight_bucket_specs("bfloat16", 1.0)
    flats = list(worker.weight_buckets("bfloat16", 1.0, device=str(worker.device)))
    buckets = [WeightBucket(s, flat.cpu().numpy()) for s, flat in zip(specs, flats,
                                                                      strict=True)]
    engine_config = TorchEngineConfig(batch_size=8, device=DEVICE, dtype="bfloat16")
    engine = TorchEngine(engine_config, model_path)
    engine.load_weight_buckets(buckets, version=1)
    sampled = sampled_train_batch(model_path, 0.7, seed=3, engine=engine)
    (sums, _), = worker.gradients(sampled, [_plan(sampled, objective, config)], [objective])
    return {"mismatch": sums["mismatch/log_prob_abs_diff"], "kl": metrics["kl"],
            "frozen": sorted({str(p.dtype) for p in worker.model.parameters()
                              if not p.requires_grad}),
            "trained": sorted({str(p.dtype) for p in worker.model.parameters()
                               if p.requires_grad}),
            "sync_bytes": sum(b.num_bytes for b in buckets)}


@needs(1, ("peft",))
def test_lora_in_bf16_adapters_reach_the_engine(tiny_model: str, report) -> None:
    batch = sampled_train_batch(tiny_model, temperature=0.7)
    result = run_ranks(_lora_bf16, 1, tiny_model, batch)[0]
    report("LoRA bf16: mismatch trainer vs engine after an adapter sync",
           f"{result['mismatch']:.2e}", "< 1e-3")
    report("LoRA bf16: bytes per adapter sync", f"{result['sync_bytes']:,}", "")
    assert result["frozen"] == ["torch.bfloat16"] and result["trained"] == ["torch.float32"]
    assert result["mismatch"] < 1e-3 and result["kl"] > 0
