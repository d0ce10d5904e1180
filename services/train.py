"""The entry point of one job: ``python -m services.train configs/demo.yaml`` (what
``ray job submit`` runs, and ``tally train``). The driver itself is services/driver/."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.config import ConfigError, load_job_config
from services.controller_client import controller_sinks
from services.driver.loop import run_job
from services.driver.run_dir import job_dir
from services.preflight import preflight


def train_from_cli(config_path: str | Path, overrides: list[str] | None = None,
                   output_dir: Path | None = None) -> int:
    """Load and preflight the config (a ConfigError goes to stderr, exit code 2), then run
    it, reporting to the controller when ``TALLY_CONTROLLER_URL`` is set. Returns the
    exit code."""
    try:
        config = load_job_config(config_path, overrides or [])
        preflight(config)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    output_dir = output_dir or (Path(config.output_dir) if config.output_dir
                                else job_dir(config.name, config.output_dir))
    with controller_sinks(config, output_dir) as sinks:  # [] unless TALLY_CONTROLLER_URL
        run_job(config, output_dir, extra_sinks=sinks)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.train",
                                     description="Run one Tally RL job.")
    parser.add_argument("config", help="YAML job config")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="override a field, e.g. trainer.optimizer.lr=1e-5")
    parser.add_argument("--output-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    return train_from_cli(args.config, args.overrides, args.output_dir)


if __name__ == "__main__":
    sys.exit(main())
