"""A registered language model as a plain `GPT` that can decode with a KV cache.

The registry holds the model as a torch.export program (MLflow's pt2 format), which keeps the
training's parameter names but not the module's methods. The run's resolved config rebuilds
the `GPT`, and the program's weights are loaded into it by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlflow.tracking import MlflowClient

from raylane.config.finetune import FinetuneConfig
from raylane.config.model_uri import parse_model_uri
from raylane.models import build_model
from raylane.models.adapters import apply_lora, load_adapter, merge_adapters
from raylane.tracking.lineage import adapter_of, recorded_model_config, registered_state
from raylane.tracking.registry import resolve_version


@dataclass(frozen=True)
class LanguageModelCard:
    registered_model: str
    version: int
    run_id: str
    context: int
    parameters: int


@dataclass(frozen=True)
class ServedAdapter:
    """A registered LoRA adapter ready for `raylane.models.multi_lora.AdapterSet.add`."""

    key: str  # NAME/VERSION
    state: dict
    scale: float  # alpha / rank


@dataclass
class GenerationModel:
    """What a generation replica holds: the model, the served version's card, the base that
    per-request adapters must belong to (None when none may be added: a merged adapter), and
    the served version's own adapter when it is an adapter kept separate from its base."""

    model: object
    card: LanguageModelCard
    base: tuple[str, int] | None
    own_adapter: ServedAdapter | None = None


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


def load_generation_model(
    tracking_uri: str, registered_model: str, version: int, *, merge: bool = True
) -> GenerationModel:
    """Registry `version` as a replica serves it. A whole model is also the base of adapters
    requested per request; an adapter version is folded into its base (`merge`), or kept
    separate so that other adapters of the same base can be served beside it.

    Raises:
        ModelNotFoundError, ValueError: as `load_language_model`.
    """
    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_model_version(registered_model, str(version))
    adapter = adapter_of(client, found)
    if adapter is None:
        model, card = load_language_model(tracking_uri, registered_model, version)
        return GenerationModel(model, card, (registered_model, int(version)))
    meta, state = adapter  # downloaded once, whether merged or kept separate
    base = (meta["base_model"], int(meta["base_version"]))
    if merge:
        model = _adapted_model(tracking_uri, meta, state, merge=True)
    else:
        model, _ = load_language_model(tracking_uri, *base)
    card = LanguageModelCard(registered_model, int(version), found.run_id,
                             model.pos_emb.num_embeddings,
                             sum(p.numel() for p in model.parameters()))  # fmt: skip
    if merge:
        return GenerationModel(model.eval(), card, None)
    own = _served_adapter(f"{registered_model}/{version}", meta, state)
    return GenerationModel(model, card, base, own)


def load_served_adapter(tracking_uri: str, name: str, version: int, base: tuple[str, int]):
    """Registered adapter `name` `version` as a `ServedAdapter`, checked to be an adapter of
    `base` (registered name, version).

    Raises:
        ModelNotFoundError: no such version.
        ValueError: it is not an adapter, or an adapter of another base (naming both).
    """
    client = MlflowClient(tracking_uri=tracking_uri)
    found = resolve_version(client, tracking_uri, name, "", version)
    adapter = adapter_of(client, found)
    if adapter is None:
        raise ValueError(f"{name} v{version} is not a LoRA adapter (a whole model)")
    meta, state = adapter
    its_base = (meta["base_model"], int(meta["base_version"]))
    if its_base != tuple(base):
        raise ValueError(
            f"{name} v{version} is an adapter of {its_base[0]} v{its_base[1]}; this endpoint "
            f"serves adapters of {base[0]} v{base[1]}"
        )
    return _served_adapter(f"{name}/{version}", meta, state)


def _served_adapter(key: str, meta: dict, state: dict) -> ServedAdapter:
    settings = FinetuneConfig.model_validate(meta["finetune"])
    return ServedAdapter(key, state, settings.alpha / settings.rank)


def _whole_model(tracking_uri: str, name: str, version: int, model_cfg):
    model = build_model(model_cfg)
    model.load_state_dict(registered_state(tracking_uri, name, version))
    return model


def _adapted_model(tracking_uri: str, meta: dict, state: dict, *, merge: bool):
    """The adapter's base (as registered) with the adapter loaded (and merged)."""
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
    ref = parse_model_uri(uri)
    return load_language_model(tracking_uri, ref.name, ref.version, ref.alias)
