"""A registered language model as a plain `GPT` that can decode with a KV cache.

The registry holds the model as a torch.export program (MLflow's pt2 format), which keeps the
training's parameter names but not the module's methods. The run's resolved config rebuilds
the `GPT`, and the program's weights are loaded into it by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LanguageModelCard:
    registered_model: str
    version: int
    run_id: str
    context: int
    parameters: int


def load_language_model(
    tracking_uri: str, registered_model: str, version: int | None, alias: str = ""
):
    """`(GPT in eval mode, LanguageModelCard)` for registry `version` (or, when it is None,
    the version holding `alias`).

    Raises:
        ModelNotFoundError: no such version or alias.
        ValueError: the version is not a GPT (generation needs one).
    """
    import mlflow
    from mlflow.tracking import MlflowClient

    from raylane.inference import resolve_version
    from raylane.models import build_model

    client = MlflowClient(tracking_uri=tracking_uri)
    found = resolve_version(client, tracking_uri, registered_model, alias, version)
    model_cfg = recorded_model_config(client, found.run_id)
    if model_cfg.kind != "gpt":
        raise ValueError(
            f"{registered_model} v{found.version} is a {model_cfg.kind!r} model; "
            "generation needs a 'gpt' language model"
        )
    mlflow.set_tracking_uri(tracking_uri)
    exported = mlflow.pytorch.load_model(
        f"models:/{registered_model}/{found.version}", map_location="cpu"
    )
    model = build_model(model_cfg)
    model.load_state_dict(exported.state_dict())
    card = LanguageModelCard(
        registered_model,
        int(found.version),
        found.run_id,
        model_cfg.input_dim,
        sum(p.numel() for p in model.parameters()),
    )
    return model.eval(), card


def recorded_model_config(client, run_id: str):
    """The `model:` section of the config run `run_id` recorded (its architecture)."""
    from raylane.config import load_config
    from raylane.tracking.runs import CONFIG_ARTIFACT

    return load_config(Path(client.download_artifacts(run_id, CONFIG_ARTIFACT))).model


def load_draft_model(tracking_uri: str, uri: str):
    """`(GPT, LanguageModelCard)` of a draft named `models:/NAME/VERSION` or
    `models:/NAME@ALIAS` (`serving.generation.draft_model`).

    Raises:
        ModelNotFoundError: no such version or alias.
        ValueError: not a model URI, or not a GPT.
    """
    from raylane.config.model_uri import parse_model_uri

    ref = parse_model_uri(uri)
    return load_language_model(tracking_uri, ref.name, ref.version, ref.alias)
