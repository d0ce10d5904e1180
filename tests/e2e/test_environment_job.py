"""Multi-turn environments through ``tally train`` (services.train.train_from_cli, in this
process, on the session's Ray cluster): both built-in environments train a step on the
tiny model (the guess game with the README's quick-look settings) and on SmolLM2, and an
environment that fails ends its episodes, writes events, and past
max_failures_per_rollout fails the job with its rows kept."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from services.driver.samples import read_samples
from services.driver.sinks import read_metrics
from services.train import train_from_cli
from tests.services.driver.test_sample_tokens_job import NO_TEXT

pytestmark = pytest.mark.usefixtures("warm_gang_pool")
"""One-rank jobs one after another: each may take the gang the last one left (another
model is loaded into the same processes)."""

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {"calculator": ROOT / "configs" / "smollm2-calculator.yaml",
           "guess-number": ROOT / "configs" / "smollm2-guess-number.yaml"}
ONE_SMALL_STEP = ["num_steps=1", "rollout.global_batch_size=4", "rollout.n_samples_per_prompt=2",
                  "trainer.dp_size=1", "eval.enabled=false", "rollout.engine.num_threads=1",
                  "rollout.sampling.max_new_tokens=12",
                  "trainer.loss.entropy_coef=0.01"]  # a gradient without reward spread
TINY = ["rollout.model=tiny", "rollout.environment.max_total_tokens=128",
        "rollout.max_prompt_tokens=128", "rollout.prompt_truncation=truncate_left"]
README_QUICK_LOOK = re.findall(r"--set (\S+)", re.search(
    r"tally train configs/smollm2-guess-number\.yaml (--set .*?)# a quick look",
    (ROOT / "README.md").read_text(), re.S).group(1))
"""The README's guess game on the tiny model, its settings as written (the test's one
small step after them)."""


def _events(job: Path) -> list[dict]:
    return [json.loads(line) for line in (job / "events.jsonl").read_text().splitlines()]


def _check_env_row(row: dict[str, float], max_turns: int) -> None:
    assert 1 <= row["env/turns_mean"] <= max_turns
    assert row["env/observations_mean"] > 0  # some observation came back to the policy
    assert 0 < row["env/policy_token_share"] < 1  # so the response has holes in its mask
    assert row["env/failures"] == 0 and row["env/seconds"] >= 0
    assert row["tokens/valid"] > 0 and row["grad_norm"] > 0


def _check_tokens(job: Path) -> None:
    """The logged samples token by token (services/driver/sample_tokens.py): the
    environment's tokens are observations (advantage 0, no log-probs); the policy's carry
    the engine's log-prob and the trainer's under the same weights (one step, synchronous),
    equal to fp32 precision across turns."""
    rows = read_samples(job / "samples.jsonl", evaluation=False)
    assert rows and all("tokens" in r for r in rows), NO_TEXT
    assert any(any(r["tokens"]["observation"]) for r in rows)
    for row in rows:
        tokens = row["tokens"]
        assert len(tokens["text"]) == row["response_tokens"]
        for obs, advantage, engine, trainer, entropy in zip(
                tokens["observation"], tokens["advantage"], tokens["engine_log_prob"],
                tokens["trainer_log_prob"], tokens["entropy"], strict=True):
            if obs:
                assert (advantage, engine, trainer, entropy) == (0.0, None, None, None)
            else:
                assert abs(trainer - engine) < 1e-4 and entropy > 0


PPO = ["rollout.advantage={type: gae, lam: 0.9}", "critic.enabled=true"]
"""PPO with a critic: each environment step's reward credited at its action's last token."""


@pytest.mark.parametrize("name", [*sorted(CONFIGS), "calculator-ppo"])
def test_a_built_in_environment_trains_a_step_on_the_tiny_model(ray_cluster: None,
                                                               tmp_path: Path,
                                                               name: str) -> None:
    job = tmp_path / name
    overrides = ([*README_QUICK_LOOK, *ONE_SMALL_STEP] if name == "guess-number" else
                 [*ONE_SMALL_STEP, *TINY, *(PPO if name.endswith("-ppo") else [])])
    assert train_from_cli(CONFIGS[name.removesuffix("-ppo")], overrides, job) == 0
    (row,) = [r["metrics"] for r in read_metrics(job / "metrics.jsonl")]
    _check_env_row(row, max_turns=5)
    _check_tokens(job)
    if name.endswith("-ppo"):  # the critic valued the episodes and stepped on them
        assert row["critic/value_loss"] > 0 and row["critic/grad_norm"] > 0
        assert -10 < row["critic/explained_variance"] <= 1


@pytest.mark.slow  # SmolLM2 plays and trains a job of one step
def test_the_calculator_trains_a_step_on_smollm2(ray_cluster: None, smollm2_path: Path,
                                                tmp_path: Path) -> None:
    """The tool environment on a real chat template (observations in ``tool`` turns); the
    guess game's ``user`` turns on SmolLM2 are tests/rollout/test_turns.py's, and both
    environments' jobs are the tiny model's above (a second SmolLM2 job: 60 s of CI)."""
    job = tmp_path / "calculator"
    overrides = [*ONE_SMALL_STEP, f"rollout.model={smollm2_path}",
                 "rollout.environment.max_turns=2"]
    assert train_from_cli(CONFIGS["calculator"], overrides, job) == 0
    (row,) = [r["metrics"] for r in read_metrics(job / "metrics.jsonl")]
    _check_env_row(row, max_turns=2)
    # the trainer's log-probs of the policy's tokens are the engine's, across turns
    assert row["mismatch/log_prob_abs_diff"] < 1e-3


def test_failing_episodes_are_reported_and_too_many_fail_the_job(ray_cluster: None,
                                                                  tmp_path: Path, capsys
                                                                  ) -> None:
    """Records labelled ``reset`` make tests/rollout/toy_envs.RaisesOnLabel raise: rollout
    step 0 has one such record (2 episodes, within max_failures_per_rollout=2), step 1
    two (4 episodes: the job fails, step 0's row and the events kept)."""
    data = tmp_path / "records.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"game {i}", "label": label}) + "\n"
                            for i, label in enumerate(["ok", "reset", "reset", "reset"])))
    overrides = [*ONE_SMALL_STEP, *TINY, "num_steps=2", "rollout.dataset.type=jsonl",
                 f"rollout.dataset.path={data}", "rollout.dataset.shuffle=false",
                 "rollout.environment.class_path=tests.rollout.toy_envs:RaisesOnLabel",
                 "rollout.environment.kwargs={}", "rollout.environment.max_failures_per_rollout=2"]
    job = tmp_path / "job"
    assert train_from_cli(CONFIGS["guess-number"], overrides, job) == 1
    said = ("rollout.environment.max_failures_per_rollout: 4 episodes of rollout step 1 "
            "failed in tests.rollout.toy_envs:RaisesOnLabel, above 2; first: "
            "RaisesOnLabel.reset: KeyError: 'no such board'")
    assert said in capsys.readouterr().err
    (row,) = [r["metrics"] for r in read_metrics(job / "metrics.jsonl")]
    assert row["env/failures"] == 2
    events = _events(job)
    failed = [e["message"] for e in events if e["kind"] == "environment_failed"]
    assert failed == ["rollout step 0: tests.rollout.toy_envs:RaisesOnLabel: RaisesOnLabel."
                      "reset: KeyError: 'no such board'; the episode ends with reward 0"] * 2
    assert any(said in e["message"] for e in events if e["kind"] == "actor_failed")

