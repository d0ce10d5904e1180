"""A user's model on a real task: one RL step and one evaluation of SmolLM2-135M-Instruct
on the math word problems, through the whole driver (real Ray, the real BPE tokenizer and
chat template, pad == eos), kept small enough for CI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.config import load_job_config
from services.driver.loop import run_job

ROOT = Path(__file__).resolve().parents[2]


def test_one_rl_step_and_its_evaluations_on_smollm2(ray_cluster: None, smollm2_path: Path,
                                                    tmp_path: Path) -> None:
    config = load_job_config(ROOT / "configs" / "smollm2-math.yaml", [
        f"rollout.model={smollm2_path}", "num_steps=1", "rollout.global_batch_size=4",
        "rollout.n_samples_per_prompt=2", "rollout.sampling.max_new_tokens=8",
        "rollout.engine.num_threads=1", "trainer.dp_size=1", "trainer.loss.entropy_coef=0.01",
        "eval.num_prompts=3", "eval.num_samples=2"])
    lines: list[str] = []
    history = run_job(config, tmp_path / "job", log=lines.append)
    (first,) = history  # one step; the evaluation runs before it (and it is the last)
    # The trainer's log-probs (same weights, temperature 0.8) match the engine's, token for
    # token on the real tokenizer's ids: a wrong mask or shift would show here.
    assert first["mismatch/log_prob_abs_diff"] < 1e-3
    # A gradient through the whole model even when no group has reward spread (8 tokens
    # rarely reach an answer): the entropy bonus.
    assert first["tokens/valid"] > 0 and first["grad_norm"] > 0
    assert 0.0 <= first["eval/accuracy"] <= 1.0 and 0.0 <= first["eval/pass@k"] <= 1.0
    assert (first["eval/num_prompts"], first["eval/k"]) == (3.0, 2.0)
    assert 0 < first["eval/response_length"] <= 8 and "eval/accuracy/d1" in first
    assert sum(first[f"length_bias/token_mean/{b}"] for b in ("short", "middle", "long")
               ) == pytest.approx(1.0)
    assert any("eval accuracy" in line and "pass@2" in line for line in lines)
    rows = [json.loads(line) for line in (tmp_path / "job" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [r["step"] for r in rows] == [0] and "eval/pass@k" in rows[0]["metrics"]
