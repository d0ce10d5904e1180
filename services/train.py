"""The entry point of one job: ``python -m services.train configs/demo.yaml`` (what
``ray job submit`` runs, and ``tally train``). The driver itself is services/driver/."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from services.config.job import ConfigError, JobConfig, load_job_config
from services.driver.run_dir import CHECKPOINTS_DIR, RunDir, job_dir, write_failure
from services.runtime.exit_codes import FAILED, exit_for
from services.runtime.placement import NeverFits, starts_local_head
from services.runtime.preflight import preflight

Resume = bool | Path | None
"""None: the config's ``resume`` decides; True: the newest readable checkpoint of the job
folder (``--resume auto``); False: none (``--no-resume``); a Path: that checkpoint."""


def train_from_cli(config_path: str | Path, overrides: list[str] | None = None,
                   output_dir: Path | None = None, resume: Resume = None,
                   force: bool = False) -> int:
    """Load and preflight the config, decide where the job resumes (a ConfigError goes to
    stderr, exit code 2: nothing started), then run it, reporting to the controller when
    ``TALLY_CONTROLLER_URL`` is set. A job that fails for good says why in its last line
    (exit code 1) and in its ``failed`` event. ``force``: resume even with settings that
    break exactness."""
    try:
        config = load_job_config(config_path, overrides or [])
        for note in preflight(config, local_head=starts_local_head(), load_user_code=True):
            print(f"note: {note}")
    except ConfigError as err:
        return _reported(err)
    if resume is not None:
        config = config.model_copy(update={"resume": resume is not False})
    named = Path(resume) if isinstance(resume, Path) else None
    if named is not None and not output_dir and not config.output_dir and (
            named.resolve().parent.name == CHECKPOINTS_DIR):
        output_dir = named.resolve().parent.parent  # the job the checkpoint belongs to
    output_dir = output_dir or (Path(config.output_dir) if config.output_dir
                                else job_dir(config.name, config.output_dir))
    if os.environ.get("RAY_ADDRESS"):
        try:
            never = _never_fits_joined(config)
        except Exception as err:  # e.g. no cluster at RAY_ADDRESS: said as run_job says it
            write_failure(RunDir(output_dir).create().path, f"{type(err).__name__}: {err}",
                          FAILED)
            raise
        if never is not None:
            return _refused_by_cluster(config.name, never, output_dir)
    # Only now the driver (torch, transformers): a refused config answers in about a
    # second, and a job too large for the cluster it joined in a few.
    from services.clients.controller import controller_sinks
    from services.driver.loop import JobFailed, run_job

    try:
        with controller_sinks(config, output_dir) as sinks:  # [] unless TALLY_CONTROLLER_URL
            run_job(config, output_dir, extra_sinks=sinks, resume_from=named, force=force,
                    preflighted=True)
    except (ConfigError, JobFailed) as err:  # the resume refused (2), the job failed (1)
        code = _reported(err)
        write_failure(output_dir, str(err), code)  # what the controller and the CLI say
        return code
    except Exception as err:  # a bug: its traceback shows, and its line is the event's
        write_failure(output_dir, f"{type(err).__name__}: {err}", 1)
        raise
    return 0


def _never_fits_joined(config: JobConfig) -> NeverFits | None:
    """Why the job can never fit the cluster named by RAY_ADDRESS (``ray job submit``, the
    controller's head), asked before the driver is imported: its imports (torch,
    transformers) cost several CPU-seconds, 15-20 s of wall time on a busy two-core
    head. The driver asks again (run_job), and alone judges a head it starts."""
    from services.runtime.gang import ensure_ray
    from services.runtime.placement import refuse_if_never_fits

    ensure_ray(0)  # joins: the number of CPUs is for a head it would start
    try:
        refuse_if_never_fits(config)
    except NeverFits as err:
        return err
    return None


def _refused_by_cluster(name: str, err: NeverFits, output_dir: Path) -> int:
    """What run_job does with a job that can never fit: its ``placement_failed`` event,
    then the failed job's line and event (exit code 1)."""
    RunDir(output_dir).create().write_event("placement_failed", str(err))
    message = f"job {name}: {err}"
    print(f"error: {message}", file=sys.stderr)
    write_failure(output_dir, message, FAILED)
    return FAILED


def _reported(err: Exception) -> int:
    """``err``'s line on stderr; its exit code (services/runtime/exit_codes.py)."""
    code, line = exit_for(err) or (1, f"error: {err}")
    print(line, file=sys.stderr)
    return code


def resume_option(resume: str | None, no_resume: bool) -> Resume:
    """``--resume auto|PATH`` / ``--no-resume`` as :data:`Resume` (ValueError for both)."""
    if resume is not None and no_resume:
        raise ValueError("--resume and --no-resume: choose one")
    if no_resume:
        return False
    if resume is None:
        return None
    return True if resume == "auto" else Path(resume)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.train",
                                     description="Run one Tally RL job.")
    parser.add_argument("config", help="YAML job config")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="override a field, e.g. trainer.optimizer.lr=1e-5")
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument("--resume", metavar="auto|PATH", default=None,
                        help="resume from the job folder's newest checkpoint (auto) or "
                             "from this checkpoint folder")
    parser.add_argument("--no-resume", action="store_true",
                        help="start at step 0 (the folder's checkpoints are set aside)")
    parser.add_argument("--force", action="store_true",
                        help="resume even with changed settings that break exactness")
    args = parser.parse_args(argv)
    try:
        resume = resume_option(args.resume, args.no_resume)
    except ValueError as err:
        parser.error(str(err))
    return train_from_cli(args.config, args.overrides, args.output_dir, resume, args.force)


if __name__ == "__main__":
    sys.exit(main())
