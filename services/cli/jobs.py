"""Commands on one job config, run here: train, demo, validate, eval, warmup, schema."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from services.cli.common import AddressOpt, ConfigArg, SetOpt, load_job
from services.runtime.exit_codes import Refused

if TYPE_CHECKING:
    from services.config.job import JobConfig


def train(config: ConfigArg, set_: SetOpt = None,
          output_dir: Annotated[Path | None, typer.Option(help="job folder")] = None,
          address: AddressOpt = None,
          resume: Annotated[str | None, typer.Option(
              metavar="auto|PATH",
              help="auto: the job folder's newest readable checkpoint (what `resume: "
                   "true` does); PATH: that checkpoint folder (its job folder is the "
                   "default --output-dir)")] = None,
          no_resume: Annotated[bool, typer.Option(
              "--no-resume", help="start at rollout step 0; the folder's checkpoints are "
                                  "set aside")] = False,
          force: Annotated[bool, typer.Option(
              help="resume even though a setting that changes what is trained differs "
                   "from the checkpoint's")] = False) -> int:
    """Run a job: joins the Ray cluster at --address / RAY_ADDRESS, or starts a local head
    and stops it when the job ends. The same entry point as ``python -m services.train``.
    Rerun with the same --output-dir it resumes, and a finished job starts nothing."""
    from services.train import resume_option, train_from_cli

    try:
        resume_from = resume_option(resume, no_resume)
    except ValueError as err:
        raise Refused(f"error: {err}") from None
    if address:
        os.environ["RAY_ADDRESS"] = address
    return train_from_cli(config, set_ or [], output_dir, resume_from, force)


def demo() -> int:
    """The embedded default: the tiny model learns a synthetic task with RL (configs/demo.yaml)."""
    return train(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml", None, None,
                 None, None, False, False)


def job_summary(job: JobConfig) -> str:
    """One line: what a job config runs."""
    rollout, trainer = job.rollout, job.trainer
    return (f"{job.name}: {job.num_steps} rollout steps of {rollout.num_prompts_per_rollout} "
            f"prompts × {rollout.n_samples_per_prompt} samples, "
            f"{job.num_updates_per_rollout} optimizer step(s) each, "
            f"{job.aggregation.mode}, model {rollout.model}, {trainer.backend} "
            f"dp={trainer.dp_size} cp={trainer.cp_size}")


def validate(config: ConfigArg, set_: SetOpt = None) -> None:
    """Every check a job gets before anything starts (its fields, data, modules, model
    folder; what the controller runs at submit), starting nothing: ``ok: <summary>``, or
    each problem on one line and exit code 2."""
    job = load_job(config, set_, check=True)
    for warning in job.warnings():
        typer.echo(f"warning: {warning.field}: {warning.message}")
    typer.echo(f"ok: {job_summary(job)}")


def eval_command(
    checkpoint: Annotated[Path, typer.Argument(
        help="a checkpoint folder (<job>/checkpoints/step_00000003, or checkpoints/latest)")],
    config: Annotated[Path, typer.Option("--config", "-c", help="YAML job config")],
    set_: SetOpt = None, address: AddressOpt = None,
) -> None:
    """The config's eval section (dataset, num_prompts, num_samples, pass@k) on a
    checkpoint's weights, through the rollout engines; no training. The seeds are those
    of the job's own evaluation of the same weight version."""
    from services.driver.evaluation import evaluate_checkpoint

    job = load_job(config, [*(set_ or []), "eval.enabled=true"], check=True)
    if address:
        os.environ["RAY_ADDRESS"] = address
    metrics = evaluate_checkpoint(job, checkpoint)  # an ExportError: exit 2, its line
    for name, value in metrics.items():
        typer.echo(f"{name:<24} {value:.4f}".rstrip("0").rstrip("."))


def warmup(config: ConfigArg, set_: SetOpt = None) -> None:
    """Run (or find cached) the supervised warm start of a job config."""
    from services.driver.job import job_model_path

    typer.echo(job_model_path(load_job(config, set_)))


def schema(markdown: Annotated[bool, typer.Option(
        help="print the option tables of docs/configuration.md instead")] = False) -> None:
    """Print the JSON schema of job configs (for editors)."""
    if markdown:
        from services.config.docs import configuration_markdown

        typer.echo(configuration_markdown(), nl=False)
        return
    from services.config.job import job_json_schema

    typer.echo(job_json_schema(), nl=False)
