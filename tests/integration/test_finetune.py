"""LoRA fine-tuning of a registered model on the session cluster: the session's pipeline LM
(no base is trained here) fine-tuned by DDP on the standard library's test suite, a domain its
base never read. The run records its base (tags, the base's logged model as an input), only
the adapter is logged and registered (tagged with its base), the registered adapter loads back
onto its base with the base's weights untouched, and a bad base or target module is refused
before Ray is asked for anything. (DDP and FSDP2 fine-tuning against single-process training:
the layout equivalence test, entries ddp2-lora and fsdp2-lora.)"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
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
    from raylane.serving.generation.loader import load_language_model

    base, _ = load_language_model(
        outcome.tracking_uri, base_cfg.tracking.registered_model, base_outcome.model_version
    )
    return base.state_dict()


def test_the_adapter_loads_onto_its_untouched_base_and_changes_the_model(finetuned, pipeline_run):
    from raylane.serving.generation.loader import load_language_model

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


def _register_adapter(cfg, base_tags: dict, seed: int):
    """A second or third adapter of the same base, trained in this process (a few AdamW steps
    on the held-out domain, so that it answers differently from the others) and registered as
    a fine-tuning run registers one: a new version of the adapter's registered model."""
    import mlflow
    import numpy as np

    from raylane.config.loader import config_to_yaml
    from raylane.data.text import stdlib_source_files, token_windows
    from raylane.models.adapters import apply_lora
    from raylane.serving.generation.loader import load_language_model
    from raylane.tracking.lineage import register_adapter
    from raylane.tracking.runs import CONFIG_ARTIFACT

    base, _ = load_language_model(cfg.tracking.tracking_uri, base_tags["raylane.base_model"],
                                  int(base_tags["raylane.base_version"]))  # fmt: skip
    torch.manual_seed(seed)
    model = apply_lora(base.train(), cfg.finetune)
    files = stdlib_source_files(32768, "python-stdlib-tests")
    x, y = token_windows(b"".join(p.read_bytes() for p in files), cfg.model.input_dim)
    pick = np.random.default_rng(seed).choice(len(x), size=(6, 8))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    for rows in pick:
        optimizer.zero_grad()
        logits = model(torch.as_tensor(x[rows], dtype=torch.long))
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), torch.as_tensor(y[rows], dtype=torch.long).flatten()
        )
        loss.backward()
        optimizer.step()
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(cfg.tracking.tracking_uri)
    try:
        mlflow.set_experiment(cfg.experiment)
        with mlflow.start_run(run_name=f"in-process adapter {seed}"):
            mlflow.log_text(config_to_yaml(cfg), CONFIG_ARTIFACT)  # its architecture, as runs do
            return register_adapter(model.eval(), cfg, base_tags)[1]
    finally:
        mlflow.set_tracking_uri(previous)


@pytest.fixture(scope="module")
def adapter_server(finetuned, pipeline_run, workspace):
    """The session's pipeline LM served for generation, holding at most 2 adapters of it, with
    a second adapter registered beside the fine-tuning run's."""
    from mlflow.tracking import MlflowClient

    from raylane.serving.app import deploy, shutdown_serve

    from .conftest import free_port, lm_overrides

    cfg, outcome = finetuned
    base_tags = MlflowClient(outcome.tracking_uri).get_run(outcome.run_id).data.tags
    second = _register_adapter(cfg, base_tags, seed=2)
    serve_cfg = load_config(ROOT / "configs" / "train" / "lm_pipeline.yaml", lm_overrides(
        workspace, "serving.api=generate", "serving.model_name=pylm",
        f"serving.port={free_port()}", "serving.generation.max_num_seqs=4",
        "serving.generation.max_adapters=2", "serving.autoscaling.max_replicas=1",
    ))  # fmt: skip
    url, _ = deploy(serve_cfg)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        yield url, client, (cfg, base_tags), [outcome.model_version, second]
    finally:
        shutdown_serve()


def _reference(tracking_uri: str, name: str, version: int, prompt: str, max_tokens: int) -> str:
    """The registered model's (an adapter merged into its base) own cache-free text, sampled
    as `SAMPLING` asks (a seeded draw: the same tokens when the distributions are the same,
    and different models' distributions differ where greedy picks may not)."""
    from raylane.serving.generation.engine import generate_without_cache
    from raylane.serving.generation.loader import load_language_model
    from raylane.serving.generation.sampling import SamplingParams

    model, _ = load_language_model(tracking_uri, name, version)
    params = SamplingParams(max_tokens=max_tokens, **SAMPLING)
    return bytes(generate_without_cache(model, list(prompt.encode()), params).output).decode(
        "utf-8", errors="replace"
    )


def _stats(url: str) -> dict:
    return httpx.get(f"{url}/v2/models/pylm/stats", timeout=10).json()["model_stats"][0]


PROMPT = "    def test_"
SAMPLING = {"temperature": 1.0, "seed": 7}


def test_two_adapters_of_one_base_answer_from_one_replica_each_as_itself(
    adapter_server, pipeline_run, workspace
):
    url, client, _, versions = adapter_server
    base_name, base_version = _base_ref(pipeline_run)
    names = ["pylm", *(f"pylm:{ADAPTED}/{v}" for v in versions)]
    uri = workspace.tracking_uri
    expected = [_reference(uri, base_name, base_version, PROMPT, 24),
                *(_reference(uri, ADAPTED, v, PROMPT, 24) for v in versions)]  # fmt: skip
    assert len(set(expected)) == 3, expected  # three models that really differ

    # Sent together, so that the replica decodes them in the same batches.
    with ThreadPoolExecutor(len(names)) as pool:
        answers = list(pool.map(lambda name: client.completions.create(
            model=name, prompt=PROMPT, max_tokens=24, **SAMPLING), names))  # fmt: skip
    assert [a.choices[0].text for a in answers] == expected
    assert [a.model for a in answers] == names
    listed = [m.id for m in client.models.list().data]
    assert listed[0] == "pylm" and sorted(listed[1:]) == sorted(names[1:])
    entry = httpx.get(f"{url}/v1/models/{names[1]}", timeout=10).json()
    assert entry["id"] == names[1] and entry["parent"] == "pylm"
    streamed = client.chat.completions.create(
        model=names[1], messages=[{"role": "user", "content": "hi"}], max_tokens=8,
        stream=True, **SAMPLING)  # fmt: skip
    # The conversation as the byte-level model reads it (one `role: content` line per message,
    # then the reply's `assistant: `), the same seeded draw, its pieces joined.
    chat = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert chat == _reference(uri, ADAPTED, versions[0], "user: hi\nassistant: ", 8), chat
    oip = httpx.post(f"{url}/v2/models/{names[2]}/generate", timeout=60,
                     json={"text_input": PROMPT, "parameters": {"max_tokens": 24,
                                                                **SAMPLING}})  # fmt: skip
    assert oip.status_code == 200 and oip.json()["text_output"] == expected[2]
    assert sorted(_stats(url)["adapters"]) == sorted(names[1:])

    too_long = client.completions.with_raw_response  # a request that cannot run loads nothing
    with pytest.raises(openai.BadRequestError, match="exceeds the model's context"):
        too_long.create(model=f"pylm:{ADAPTED}/98", prompt="x" * 300, max_tokens=4)
    for name, message in [
        (f"pylm:{ADAPTED}/99", f"registered model '{ADAPTED}' has no version 99"),
        (f"pylm:{base_name}/{base_version}", "is not a LoRA adapter"),
        ("pylm:lm-lora-test@champion", "is not served here; available: 'pylm' and its base's"),
        ("other", "model 'other' is not served here"),
    ]:
        with pytest.raises(openai.NotFoundError, match=re.escape(message)):
            client.completions.create(model=name, prompt=PROMPT, max_tokens=4)


def test_a_new_adapter_version_is_served_under_load_without_a_restart_or_a_failed_request(
    adapter_server, workspace
):
    url, client, (cfg, base_tags), versions = adapter_server
    pid = _stats(url)["replica_pid"]
    stop, answered, failed = threading.Event(), [], []
    loaded = ("pylm", f"pylm:{ADAPTED}/{versions[0]}")

    def load(name: str) -> None:
        while not stop.is_set():
            try:
                client.completions.create(model=name, prompt=PROMPT, max_tokens=16)
                answered.append((name, time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
                failed.append(repr(exc))

    threads = [threading.Thread(target=load, args=(name,)) for name in loaded]
    for thread in threads:
        thread.start()
    try:
        third = _register_adapter(cfg, base_tags, seed=3)  # registered while requests run
        name = f"pylm:{ADAPTED}/{third}"
        answer = client.completions.create(model=name, prompt=PROMPT, max_tokens=24, **SAMPLING)
        installed = time.monotonic()
        # More load after it was installed: both loaded models answer again (however long a
        # loaded machine takes), or a failure ends the wait.
        deadline = installed + 300
        while {n for n, at in answered if at > installed} != set(loaded) and not failed:
            assert time.monotonic() < deadline, answered[-4:]
            time.sleep(0.1)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    assert answer.choices[0].text == _reference(workspace.tracking_uri, ADAPTED, third, PROMPT, 24)
    assert failed == [], failed
    # Answered throughout: both models, before the new version was installed and after it.
    for model in loaded:
        times = [at for n, at in answered if n == model]
        assert min(times) < installed < max(times), (model, installed, times)
    stats = _stats(url)
    assert stats["replica_pid"] == pid  # the same replica process throughout
    # Two slots: the idle second adapter made room for the third; the busy first stayed.
    assert sorted(stats["adapters"]) == sorted([f"pylm:{ADAPTED}/{versions[0]}", name])


def test_compare_and_reproduce_read_the_base_and_its_present_weights(finetuned, pipeline_run):
    from mlflow.tracking import MlflowClient

    from raylane.reproduce import present_base
    from raylane.tracking.compare import run_record

    _, outcome = finetuned
    client = MlflowClient(outcome.tracking_uri)
    recorded = run_record(client, outcome.run_id)["base"]
    name, version = _base_ref(pipeline_run)
    assert recorded["base_model"] == name and recorded["base_version"] == str(version)
    assert recorded["base_digest"] == base_digest(outcome)
    assert present_base(client, recorded) == recorded  # the base's weights as they were
    gone = present_base(client, recorded | {"base_version": "999"})
    assert gone["base_digest"] == "missing"


def test_a_served_adapter_version_is_merged_or_kept_beside_its_base(finetuned, pipeline_run):
    from raylane.serving.generation.loader import load_generation_model, load_language_model

    _, outcome = finetuned
    merged = load_generation_model(outcome.tracking_uri, ADAPTED, outcome.model_version)
    assert merged.base is None and merged.own_adapter is None  # nothing else may be asked for
    reference, card = load_language_model(outcome.tracking_uri, ADAPTED, outcome.model_version)
    assert merged.card == card
    for name, tensor in reference.state_dict().items():
        assert torch.equal(merged.model.state_dict()[name], tensor), name
    apart = load_generation_model(outcome.tracking_uri, ADAPTED, outcome.model_version, merge=False)
    assert apart.base == _base_ref(pipeline_run)
    assert apart.own_adapter.key == f"{ADAPTED}/{outcome.model_version}"
    base_state = _base_state(outcome, *pipeline_run)
    assert apart.model.state_dict().keys() == base_state.keys()  # the plain base, no adapter in it
