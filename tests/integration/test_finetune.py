"""LoRA fine-tuning of a registered model on the session cluster: the session's pipeline LM
(no base is trained here) fine-tuned by DDP on the standard library's test suite, a domain its
base never read. The run records its base (tags, the base's logged model as an input), only
the adapter is logged and registered (tagged with its base), the registered adapter loads back
onto its base with the base's weights untouched, and a bad base or target module is refused
before Ray is asked for anything. (DDP and FSDP2 fine-tuning against single-process training:
the layout equivalence test, entries ddp2-lora and fsdp2-lora.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from raylane.config import load_config
from raylane.tracking.identity import weights_digest
from raylane.train.checkpointing import load_model_state

from .conftest import ROOT

pytestmark = pytest.mark.integration

ADAPTED = "lm-lora-test"


def _config(pipeline_cfg, workspace, *extra: str):
    model = pipeline_cfg.model
    registered = pipeline_cfg.tracking.registered_model
    return load_config(
        ROOT / "configs" / "finetune" / "lm_lora.yaml",
        [
            f"finetune.base=models:/{registered}@champion",
            *(f"model.{k}={getattr(model, k)}" for k in ("input_dim", "d_model", "n_heads")),
            f"model.n_layers={model.n_layers}",
            f"data.train_path={workspace.root}/lm-tests/train.parquet",
            f"data.validation_path={workspace.root}/lm-tests/validation.parquet",
            "data.max_bytes=65536",
            f"training.storage_path={workspace.root}/runs",
            f"tracking.tracking_uri={workspace.tracking_uri}",
            f"tracking.registered_model={ADAPTED}",
            "parallelism.resources_per_worker={CPU: 0.25}",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def finetuned(pipeline_run, workspace):
    from raylane.train.job import run_training

    cfg = _config(pipeline_run[0], workspace)
    return cfg, run_training(cfg)


def test_the_run_records_its_base_and_registers_the_adapter_alone(finetuned, pipeline_run):
    from mlflow.tracking import MlflowClient

    cfg, outcome = finetuned
    base_cfg, base_outcome = pipeline_run
    client = MlflowClient(outcome.tracking_uri)
    base_version = client.get_model_version(
        base_cfg.tracking.registered_model, str(base_outcome.model_version)
    )
    run = client.get_run(outcome.run_id)
    assert run.data.tags["raylane.base_model"] == base_cfg.tracking.registered_model
    assert run.data.tags["raylane.base_version"] == str(base_outcome.model_version)
    base_run = client.get_run(base_version.run_id)
    assert run.data.tags["raylane.base_digest"] == base_run.data.tags["raylane.weights_digest"]
    # The base's logged model (MLflow 3: the version's source is models:/<model id>).
    assert [f"models:/{m.model_id}" for m in run.inputs.model_inputs] == [base_version.source]

    version = client.get_model_version(ADAPTED, str(outcome.model_version))
    assert version.source == f"runs:/{outcome.run_id}/adapter"
    assert version.tags["raylane.base_model"] == base_cfg.tracking.registered_model
    assert version.tags["raylane.base_version"] == str(base_outcome.model_version)
    assert version.tags["raylane.adapter"] == "lora"
    artifacts = {a.path for a in client.list_artifacts(outcome.run_id, "adapter")}
    assert artifacts == {"adapter/adapter.json", "adapter/adapter.safetensors"}
    assert not client.list_artifacts(outcome.run_id, "model")  # no whole-model copy
    adapter_bytes = run.data.metrics["adapter_bytes"]
    base_bytes = 4 * sum(t.numel() for t in _base_state(outcome, base_cfg, base_outcome).values())
    assert adapter_bytes < 0.05 * base_bytes, (adapter_bytes, base_bytes)


def _base_state(outcome, base_cfg, base_outcome) -> dict:
    from raylane.generation.loader import load_language_model

    base, _ = load_language_model(
        outcome.tracking_uri, base_cfg.tracking.registered_model, base_outcome.model_version
    )
    return base.state_dict()


def test_the_adapter_loads_onto_its_untouched_base_and_changes_the_model(finetuned, pipeline_run):
    from raylane.generation.loader import load_language_model

    cfg, outcome = finetuned
    base_state = _base_state(outcome, *pipeline_run)
    adapted, card = load_language_model(
        outcome.tracking_uri, ADAPTED, outcome.model_version, merge=False
    )
    assert card.registered_model == ADAPTED
    # What the run trained (its last checkpoint): every base weight as registered, adapters
    # moved from their zero start, and those adapters are what the registry holds.
    trained = load_model_state(Path(outcome.checkpoint_path))
    base_part = {n: t for n, t in trained.items() if ".lora_" not in n}
    assert {n.replace(".base_layer", "") for n in base_part} == set(base_state)
    for name, tensor in base_part.items():
        assert torch.equal(tensor, base_state[name.replace(".base_layer", "")]), name
    adapters = {n: t for n, t in trained.items() if ".lora_" in n}
    assert adapters and all(adapters[n].abs().sum() > 0 for n in adapters if "lora_B" in n)
    for name, tensor in adapted.state_dict().items():
        if ".lora_" in name:
            assert torch.equal(tensor, adapters[name]), name

    merged, _ = load_language_model(outcome.tracking_uri, ADAPTED, outcome.model_version)
    assert set(merged.state_dict()) == set(base_state)
    tokens = torch.randint(0, 256, (2, cfg.model.input_dim))
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens), adapted(tokens), rtol=1e-4, atol=1e-5)
        base, _ = load_language_model(outcome.tracking_uri, *_base_ref(pipeline_run))
        assert not torch.allclose(merged(tokens), base(tokens), atol=1e-3)
    assert weights_digest(base.state_dict()) == base_digest(outcome)


def base_digest(outcome) -> str:
    from mlflow.tracking import MlflowClient

    return (
        MlflowClient(outcome.tracking_uri).get_run(outcome.run_id).data.tags["raylane.base_digest"]
    )


def _base_ref(pipeline_run) -> tuple[str, int]:
    base_cfg, base_outcome = pipeline_run
    return base_cfg.tracking.registered_model, base_outcome.model_version


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["finetune.base=models:/no-such-model/3"],
         "registered model 'no-such-model' has no version 3"),
        (["finetune.target_modules=[q, qkv]"],
         "finetune.target_modules ['qkv'] match no linear layer of the model"),
        (["model.d_model=32", "model.n_heads=2"], "has model.d_model 64; the config says 32"),
        (["tracking.registered_model=raylane-lm"], "tracking.registered_model is the base's own"),
    ],
)  # fmt: skip
def test_a_bad_base_is_named_before_ray_starts(pipeline_run, workspace, extra, message):
    from raylane.tracking.lineage import resolve_base

    cfg = _config(pipeline_run[0], workspace, *extra)
    with pytest.raises((ValueError, LookupError), match=re.escape(message)):
        resolve_base(cfg, workspace.tracking_uri)


def test_an_adapter_is_not_a_base(finetuned, pipeline_run, workspace):
    from raylane.tracking.lineage import resolve_base

    _, outcome = finetuned
    cfg = _config(pipeline_run[0], workspace, f"finetune.base=models:/{ADAPTED}/1")
    with pytest.raises(ValueError, match=re.escape(
        f"finetune.base models:/{ADAPTED}/1 (v1) is an adapter of "
        f"{pipeline_run[0].tracking.registered_model}"
    )):  # fmt: skip
        resolve_base(cfg, workspace.tracking_uri)


def test_an_adapter_is_served_as_generation_and_a_resumed_run_keeps_its_base(
    finetuned, pipeline_run, workspace
):
    from mlflow.tracking import MlflowClient

    from raylane.serving.app import check_served_models
    from raylane.serving.errors import ServedModelError
    from raylane.tracking.lineage import pinned_base

    cfg, outcome = finetuned
    as_infer = cfg.model_copy(update={"serving": cfg.serving.model_copy(update={"api": "infer"})})
    with pytest.raises(ServedModelError, match=re.escape(
        f"{ADAPTED} v{outcome.model_version} is a LoRA adapter: serve it with serving.api: generate"
    )):  # fmt: skip
        check_served_models(as_infer, workspace.tracking_uri, outcome.model_version)
    check_served_models(cfg, workspace.tracking_uri, outcome.model_version)

    # The recorded config names the base by alias; its resume or reproduction by version.
    assert cfg.finetune.base.endswith("@champion")
    tags = MlflowClient(workspace.tracking_uri).get_run(outcome.run_id).data.tags
    name, version = _base_ref(pipeline_run)
    assert pinned_base(cfg, tags).finetune.base == f"models:/{name}/{version}"
