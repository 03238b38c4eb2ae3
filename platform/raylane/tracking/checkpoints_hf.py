"""Hugging Face checkpoints in and out of the Model Registry (`raylane import`, `raylane export`).

Import logs a checkpoint directory, as it is, as the `checkpoint/` artifacts of a run of the
`imports` experiment and registers that directory as a new version, tagged `raylane.kind`
hf-checkpoint, with the directory it came from and the sha256 of its weight files (each file's
own digest is in the run's `checkpoint_files.json`).

Export writes a Hugging Face directory for a registered version: an imported one is its
`checkpoint/` artifacts again, byte for byte; one trained by raylane with `model.kind: llama` is
rebuilt from its run's recorded `model:` section and the weights of the version's logged model
(the torch.export program the run registered: what `raylane serve` serves), checked against the
run's `raylane.weights_digest`, and written by `hf_checkpoint.save_pretrained` with the tokenizer
files of its `model.pretrained` directory (when it is still there) and the run's logged
`data/tokenizer.json`.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from raylane.config import ConfigError
from raylane.config.families import kinds_where, traits
from raylane.config.families import named as named_kinds
from raylane.config.model_uri import parse_model_uri
from raylane.models.hf_checkpoint import TOKENIZER_FILES, read_config, save_pretrained
from raylane.models.hf_checkpoint import weights_sha256 as files_sha256
from raylane.models.llama import LlamaForCausalLM, llama_config
from raylane.tracking.identity import weights_digest
from raylane.tracking.lineage import (
    ADAPTER_TAG,
    BASE_MODEL_TAG,
    BASE_VERSION_TAG,
    CHECKPOINT_DIR,
    HF_KIND,
    KIND_TAG,
    SHA_TAG,
    SOURCE_TAG,
    recorded_model_config,
    registered_state,
)
from raylane.tracking.registry import resolve_version

if TYPE_CHECKING:
    from raylane.config.schema import ModelConfig

IMPORT_EXPERIMENT = "imports"
FILES_ARTIFACT = "checkpoint_files.json"
RUN_TOKENIZER = "data/tokenizer.json"


class CheckpointError(ValueError):
    """A directory or registered version cannot be imported or exported (one line saying why)."""


@dataclass(frozen=True)
class Imported:
    name: str
    version: int
    run_id: str
    source: Path
    sha256: str


@dataclass(frozen=True)
class Exported:
    directory: Path
    name: str
    version: int
    kind: str  # HF_KIND, or "llama" for a version raylane trained


def weights_sha256(directory: str | Path) -> tuple[str, dict[str, str]]:
    """`hf_checkpoint.weights_sha256`, its error a CheckpointError."""
    try:
        return files_sha256(directory)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def import_checkpoint(directory: str | Path, name: str, tracking_uri: str) -> Imported:
    """Log `directory` (a Hugging Face checkpoint raylane reads) into a new run of the
    `imports` experiment and register it as a new version of `name`.

    Raises:
        CheckpointError: not a directory, or not a checkpoint raylane reads (naming the file).
    """
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    directory = Path(directory).resolve()
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory (a Hugging Face checkpoint)")
    try:
        cfg = read_config(directory)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    sha256, each = weights_sha256(directory)
    params = {"model_type": cfg.model_type, "hidden_size": cfg.d_model,
              "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
              "num_key_value_heads": cfg.n_kv_heads, "vocab_size": cfg.vocab_size}  # fmt: skip
    tags = {SOURCE_TAG: str(directory), SHA_TAG: sha256}
    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name(IMPORT_EXPERIMENT)
    experiment_id = (
        experiment.experiment_id if experiment else client.create_experiment(IMPORT_EXPERIMENT)
    )
    run_id = client.create_run(
        experiment_id, run_name=f"import-{directory.name}", tags=tags
    ).info.run_id
    try:
        client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()])
        client.log_artifacts(run_id, str(directory), CHECKPOINT_DIR)
        client.log_dict(run_id, {"weights_sha256": sha256, "files": each}, FILES_ARTIFACT)
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id)
    if not client.search_registered_models(f"name = '{name}'"):
        client.create_registered_model(name)
    version = client.create_model_version(
        name, f"runs:/{run_id}/{CHECKPOINT_DIR}", run_id, tags={KIND_TAG: HF_KIND, **tags}
    )
    return Imported(name, int(version.version), run_id, directory, sha256)


def export_model(uri: str, directory: str | Path, tracking_uri: str) -> Exported:
    """Write registered model `uri` (`models:/NAME/VERSION` or `models:/NAME@ALIAS`) as a
    Hugging Face directory that `transformers.AutoModelForCausalLM.from_pretrained` loads.

    Raises:
        CheckpointError: not a model URI, `directory` holds files already, or the version is
            neither an imported checkpoint nor a Llama-family model trained by raylane.
        ModelNotFoundError: no such version or alias.
    """
    from mlflow.tracking import MlflowClient

    try:
        ref = parse_model_uri(uri)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise CheckpointError(f"{directory} exists and is not an empty directory")
    client = MlflowClient(tracking_uri=tracking_uri)
    found = resolve_version(client, tracking_uri, ref.name, ref.alias, ref.version)
    version, tags = int(found.version), found.tags or {}
    if tags.get(KIND_TAG) == HF_KIND:
        _download_checkpoint(client, found.run_id, directory)
        return Exported(directory, ref.name, version, HF_KIND)
    named = f"models:/{ref.name}/{version}"
    _refuse_adapter(named, tags)
    model_cfg = _trained_model_config(client, found.run_id, named)
    if not traits(model_cfg.kind).hf_checkpoint:
        writes = named_kinds(kinds_where("hf_checkpoint"))
        raise CheckpointError(
            f"{named} is a model.kind '{model_cfg.kind}' model; raylane export writes "
            f"model.kind {writes} (Hugging Face checkpoints)"
        )

    model = _checked_trained_llama(client, tracking_uri, found, model_cfg, named)
    save_pretrained(model, directory, source=_tokenizer_source(model_cfg))
    _copy_run_tokenizer(client, found.run_id, directory)
    return Exported(directory, ref.name, version, "llama")


def read_trained_llama(
    tracking_uri: str, name: str, found, tokenizer_dir: str | Path
) -> tuple[LlamaForCausalLM, Exported]:
    """A Llama-family version trained by raylane (`found`, its registry entry), as export reads
    it, without writing its weights anywhere: the model (its weights checked against the run's
    digest) and, in the empty directory `tokenizer_dir`, the tokenizer files export writes
    beside them (its `model.pretrained` checkpoint's, then the run's logged tokenizer).

    Raises:
        CheckpointError: as `export_model`.
    """
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    named = f"models:/{name}/{found.version}"
    model_cfg = _trained_model_config(client, found.run_id, named)
    model = _checked_trained_llama(client, tracking_uri, found, model_cfg, named)
    directory = Path(tokenizer_dir)
    source = _tokenizer_source(model_cfg)
    for file in TOKENIZER_FILES if source is not None else ():
        if (source / file).is_file():
            shutil.copyfile(source / file, directory / file)
    _copy_run_tokenizer(client, found.run_id, directory)
    return model, Exported(directory, name, int(found.version), "llama")


def _checked_trained_llama(client, tracking_uri: str, found, model_cfg, named: str):
    """The run's Llama with the registered weights, refused unless they are the run's final
    weights (`raylane.weights_digest`)."""
    model = trained_llama(model_cfg, registered_state(tracking_uri, found.name, int(found.version)))
    recorded = client.get_run(found.run_id).data.tags.get("raylane.weights_digest")
    if recorded and weights_digest(model.state_dict()) != recorded:
        raise CheckpointError(
            f"{named}: the logged model's weights are not the run's final weights "
            f"(raylane.weights_digest {recorded[:12]})"
        )
    return model


def _tokenizer_source(model_cfg: ModelConfig) -> Path | None:
    """The `model.pretrained` directory whose tokenizer files a trained Llama keeps, if here."""
    pretrained = model_cfg.pretrained
    return Path(pretrained) if pretrained is not None and Path(pretrained).is_dir() else None


def trained_llama(model_cfg: ModelConfig, state: dict) -> LlamaForCausalLM:
    """The `LlamaForCausalLM` a run's `model:` section describes, holding `state` (its weights
    by raylane's parameter names, a tied head's weight optional).

    Raises:
        CheckpointError: `state` is not that model's (a missing, unexpected or misshapen tensor).
    """
    import torch

    if model_cfg.pretrained is not None:
        try:
            cfg = read_config(model_cfg.pretrained)
        except ValueError as exc:  # the architecture is recorded in that directory only
            raise CheckpointError(str(exc)) from None
    else:
        cfg = llama_config(model_cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    state = dict(state)
    if cfg.tie_embeddings and "head.weight" not in state and "tok_emb.weight" in state:
        state["head.weight"] = state["tok_emb.weight"]
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        reason = " ".join(str(exc).split("\n\t")[1:2]) or str(exc).splitlines()[0]
        raise CheckpointError(
            f"the logged weights do not fit the recorded model: {reason}"
        ) from None
    model.tie_weights()
    return model.eval()


def _download_checkpoint(client, run_id: str, directory: Path) -> None:
    """The run's `checkpoint/` artifacts, moved into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        downloaded = Path(client.download_artifacts(run_id, CHECKPOINT_DIR, scratch))
        for entry in sorted(downloaded.iterdir()):
            shutil.move(str(entry), directory / entry.name)


def _refuse_adapter(named: str, tags: dict[str, str]) -> None:
    if tags.get(ADAPTER_TAG):
        raise CheckpointError(
            f"{named} is a LoRA adapter of {tags.get(BASE_MODEL_TAG)} "
            f"v{tags.get(BASE_VERSION_TAG)}; raylane export writes whole models"
        )


def _trained_model_config(client, run_id: str, named: str) -> ModelConfig:
    """The `model:` section the version's run recorded."""
    from mlflow.exceptions import MlflowException

    try:
        return recorded_model_config(client, run_id)
    except (MlflowException, OSError):
        raise CheckpointError(
            f"{named} is neither an imported checkpoint nor trained by raylane (its run has "
            "no config/resolved.yaml)"
        ) from None
    except ConfigError as exc:
        raise CheckpointError(f"{named}: its run's config no longer loads: {exc}") from None


def _copy_run_tokenizer(client, run_id: str, directory: Path) -> None:
    """The tokenizer the run's data was tokenized with, when it logged one."""
    folder, name = RUN_TOKENIZER.split("/")
    if not any(item.path == RUN_TOKENIZER for item in client.list_artifacts(run_id, folder)):
        return
    with tempfile.TemporaryDirectory() as scratch:
        shutil.copyfile(client.download_artifacts(run_id, RUN_TOKENIZER, scratch), directory / name)
