"""Test doubles and helpers of the controller: a Ray job backend in memory, an app on a
loopback socket of its own in a thread, a port that refuses connections, and a few metric
rows.

Ports are never picked by "bind port 0, close, reuse the number" (another process can take
it in between): a socket bound here to port 0 is handed to uvicorn as it is, and a port
that must refuse is held bound (not listening) for as long as it is used."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from services.controller.ray_jobs import BackendUnavailable, RayJobInfo
from services.controller.settings import Settings
from services.controller.tables import TERMINAL

ROOT = Path(__file__).resolve().parents[3]
DEMO = (ROOT / "configs" / "demo.yaml").read_text()
"""The demo job config's text, as a client would submit it."""
DEMO_OVERRIDES = ["num_steps=2", "warmup.enabled=false", "rollout.global_batch_size=16",
                  "rollout.n_samples_per_prompt=4", "trainer.dp_size=1"]


class FakeBackend:
    """Ray's job server in memory: jobs stay as the test sets them."""

    address = "fake://ray"

    def __init__(self) -> None:
        self.jobs: dict[str, dict] = {}
        self.down = False
        self.usage: dict[str, tuple[float, float]] | None = None
        """(used, total) per resource; None: unknown (admission by max_running_jobs)."""

    def _check(self) -> None:
        if self.down:
            raise BackendUnavailable("fake Ray is down")

    def submit(self, submission_id: str, entrypoint: str, env_vars: dict[str, str],
               metadata: dict[str, str]) -> str:
        self._check()
        if submission_id in self.jobs:
            raise RuntimeError(f"Job with submission_id {submission_id} already exists.")
        self.jobs[submission_id] = {"status": "pending", "entrypoint": entrypoint,
                                    "env": env_vars, "logs": "", "message": None}
        return submission_id

    def info(self, submission_id: str) -> RayJobInfo | None:
        self._check()
        job = self.jobs.get(submission_id)
        return None if job is None else RayJobInfo(job["status"], job["message"], "01000000")

    def stop(self, submission_id: str) -> bool:
        """As Ray's ``stop_job``: True if the job was running (it is stopped now)."""
        self._check()
        job = self.jobs.get(submission_id)
        if job is None or job["status"] in TERMINAL:
            return False
        job["status"] = "cancelled"
        return True

    def logs(self, submission_id: str) -> str | None:
        self._check()
        job = self.jobs.get(submission_id)
        return None if job is None else job["logs"]

    async def follow(self, submission_id: str) -> AsyncIterator[str]:
        """As Ray's ``tail_job_logs``: the log from its start, then what the test appends,
        until the job ends (or is forgotten)."""
        sent = 0
        while (job := self.jobs.get(submission_id)) is not None:
            if len(job["logs"]) > sent:
                yield job["logs"][sent:]
                sent = len(job["logs"])
            if job["status"] in TERMINAL:
                return
            await asyncio.sleep(0.02)

    def find_submission(self, ray_job_id: str, driver_pid: int) -> str | None:
        return None

    def resources(self) -> dict[str, tuple[float, float]] | None:
        self._check()
        return self.usage

    def finish(self, submission_id: str, status: str, logs: str = "",
               message: str | None = None) -> None:
        self.jobs[submission_id].update(status=status, logs=logs, message=message)


def make_settings(tmp: Path, **overrides: object) -> Settings:
    overrides.setdefault("allowed_hosts", ("testserver",))  # TestClient's Host
    return Settings(data_dir=tmp / "data", reconcile_interval_s=0.2, **overrides)


def api_client(tmp: Path, **overrides: object) -> Any:
    """A TestClient of the app on a :class:`FakeBackend`, reached as ``.backend``, and the
    app's Controller as ``.ctl``."""
    from fastapi.testclient import TestClient

    from services.controller.app import create_app

    backend = FakeBackend()
    app = create_app(make_settings(tmp, **overrides), backend=backend)
    client = TestClient(app)
    client.backend = backend  # type: ignore[attr-defined]
    client.ctl = app.state.controller  # type: ignore[attr-defined]
    return client


def step_rows(num_steps: int, scale: float = 1.0, start: int = 0) -> list[dict]:
    """Plausible metric rows of ``num_steps`` steps."""
    rows = []
    for step in range(start, start + num_steps):
        decay = 1.0 / (1 + step)
        metrics = {"pg_loss": 0.5 * decay * scale, "reward/mean": 1 - decay,
                   "reward/std": 0.2 * decay, "kl": 0.01 * step, "entropy": 3 - step * 0.01,
                   "clip_fraction": 0.1 * decay, "clip_fraction/min": 0.0,
                   "clip_fraction/max": 0.2 * decay, "grad_norm": 2 * decay,
                   "response_length/mean": 6 + step % 3, "perf/tokens_per_s": 1500.0,
                   "padding_fraction": 0.1, "lr": 1e-3}
        for i, mode in enumerate(("sample_mean", "token_mean", "prompt_mean", "constant")):
            metrics[f"pg_loss/{mode}"] = (0.5 + 0.1 * i) * decay * scale
        rows.append({"step": step, "time": time.time(), "metrics": metrics})
    return rows


def with_length_bias_and_eval(rows: list[dict], eval_every: int = 5, k: int = 4
                              ) -> list[dict]:
    """``rows`` plus plausible length-bias shares every step and evaluation metrics on
    every ``eval_every``-th step only (as a driver evaluating every few steps logs them)."""
    modes = ("sample_mean", "token_mean", "prompt_mean", "constant")
    long_share = {"sample_mean": 1 / 3, "token_mean": 0.6, "prompt_mean": 0.55,
                  "constant": 0.6}
    for row in rows:
        step = row["step"]
        for mode in modes:
            long = long_share[mode] - 0.001 * (step % 7)
            short = (1 - long) / 3
            row["metrics"] |= {f"length_bias/{mode}/long": long,
                               f"length_bias/{mode}/middle": 1 - long - short,
                               f"length_bias/{mode}/short": short}
        if step % eval_every == 0:
            accuracy = min(1.0, 0.2 + 0.02 * step)
            row["metrics"] |= {"eval/accuracy": accuracy,
                               "eval/pass@k": min(1.0, accuracy + 0.15), "eval/k": float(k)}
    return rows


def with_reward_parts(rows: list[dict], parts: tuple[str, ...] = ("exact_match", "num")
                      ) -> list[dict]:
    """``rows`` plus each reward part's mean and std (rollout/manager.py: _part_metrics)."""
    for row in rows:
        for i, part in enumerate(parts):
            row["metrics"] |= {f"reward/{part}/mean": (1 - 1 / (2 + row["step"])) / (1 + i),
                               f"reward/{part}/std": 0.1}
    return rows


def sample_records(step: int, count: int = 3, parts: tuple[str, ...] = ("exact_match", "num"),
                   tokens: bool = False) -> list[dict]:
    """samples.jsonl records of a rollout step as the driver writes them (rollout/manager.py,
    then services/driver/samples.with_advantages); values exact in binary. ``tokens``: each
    with its per-token record (:func:`sample_tokens`, advantages around its own)."""
    return [{"step": step, "index": i, "group": i // 2, "prompt": f"<bos>copy {step}{i}=",
             "record_prompt": f"copy {step}{i}=", "response": f"{step}{i}", "label": f"{step}{i}",
             "reward": 1.0 - 0.5 * (i % 2), "rewards": {p: 1.0 - 0.25 * (i % 2) * (k + 1)
                                                        for k, p in enumerate(parts)},
             "response_tokens": 2 + i, "advantage": 0.25 - i,
             **({"tokens": sample_tokens(0.25 - i)} if tokens else {})} for i in range(count)]


TOKEN_TEXT = ["Let", " me", " call", "\n", "<tool>2+2</tool>", "\n", "=", " 4", "\n", " So",
              " ", "<b>4</b>", "</s>"]
"""A multi-turn response's tokens (:func:`sample_tokens`): a newline, a lone space and
markup among the policy's; positions 4 and 5 an environment's observation."""
OBSERVED = (4, 5)


def sample_tokens(advantage: float) -> dict:
    """A samples.jsonl ``tokens`` record (rollout/sample_record.SampleTokens) of
    :data:`TOKEN_TEXT`: the policy's token k has advantage ``advantage + 0.5 − 0.125·k``
    (signs on both sides of 0 within the sample), engine log-prob −0.25·(k+1), a
    trainer-vs-engine gap of 0.0625·(k − 6) and entropy 0.125·k; the observation's tokens
    advantage 0 and no log-probs. Values exact in binary."""
    rows: dict[str, list] = {key: [] for key in ("text", "observation", "advantage",
                                                 "engine_log_prob", "trainer_log_prob",
                                                 "entropy")}
    for k, text in enumerate(TOKEN_TEXT):
        observed = k in OBSERVED
        engine = None if observed else -0.25 * (k + 1)
        rows["text"].append(text)
        rows["observation"].append(observed)
        rows["advantage"].append(0.0 if observed else advantage + 0.5 - 0.125 * k)
        rows["engine_log_prob"].append(engine)
        rows["trainer_log_prob"].append(None if engine is None else engine + 0.0625 * (k - 6))
        rows["entropy"].append(None if observed else 0.125 * k)
    return rows


def eval_records(version: int, parts: tuple[str, ...] = ("exact_match", "num")) -> list[dict]:
    """samples.jsonl records of an evaluation of weights ``version``: a greedy and a
    sampled response to one held-out prompt."""
    return [{"step": version, "eval": True, "greedy": greedy, "group": 0,
             "prompt": "<bos>add 1 1=", "record_prompt": "add 1 1=", "response": "2" if greedy
             else "3", "label": "2", "reward": float(greedy),
             "rewards": dict.fromkeys(parts, float(greedy)), "response_tokens": 1}
            for greedy in (True, False)]


def loopback_socket(port: int = 0, rebindable: bool = False) -> socket.socket:
    """A TCP socket bound to 127.0.0.1 (on a port the OS picks by default), not listening
    yet: until it listens, connections to it are refused, and no other process can bind
    its port. ``rebindable``: SO_REUSEADDR, for a port bound again once its server is gone
    (past the TIME_WAIT of its connections); Linux then lets another SO_REUSEADDR socket
    bind it too while neither listens, so only a port known to be ours gets it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rebindable:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


def port_of(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])


@contextmanager
def refusing_url() -> Iterator[str]:
    """``http://127.0.0.1:<port>`` where nothing listens (connections are refused), the port
    held for the block: a server that is down, and no stranger answering in its place."""
    with loopback_socket() as sock:
        yield f"http://127.0.0.1:{port_of(sock)}"


class HungServer:
    """A TCP server on 127.0.0.1 that accepts every connection and never answers (a
    session server whose call hangs). :meth:`close` (or leaving the ``with`` block)
    closes every connection: each waiting client sees it end."""

    def __init__(self) -> None:
        self.listener = loopback_socket()
        self.listener.listen(64)
        self.listener.settimeout(0.1)
        self.host, self.port = "127.0.0.1", port_of(self.listener)
        self.accepted: list[socket.socket] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.done.is_set():
            try:
                self.accepted.append(self.listener.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    def close(self) -> None:
        self.done.set()
        self.thread.join(timeout=5)
        for conn in self.accepted:
            conn.close()
        self.listener.close()

    def __enter__(self) -> HungServer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


@contextmanager
def serve_in_thread(app: Any, sock: socket.socket | None = None) -> Iterator[str]:
    """Run ``app`` with uvicorn in a thread on ``sock`` (a :func:`loopback_socket`; a new
    one by default), which uvicorn makes listen and closes at the end; yields its URL."""
    import uvicorn

    sock = sock or loopback_socket()
    port = port_of(sock)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
