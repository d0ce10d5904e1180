"""The demo rewarded by a remote endpoint (``type: http``) and a judge on an
OpenAI-compatible server, both loopback servers of this test (tests/rollout/chat_server.py),
the endpoint's key given by a 0600 file.

Run once against servers that never fail, and once against servers that answer 503 to
their first two requests and then, from rollout step 1, a reward endpoint down for good
until the job restarts: the retries leave the scores as they were, the outage restarts
the job from its checkpoint (a fault, not "not retried"), and the two runs train the same
thing bit for bit. The key is in no file of either job folder, no line the driver logged
and no log of the Ray session."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.config.job import parse_job_config
from services.driver.loop import RunningJob, run_job
from services.driver.samples import read_samples
from services.driver.sinks import read_metrics
from tests.rollout.chat_server import ChatHandler, LoopbackHandler, RewardHandler, fresh, serving
from tests.services.driver.clean_run import CLEAN, ROOT, VARIES, final_weights

pytestmark = pytest.mark.usefixtures("warm_gang_pool")
"""Jobs in this process: each may take the gang the last one left (tests/conftest.py)."""

KEY = "sk-e2e-3b1f9c0d7a26e845"
STEPS = 3


def endpoint_score(response: str, label: str | None) -> float:
    """The remote reward: closeness of the response's length to the label's."""
    return -0.125 * abs(len(response.strip()) - len(label or ""))


class _Rewards(RewardHandler):
    def reward(self, prompt: str, response: str, label: str | None) -> float:
        return endpoint_score(response, label)


class _Judge(ChatHandler):
    """Yes when the graded response (the default template's Answer) has an even length."""

    def answer(self, body: dict) -> str:
        response = re.search(r"Answer: (.*)\nReference", body["messages"][0]["content"],
                             re.DOTALL).group(1)
        return "Yes." if len(response) % 2 == 0 else "No."


def _config(reward_url: str, judge_url: str, key_file: Path) -> Any:
    data = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    data["rollout"]["reward"] = [
        {"type": "exact_match"},
        {"type": "http", "name": "remote", "url": f"{reward_url}/get_reward",
         "weight": 0.5, "batch_size": 8, "max_retries": 2, "backoff_s": 0.05,
         "timeout_s": 30, "api_key_file": str(key_file), "max_unscored_fraction": 0.5},
        {"type": "judge", "name": "judge", "url": judge_url, "parse": "yes-no",
         "weight": 0.25, "backoff_s": 0.05, "timeout_s": 30}]
    # synchronous: the outage hits the step after the hook, not a rollout made ahead
    return parse_job_config(yaml.safe_dump(data), [
        *CLEAN, f"num_steps={STEPS}", "rollout.async_steps=0", "trainer.dp_size=1",
        "logging.samples_per_step=32"])


def _run(folder: Path, key_file: Path, reward: type[LoopbackHandler],
         judge: type[LoopbackHandler], outage_after: int | None = None
         ) -> tuple[list[dict[str, float]], list[str]]:
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        if "restarting" in line:  # the endpoint is back for the restarted job
            reward.fail_always = None

    def go_down(step: int, job: RunningJob) -> None:
        if step == outage_after:
            reward.fail_always = 503

    with serving(reward) as reward_url, serving(judge) as judge_url:
        history = run_job(_config(reward_url, judge_url, key_file), folder, log=log,
                          after_step=go_down)
    return history, lines


def _trained(rows: list[dict]) -> list[dict[str, float]]:
    skip = (*VARIES, "reward/remote/retries", "reward/remote/failed_calls",
            "reward/judge/retries", "reward/judge/failed_calls")
    return [{k: v for k, v in r["metrics"].items() if not k.startswith(skip)} for r in rows]


@pytest.mark.slow  # two runs of the demo job with remote rewards
def test_remote_rewards_survive_retries_and_an_outage_restarts_from_the_checkpoint(
        ray_cluster: None, tmp_path: Path) -> None:
    import ray

    key_file = tmp_path / "secret.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)

    reward, judge = fresh(_Rewards), fresh(_Judge)
    clean_history, clean_log = _run(tmp_path / "clean", key_file, reward, judge)
    samples = read_samples(tmp_path / "clean" / "samples.jsonl", evaluation=False)
    assert sorted({s["step"] for s in samples}) == list(range(STEPS))
    for sample in samples:  # the endpoint's score, recomputed from what the job logged
        assert sample["rewards"]["remote"] == endpoint_score(sample["response"],
                                                             sample["label"])
        assert sample["rewards"]["judge"] == float(len(sample["response"]) % 2 == 0)
    assert {r["headers"]["Authorization"] for r in reward.received} == {f"Bearer {KEY}"}
    assert all("Authorization" not in r["headers"] for r in judge.received)
    assert {r["body"]["model"] for r in judge.received} == {"default"}

    flaky_reward = fresh(_Rewards, failures=[503, 503])
    flaky_judge = fresh(_Judge, failures=[503, 503])
    history, log = _run(tmp_path / "flaky", key_file, flaky_reward, flaky_judge,
                        outage_after=0)
    assert any("RemoteOutage" in line and "restarting (1/1)" in line for line in log), log
    assert [row["job/restarts"] for row in history] == [0.0, 1.0, 1.0]
    rows = read_metrics(tmp_path / "flaky" / "metrics.jsonl")
    assert rows[0]["metrics"]["reward/remote/retries"] == 2.0
    assert all(r["metrics"]["reward/remote/failed_calls"] == 0.0 for r in rows)
    assert _trained(rows) == _trained(read_metrics(tmp_path / "clean" / "metrics.jsonl"))
    assert read_samples(tmp_path / "flaky" / "samples.jsonl") == read_samples(
        tmp_path / "clean" / "samples.jsonl")
    for name, tensor in final_weights(tmp_path / "flaky").items():
        assert tensor.equal(final_weights(tmp_path / "clean")[name]), name
    assert "RemoteOutage" in (tmp_path / "flaky" / "events.jsonl").read_text()

    logs = [p for p in (tmp_path / "clean").rglob("*") if p.is_file()] + \
        [p for p in (tmp_path / "flaky").rglob("*") if p.is_file()]
    session = Path(ray._private.worker._global_node.get_logs_dir_path())
    logs += [p for p in session.rglob("*") if p.is_file()]
    assert len(logs) > 20
    assert not [str(p) for p in logs if KEY.encode() in p.read_bytes()]
    assert not [line for line in clean_log + log if KEY in line]
    assert clean_history[-1]["job/restarts"] == 0.0
