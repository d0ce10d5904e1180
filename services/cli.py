"""The `tally` command line."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Tally: RL post-training with exact loss aggregation.")


@app.command("aggregation-demo")
def aggregation_demo(dp: int = 2, cp: int = 2) -> None:
    """Split one random step over DP × CP gloo processes; print J per mode vs the reference."""
    from services.aggregation_demo import print_demo

    if not print_demo(dp, cp):
        raise typer.Exit(1)


@app.command()
def demo() -> None:
    """The embedded default job (for now: the aggregation demo)."""
    aggregation_demo(2, 2)


if __name__ == "__main__":
    app()
