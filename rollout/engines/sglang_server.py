"""Launching one SGLang server as a child process and waiting until it is healthy.

The server inherits the Ray actor's environment, so the GPUs Ray assigned to the actor
(CUDA_VISIBLE_DEVICES) are the ones it uses. Its output goes to a log file whose tail is
quoted when the launch fails.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from rollout.config import SGLangEngineConfig


class SGLangLaunchError(RuntimeError):
    """A launched SGLang server exited or never became healthy."""


DETERMINISTIC_FLAG = "--enable-deterministic-inference"
"""SGLang's ServerArgs.enable_deterministic_inference (python/sglang/srt/server_args.py).
Without it a request's ``sampling_params.sampling_seed`` is accepted but ignored."""


def launch_command(config: SGLangEngineConfig, model_path: str, port: int) -> list[str]:
    """The ``python -m sglang.launch_server`` command line for one engine.

    With ``config.sampling_seed`` the server runs with ``--enable-deterministic-inference``:
    only then does SGLang honour the per-request seeds the engine sends (it also switches
    to batch-invariant kernels and the pytorch sampling backend, and accepts only some
    attention backends: fa3, fa4, flashinfer, triton, ascend, intel_xpu; not torch_native).
    """
    command = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        config.host,
        "--port",
        str(port),
        "--tp-size",
        str(config.tp_size),
    ]
    if config.mem_fraction_static is not None:
        command += ["--mem-fraction-static", str(config.mem_fraction_static)]
    if config.sampling_seed and DETERMINISTIC_FLAG not in config.extra_args:
        command.append(DETERMINISTIC_FLAG)
    if config.max_lora_rank is not None:  # adapters arrive through /load_lora_adapter
        command += ["--enable-lora", "--max-lora-rank", str(config.max_lora_rank),
                    "--lora-target-modules", *(config.lora_target_modules or ["all"])]
    return command + list(config.extra_args)


def wait_healthy(
    url: str,
    timeout_s: float,
    process: subprocess.Popen | None = None,
    log_path: Path | None = None,
) -> None:
    """Poll ``GET /health`` until it answers 200; fail early if the process died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise SGLangLaunchError(
                f"sglang server for {url} exited with code {process.returncode}:\n{_tail(log_path)}"
            )
        try:
            if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(1.0)
    raise SGLangLaunchError(
        f"sglang server {url} not healthy after {timeout_s:.0f}s:\n{_tail(log_path)}"
    )


def launch_server(
    config: SGLangEngineConfig, model_path: str, rank: int
) -> tuple[str, subprocess.Popen]:
    """Start engine `rank`'s server on base_port + rank; returns (url, process)."""
    port = config.base_port + rank
    url = f"http://{config.host}:{port}"
    log_path = Path(tempfile.mkdtemp(prefix="tally-sglang-")) / f"server-{rank}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            launch_command(config, model_path, port), stdout=log, stderr=subprocess.STDOUT
        )
    try:
        wait_healthy(url, config.launch_timeout_s, process, log_path)
    except BaseException:
        stop_server(process)
        raise
    return url, process


def stop_server(process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Terminate a launched server, killing it if it does not exit in time."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _tail(log_path: Path | None, num_lines: int = 30) -> str:
    if log_path is None or not log_path.is_file():
        return "(no log)"
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-num_lines:])
