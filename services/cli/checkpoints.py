"""Commands on checkpoint folders: ``export`` and ``checkpoint verify``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from services.runtime.exit_codes import REFUSED, Refused


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
    from trainer.export import export_checkpoint

    # an ExportError: exit 2, its line
    typer.echo(export_checkpoint(checkpoint, out_dir, dtype, adapter=adapter, base=base))


checkpoint_app = typer.Typer(no_args_is_help=True, help="Check checkpoint folders.")


def checkpoint_verify(folder: Annotated[Path, typer.Argument(
        help="a checkpoint (step_N or latest), a job's checkpoints/ folder or a job "
             "folder")]) -> int:
    """Read every byte of each checkpoint in FOLDER against its manifest (a start checks
    only sizes and the small files): one line per checkpoint, exit 2 when any fails."""
    from services.driver.checkpoint import DRIVER_STATE, unreadable
    from services.driver.run_dir import CHECKPOINTS_DIR
    from trainer.checkpoint import checkpoints

    folder = folder.resolve()
    found = ([folder] if (folder / DRIVER_STATE).is_file()
             else checkpoints(folder / CHECKPOINTS_DIR) or checkpoints(folder))
    if not found:
        raise Refused(f"error: {folder}: no checkpoint here (no {DRIVER_STATE}, no step_N "
                      "folders)")
    failed = 0
    for path in found:
        reason = unreadable(path, full=True)
        failed += reason is not None
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        typer.echo(f"{path}: {reason}" if reason else
                   f"{path}: ok ({size:,} bytes read)", err=reason is not None)
    return REFUSED if failed else 0  # a checkpoint that cannot be resumed from
