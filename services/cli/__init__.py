"""The ``tally`` command line: one file per command group, every command behind one error
mapping (services/runtime/exit_codes.py: 2 refused before anything started, 1 ran and failed).

    jobs.py         train, demo, validate, eval, warmup, schema
    rm.py           train-rm
    verify.py       verify-aggregation, verify-objective, aggregation-demo (the programs:
                    services/verify/)
    models.py       import-model
    checkpoints.py  export, checkpoint verify
    controller.py   serve, submit, jobs, status, logs, samples, cancel

The commands are registered here, in the order ``tally --help`` lists them.
"""

from __future__ import annotations

from typing import Annotated

import typer

from services.cli import checkpoints, controller, jobs, models, rm, verify
from services.cli.common import mapped

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Tally: RL post-training with exact loss aggregation.")


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


for _name, _command in (
        ("train", jobs.train), ("train-rm", rm.train_rm), ("validate", jobs.validate),
        ("eval", jobs.eval_command), ("verify-aggregation", verify.verify_aggregation),
        ("verify-objective", verify.verify_objective),
        ("import-model", models.import_model_command), ("export", checkpoints.export_command),
        ("warmup", jobs.warmup), ("schema", jobs.schema),
        ("aggregation-demo", verify.aggregation_demo), ("demo", jobs.demo),
        ("serve", controller.serve), ("submit", controller.submit), ("jobs", controller.jobs),
        ("status", controller.status), ("logs", controller.logs),
        ("samples", controller.samples), ("cancel", controller.cancel)):
    app.command(_name)(mapped(_command))
checkpoints.checkpoint_app.command("verify")(mapped(checkpoints.checkpoint_verify))
app.add_typer(checkpoints.checkpoint_app, name="checkpoint")

__all__ = ["app"]
