"""`raylane import` and `raylane export` against a real MLflow store (SQLite, no Ray): an
imported checkpoint's version, tags and digest; exports that transformers loads with the
original's logits; the one-line refusals."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
import transformers
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from raylane.cli import app
from tests.readme_blocks import ROOT

SIZES = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
MLFLOW_LOG = re.compile(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d INFO mlflow")
TOKENS = torch.tensor([[3, 17, 200, 5, 99, 42, 7, 1], [8, 8, 250, 0, 13, 64, 2, 31]])


@pytest.fixture
def store(tmp_path):
    """A fresh SQLite store; the process's MLflow tracking URI is restored afterwards."""
    before = mlflow.get_tracking_uri()
    yield f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(before)


def _checkpoint(directory, family: str = "llama"):
    """A tiny random transformers model saved to `directory`, with a tokenizer file beside it."""
    torch.manual_seed(0)
    if family == "qwen2":
        config = transformers.Qwen2Config(**SIZES, tie_word_embeddings=True,
                                          use_sliding_window=False)  # fmt: skip
        model = transformers.Qwen2ForCausalLM(config)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES))
    model.save_pretrained(directory)
    (directory / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    return model.eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def _invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def _said(result) -> list[str]:
    """What the command printed, without MLflow's own log lines (a new store's tables)."""
    return [line for line in result.output.strip().splitlines() if not MLFLOW_LOG.match(line)]


def _one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = _said(result)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0].removeprefix("error: ")


def test_import_registers_the_directory_and_export_gives_it_back(tmp_path, store):
    source = tmp_path / "tiny-llama"
    original = _checkpoint(source)
    expected = hashlib.sha256((source / "model.safetensors").read_bytes()).hexdigest()

    result = _invoke("import", str(source), "--name", "tiny", "--tracking-uri", store)
    assert result.exit_code == 0, result.output
    assert _said(result) == [f"registered tiny v1 from {source} (sha256 {expected})"]

    client = MlflowClient(store)
    version = client.get_model_version("tiny", "1")
    assert version.tags == {
        "raylane.kind": "hf-checkpoint",
        "raylane.source_path": str(source),
        "raylane.weights_sha256": expected,
    }
    run = client.get_run(version.run_id)
    assert run.info.run_name == "import-tiny-llama" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "imports"
    assert run.data.params == {"model_type": "llama", "hidden_size": "32",
                               "num_hidden_layers": "2", "num_attention_heads": "4",
                               "num_key_value_heads": "2", "vocab_size": "256"}  # fmt: skip
    assert run.data.tags["raylane.weights_sha256"] == expected
    listed = client.download_artifacts(run.info.run_id, "checkpoint_files.json")
    listed = json.loads(Path(listed).read_text())
    assert listed == {"weights_sha256": expected, "files": {"model.safetensors": expected}}

    again = _invoke("import", str(source), "--name", "tiny", "--tracking-uri", store)
    assert again.exit_code == 0 and "registered tiny v2 from" in again.output

    client.set_registered_model_alias("tiny", "prod", "1")
    for uri, out in (
        ("models:/tiny/1", tmp_path / "out-v1"),
        ("models:/tiny@prod", tmp_path / "out-prod"),
    ):
        result = _invoke("export", uri, str(out), "--tracking-uri", store)
        assert result.exit_code == 0, result.output
        assert _said(result) == [
            f"wrote {out} (transformers.AutoModelForCausalLM.from_pretrained loads it)"
        ]
        assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in source.iterdir())
        for path in source.iterdir():
            assert (out / path.name).read_bytes() == path.read_bytes(), path.name
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        assert (_logits(loaded) - _logits(original)).abs().max().item() <= 1e-6


def test_import_of_a_sharded_checkpoint_digests_its_shards_in_name_order(tmp_path, store):
    from raylane.tracking.checkpoints_hf import import_checkpoint

    source = tmp_path / "sharded"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES))
    model.save_pretrained(source, max_shard_size="40KB")
    shards = sorted(source.glob("model-*.safetensors"))
    assert len(shards) > 1
    total = hashlib.sha256(b"".join(p.read_bytes() for p in shards)).hexdigest()
    done = import_checkpoint(source, "sharded", store)
    assert done.sha256 == total and done.version == 1
    tags = MlflowClient(store).get_model_version("sharded", "1").tags
    assert tags["raylane.weights_sha256"] == total


def _log_trained(tmp_path, store: str, overrides: list[str], weights=None, tokenizer=True):
    """Record a run as `raylane train` does (resolved config, weights digest, the model logged
    by torch.export and registered, the data's tokenizer unless it trained on bytes), without
    Ray: (config, model)."""
    from raylane.config import load_config
    from raylane.config.loader import config_to_yaml
    from raylane.models import build_model
    from raylane.tracking.identity import weights_digest
    from raylane.tracking.runs import CONFIG_ARTIFACT, log_trained_model

    cfg = load_config(ROOT / "configs" / "train" / "llama_chat.yaml", [
        f"tracking.tracking_uri={store}", "tracking.registered_model=trained", *overrides,
    ])  # fmt: skip
    torch.manual_seed(1)
    model = build_model(cfg.model).eval()
    if weights is not None:
        weights(model)
    mlflow.set_tracking_uri(store)
    mlflow.set_experiment("llama-chat")
    with mlflow.start_run():
        mlflow.log_text(config_to_yaml(cfg), CONFIG_ARTIFACT)
        mlflow.set_tag("raylane.weights_digest", weights_digest(model.state_dict()))
        if tokenizer:
            path = tmp_path / "run-data" / "tokenizer.json"
            path.parent.mkdir()
            path.write_text('{"run": "tokenizer"}\n')
            mlflow.log_artifact(str(path), "data")
        example = np.random.default_rng(0).integers(0, cfg.model.num_classes, (2, 16))
        log_trained_model(model, cfg, example)
    return cfg, model


def test_export_of_a_trained_llama_rebuilds_it_from_the_logged_model(tmp_path, store):
    """A fine-tuned Qwen2 (tied embeddings, q/k/v biases): the exported directory holds the
    trained weights, not the pretrained ones, with the pretrained tokenizer files and the
    run's own tokenizer.json."""
    pretrained = tmp_path / "tiny-qwen2"
    base = _checkpoint(pretrained, "qwen2")

    def train(model):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.01 * torch.randn_like(parameter))

    cfg, trained = _log_trained(tmp_path, store, [
        f"model.pretrained={pretrained}", "model.num_classes=256", "model.input_dim=16",
    ], train)  # fmt: skip
    out = tmp_path / "exported"
    result = _invoke("export", "models:/trained/1", str(out), "--tracking-uri", store)
    assert result.exit_code == 0, result.output
    assert _said(result)[-1].startswith(f"wrote {out} (")
    assert (out / "tokenizer.json").read_text() == '{"run": "tokenizer"}\n'
    assert (out / "tokenizer_config.json").read_bytes() == (
        pretrained / "tokenizer_config.json"
    ).read_bytes()
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        ours = trained(TOKENS)
    assert (_logits(loaded) - ours).abs().max().item() <= 1e-5
    assert (_logits(loaded) - _logits(base)).abs().max().item() > 1e-3  # the trained weights

    run_id = MlflowClient(store).get_model_version("trained", "1").run_id
    MlflowClient(store).set_tag(run_id, "raylane.weights_digest", "0123456789abcdef")
    message = _one_line_error(
        _invoke("export", "models:/trained/1", str(tmp_path / "o"), "--tracking-uri", store)
    )
    assert message == ("models:/trained/1: the logged model's weights are not the run's final "
                       "weights (raylane.weights_digest 0123456789ab)")  # fmt: skip


def test_export_of_a_random_init_llama_with_tied_embeddings(tmp_path, store):
    cfg, trained = _log_trained(tmp_path, store, [
        "model.pretrained=null", "model.num_classes=300", "model.input_dim=16",
        "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=2",
        "model.tie_embeddings=true", "data.tokenizer=bytes",
    ], tokenizer=False)  # fmt: skip
    from raylane.tracking.checkpoints_hf import export_model

    done = export_model("models:/trained/1", tmp_path / "out", store)
    assert (done.name, done.version, done.kind) == ("trained", 1, "llama")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["vocab_size"], config["tie_word_embeddings"]) == (300, True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert (_logits(loaded) - trained(TOKENS)).abs().max().item() <= 1e-5

    # What generation serves: the same weights, read without an export, in the serving dtype.
    from raylane.serving.generation.loader import load_language_model
    from raylane.serving.generation.text_codec import BYTES

    served, card = load_language_model(store, "trained", 1, dtype=torch.bfloat16)
    assert card.codec is BYTES and card.parameters == sum(p.numel() for p in trained.parameters())
    assert {p.dtype for p in served.parameters()} == {torch.bfloat16}
    assert served.head.weight is served.tok_emb.weight  # still tied
    with torch.no_grad():
        assert torch.equal(served(TOKENS), trained.to(torch.bfloat16)(TOKENS))


def test_trained_llama_refuses_weights_of_another_model():
    from raylane.config.schema import ModelConfig
    from raylane.models.llama import LlamaForCausalLM, llama_config
    from raylane.tracking.checkpoints_hf import CheckpointError, trained_llama

    model_cfg = ModelConfig(kind="llama", num_classes=64, input_dim=8, d_model=16, n_heads=2,
                            n_layers=1)  # fmt: skip
    state = LlamaForCausalLM(llama_config(model_cfg)).state_dict()
    assert trained_llama(model_cfg, state).head.weight.shape == (64, 16)
    with pytest.raises(CheckpointError, match="do not fit the recorded model: .*blocks.0"):
        trained_llama(
            model_cfg, {k: v for k, v in state.items() if not k.startswith("blocks.0.mlp")}
        )


def test_the_one_line_errors(tmp_path, store):
    empty = tmp_path / "empty"
    empty.mkdir()
    message = _one_line_error(_invoke("import", str(empty), "--name", "x", "--tracking-uri", store))
    assert (
        message
        == f"{empty / 'config.json'}: not found (a Hugging Face model directory holds config.json)"
    )  # noqa: E501

    gpt2 = tmp_path / "gpt2"
    config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(gpt2)
    message = _one_line_error(_invoke("import", str(gpt2), "--name", "x", "--tracking-uri", store))
    assert "model_type 'gpt2' is not supported; raylane reads llama, mistral, qwen2" in message

    no_weights = tmp_path / "no-weights"
    _checkpoint(no_weights)
    (no_weights / "model.safetensors").unlink()
    message = _one_line_error(
        _invoke("import", str(no_weights), "--name", "x", "--tracking-uri", store)
    )
    assert message.endswith("no model.safetensors or model.safetensors.index.json (raylane "
                            "reads safetensors weights only)")  # fmt: skip
    assert not MlflowClient(store).search_registered_models()  # nothing half-registered

    message = _one_line_error(
        _invoke("export", "models:/nothing/3", str(tmp_path / "o"), "--tracking-uri", store)
    )
    assert message == f"registered model 'nothing' has no version 3 in {store}"
    message = _one_line_error(_invoke("export", "nothing", str(tmp_path / "o")))
    assert message == "'nothing' is not models:/NAME/VERSION or models:/NAME@ALIAS"

    # A classifier trained by raylane: its run recorded an mlp config.
    from raylane.config import load_config
    from raylane.config.loader import config_to_yaml
    from raylane.tracking.runs import CONFIG_ARTIFACT

    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("digits")).info.run_id
    digits = load_config(ROOT / "configs" / "train" / "digits_ddp.yaml")
    client.log_text(run_id, config_to_yaml(digits), CONFIG_ARTIFACT)
    client.create_registered_model("raylane-digits")
    client.create_model_version("raylane-digits", f"runs:/{run_id}/model", run_id)
    message = _one_line_error(
        _invoke("export", "models:/raylane-digits/1", str(tmp_path / "o"), "--tracking-uri", store)
    )
    assert (
        message == "models:/raylane-digits/1 is a model.kind 'mlp' model; raylane export writes "
        "model.kind 'llama' (Hugging Face checkpoints)"
    )  # noqa: E501

    # A version registered by hand, from a run with no recorded config.
    bare = client.create_run(client.get_experiment_by_name("digits").experiment_id).info.run_id
    client.create_model_version("raylane-digits", f"runs:/{bare}/model", bare)
    message = _one_line_error(
        _invoke("export", "models:/raylane-digits/2", str(tmp_path / "o"), "--tracking-uri", store)
    )
    assert message == ("models:/raylane-digits/2 is neither an imported checkpoint nor trained "
                       "by raylane (its run has no config/resolved.yaml)")  # fmt: skip

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    message = _one_line_error(
        _invoke("export", "models:/raylane-digits/1", str(taken), "--tracking-uri", store)
    )
    assert message == f"{taken} exists and is not an empty directory"
    assert (taken / "keep.txt").read_text() == "mine"


def _lora_config(pretrained: Path, store: str, *extra: str):
    from raylane.config import load_config

    return load_config(
        ROOT / "configs" / "finetune" / "llama_lora.yaml",
        [f"model.pretrained={pretrained}", "model.num_classes=256", "model.input_dim=64",
         f"tracking.tracking_uri={store}", *extra],
    )  # fmt: skip


def test_an_imported_checkpoint_is_a_fine_tuning_base_read_from_its_directory(tmp_path, store):
    from raylane.tracking.lineage import BaseModelError, resolve_base

    source = tmp_path / "tiny"
    _checkpoint(source)
    assert (
        _invoke("import", str(source), "--name", "tiny-llama", "--tracking-uri", store).exit_code
        == 0
    )
    imported = MlflowClient(store).get_model_version("tiny-llama", "1").tags
    cfg = _lora_config(source, store)
    base = resolve_base(cfg, store)
    # The workers load the base from model.pretrained: no weights travel through Ray.
    assert (base.name, base.version, base.state) == ("tiny-llama", 1, None)
    assert base.digest == imported["raylane.weights_sha256"]
    assert base.tags()["raylane.base_digest"] == base.digest
    # Other files than were imported: refused, naming both digests.
    other = tmp_path / "other"
    _checkpoint(other)
    weights = other / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x01")
    with pytest.raises(BaseModelError, match=rf"imported from weights sha256 {base.digest[:12]};"):
        resolve_base(_lora_config(other, store), store)
    # A reproduced run checks the digest it recorded.
    with pytest.raises(BaseModelError, match="was fine-tuned from weights sha256 0123456789ab"):
        resolve_base(cfg, store, expect_digest="0123456789abcdef")
    with pytest.raises(BaseModelError, match=r"target_modules \['q'\] match no linear layer"):
        resolve_base(_lora_config(source, store, "finetune.target_modules=[q]"), store)


def test_an_imported_draft_is_checked_against_the_imported_model_before_a_deploy(tmp_path, store):
    # torch-free serving module, imported here as the deploying process imports it
    from raylane.serving.app import check_draft_model
    from raylane.serving.errors import ServedModelError

    _checkpoint(tmp_path / "target")  # 256 tokens, 128 positions
    drafts = {
        "tiny-draft": {"num_hidden_layers": 1},
        "other-vocab": {"vocab_size": 128},
        "short": {"num_hidden_layers": 1, "max_position_embeddings": 64},
    }
    for name, sizes in drafts.items():
        torch.manual_seed(1)
        config = transformers.LlamaConfig(**{**SIZES, **sizes})
        transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / name)
    for name in ("target", *drafts):
        assert _invoke("import", str(tmp_path / name), "--name", name,
                       "--tracking-uri", store).exit_code == 0  # fmt: skip

    def check(draft: str, *extra: str):
        cfg = _lora_config(tmp_path / "target", store, "tracking.registered_model=target",
                           f"serving.generation.draft_model=models:/{draft}/1",
                           "serving.generation.speculate=3", *extra)  # fmt: skip
        check_draft_model(cfg, store, 1)

    def refusal(draft: str) -> str:
        with pytest.raises(ServedModelError) as refused:
            check(draft)
        prefix = (
            f"serving.generation.draft_model models:/{draft}/1 (v1) cannot draft for target v1: "
        )
        assert str(refused.value).startswith(prefix), refused.value
        return str(refused.value).removeprefix(prefix)

    check("tiny-draft")  # one layer of the same vocabulary and context: it can propose
    assert refusal("other-vocab") == "the draft's vocabulary is 128 tokens, the model's 256"
    assert refusal("short") == "the draft's context (64 tokens) is shorter than the model's (128)"
    check("short", "serving.generation.max_model_len=64")  # what is served is what it covers
