"""`raylane import` and `export`: Hugging Face checkpoints into the Model Registry and out."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from raylane.cli.common import TrackingUriOption, app, console, user_mistakes


@app.command("import")
def import_(
    directory: Annotated[
        Path, typer.Argument(help="Hugging Face checkpoint directory (config.json, safetensors).")
    ],
    name: Annotated[str, typer.Option("--name", help="Registered model to add a version to.")],
    tracking_uri: TrackingUriOption = None,
) -> None:
    """Register a Hugging Face checkpoint (Llama, Mistral, Qwen2) as a new model version."""
    from raylane.tracking import resolve_tracking_uri
    from raylane.tracking.checkpoints_hf import CheckpointError, import_checkpoint

    with user_mistakes(CheckpointError):
        done = import_checkpoint(directory, name, resolve_tracking_uri(tracking_uri))
    _report(f"registered {done.name} v{done.version} from {done.source} (sha256 {done.sha256})")


@app.command("export")
def export(
    model_uri: Annotated[
        str, typer.Argument(help="Registered version: models:/NAME/VERSION or models:/NAME@ALIAS.")
    ],
    directory: Annotated[Path, typer.Argument(help="Directory to write (new or empty).")],
    tracking_uri: TrackingUriOption = None,
) -> None:
    """Write a registered Llama-family model (imported, or trained by raylane) as a Hugging
    Face directory."""
    from raylane.tracking import resolve_tracking_uri
    from raylane.tracking.checkpoints_hf import CheckpointError, export_model

    with user_mistakes(CheckpointError):
        done = export_model(model_uri, directory, resolve_tracking_uri(tracking_uri))
    _report(f"wrote {done.directory} (transformers.AutoModelForCausalLM.from_pretrained loads it)")


def _report(line: str) -> None:
    """The command's result: one line, unwrapped (paths and digests stay whole)."""
    console.print(line, highlight=False, soft_wrap=True)
