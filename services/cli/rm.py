"""``tally train-rm``: a Bradley–Terry reward model (services/train_rm/)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from services.cli.common import AddressOpt, ConfigArg, SetOpt


def train_rm(config: ConfigArg, set_: SetOpt = None,
             output_dir: Annotated[Path | None, typer.Option(
                 help="run folder (default: the config's output_dir, else "
                      "<data dir>/jobs/<name>-<time>)")] = None,
             address: AddressOpt = None) -> int:
    """Train a Bradley–Terry reward model on preference pairs (JSONL {"prompt", "chosen",
    "rejected"}); writes metrics.jsonl and final_model/, a folder
    AutoModelForSequenceClassification loads (docs/reward-models.md). A bad config or
    data file is one line naming the field or the line, exit code 2, nothing started."""
    from services.train_rm.run import train_rm_from_cli

    if address:
        os.environ["RAY_ADDRESS"] = address
    return train_rm_from_cli(config, set_ or [], output_dir)
