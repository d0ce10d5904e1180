"""A job rewarded by a reward model beside a rule, on Ray: the rewards in samples.jsonl are
transformers' own scores of the record's prompt and the response (special tokens added
once, rollout/reward_text.py), and a reward actor killed mid-job restarts
the job, which ends as the run that was never interrupted (samples.jsonl included)."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch
import yaml
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from services.config.job import parse_job_config
from services.driver.loop import RunningJob, run_job
from services.driver.samples import read_samples
from services.driver.sinks import read_metrics
from tests.reward_model_folders import save_random_reward_model
from tests.services.driver.clean_run import (
    CLEAN,
    ROOT,
    CleanRun,
    assert_same_training,
    wait_until_dead,
)


def _config(reward_model: str):
    data = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    data["rollout"]["reward"] = [
        {"type": "exact_match"},
        {"type": "model", "name": "rm", "path": reward_model, "weight": 0.05,
         "num_cpus": 0, "batch_size": 8}]
    # synchronous: the step after the kill asks the dead actor for its rewards
    return parse_job_config(yaml.safe_dump(data), [*CLEAN, "rollout.async_steps=0",
                                                   "trainer.dp_size=1",  # time: one rank
                                                   "logging.samples_per_step=6"])


@pytest.mark.slow  # two runs of a job with a reward model
def test_reward_model_job_logs_transformers_scores_and_survives_a_killed_reward_actor(
        ray_cluster: None, tmp_path: Path) -> None:
    from rollout.tiny import resolve_model_path

    folder = save_random_reward_model(tmp_path / "rm", resolve_model_path("tiny"), seed=4)
    config = _config(folder)
    whole = tmp_path / "whole"
    history = run_job(config, whole, log=lambda *_: None)

    samples = read_samples(whole / "samples.jsonl", evaluation=False)
    assert sorted({s["step"] for s in samples}) == [0, 1, 2, 3]
    assert all(len([s for s in samples if s["step"] == k]) == 6 for k in range(4))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    for sample in samples:  # the record's prompt and the response, special tokens once
        with torch.no_grad():
            score = model(**tokenizer(sample["record_prompt"] + sample["response"],
                                      return_tensors="pt")).logits[0, 0]
        assert sample["rewards"]["rm"] == pytest.approx(float(score), abs=1e-4)
        assert sample["reward"] == sample["rewards"]["exact_match"] + \
            0.05 * sample["rewards"]["rm"]
    assert all(r["metrics"]["reward/rm/std"] > 0 for r in read_metrics(whole / "metrics.jsonl"))

    killed: list[int] = []

    def kill_reward_actor(step: int, job: RunningJob) -> None:
        if step == 1 and not killed:
            (actor,) = ray.get(job.actors.manager.__ray_call__.remote(
                lambda manager: manager.reward_actors["rm"]))
            ray.kill(actor)
            wait_until_dead(actor.ping.remote)
            killed.append(step)

    again = tmp_path / "killed"
    rows = run_job(config, again, log=lambda *_: None, after_step=kill_reward_actor)
    assert killed == [1]
    assert [m["job/restarts"] for m in rows] == [0.0, 0.0, 1.0, 1.0]
    assert_same_training(again, CleanRun(whole, history))
    assert read_samples(again / "samples.jsonl") == read_samples(whole / "samples.jsonl")
