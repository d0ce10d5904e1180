"""Where a start of a job begins, decided before anything starts: the guards of a resume
(a setting that changes what is trained is refused naming it unless forced; the learning
rate and num_steps may change, said in an event), a named checkpoint and --no-resume
(the checkpoints after the start set aside, `latest` following), a finished job that
starts nothing; and a deterministic failure of an actor told from a fault."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import ray

from services.config.job import ConfigError
from services.driver.checkpoint import link_latest, plan_resume
from services.driver.loop import failure
from services.driver.run_dir import RunDir
from services.train import train_from_cli
from tests.services.driver.clean_run import CLEAN, ROOT, clean_config
from tests.services.driver.test_checkpoint import write_checkpoint
from trainer.group import TrainerRankDied

DEMO = ROOT / "configs" / "demo.yaml"


def job_folder(path: Path, steps: list[int]) -> RunDir:
    """A job folder of the clean config (config.json as the driver writes it) with
    committed checkpoints after ``steps``."""
    run_dir = RunDir(path).create()
    run_dir.config_file.write_text(clean_config().model_dump_json(indent=2))
    for step in steps:
        write_checkpoint(run_dir, step, {})
    link_latest(run_dir)
    return run_dir


def events(run_dir: RunDir) -> list[dict]:
    if not run_dir.events_file.exists():
        return []
    return [json.loads(line) for line in run_dir.events_file.read_text().splitlines()]


def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("nothing may start")

    monkeypatch.setattr("services.driver.loop.ensure_ray", refuse)
    monkeypatch.setattr("services.driver.loop.RunningJob.start", refuse)


def test_a_changed_setting_that_changes_training_is_refused_naming_it(
        tmp_path: Path) -> None:
    run_dir = job_folder(tmp_path / "job", [0, 1])
    changed = clean_config("rollout.n_samples_per_prompt=4", "aggregation.mode=token_mean")
    with pytest.raises(ConfigError) as refused:
        plan_resume(changed, run_dir, None, force=False, log=print)
    assert [p.field for p in refused.value.problems] == [
        "aggregation.mode", "rollout.n_samples_per_prompt"]
    assert str(refused.value).splitlines()[1].startswith(
        f"rollout.n_samples_per_prompt: was 8 when the checkpoints in {run_dir.path} were "
        "written, is 4 now: ")
    assert "--force" in str(refused.value)
    forced = plan_resume(changed, run_dir, None, force=True, log=print)
    assert forced.checkpoint == run_dir.checkpoints_dir / "step_00000001"
    assert forced.changes == ('aggregation.mode: "sample_mean" → "token_mean" (--force)',
                              "rollout.n_samples_per_prompt: 8 → 4 (--force)")


def test_the_learning_rate_and_num_steps_may_change_and_the_layout_changes_freely(
        tmp_path: Path) -> None:
    run_dir = job_folder(tmp_path / "job", [0, 1])
    plan = plan_resume(clean_config("trainer.optimizer.lr=1e-3", "num_steps=6",
                                    "trainer.dp_size=1", "eval.enabled=true",
                                    "eval.dataset={type: synthetic, task: copy}"),
                       run_dir, None, force=False, log=print)
    assert (plan.checkpoint, plan.step, plan.finished) == (
        run_dir.checkpoints_dir / "step_00000001", 1, False)
    assert plan.changes == ("num_steps: 4 → 6", "trainer.optimizer.lr: 0.002 → 0.001")


def test_a_checkpoint_that_holds_the_last_step_is_a_finished_job(tmp_path: Path) -> None:
    run_dir = job_folder(tmp_path / "job", [1, 3])
    plan = plan_resume(clean_config(), run_dir, None, force=False, log=print)
    assert plan.finished and plan.checkpoint == run_dir.checkpoints_dir / "step_00000003"


def test_a_named_checkpoint_sets_the_later_ones_aside_and_latest_follows(
        tmp_path: Path) -> None:
    run_dir = job_folder(tmp_path / "job", [0, 1, 2])
    assert os.readlink(run_dir.latest_link) == "step_00000002"
    lines: list[str] = []
    plan = plan_resume(clean_config(), run_dir, run_dir.checkpoints_dir / "step_00000000",
                       force=False, log=lines.append)
    assert plan.checkpoint == run_dir.checkpoints_dir / "step_00000000"
    (aside,) = run_dir.checkpoints_dir.glob("set-aside-*")
    assert sorted(p.name for p in aside.iterdir()) == ["step_00000001", "step_00000002"]
    assert sorted(p.name for p in run_dir.checkpoints_dir.glob("step_*")) == ["step_00000000"]
    assert os.readlink(run_dir.latest_link) == "step_00000000"
    assert [e["kind"] for e in events(run_dir)] == ["checkpoints_set_aside"]
    assert lines == [events(run_dir)[0]["message"]]
    # The link names a checkpoint too.
    again = plan_resume(clean_config(), run_dir, run_dir.latest_link, force=False,
                        log=print)
    assert again.checkpoint == run_dir.checkpoints_dir / "step_00000000"


def test_an_unreadable_newer_checkpoint_is_set_aside_by_an_automatic_resume(
        tmp_path: Path) -> None:
    run_dir = job_folder(tmp_path / "job", [0, 1])
    (run_dir.checkpoints_dir / "step_00000001" / "driver_state.json").write_text("{torn")
    plan = plan_resume(clean_config(), run_dir, None, force=False, log=lambda _: None)
    assert plan.checkpoint == run_dir.checkpoints_dir / "step_00000000"
    assert os.readlink(run_dir.latest_link) == "step_00000000"  # never the torn one
    assert [e["kind"] for e in events(run_dir)] == ["checkpoint_unreadable",
                                                    "checkpoints_set_aside"]


def test_no_resume_starts_at_step_zero_with_every_checkpoint_set_aside(
        tmp_path: Path) -> None:
    run_dir = job_folder(tmp_path / "job", [0, 1])
    config = clean_config().model_copy(update={"resume": False})
    assert plan_resume(config, run_dir, None, force=False, log=print).checkpoint is None
    assert not list(run_dir.checkpoints_dir.glob("step_*"))
    assert not run_dir.latest_link.is_symlink()


def test_a_named_checkpoint_must_be_readable_and_its_job_config_known(
        tmp_path: Path) -> None:
    run_dir = job_folder(tmp_path / "job", [0, 1])
    with pytest.raises(ConfigError, match=r"--resume: .*nope: not a checkpoint folder"):
        plan_resume(clean_config(), run_dir, tmp_path / "nope", force=False, log=print)
    run_dir.config_file.unlink()
    with pytest.raises(ConfigError, match=r"config.json is missing.*--force"):
        plan_resume(clean_config(), run_dir, None, force=False, log=print)
    assert plan_resume(clean_config(), run_dir, None, force=True, log=print).checkpoint


def test_rerunning_a_finished_job_says_so_in_one_line_and_starts_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = job_folder(tmp_path / "job", [3])
    run_dir.final_model_dir.mkdir()
    nothing_starts(monkeypatch)
    assert train_from_cli(DEMO, list(CLEAN), run_dir.path) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        f"job demo is finished: all 4 rollout steps are done in {run_dir.path} (final "
        f"weights: {run_dir.final_model_dir}/); raise num_steps to train further, or pass "
        "--no-resume to start again"]


def test_a_refused_resume_exits_2_naming_the_field_before_anything_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = job_folder(tmp_path / "job", [1])
    nothing_starts(monkeypatch)
    code = train_from_cli(DEMO, [*CLEAN, "rollout.global_batch_size=32"],
                          run_dir.path)
    assert code == 2
    assert capsys.readouterr().err.startswith(
        f"rollout.global_batch_size: was 16 when the checkpoints in {run_dir.path} were "
        "written, is 32 now")


RAY_INIT_FAILURE = (
    "The actor died because of an error raised in its creation task, \x1b[36mray::"
    "RolloutManager.__init__()\x1b[39m (pid=14911, ip=192.0.2.2, actor_id=c0df)\n"
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "/work/rollout/datasets.py", line 11, in load\n'
    "    raise DatasetError(...)\n"
    "rollout.datasets.DatasetError: dataset.path: data.jsonl line 10: not valid JSON")


def test_an_exception_at_start_up_is_a_deterministic_failure_said_in_one_line() -> None:
    died = ray.exceptions.RayActorError("c0df", RAY_INIT_FAILURE, actor_init_failed=True)
    assert failure(died) == ("the rollout manager failed to start: rollout.datasets."
                             "DatasetError: dataset.path: data.jsonl line 10: not valid "
                             "JSON", False)
    try:
        raise TrainerRankDied(1, "rendezvous_address", died) from died
    except TrainerRankDied as rank_died:
        assert failure(rank_died) == (
            "trainer rank 1 failed to start: rollout.datasets.DatasetError: dataset.path: "
            "data.jsonl line 10: not valid JSON", False)
    raised = ray.exceptions.RayTaskError(
        "setup", 'Traceback (most recent call last):\n  File "x.py", line 1, in setup\n',
        FileNotFoundError("/m has no config.json"), proctitle="ray::FSDPWorker.setup"
    ).as_instanceof_cause()
    assert failure(raised) == (
        "FSDPWorker.setup failed: FileNotFoundError: /m has no config.json", False)


def test_a_killed_actor_or_a_timeout_is_a_fault_to_restart_from() -> None:
    killed = ray.exceptions.ActorDiedError()
    assert failure(killed) == ("The actor died unexpectedly before finishing this task.",
                               True)
    try:
        raise TrainerRankDied(1, "train_step", killed) from killed
    except TrainerRankDied as rank_died:
        assert failure(rank_died) == ("trainer rank 1 died during train_step: The actor "
                                      "died unexpectedly before finishing this task.", True)
    # An engine killed while the manager's constructor waited for it: still a fault.
    inner = RAY_INIT_FAILURE.replace(
        "rollout.datasets.DatasetError: dataset.path: data.jsonl line 10: not valid JSON",
        "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this "
        "task.")
    assert failure(ray.exceptions.RayActorError("c0df", inner, actor_init_failed=True))[1]
    # The manager's own start-up ping past rollout.call_timeout_s: a fault, said as such.
    pinged = RAY_INIT_FAILURE.replace(
        "rollout.datasets.DatasetError: dataset.path: data.jsonl line 10: not valid JSON",
        "TimeoutError: rollout ping took longer than rollout.call_timeout_s=1e-06 s (the "
        "manager's start-up: its engines, teachers and reward actors did not all answer)")
    assert failure(ray.exceptions.RayActorError("c0df", pinged, actor_init_failed=True)) == (
        "the rollout manager failed to start: TimeoutError: rollout ping took longer than "
        "rollout.call_timeout_s=1e-06 s (the manager's start-up: its engines, teachers and "
        "reward actors did not all answer)", True)
    assert failure(TimeoutError("trainer: ranks [1] did not finish train_step within 3 s")
                   ) == ("trainer: ranks [1] did not finish train_step within 3 s", True)
