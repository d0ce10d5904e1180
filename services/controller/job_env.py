"""The environment every job and session starts from: an allowlist, never the controller's.

A Ray job's driver is a child of the head's job agent and its actors are children of the
raylet, so all of them inherit the environment of ``ray start``; ``runtime_env``
``env_vars`` can add variables but never remove one. So the embedded head is started from
:func:`scrubbed_env` (services/controller/ray_head.py), and what a job adds is its own
(services/controller/ray_jobs.py refuses :data:`CONTROLLER_ONLY` in ``env_vars``).

Kept, and why (anything else, every other ``TALLY_*`` included, is dropped):

- ``PATH``, ``HOME``, ``USER``, ``LOGNAME``, ``SHELL``, ``TMPDIR``/``TMP``/``TEMP``, ``TZ``,
  ``LANG``/``LANGUAGE``/``LC_*``: finding programs, the home folder (Ray's own
  ``~/.ray/auth_token``, caches under ``~/.cache``), temp files and text encoding.
- ``PYTHONPATH``, ``VIRTUAL_ENV``, ``PYTHONUNBUFFERED``, ``PYTHONHASHSEED``,
  ``PYTHONDONTWRITEBYTECODE``, ``LD_LIBRARY_PATH``: the same interpreter and import path as
  the controller's (a user module on PYTHONPATH is found by the job as by the check at
  submit), the same native libraries.
- ``RAY_*`` (``RAY_ADDRESS`` excepted: a job joins its own head): Ray's own settings,
  ``RAY_AUTH_MODE``/``RAY_AUTH_TOKEN`` included, which every worker needs to reach its
  cluster at all (a job can already start anything on that cluster: no new power).
- ``HF_HOME``, ``HF_HUB_OFFLINE``, ``HF_HUB_CACHE``, ``HF_DATASETS_OFFLINE``,
  ``HF_HUB_DISABLE_*``, ``TRANSFORMERS_*``, ``TOKENIZERS_PARALLELISM``: where models live and
  that nothing is downloaded. Not ``HF_TOKEN``: jobs read local folders only.
- ``CUDA_*``, ``NVIDIA_*``, ``NCCL_*``, ``GLOO_*``, ``PYTORCH_*``, ``TORCH_*``,
  ``TORCHINDUCTOR_*``, ``TRITON_*``, ``OMP_NUM_THREADS``, ``MKL_*``, ``XDG_CACHE_HOME``:
  which GPUs, how collectives connect, thread counts and compile caches.
- ``WANDB_*``: ``logging.wandb`` is a job feature the operator configures for jobs; the
  key grants W&B only, nothing of the controller's.
- ``SSL_CERT_FILE``, ``SSL_CERT_DIR``, ``REQUESTS_CA_BUNDLE``: TLS trust for W&B and a
  controller behind HTTPS.
- ``TALLY_CACHE_DIR`` (the tiny model's cache). ``TALLY_DATA_DIR`` and a job's
  ``TALLY_JOB_TOKEN`` come by ``env_vars``, per job.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from services.controller.auth import run_token
from services.sessions.server import ADVERTISE_ENV, IDLE_ENV

if TYPE_CHECKING:
    from services.controller.settings import Settings
    from services.controller.tables import Run

KEPT = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TMPDIR", "TMP", "TEMP", "TZ", "LANG",
    "LANGUAGE", "PYTHONPATH", "VIRTUAL_ENV", "PYTHONUNBUFFERED", "PYTHONHASHSEED",
    "PYTHONDONTWRITEBYTECODE", "LD_LIBRARY_PATH", "HF_HOME", "HF_HUB_OFFLINE",
    "HF_HUB_CACHE", "HF_DATASETS_OFFLINE", "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS",
    "XDG_CACHE_HOME", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE",
    "TALLY_CACHE_DIR"})
"""Variables kept by name (the module doc says why)."""
KEPT_PREFIXES = ("LC_", "RAY_", "HF_HUB_DISABLE_", "TRANSFORMERS_", "CUDA_", "NVIDIA_",
                 "NCCL_", "GLOO_", "PYTORCH_", "TORCH_", "TORCHINDUCTOR_", "TRITON_", "MKL_",
                 "WANDB_")
"""Families kept whole (the module doc says why)."""
DROPPED = frozenset({"RAY_ADDRESS"})
"""Kept by a prefix, dropped all the same: a job of the embedded head joins that head."""
CONTROLLER_ONLY = frozenset({"TALLY_API_TOKEN", "TALLY_DATABASE_URL",
                             "TALLY_CONTROLLER_DIR"})
"""The controller's own credentials: never in a job's environment, by any route."""


def kept(name: str) -> bool:
    """Whether a job may inherit variable ``name``."""
    if name in DROPPED or name in CONTROLLER_ONLY:
        return False
    return name in KEPT or name.startswith(KEPT_PREFIXES)


def scrubbed_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` a job may inherit (the module doc's allowlist)."""
    return {name: value for name, value in environ.items() if kept(name)}


def run_env(settings: Settings, run: Run) -> dict[str, str]:
    """What a run adds to the allowlist (``env_vars``), rebuilt from its row and the
    controller's settings each time it is started, never read back from its folder (a Ray
    pod may write there): where its data folder is, and

    - a job: the controller's URL, its id and its own token (auth.py ``run_token``) to
      post its metrics and status;
    - a session: its idle timeout and the address its server advertises.

    A variable of :data:`CONTROLLER_ONLY` never appears (ray_jobs.py refuses it too)."""
    env = {"TALLY_DATA_DIR": str(settings.data_dir)}
    if run.kind == "session":
        idle = run.idle_timeout_s or settings.session_idle_timeout_s
        env[IDLE_ENV] = str(idle)
        if advertise := run.advertise_host or settings.sessions_advertise_host:
            env[ADVERTISE_ENV] = advertise
    else:
        env.update(TALLY_CONTROLLER_URL=settings.controller_url, TALLY_JOB_ID=run.id)
        if settings.api_token:
            env["TALLY_JOB_TOKEN"] = run_token(settings.api_token, run.kind, run.id)
    return {name: value for name, value in env.items() if name not in CONTROLLER_ONLY}
