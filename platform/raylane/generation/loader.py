"""A registered language model as a plain `GPT` that can decode with a KV cache.

The registry holds the model as a torch.export program (MLflow's pt2 format), which keeps the
training's parameter names but not the module's methods. The run's resolved config rebuilds
the `GPT`, and the program's weights are loaded into it by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from raylane.tracking.lineage import recorded_model_config, registered_state


@dataclass(frozen=True)
class LanguageModelCard:
    registered_model: str
    version: int
    run_id: str
    context: int
    parameters: int


def load_language_model(
    tracking_uri: str,
    registered_model: str,
    version: int | None,
    alias: str = "",
    *,
    merge: bool = True,
):
    """`(GPT in eval mode, LanguageModelCard)` for registry `version` (or, when it is None,
    the version holding `alias`). A LoRA adapter's version is its base with the adapter
    loaded, folded into the weights unless `merge` is off.

    Raises:
        ModelNotFoundError: no such version or alias, or an adapter's base version is gone
            (naming the base).
        ValueError: the version is not a GPT (generation needs one).
    """
    from mlflow.tracking import MlflowClient

    from raylane.inference import resolve_version
    from raylane.tracking.lineage import adapter_of

    client = MlflowClient(tracking_uri=tracking_uri)
    found = resolve_version(client, tracking_uri, registered_model, alias, version)
    model_cfg = recorded_model_config(client, found.run_id)
    if model_cfg.kind != "gpt":
        raise ValueError(
            f"{registered_model} v{found.version} is a {model_cfg.kind!r} model; "
            "generation needs a 'gpt' language model"
        )
    adapter = adapter_of(client, found)
    if adapter is None:
        model = _whole_model(tracking_uri, registered_model, int(found.version), model_cfg)
    else:
        model = _adapted_model(tracking_uri, *adapter, merge=merge)
    card = LanguageModelCard(
        registered_model,
        int(found.version),
        found.run_id,
        model_cfg.input_dim,
        sum(p.numel() for p in model.parameters()),
    )
    return model.eval(), card


def _whole_model(tracking_uri: str, name: str, version: int, model_cfg):
    from raylane.models import build_model

    model = build_model(model_cfg)
    model.load_state_dict(registered_state(tracking_uri, name, version))
    return model


def _adapted_model(tracking_uri: str, meta: dict, state: dict, *, merge: bool):
    """The adapter's base (as registered) with the adapter loaded (and merged)."""
    from raylane.config.finetune import FinetuneConfig
    from raylane.models.adapters import apply_lora, load_adapter, merge_adapters

    base, _ = load_language_model(tracking_uri, meta["base_model"], meta["base_version"])
    load_adapter(apply_lora(base, FinetuneConfig.model_validate(meta["finetune"])), state)
    return merge_adapters(base) if merge else base


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
