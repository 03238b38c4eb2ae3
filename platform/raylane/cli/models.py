"""`raylane import` and `export`: Hugging Face checkpoints into the Model Registry and out."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from raylane.cli.common import TrackingUriOption, console
from raylane.cli.lazy import deferred
from raylane.cli.running import user_mistakes
from raylane.tracking import resolve_tracking_uri

# MLflow and torch: loaded once the arguments are checked.
checkpoints = deferred("raylane.tracking.checkpoints_hf")


def import_(
    directory: Annotated[
        Path,
        typer.Argument(
            metavar="DIRECTORY",
            help="Hugging Face checkpoint directory (config.json, safetensors).",
        ),
    ],
    name: Annotated[str, typer.Option("--name", help="Registered model to add a version to.")],
    tracking_uri: TrackingUriOption = None,
) -> None:
    """Register a Hugging Face checkpoint as a new model version.

    Llama, Mistral and Qwen2 checkpoints (config.json and safetensors).

    Example: raylane import checkpoints/tiny-llama --name tiny-llama
    """
    with user_mistakes(checkpoints.CheckpointError):
        done = checkpoints.import_checkpoint(directory, name, resolve_tracking_uri(tracking_uri))
    _report(f"registered {done.name} v{done.version} from {done.source} (sha256 {done.sha256})")


def export(
    model_uri: Annotated[
        str,
        typer.Argument(
            metavar="MODEL_URI",
            help="Registered version: models:/NAME/VERSION or models:/NAME@ALIAS.",
        ),
    ],
    directory: Annotated[
        Path, typer.Argument(metavar="DIRECTORY", help="Directory to write (new or empty).")
    ],
    tracking_uri: TrackingUriOption = None,
) -> None:
    """Write a registered Llama-family model as a Hugging Face directory.

    An imported model, or one raylane trained.

    Example: raylane export models:/tiny-llama/1 exported/tiny-llama
    """
    with user_mistakes(checkpoints.CheckpointError):
        done = checkpoints.export_model(model_uri, directory, resolve_tracking_uri(tracking_uri))
    _report(f"wrote {done.directory} (transformers.AutoModelForCausalLM.from_pretrained loads it)")


def _report(line: str) -> None:
    """The command's result: one line, unwrapped (paths and digests stay whole)."""
    console.print(line, highlight=False, soft_wrap=True)
