"""The training API for real: a controller process, a local Ray head, sessions on the tiny
model. Several forward_backward calls then one optim_step equal one call on their union
(every mode, DP 1 and 2, two and four calls); bad input is a 4xx naming the field; a
controller killed mid-session loses nothing; an idle session saves its state and ends;
the client and the README's example loop run."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from services.clients.training import TrainingAPIError, TrainingClient, datum
from tests.services.controller.fakes import ROOT
from tests.services.controller.test_ray import ControllerProcess, controller_on_own_head

pytestmark = pytest.mark.slow

MODES = ["sample_mean", "token_mean", "prompt_mean", "constant"]
VOCAB = 100  # the tiny model's
GROUP = 4
IDLE_S = 3.0


LIMIT = 128 * 1024
"""The module's server.max_request_bytes: the example's calls fit, a big one is split."""


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControllerProcess]:
    with controller_on_own_head(tmp_path_factory, 6,
                                {"TALLY_MAX_REQUEST_BYTES": str(LIMIT)}) as proc:
        yield proc


@pytest.fixture
def client(controller: ControllerProcess) -> Iterator[TrainingClient]:
    training = TrainingClient(controller.url)
    yield training
    training.close()


@pytest.fixture(scope="module")
def shared(controller: ControllerProcess) -> Iterator:
    """One DP 1 session for the tests that need any session (one start, not one each)."""
    training = TrainingClient(controller.url)
    session = training.create_session({"rollout": {"model": "tiny"}})
    yield session
    session.close()
    training.close()


@pytest.fixture(scope="module")
def shared_dp2(controller: ControllerProcess) -> Iterator:
    """One DP 2 session (1.5 CPUs of the head's 6) for the tests that need two ranks."""
    training = TrainingClient(controller.url)
    session = training.create_session({"rollout": {"model": "tiny"}, "trainer": {
        "dp_size": 2, "num_cpus_per_rank": 0.5}})
    yield session
    session.close()
    training.close()


def random_data(num_samples: int, seed: int) -> list[dict]:
    """Sequences of 5–14 tokens: a prompt, then response tokens with a hole (an
    observation) in some and fractional weights on others, sampling log-probs, and an
    advantage per token (a per-sample one in some); groups of 4."""
    rng = random.Random(seed)
    data = []
    for i in range(num_samples):
        size, prompt = rng.randint(5, 14), rng.randint(2, 4)
        sequence = [rng.randrange(VOCAB) for _ in range(size + 1)]
        weights = [0.0] * (prompt - 1) + [rng.choice([1.0, 1.0, 0.5, 0.25])
                                          for _ in range(size - prompt + 1)]
        if rng.random() < 0.4 and size - prompt > 2:
            weights[prompt + 1] = 0.0
        advantages = ([round(rng.gauss(0, 1), 3)] * size if i % 3 == 0
                      else [round(rng.gauss(0, 1), 3) for _ in range(size)])
        data.append({"tokens": sequence[:-1], "targets": sequence[1:], "weights": weights,
                     "advantages": advantages,
                     "logprobs": [-round(rng.uniform(0.5, 5), 3) for _ in range(size)],
                     "group": i // GROUP})
    return data


def weights_of(path: str) -> dict:
    return load_file(Path(path) / "model.safetensors")


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def take_step(session, data: list[dict], sizes: list[int], mode: str) -> tuple[list, dict]:
    """forward_backward over consecutive slices of ``sizes``, then optim_step."""
    aggregation = {"mode": mode, **({"divisor": 9.0} if mode == "constant" else {})}
    calls, start = [], 0
    for size in sizes:
        calls.append(session.forward_backward(data[start:start + size], "ppo", aggregation))
        start += size
    assert start == len(data)
    step = session.optim_step(lr=1e-3, eps=1e-3).result()  # eps: scale reaches the weights
    return [c.result() for c in calls], step


def split_against_union(session, data: list[dict]) -> None:
    """For each mode: one call on 24 samples, two calls, four calls of uneven sizes (whole
    groups under prompt_mean), each from the same saved state: the weights after the step
    agree to 1e-6, and the step's loss (and grad norm) to the union's J."""
    session.save("start").result()
    start = weights_of(str(Path(session.info["output_dir"]) / "saved" / "start"))
    for mode in MODES:
        four = [4, 8, 4, 8] if mode == "prompt_mean" else [3, 9, 5, 7]
        results = {}
        for name, sizes in (("one", [24]), ("two", [12, 12]), ("four", four)):
            session.load("start").result()
            calls, step = take_step(session, data, sizes, mode)
            results[name] = (calls, step, weights_of(session.save(f"{mode}-{name}")
                                                     .result()["path"]))
        (union,), one_step, one_weights = results["one"]
        assert one_step["loss"] == pytest.approx(union["loss"], rel=1e-9, abs=1e-12)
        for name in ("two", "four"):
            calls, step, weights = results[name]
            assert max_difference(weights, one_weights) <= 1e-6, (mode, name)
            assert step["loss"] == pytest.approx(union["loss"], rel=1e-6, abs=1e-9)
            assert step["grad_norm"] == pytest.approx(one_step["grad_norm"], rel=1e-6)
            assert step["metrics"]["calls"] == len(calls)
            # what the calls say alone is not the step's J (why it is deferred)
            assert any(abs(c["loss"] - union["loss"]) > 1e-4 for c in calls), (mode, name)
        # the step moved the weights (a no-op would pass the comparisons)
        assert max_difference(one_weights, start) > 1e-5, mode


def test_split_calls_give_the_step_of_one_call_on_their_union_at_dp_1_and_2(
        shared, shared_dp2) -> None:
    """:func:`split_against_union` on a DP 1 and a DP 2 session, side by side."""
    sessions = {1: shared, 2: shared_dp2}
    with ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(split_against_union, session, random_data(24, seed=dp))
                     for dp, session in sessions.items()]:
            done.result()
    assert {s.state()["world_size"] for s in sessions.values()} == {1, 2}


def detail_of(future) -> tuple[int, str]:
    with pytest.raises(TrainingAPIError) as raised:
        future.result()
    return raised.value.status, raised.value.detail


def test_bad_input_is_a_4xx_naming_the_field(shared, controller: ControllerProcess) -> None:
    session, step_before = shared, shared.state()["step"]
    tokens_before = shared.state()["tokens"]
    data = random_data(8, seed=7)
    short = {**data[0], "weights": data[0]["weights"][:-1]}
    assert detail_of(session.forward_backward([data[1], short], "ppo")) == (
        422, f"data[1].weights: has {len(short['weights'])} values; tokens has "
             f"{len(short['tokens'])}")
    outside = {**data[0], "tokens": [VOCAB + 5, *data[0]["tokens"][1:]]}
    status, detail = detail_of(session.forward([*data[:2], outside], "ppo"))
    assert status == 422 and detail.startswith("data[2].tokens[0]: token id 105 is "
                                               "outside the vocabulary (0..99)")
    status, detail = detail_of(session.forward_backward(data[:6], "ppo", "prompt_mean"))
    assert status == 422 and detail.startswith("data[4].group: group 1 has 2 samples in "
                                               "this call, other groups have 4")
    assert session.forward_backward(data[:4], "ppo", "prompt_mean").result()["loss"]
    status, detail = detail_of(session.forward_backward(data[:4], "ppo", "prompt_mean"))
    assert status == 422 and detail.startswith("data[0].group: group 0 was in an earlier "
                                               "forward_backward call of this step")
    status, detail = detail_of(session.forward_backward(data[4:], "ppo", "token_mean"))
    assert status == 409 and detail.startswith("aggregation.mode: mode token_mean "
                                               "differs from mode prompt_mean")
    no_advantage = {k: v for k, v in data[0].items() if k != "advantages"}
    status, detail = detail_of(session.forward([no_advantage], "importance_sampling"))
    assert (status, detail) == (422, "data[0].advantages: required by loss_fn "
                                     "importance_sampling")
    status, detail = detail_of(session.forward_backward(data, "ppo", {"mode": "constant"}))
    assert status == 422 and "aggregation" in detail and "divisor" in detail
    assert session.optim_step(lr=1e-3).result()["step"] == step_before + 1
    status, detail = detail_of(session.optim_step(lr=1e-3))
    assert status == 409 and "no forward_backward call since the last optim_step" in detail
    # tokens trained: those with a weight > 0 (a fractional one counts as a token)
    assert session.state()["tokens"] - tokens_before == sum(sum(w > 0 for w in d["weights"])
                                                              for d in data[:4])
    unknown = httpx.post(f"{controller.url}/api/sessions/0123456789ab/optim_step",
                         json={"adam": {"lr": 1e-3}})
    assert (unknown.status_code, unknown.json()["detail"]) == (
        404, "session 0123456789ab: no such session")
    bad = httpx.post(f"{controller.url}/api/sessions",
                     json={"config": {"trainer": {"backend": "megatron"}}})
    assert bad.status_code == 422 and "trainer.backend" in bad.json()["detail"]


def arm_fault(controller: ControllerProcess, session_id: str, rank: int) -> None:
    """Rank ``rank`` of the session fails its next forward_backward after its collectives
    (the test-only ``arm_fault`` verb of services/sessions/calls.py), armed from a Ray job on
    the session's cluster: the ranks are named actors there (trainer/group.py)."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    name = f"tally-session-{session_id}-rank{rank}"
    code = ("import ray; ray.init(); "
            f"ray.get(ray.get_actor({name!r}, namespace='tally')"
            ".arm_fault.remote('forward_backward'), timeout=60)")
    jobs = JobSubmissionClient(controller.env["TALLY_RAY_ADDRESS"])
    job = jobs.submit_job(entrypoint=f"{sys.executable} -c \"{code}\"")
    deadline = time.monotonic() + 120
    while (status := jobs.get_job_status(job)) not in (JobStatus.SUCCEEDED, JobStatus.FAILED,
                                                       JobStatus.STOPPED):
        assert time.monotonic() < deadline, status
        time.sleep(0.5)
    assert status == JobStatus.SUCCEEDED, jobs.get_job_logs(job)[-2000:]


def post(controller: ControllerProcess, session_id: str, verb: str, body: dict
         ) -> httpx.Response:
    return httpx.post(f"{controller.url}/api/sessions/{session_id}/{verb}", json=body,
                      timeout=300)


def gspo_call_loss(data: list[dict], logprobs: list[list[float]], eps_low: float,
                   eps_high: float) -> float:
    """GSPO's J of one sample_mean call, written out (Zheng et al. 2025, token form):
    s_i = exp(mean over the valid targets of log π − log π_sample), each target's loss
    max(−A·s_i, −A·clip(s_i)), weighed by m/M_i and averaged over the N samples."""
    total = 0.0
    for sample, new in zip(data, logprobs, strict=True):
        valid = [t for t, w in enumerate(sample["weights"]) if w > 0]
        log_ratio = sum(new[t] - sample["logprobs"][t] for t in valid) / len(valid)
        s = math.exp(log_ratio)
        clipped = min(max(s, 1 - eps_low), 1 + eps_high)
        size = sum(sample["weights"])
        total += sum(sample["weights"][t] / size * max(-sample["advantages"][t] * s,
                                                      -sample["advantages"][t] * clipped)
                     for t in valid)
    return total / len(data)


def test_a_call_names_its_policy_loss_and_correction_as_a_job_does(shared) -> None:
    """``policy_loss``, ``kl_estimator`` and ``rollout_correction`` per call, the jobs'
    names: a gspo call's J is GSPO's formula over the log-probs it returns (its own clip
    range, 3e-4 / 4e-4, since the session set none), and a bad setting is a 422 naming
    the field."""
    data = random_data(8, seed=11)
    answer = shared.forward(data, policy_loss="gspo", kl_estimator="k2",
                            rollout_correction={"level": "sequence", "mode": "mask"}).result()
    want = gspo_call_loss(data, answer["logprobs"], 3e-4, 4e-4)
    assert answer["loss"] == pytest.approx(want, rel=1e-5, abs=1e-7)
    ppo = shared.forward(data, "ppo").result()["loss"]
    assert abs(ppo - want) > 1e-4  # the policy loss named reached the ranks
    status, detail = detail_of(shared.forward(data, "ppo", rollout_correction={
        "mode": "truncate", "low": 0.5}))
    assert status == 422 and "rollout_correction" in detail and "low" in detail


def test_a_call_failed_on_rank_1_is_undone_and_a_repeated_request_id_applies_once(
        shared_dp2, controller: ControllerProcess) -> None:
    """DP 2: the second of two forward_backward calls fails on rank 1 after its
    reduce-scatter (rank 0 holds its share of the gradient); the client's retry (same
    request_id) applies it, a third copy of the id applies nothing, and the step's
    weights are those of a clean run. The id sent again with other data is a 409."""
    session, data = shared_dp2, random_data(16, seed=11)
    fb = {"loss_fn": "ppo", "aggregation": {"mode": "token_mean"}}
    session.save("tx").result()
    session.load("tx").result()
    for part in (data[:8], data[8:]):
        session.forward_backward(part, "ppo", "token_mean").result()
    session.optim_step(lr=1e-3, eps=1e-3).result()
    clean = weights_of(session.save("tx-clean").result()["path"])

    session.load("tx").result()
    session.forward_backward(data[:8], "ppo", "token_mean").result()
    arm_fault(controller, session.id, rank=1)
    second = {**fb, "data": data[8:], "request_id": "second-call"}
    failed = post(controller, session.id, "forward_backward", second)
    assert failed.status_code == 500 and failed.json()["retriable"] is True, failed.text
    assert "trainer rank 1 failed: InjectedFault" in failed.json()["detail"]
    assert "every rank's gradient is restored" in failed.json()["detail"]
    assert session.state()["pending_calls"] == 1  # pending untouched by the failure
    retried = session._post("forward_backward", second).result()  # the client's retry
    again = post(controller, session.id, "forward_backward", second)
    assert again.status_code == 200 and again.json() == retried  # the first answer
    assert session.state()["pending_calls"] == 2
    other = post(controller, session.id, "forward_backward", {**second, "data": data[:4]})
    assert other.status_code == 409 and other.json()["detail"].startswith(
        "request_id: request_id 'second-call' was already used for a different call")
    step = session.optim_step(lr=1e-3, eps=1e-3).result()
    assert step["metrics"]["calls"] == 2
    faulted = weights_of(session.save("tx-faulted").result()["path"])
    assert max_difference(faulted, clean) <= 1e-7
    assert max_difference(clean, weights_of(str(Path(session.info["output_dir"]) / "saved"
                                                / "tx"))) > 1e-5  # the step moved them


def test_an_empty_optim_step_is_409_and_leaves_the_optimizer_bit_for_bit(shared) -> None:
    """A step over calls without a weighted token is refused; the step after it is, bit
    for bit, the step taken without it (Adam's moments and step count untouched)."""
    session, data = shared, random_data(8, seed=5)
    zero = [{**d, "weights": [0.0] * len(d["weights"])} for d in data[:4]]
    session.forward_backward(data, "ppo", "sample_mean").result()
    session.optim_step(lr=1e-3, eps=1e-3).result()  # moments that a decay would show
    session.save("empty-0").result()
    after = {}
    for name in ("plain", "refused-first"):
        session.load("empty-0").result()
        if name == "refused-first":
            session.forward_backward(zero, "ppo", "sample_mean").result()
            status, detail = detail_of(session.optim_step(lr=1e-3, eps=1e-3,
                                                          weight_decay=0.1))
            assert status == 409 and "hold no weighted token" in detail, detail
            assert session.state()["pending_calls"] == 0
        session.forward_backward(data[4:], "ppo", "sample_mean").result()
        session.optim_step(lr=1e-3, eps=1e-3).result()
        after[name] = weights_of(session.save(f"empty-{name}").result()["path"])
    assert max_difference(after["plain"], after["refused-first"]) == 0.0


def test_non_finite_settings_and_a_foreign_temperature_are_422(shared) -> None:
    session, data = shared, random_data(4, seed=9)
    for lr in (float("inf"), float("nan")):
        status, detail = detail_of(session.optim_step(lr=lr))
        assert status == 422 and detail.startswith("adam.lr: Input should be a finite"), detail
    status, detail = detail_of(session.forward_backward(
        data, "ppo", {"mode": "constant", "divisor": float("inf")}))
    assert status == 422 and detail.startswith("aggregation.divisor: Input should be a "
                                               "finite number"), detail
    (sampled,), = session.sample([[1, 2, 3]], temperature=0.5,
                                 max_new_tokens=3).result()["sequences"]
    assert sampled["temperature"] == 0.5
    hot = datum([1, 2, 3], sampled["tokens"], 1.0, sampled["logprobs"],
                temperature=sampled["temperature"])
    status, detail = detail_of(session.forward_backward([data[0], hot], "ppo"))
    assert (status, detail) == (422, "data[1].temperature: is 0.5 but the session's loss "
                                     "temperature is 1 (rollout.sampling.temperature): "
                                     "sample at 1, or start a session with that temperature")
    assert session.state()["pending_calls"] == 0


def test_a_call_over_the_body_limit_is_split_by_the_client_into_whole_groups(
        shared, client: TrainingClient) -> None:
    """A prompt_mean forward_backward of ~200 KB (the limit is 128 KiB) goes as two
    calls of whole groups; the merged loss is the union's J (``forward`` on the same data,
    split too) and the step takes both calls."""
    rng = random.Random(4)
    data = [{**d, "tokens": (tokens := [rng.randrange(VOCAB) for _ in range(200)]),
             "targets": [*tokens[1:], 7], "weights": [0.0] * 20 + [1.0] * 180,
             "advantages": [d["advantages"][0]] * 200, "logprobs": [-1.234567] * 200}
            for d in random_data(32, seed=4)]
    raw = httpx.post(f"{client.url}/api/sessions/{shared.id}/forward",
                     json={"data": data, "loss_fn": "ppo"}, timeout=60)
    assert raw.status_code == 413 and raw.json()["setting"] == "server.max_request_bytes"
    before = shared.state()["pending_calls"]
    evaluated = shared.forward(data, "ppo", "prompt_mean").result()
    done = shared.forward_backward(data, "ppo", "prompt_mean").result()
    assert done["metrics"]["parts"] == evaluated["metrics"]["parts"] >= 2
    assert done["loss"] == pytest.approx(evaluated["loss"], rel=1e-9)
    assert len(done["logprobs"]) == 32 and len(done["logprobs"][5]) == 200
    assert shared.state()["pending_calls"] == before + done["metrics"]["parts"]
    step = shared.optim_step(lr=1e-3).result()
    assert step["metrics"]["calls"] == done["metrics"]["parts"]
    assert step["loss"] == pytest.approx(evaluated["loss"], rel=1e-6)


def test_a_controller_killed_mid_session_loses_no_step(shared, client: TrainingClient,
                                                       controller: ControllerProcess) -> None:
    """kill -9 with a step done and one forward_backward pending: the restarted
    controller finds the session as it was and the step completes."""
    data = random_data(8, seed=3)
    session = shared
    _, done = take_step(session, data, [8], "token_mean")
    session.forward_backward(data[:4], "ppo", "token_mean").result()
    controller.kill()
    controller.start()
    state = session.state()
    assert (state["status"], state["step"], state["pending_calls"]) == (
        "ready", done["step"], 1)
    step = session.optim_step(lr=1e-3).result()
    assert step["step"] == done["step"] + 1 and step["metrics"]["calls"] == 1
    listed = {s["id"]: s for s in client.list_sessions()}
    assert listed[session.id]["step"] == step["step"]
    assert listed[session.id]["loss"] == step["loss"]


def test_the_example_loop_runs_over_the_client(controller: ControllerProcess) -> None:
    """docs/examples/grpo_copy.py, a few steps (its learning run is in the docs)."""
    env = {**os.environ, "GRPO_COPY_STEPS": "3"}
    done = subprocess.run([sys.executable, "docs/examples/grpo_copy.py", controller.url],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("step")]
    assert [line.split()[1] for line in lines] == ["1", "2", "3"]
    saved = done.stdout.splitlines()[-1].removeprefix("saved: ")
    assert (Path(saved) / "model.safetensors").is_file()


def test_sampling_follows_the_steps_then_an_idle_session_saves_and_ends(
        client: TrainingClient) -> None:
    """The engine serves the weights of the last step: its log-probs of what it samples
    are the trainer's on the same tokens (``forward``), and they moved with the step.
    Left alone, the session saves its state (a Hugging Face folder) and ends; a call
    then says where the state is."""
    session = client.create_session({"rollout": {"model": "tiny"}}, idle_timeout_s=IDLE_S)
    prompt, greedy = [1, 71, 84, 4], {"temperature": 0.0, "max_new_tokens": 6}
    samples = []
    for step in (1, 2):
        session.forward_backward([datum(prompt, [69, 70, 71, 69, 70, 71])], "cross_entropy")
        assert session.optim_step(lr=1e-2).result()["step"] == step
        (sampled,), = session.sample([prompt], **greedy).result()["sequences"]
        trainer = session.forward([datum(prompt, sampled["tokens"])]).result()["logprobs"][0]
        engine = sampled["logprobs"]
        assert max(abs(a - b) for a, b in zip(trainer[-len(engine):], engine,
                                              strict=True)) < 1e-4, step
        samples.append(engine)
    assert abs(samples[0][0] - samples[1][0]) > 1e-3  # the second step reached the engine
    deadline = time.monotonic() + IDLE_S + 60
    while (state := session.state())["status"] != "ended":
        assert time.monotonic() < deadline, state
        time.sleep(0.5)
    saved = Path(state["saved_path"])
    assert saved.name == "idle" and (saved / "config.json").is_file()
    assert state["step"] == 2
    status, detail = detail_of(session.sample([[1, 2, 3]]))
    assert status == 409 and detail == f"session {session.id} is ended (its state is saved " \
                                       f"at {saved})"
