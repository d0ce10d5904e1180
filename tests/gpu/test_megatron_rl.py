"""A short RL run on one GPU: SGLang generates, the Megatron backend trains, weights sync
back to SGLang every step — after each sync the engine's log-probs of what it samples are
the trainer's (fp32 on both sides), at T = 1 and at T = 0.7 (both sides must scale the
logits by 1/T) — and the final checkpoint is a loadable HF folder."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from tests.gpu.needs import needs

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
NUM_STEPS = 3
# The char tokenizer is ours (ids in, ids out); head dim 16 needs SGLang's torch backend.
SGLANG_TINY_ARGS = ["--dtype", "float32", "--skip-tokenizer-init",
                    "--cuda-graph-backend-decode", "disabled",
                    "--cuda-graph-backend-prefill", "disabled",
                    "--attention-backend", "torch_native"]


@needs(1, ("megatron.core", "sglang"))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_short_rl_run_megatron_with_sglang(ray_cluster: None, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch,
                                           temperature: float) -> None:
    # Imported here: collecting tests/gpu must work where Ray and the services are not.
    from services.config.job import parse_job_config
    from services.driver.loop import RunningJob, run_job

    monkeypatch.setenv("TALLY_DATA_DIR", str(tmp_path / "data"))
    job = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    job.update(name="megatron-sglang", num_steps=NUM_STEPS, warmup={"enabled": False})
    job["rollout"]["sampling"]["temperature"] = temperature
    # Its own port per temperature: a server still releasing its port cannot block the next.
    port = 31700 if temperature == 1.0 else 31710
    job["rollout"].update(global_batch_size=32, engine={
        "type": "sglang", "num_engines": 1, "num_gpus": 0.5, "mem_fraction_static": 0.3,
        "base_port": port, "extra_args": SGLANG_TINY_ARGS})
    job["trainer"].update(backend="megatron", dp_size=1, num_gpus_per_rank=0.5,
                          dtype="float32")
    held = {}

    def after_last_sync(step: int, running: RunningJob) -> None:
        """Once the final weights are synced: a rollout SGLang samples from them, and the
        trainer's log-probs of it (its ``log_probs`` verb, same weights and temperature)."""
        if step == NUM_STEPS - 1:
            manager, call = running.actors.manager, running.actors.rollout_call
            held["batch"] = call(manager.generate_batch.remote(step + 1), "generate_batch")
            held["trainer"] = running.actors.trainer.log_probs(held["batch"])

    history = run_job(parse_job_config(yaml.safe_dump(job)), tmp_path / "job",
                      log=lambda *_: None, after_step=after_last_sync)
    assert len(history) == NUM_STEPS
    for metrics in history:
        for key in ("pg_loss", "entropy", "grad_norm", "pg_loss/token_mean"):
            assert math.isfinite(metrics[key]), (key, metrics)
        # Synchronous: each rollout sampled from the weights synced after the previous
        # step, which the trainer holds until it steps: mean |log π_trainer − log π_engine|.
        assert metrics["rollout/staleness"] == 0
        assert metrics["mismatch/log_prob_abs_diff"] < 1e-3, metrics
    batch = held["batch"]
    mask = batch.loss_mask > 0
    assert mask.any()
    difference = (held["trainer"] - batch.rollout_log_probs).abs()[mask]
    assert float(difference.mean()) < 1e-3 and float(difference.max()) < 1e-2, (
        float(difference.mean()), float(difference.max()))
    final = tmp_path / "job" / "checkpoints" / "step_00000002" / "model"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(final))
