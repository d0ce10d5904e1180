"""The `tally` command line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Tally: RL post-training with exact loss aggregation.")

ConfigArg = Annotated[Path, typer.Argument(help="YAML job config", exists=False)]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", help="override a field: --set trainer.optimizer.lr=1e-5 (repeatable)")]


def _load(config: Path, overrides: list[str] | None):
    from services.config import ConfigError, load_job_config

    try:
        return load_job_config(config, overrides or [])
    except ConfigError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None


@app.command()
def train(config: ConfigArg, set_: SetOpt = None,
          output_dir: Annotated[Path | None, typer.Option(help="job folder")] = None,
          address: Annotated[str | None, typer.Option(
              help="Ray cluster to join (e.g. 127.0.0.1:6379); default: RAY_ADDRESS, "
                   "else a local head started and stopped by this command")] = None) -> None:
    """Run a job: joins the Ray cluster at --address / RAY_ADDRESS, or starts a local head
    and stops it when the job ends."""
    from services.config import ConfigError
    from services.train import preflight, run_job

    if address:
        os.environ["RAY_ADDRESS"] = address
    job = _load(config, set_)
    try:
        preflight(job)
    except ConfigError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None
    run_job(job, output_dir)


@app.command("verify-aggregation")
def verify_aggregation(
    config: ConfigArg, set_: SetOpt = None,
    layouts: Annotated[str, typer.Option(help="comma-separated, e.g. dp1cp1,dp2cp1,dp1cp2")]
    = "dp1cp1,dp2cp1,dp1cp2",
) -> None:
    """One optimizer step on the same rollout batch under each layout; prints the max
    relative difference of updated weights and logged losses against the first layout."""
    import ray

    from services.train import data_dir, ensure_ray
    from trainer.verify import Layout, verify_layouts

    job = _load(config, set_)
    parsed = [Layout.parse(text) for text in layouts.split(",") if text]
    needed = max(lay.dp_size * lay.cp_size for lay in parsed) + 2
    started = ensure_ray(max(os.cpu_count() or 1, needed))
    try:
        from rollout.manager import RolloutManagerActor
        from rollout.tiny import resolve_model_path

        model_path = resolve_model_path(job.rollout.model, data_dir() / "models")
        manager = RolloutManagerActor.remote(job.rollout, model_path)
        batch = ray.get(manager.generate_batch.remote(0))
        ray.get(manager.shutdown.remote())
        typer.echo(f"batch: {batch.num_samples} samples, {batch.num_valid_tokens} valid tokens; "
                   f"reference layout {parsed[0]}")
        rows = verify_layouts(job.trainer_config(), model_path, batch, parsed,
                              job.max_response_len)
        typer.echo(f"{'layout':<8} {'mode':<12} {'weights':>9} {'pg_loss':>9} {'kl':>9} "
                   f"{'entropy':>9} {'grad_norm':>9}")
        for row in rows:
            typer.echo(f"{row['layout']:<8} {row['mode']:<12} " + " ".join(
                f"{row[k]:>9.1e}" for k in ("weights", "pg_loss", "kl", "entropy", "grad_norm")))
    finally:
        if started:
            ray.shutdown()


@app.command()
def warmup(config: ConfigArg, set_: SetOpt = None) -> None:
    """Run (or find cached) the supervised warm start of a job config."""
    from rollout.tiny import resolve_model_path
    from services.train import data_dir
    from services.warmup import warm_start

    job = _load(config, set_)
    model_path = resolve_model_path(job.rollout.model, data_dir() / "models")
    typer.echo(warm_start(model_path, job.rollout.dataset, job.warmup, data_dir() / "warmup"))


@app.command()
def schema(markdown: Annotated[bool, typer.Option(
        help="print the option tables of docs/configuration.md instead")] = False) -> None:
    """Print the JSON schema of job configs (for editors)."""
    if markdown:
        from services.config_docs import configuration_markdown

        typer.echo(configuration_markdown(), nl=False)
        return
    from services.config import job_json_schema

    typer.echo(job_json_schema(), nl=False)


@app.command("aggregation-demo")
def aggregation_demo(dp: int = 2, cp: int = 2) -> None:
    """Split one random step over DP × CP gloo processes; print J per mode vs the reference."""
    from services.aggregation_demo import print_demo

    if not print_demo(dp, cp):
        raise typer.Exit(1)


@app.command()
def demo() -> None:
    """The embedded default: the tiny model learns a synthetic task with RL (configs/demo.yaml)."""
    train(Path(__file__).resolve().parent.parent / "configs" / "demo.yaml", None, None, None)


if __name__ == "__main__":
    app()
