"""A fine-tuning run's base model, and the adapter it registers against it (MLflow lineage).

Before Ray starts, `resolve_base` finds the registered version `finetune.base` names, checks
that its recorded architecture is the config's `model:` and that `finetune.target_modules`
match its layers, and loads its weights (the driver hands them to the workers through Ray's
object store: workers never read the registry). The run is tagged with the base's name,
version and weights digest, and lists the base's logged model as an MLflow model input.

A LoRA run registers only its adapter: `adapter/adapter.safetensors` (the LoRA tensors) and
`adapter/adapter.json` (its `finetune:` settings and base) as the version's source, the version
tagged `raylane.base_model` / `raylane.base_version` / `raylane.adapter`. Loading it
(`raylane.serving.generation.loader.load_language_model`) rebuilds the base, adapts it the same way
and loads the adapter. A resumed or reproduced run uses the base version its record names
(`pinned_base`), never what an alias points to now, and checks its weights digest.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from raylane.config import load_config
from raylane.config.families import kinds_where, traits
from raylane.config.families import named as named_kinds
from raylane.config.model_uri import parse_model_uri
from raylane.tracking.identity import weights_digest
from raylane.tracking.registry import resolve_version
from raylane.tracking.runs import CONFIG_ARTIFACT

if TYPE_CHECKING:
    import torch

    from raylane.config import RaylaneConfig
    from raylane.config.schema import ModelConfig

ADAPTER_DIR = "adapter"
ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_META = "adapter.json"
#: Registry tags of a fine-tuned version.
BASE_MODEL_TAG, BASE_VERSION_TAG, ADAPTER_TAG = (
    "raylane.base_model", "raylane.base_version", "raylane.adapter",
)  # fmt: skip
#: Registry tags of an imported Hugging Face checkpoint (`raylane import`).
KIND_TAG, SOURCE_TAG, SHA_TAG = "raylane.kind", "raylane.source_path", "raylane.weights_sha256"
HF_KIND = "hf-checkpoint"
CHECKPOINT_DIR = "checkpoint"  # an imported checkpoint's files, among its run's artifacts


class BaseModelError(ValueError):
    """A fine-tuning run's base cannot be used as configured (one line naming why)."""


@dataclass(frozen=True)
class BaseModel:
    """The registered version a fine-tuning run starts from."""

    name: str
    version: int
    run_id: str
    digest: str
    model_id: str | None
    # None for an imported checkpoint: the workers load it from `model.pretrained`.
    state: dict[str, torch.Tensor] | None = field(repr=False)

    def tags(self) -> dict[str, str]:
        return {
            BASE_MODEL_TAG: self.name,
            BASE_VERSION_TAG: str(self.version),
            "raylane.base_digest": self.digest,
        }


def recorded_model_config(client, run_id: str) -> ModelConfig:
    """The `model:` section of the config run `run_id` recorded (its architecture)."""
    return load_config(Path(client.download_artifacts(run_id, CONFIG_ARTIFACT))).model


def recorded_shape(client, version) -> tuple[int, int]:
    """`(vocabulary, context)` of registered `version`: an imported checkpoint's
    `config.json` (`vocab_size`, `max_position_embeddings`), else its run's recorded model
    config (`num_classes`, `input_dim`); a LoRA adapter's, its base's (it serves on it)."""
    tags = version.tags or {}
    if tags.get(ADAPTER_TAG):
        base = client.get_model_version(tags[BASE_MODEL_TAG], tags[BASE_VERSION_TAG])
        return recorded_shape(client, base)
    if tags.get(KIND_TAG) != HF_KIND:
        model = recorded_model_config(client, version.run_id)
        return model.num_classes, model.input_dim
    with tempfile.TemporaryDirectory(prefix="raylane-shape-") as scratch:
        path = client.download_artifacts(version.run_id, f"{CHECKPOINT_DIR}/config.json", scratch)
        config = json.loads(Path(path).read_text())
    return int(config["vocab_size"]), int(config["max_position_embeddings"])


def pinned_base(cfg: RaylaneConfig, run_tags: dict[str, str]) -> RaylaneConfig:
    """`cfg` (a recorded fine-tuning config) with `finetune.base` pinned to the version the
    run's tags name: what the run trained on, wherever its alias points now."""
    if cfg.finetune is None or BASE_MODEL_TAG not in run_tags:
        return cfg
    uri = f"models:/{run_tags[BASE_MODEL_TAG]}/{run_tags[BASE_VERSION_TAG]}"
    return cfg.model_copy(update={"finetune": cfg.finetune.model_copy(update={"base": uri})})


def resolve_base(
    cfg: RaylaneConfig, tracking_uri: str, expect_digest: str | None = None
) -> BaseModel:
    """The base of `cfg.finetune`, checked against the config (and, for a resumed or
    reproduced run, against the weights digest it recorded) and loaded.

    Raises:
        ModelNotFoundError: no such version or alias (naming it and the store).
        BaseModelError: an adapter as base, the run's own registered name, another
            architecture, target modules that match no layer, or other weights than recorded.
    """
    from mlflow.tracking import MlflowClient

    finetune = cfg.finetune
    ref = parse_model_uri(finetune.base)
    client = MlflowClient(tracking_uri=tracking_uri)
    found = resolve_version(client, tracking_uri, ref.name, ref.alias, ref.version)
    named = f"finetune.base {finetune.base} (v{found.version})"
    if (found.tags or {}).get(ADAPTER_TAG):
        raise BaseModelError(
            f"{named} is an adapter of {found.tags.get(BASE_MODEL_TAG)} "
            f"v{found.tags.get(BASE_VERSION_TAG)}: fine-tune that base instead"
        )
    if cfg.tracking.registered_model == ref.name:
        raise BaseModelError(
            f"{named}: tracking.registered_model is the base's own name; register the "
            "fine-tuned model under another (its versions would compete for the base's alias)"
        )
    if (found.tags or {}).get(KIND_TAG) == HF_KIND:
        return _imported_base(cfg, found, named, expect_digest)
    _check_architecture(cfg, recorded_model_config(client, found.run_id), named)
    state = registered_state(tracking_uri, ref.name, int(found.version))
    digest = weights_digest(state)
    if expect_digest and digest != expect_digest:
        raise BaseModelError(
            f"{named} now holds weights {digest[:12]}, not the {expect_digest[:12]} the run "
            "was fine-tuned from"
        )
    return BaseModel(
        name=ref.name,
        version=int(found.version),
        run_id=found.run_id,
        digest=digest,
        model_id=_logged_model_id(found),
        state=state,
    )


def _imported_base(cfg: RaylaneConfig, found, named: str, expect_digest: str | None):
    """An imported Hugging Face checkpoint as the base: the config's `model.pretrained` must
    hold the very weight files that were imported (their sha256, the version's tag); the
    workers load the base from there, as a `model.pretrained` run does."""
    # lazy: reading a checkpoint imports torch; serving reads lineage without it
    from raylane.models.hf_checkpoint import weights_sha256

    tags = found.tags or {}
    imported, source = tags.get(SHA_TAG, ""), tags.get(SOURCE_TAG, "?")
    model = cfg.model
    if not traits(model.kind).hf_checkpoint or model.pretrained is None:
        raise BaseModelError(
            f"{named} is a Hugging Face checkpoint imported from {source}: set model.kind "
            f"{named_kinds(kinds_where('hf_checkpoint'))} and model.pretrained to that directory"
        )
    try:
        sha, _ = weights_sha256(model.pretrained)
    except ValueError as exc:
        raise BaseModelError(f"model.pretrained: {exc}") from None
    for want, what in ((imported, "was imported from"), (expect_digest, "was fine-tuned from")):
        if want and sha != want:
            raise BaseModelError(
                f"{named} {what} weights sha256 {want[:12]}; model.pretrained "
                f"{model.pretrained} holds {sha[:12]}"
            )
    if cfg.finetune.method == "lora":
        _check_targets(cfg)
    return BaseModel(found.name, int(found.version), found.run_id, sha, None, state=None)


def _check_targets(cfg: RaylaneConfig) -> None:
    """Raise BaseModelError unless `finetune.target_modules` match layers of the model (built
    on the meta device: no weights read)."""
    # lazy: imports torch; serving's driver reads a version's lineage without it
    import torch

    from raylane.models import build_model  # lazy: as above
    from raylane.models.adapters import AdapterTargetError, apply_lora  # lazy: as above

    with torch.device("meta"):
        model = build_model(cfg.model.model_copy(update={"pretrained": None}))
    try:
        apply_lora(model, cfg.finetune)
    except AdapterTargetError as exc:
        raise BaseModelError(str(exc)) from None


def _check_architecture(cfg: RaylaneConfig, recorded, named: str) -> None:
    """Raise BaseModelError unless the config's model is the base's recorded one and (LoRA)
    its target modules match layers of it."""
    differs = [k for k, v in recorded.model_dump().items() if getattr(cfg.model, k) != v]
    if differs:
        key = differs[0]
        raise BaseModelError(
            f"{named} has model.{key} {getattr(recorded, key)!r}; the config says "
            f"{getattr(cfg.model, key)!r} (a fine-tuning config states the base's architecture)"
        )
    if cfg.finetune.method == "lora":
        _check_targets(cfg)


def _logged_model_id(version) -> str | None:
    """The MLflow 3 logged model behind a registered version (its source is models:/m-...)."""
    if getattr(version, "model_id", None):
        return version.model_id
    source = version.source or ""
    return source.removeprefix("models:/") if source.startswith("models:/m-") else None


def registered_state(tracking_uri: str, name: str, version: int) -> dict:
    """The weights of registered `version` of `name` (a whole model, as torch.export logged
    it), by parameter name."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    exported = mlflow.pytorch.load_model(f"models:/{name}/{version}", map_location="cpu")
    return {k: v.detach().clone() for k, v in exported.state_dict().items()}


def log_base_input(client, run_id: str, base: BaseModel) -> None:
    """Tag the run with its base and list the base's logged model as a model input."""
    from mlflow.entities import RunTag

    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in base.tags().items()])
    if base.model_id:
        from mlflow.entities import LoggedModelInput

        client.log_inputs(run_id, [], models=[LoggedModelInput(model_id=base.model_id)])


def register_adapter(model, cfg: RaylaneConfig, base_tags: dict[str, str]) -> tuple[str, int]:
    """Log `model`'s adapter (alone) into the active run and register it as a new version of
    `tracking.registered_model` tagged with its base: (source URI, version)."""
    import mlflow
    from mlflow.tracking import MlflowClient
    from safetensors.torch import save_file

    from raylane.models.adapters import adapter_state  # lazy: imports torch, as above

    state = adapter_state(model)
    meta = {
        "finetune": cfg.finetune.model_dump(mode="json"),
        "base_model": base_tags[BASE_MODEL_TAG],
        "base_version": int(base_tags[BASE_VERSION_TAG]),
        "base_digest": base_tags.get("raylane.base_digest"),
    }
    with tempfile.TemporaryDirectory() as directory:
        save_file(state, str(Path(directory) / ADAPTER_WEIGHTS))
        (Path(directory) / ADAPTER_META).write_text(json.dumps(meta, indent=2))
        size = (Path(directory) / ADAPTER_WEIGHTS).stat().st_size
        mlflow.log_artifacts(directory, artifact_path=ADAPTER_DIR)
    run = mlflow.active_run()
    mlflow.log_metric("adapter_bytes", size)
    client = MlflowClient()
    name = cfg.tracking.registered_model
    if not client.search_registered_models(f"name = '{name}'"):
        client.create_registered_model(name)
    source = f"runs:/{run.info.run_id}/{ADAPTER_DIR}"
    tags = {BASE_MODEL_TAG: meta["base_model"], BASE_VERSION_TAG: str(meta["base_version"]),
            ADAPTER_TAG: cfg.finetune.method}  # fmt: skip
    version = client.create_model_version(name, source, run.info.run_id, tags=tags)
    return source, int(version.version)


def adapter_of(client, version) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """`(adapter.json, adapter tensors)` of a registered adapter version, or None when the
    version is a whole model."""
    if not (version.tags or {}).get(ADAPTER_TAG):
        return None
    from safetensors.torch import load_file

    directory = Path(client.download_artifacts(version.run_id, ADAPTER_DIR))
    meta = json.loads((directory / ADAPTER_META).read_text())
    return meta, load_file(str(directory / ADAPTER_WEIGHTS))
