"""A short RL run on one GPU: SGLang generates, the Megatron backend trains, weights sync
back to SGLang every step, and the final checkpoint is a loadable HF folder."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from services.config import parse_job_config
from services.driver.loop import run_job
from tests.gpu.needs import needs

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
# The char tokenizer is ours (ids in, ids out); head dim 16 needs SGLang's torch backend.
SGLANG_TINY_ARGS = ["--dtype", "float32", "--skip-tokenizer-init", "--disable-cuda-graph",
                    "--attention-backend", "torch_native"]


@needs(1, ("megatron.core", "sglang"))
def test_short_rl_run_megatron_with_sglang(ray_cluster: None, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TALLY_DATA_DIR", str(tmp_path / "data"))
    job = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    job.update(name="megatron-sglang", num_steps=3, warmup={"enabled": False})
    job["rollout"].update(global_batch_size=32, engine={
        "type": "sglang", "num_engines": 1, "num_gpus": 0.5, "mem_fraction_static": 0.3,
        "base_port": 31700, "extra_args": SGLANG_TINY_ARGS})
    job["trainer"].update(backend="megatron", dp_size=1, num_gpus_per_rank=0.5,
                          dtype="float32")
    history = run_job(parse_job_config(yaml.safe_dump(job)), tmp_path / "job",
                      log=lambda *_: None)
    assert len(history) == 3
    for metrics in history:
        for key in ("pg_loss", "entropy", "grad_norm", "pg_loss/token_mean"):
            assert math.isfinite(metrics[key]), (key, metrics)
    final = tmp_path / "job" / "checkpoints" / "step_00000002" / "model"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(final))
