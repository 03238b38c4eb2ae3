"""A registered language model as a plain module that can decode with a KV cache, and the
codec of its text (`raylane.serving.generation.text_codec`).

A byte-level `GPT` (`model.kind: gpt`): the registry holds it as a torch.export program
(MLflow's pt2 format), which keeps the training's parameter names but not the module's methods.
The run's resolved config rebuilds the `GPT`, the program's weights are loaded into it by name,
and its text is bytes.

A Llama-family model: an imported Hugging Face checkpoint is read from its own files
(downloaded as `raylane export` gets them) straight into the dtype and onto the device it is
served in, no fp32 copy first; a `model.kind: llama` trained by raylane is rebuilt from its
run's config holding the registered weights (checked against the run's digest, as export
checks them), without writing them anywhere, and its text read by the tokenizer files export
would put beside them (`raylane.tracking.checkpoints_hf.read_trained_llama`). A trained Llama
whose run logged no tokenizer was trained on bytes: its text is bytes.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from mlflow.tracking import MlflowClient

from raylane.config.families import kinds_where, traits
from raylane.config.families import named as named_kinds
from raylane.config.finetune import FinetuneConfig
from raylane.config.model_uri import parse_model_uri
from raylane.models import build_model
from raylane.models.adapters import apply_lora, load_adapter, merge_adapters
from raylane.models.hf_checkpoint import load_pretrained
from raylane.serving.generation.model_shape import context_length, vocabulary
from raylane.serving.generation.text_codec import BYTES, TextCodec
from raylane.serving.generation.tokenizer_codec import load_codec
from raylane.tracking.checkpoints_hf import (
    HF_KIND,
    KIND_TAG,
    Exported,
    export_model,
    read_trained_llama,
)
from raylane.tracking.lineage import adapter_of, recorded_model_config, registered_state
from raylane.tracking.registry import resolve_version


@dataclass(frozen=True)
class LanguageModelCard:
    registered_model: str
    version: int
    run_id: str
    context: int
    parameters: int
    codec: TextCodec = BYTES  # how its text becomes ids and back


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
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
):
    """`(model in eval mode, LanguageModelCard)` for registry `version` (or, when it is None,
    the version holding `alias`): a `GPT` or a `LlamaForCausalLM`, the card holding its codec.
    A LoRA adapter's version is its base with the adapter loaded, folded into the weights
    unless `merge` is off. An imported checkpoint is read in `dtype` onto `device`, a trained
    whole model moved there; an adapter's base is loaded in fp32 (the adapter is folded into
    fp32 weights) for the caller to place.

    Raises:
        ModelNotFoundError: no such version or alias, or an adapter's base version is gone
            (naming the base).
        ValueError: the version is not a language model generation serves, or a Llama
            checkpoint without its tokenizer.
    """
    client = MlflowClient(tracking_uri=tracking_uri)
    found = resolve_version(client, tracking_uri, registered_model, alias, version)
    adapter = adapter_of(client, found)
    if adapter is None:
        model, codec = _whole_model(client, tracking_uri, registered_model, found, dtype, device)
    else:
        model, codec = _adapted_model(tracking_uri, *adapter, merge=merge)
    card = _card(registered_model, int(found.version), found.run_id, model, codec)
    return model.eval(), card


def load_generation_model(
    tracking_uri: str, registered_model: str, version: int, *, merge: bool = True,
    dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
) -> GenerationModel:  # fmt: skip
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
        model, card = load_language_model(
            tracking_uri, registered_model, version, dtype=dtype, device=device
        )
        return GenerationModel(model, card, (registered_model, int(version)))
    meta, state = adapter  # downloaded once, whether merged or kept separate
    base = (meta["base_model"], int(meta["base_version"]))
    if merge:
        model, codec = _adapted_model(tracking_uri, meta, state, merge=True)
    else:
        model, base_card = load_language_model(tracking_uri, *base)
        codec = base_card.codec
    card = _card(registered_model, int(version), found.run_id, model, codec)
    if merge:
        return GenerationModel(model.eval(), card, None)
    own = _served_adapter(f"{registered_model}/{version}", meta, state)
    return GenerationModel(model, card, base, own)


def _card(name: str, version: int, run_id: str, model, codec: TextCodec) -> LanguageModelCard:
    parameters = sum(p.numel() for p in model.parameters())
    return LanguageModelCard(name, version, run_id, context_length(model), parameters, codec)


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


def _whole_model(client, tracking_uri: str, name: str, found, dtype, device):
    """`(model, codec)` of a whole registered version: a GPT, or a Llama-family model."""
    version = int(found.version)
    if (found.tags or {}).get(KIND_TAG) == HF_KIND:
        return _imported_model(tracking_uri, name, version, dtype, device)
    model_cfg = recorded_model_config(client, found.run_id)
    if not traits(model_cfg.kind).language:
        raise ValueError(
            f"{name} v{version} is a {model_cfg.kind!r} model; generation needs a language "
            f"model ({named_kinds(kinds_where('language'))})"
        )
    if traits(model_cfg.kind).hf_checkpoint:
        with tempfile.TemporaryDirectory(prefix="raylane-generate-") as scratch:
            model, tokenizer = read_trained_llama(tracking_uri, name, found, scratch)
            codec = _exported_codec(tokenizer, vocabulary(model))
        return model.to(device=device, dtype=dtype), codec
    model = build_model(model_cfg)
    model.load_state_dict(registered_state(tracking_uri, name, version))
    return model.to(device=device, dtype=dtype), BYTES


def _imported_model(tracking_uri: str, name: str, version: int, dtype, device):
    """`(LlamaForCausalLM, codec)` of an imported checkpoint: its own files (downloaded), its
    weights read in `dtype` onto `device`."""
    with tempfile.TemporaryDirectory(prefix="raylane-generate-") as scratch:
        exported = export_model(f"models:/{name}/{version}", Path(scratch) / "hf", tracking_uri)
        model = load_pretrained(exported.directory, dtype, device)
        codec = _exported_codec(exported, vocabulary(model))
    return model, codec


def _exported_codec(exported: Exported, vocab: int) -> TextCodec:
    """The directory's tokenizer; none from a trained run means bytes (data.tokenizer: bytes
    logs no tokenizer), none in an import is refused."""
    named = f"{exported.name} v{exported.version}"
    if (exported.directory / "tokenizer.json").is_file():
        codec = load_codec(exported.directory)
    elif exported.kind == HF_KIND:
        raise ValueError(f"{named}: the imported checkpoint has no tokenizer.json")
    else:
        codec = BYTES
    if codec.vocab_size > vocab:
        raise ValueError(
            f"{named}: its tokenizer has {codec.vocab_size} tokens, the model embeds {vocab}"
        )
    return codec


def _adapted_model(tracking_uri: str, meta: dict, state: dict, *, merge: bool):
    """`(model, codec)`: the adapter's base (as registered) with the adapter loaded (and
    merged)."""
    base, card = load_language_model(tracking_uri, meta["base_model"], meta["base_version"])
    load_adapter(apply_lora(base, FinetuneConfig.model_validate(meta["finetune"])), state)
    return (merge_adapters(base) if merge else base), card.codec


def load_draft_model(tracking_uri: str, uri: str):
    """`(model, LanguageModelCard)` of a draft named `models:/NAME/VERSION` or
    `models:/NAME@ALIAS` (`serving.generation.draft_model`).

    Raises:
        ModelNotFoundError: no such version or alias.
        ValueError: not a model URI, or not a language model.
    """
    ref = parse_model_uri(uri)
    return load_language_model(tracking_uri, ref.name, ref.version, ref.alias)
