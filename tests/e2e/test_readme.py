"""The README's commands, run as a newcomer runs them: each block parsed from README.md and
run verbatim by bash from the repository root, with only the venv the README's
``make install`` makes. A long run has its step count cut by the test (said in the test's
name); nothing else is changed.

A block that starts Ray (``ray start --head`` … ``ray stop``) runs in new PID, mount and
network namespaces with its own /tmp/ray and HOME: a fresh machine, whose default ports
(6379, 8265) and ``ray stop`` reach no other Ray of this machine (the suite runs two
workers, each with heads of its own)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv"
FRESH_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""A login shell's PATH: no venv, no test's own tools."""

pytestmark = pytest.mark.skipif(
    Path(sys.prefix).resolve() != VENV.resolve(),
    reason="the README's commands run in the repository's own .venv (make install)")


def readme_blocks() -> list[str]:
    """Every ```bash block of README.md, in order."""
    text = (ROOT / "README.md").read_text()
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)


def block_with(fragment: str) -> str:
    (block,) = [b for b in readme_blocks() if fragment in b]
    return block


def fresh_env() -> dict[str, str]:
    """A new shell's environment: no RAY_*, TALLY_* or venv of the test's; usage stats
    off as everywhere on this machine."""
    return {"PATH": FRESH_PATH, "LANG": "C.UTF-8", "RAY_USAGE_STATS_ENABLED": "0"}


def run_on_fresh_machine(script: str, home: Path, timeout_s: float
                         ) -> subprocess.CompletedProcess:
    """``script`` (bash, -e) in namespaces of its own (Ray's /tmp/ray a new tmpfs there),
    from the repository root, HOME ``home`` (new, empty); what it printed, the last line
    ``raylets left: N``."""
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is needed to give the README's Ray head a machine "
                    "of its own")
    Path("/tmp/ray").mkdir(exist_ok=True)  # the mount point; this machine's Ray uses it
    setup = ("ip link set lo up && mount -t tmpfs tmpfs /tmp/ray && "
             f"export HOME={shlex.quote(str(home))} && cd {shlex.quote(str(ROOT))}")
    check = "echo \"raylets left: $(pgrep -c raylet || true)\""
    command = f"{setup}\nset -e\n{script}\nset +e\n{check}\n"
    return subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "--net", "bash", "-c", command],
        env=fresh_env(), capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.slow
def test_readme_ray_job_submit_block_verbatim_with_num_steps_cut_to_2_and_a_job_too_big(
        tmp_path: Path) -> None:
    """On a fresh machine, the README's block — venv, token auth, a default ``ray start
    --head`` (2 CPUs on two cores), ``ray job submit --working-dir .``, ``ray stop`` —
    runs the demo to its end with exit 0 and leaves no Ray process.

    Before its submit, on that head, the same submit with trainer ranks asking for more
    CPUs than the machine has: Ray's CLI returns within 30 s, the job failed, its last
    line says what it needs, what the cluster has and what to lower (one head for both:
    the head's start is most of either's cost)."""
    block = block_with("ray job submit")
    assert "--set num_steps=50" in block
    cores = os.cpu_count() or 1
    submit = block[block.index("ray job submit"):block.index("ray stop")]
    too_big = submit.replace("--set num_steps=50",
                             f"--set num_steps=2 --set trainer.num_cpus_per_rank={cores + 1}")
    timed = (f"start=$SECONDS\n{too_big.rstrip()} || true\n"
             "echo \"submit took $((SECONDS - start)) s\"\n")
    script = block.replace(submit, timed + submit).replace("num_steps=50", "num_steps=2")
    assert script.count("ray job submit") == 2
    result = run_on_fresh_machine(script, tmp_path, 600)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    refused, _, verbatim = out.partition("submit took ")
    took = int(verbatim.split()[0])
    assert took < 30, out[-3000:]
    need = 2 * (cores + 1) + 0.5
    assert (f"the job can never fit this Ray cluster: it needs {need:g} CPU, the cluster has "
            f"{cores} CPU in all; lower trainer.num_cpus_per_rank / trainer.dp_size"
            ) in refused, refused[-3000:]
    assert re.search(r"Job '\w+' failed", refused) and "warmup: step" not in refused
    assert "(2/2 done)" in verbatim and re.search(r"Job '\w+' succeeded", verbatim), (
        verbatim[-4000:])
    assert "Authentication required" not in out and "waiting for resources" not in out
    assert result.stdout.rstrip().endswith("raylets left: 0"), out[-2000:]


def test_readme_gpu_line_verbatim_is_refused_only_for_what_this_machine_lacks() -> None:
    """The README's GPU recipe on this CPU machine: the engine type switched by --set
    carries no torch-engine field over (no 'unknown key'); what is refused is the GPU
    (and SGLang, a GPU package) — in one line each, exit 2, before Ray starts."""
    block = block_with("rollout.engine.type=sglang")
    script = f"source .venv/bin/activate\n{block}"
    started = time.monotonic()
    result = subprocess.run(["bash", "-c", script], cwd=ROOT, env=fresh_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert time.monotonic() - started < 60
    lines = result.stderr.strip().splitlines()
    assert not any("unknown key" in line for line in lines), lines
    assert any(line.startswith("trainer.num_gpus_per_rank: 1 GPU per rank asked for, but "
                               "this machine has no GPU") for line in lines), lines
    assert all(line.split(":")[0] in ("trainer.num_gpus_per_rank", "rollout.engine.type")
               for line in lines), lines


def run_in_venv(script: str, home: Path, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """``script`` (bash, -e) from the repository root with the venv activated, HOME
    ``home`` (a fresh ~/.tally)."""
    return subprocess.run(["bash", "-c", f"set -e\nsource .venv/bin/activate\n{script}"],
                          cwd=ROOT, env={**fresh_env(), "HOME": str(home)},
                          capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.slow
def test_readme_first_commands_with_num_steps_cut_to_2_then_ppo_epochs_and_export(
        tmp_path: Path) -> None:
    """The README's first CLI block (validate, a train cut to 2 steps, schema, version,
    help), then its 3-rollout PPO-epochs run verbatim, then its export block on the
    checkpoint that run wrote (the README names ``step_00000002``: steps count from 0),
    with ``<job>`` the job folder's name."""
    first = block_with("tally validate configs/demo.yaml")
    assert "--set num_steps=50" in first
    schema = ROOT / "my-editor-schema.json"
    try:
        result = run_in_venv(first.replace("num_steps=50", "num_steps=2"), tmp_path)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "(2/2 done)" in result.stdout, result.stdout[-3000:]
        assert '"title": "JobConfig"' in schema.read_text()
        assert "usage: tally train" in result.stdout.lower()
    finally:
        schema.unlink(missing_ok=True)
    epochs = run_in_venv(block_with("--set trainer.ppo_epochs=2"), tmp_path)
    assert epochs.returncode == 0, epochs.stdout[-3000:] + epochs.stderr[-3000:]
    assert "(3/3 done)" in epochs.stdout and "8 updates" in epochs.stdout
    job = re.search(r"^output: .*/\.tally/jobs/(\S+)$", epochs.stdout, flags=re.M)
    assert job is not None, epochs.stdout[-2000:]
    export = block_with("tally export ~/.tally/jobs/<job>/checkpoints/")
    exported = run_in_venv(f"cd {tmp_path}\n" + export.replace("<job>", job.group(1)),
                           tmp_path)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    for folder, dtype in (("my-model", "float32"), ("my-model-bf16", "bfloat16")):
        config = (tmp_path / folder / "config.json").read_text()
        assert f'"torch_dtype": "{dtype}"' in config
        assert (tmp_path / folder / "model.safetensors").is_file()


def test_readme_verify_objective_block_verbatim(tmp_path: Path) -> None:
    """The README's verify-objective block as written: every term holds, exit 0."""
    block = block_with("tally verify-objective")
    result = run_in_venv(block, tmp_path, 300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "terms hold to their formula" in result.stdout
    assert " ok" in result.stdout and "FAIL" not in result.stdout
