"""A LoRA job end to end on real Ray (the clean job's layout: DP 2, two rollouts asked
for ahead, 4 optimizer steps per rollout, a checkpoint every step): stopped after step 1
and resumed it trains bit for bit what the uninterrupted run does; a sync is the
adapters only; the job ends with the merged model and peft's adapter folder, and `tally export
--adapter` writes one from a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from services.cli import app
from tests.services.driver.clean_run import (
    CleanRun,
    assert_resumes_exactly,
    clean_config,
    rows,
)

pytestmark = pytest.mark.usefixtures("warm_gang_pool")
"""Jobs in this process: each may take the gang the last one left (tests/conftest.py)."""

LORA = ["trainer.lora.rank=4", "trainer.lora.alpha=8", "trainer.optimizer.lr=1e-2",
        "trainer.loss.kl_coef=0.05"]


@pytest.mark.slow  # two jobs
def test_a_lora_job_resumes_exactly_and_syncs_only_adapters(ray_cluster: None,
                                                            tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    config = clean_config(*LORA)
    assert config.weight_transport() == "object_store"
    whole = assert_resumes_exactly(config, tmp_path)
    metrics = [r["metrics"] for r in rows(whole / "metrics.jsonl")]
    # (Samples are up to two versions stale here, so the log-prob mismatch is the
    # staleness's; at one version it is fp32 rounding: tests/trainer/fsdp/test_lora.py.)
    assert metrics[-1]["kl"] > 0  # the policy moved off its base
    model = AutoModelForCausalLM.from_pretrained(whole / "final_model")  # no peft needed
    full_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert all(0 < m["perf/sync_bytes"] < 0.2 * full_bytes for m in metrics)
    share = metrics[0]["perf/sync_bytes"] / full_bytes  # the job's own report of it
    assert metrics[0]["perf/sync_share_of_full"] == pytest.approx(share, rel=1e-3)
    assert (whole / "final_adapter" / "adapter_config.json").is_file()

    runner = CliRunner()
    latest = whole / "checkpoints" / "latest"
    out = tmp_path / "adapter"
    result = runner.invoke(app, ["export", str(latest), str(out), "--adapter"])
    assert result.exit_code == 0, result.output
    assert (out / "adapter_model.safetensors").is_file()
    merged = runner.invoke(app, ["export", str(latest), str(tmp_path / "merged")])
    assert merged.exit_code == 0, merged.output
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(again[name], tensor), name


@pytest.mark.slow  # the session's clean job
def test_export_adapter_of_a_full_checkpoint_says_so(clean_run: CleanRun,
                                                     tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["export", str(clean_run.path / "checkpoints" / "latest"),
                                      str(tmp_path / "out"), "--adapter"])
    assert result.exit_code == 2
    assert "--adapter:" in result.output and "without trainer.lora" in result.output
