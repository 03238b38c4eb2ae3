import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from raylane.config import ConfigError, RaylaneConfig, load_config, parse_overrides
from raylane.config.loader import config_to_yaml, flatten

ROOT = Path(__file__).resolve().parents[2]
TRAIN_CONFIGS = sorted((ROOT / "configs" / "train").glob("*.yaml"))
REFERENCE = ROOT / "configs" / "train" / "digits_ddp.yaml"


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    cfg = load_config(path)
    assert cfg.experiment


def test_reference_config_is_shipped():
    assert REFERENCE in TRAIN_CONFIGS


def test_overrides_are_typed_and_nested():
    cfg = load_config(
        REFERENCE,
        ["training.epochs=3", "model.hidden_sizes=[32, 16]", "parallelism.use_gpu=false"],
    )
    assert cfg.training.epochs == 3
    assert cfg.model.hidden_sizes == [32, 16]


def test_resolved_yaml_round_trips(tmp_path):
    cfg = load_config(REFERENCE, ["training.lr=0.01"])
    out = tmp_path / "resolved.yaml"
    out.write_text(config_to_yaml(cfg))
    assert load_config(out) == cfg
    assert flatten(cfg.model_dump(mode="json"))["serving.autoscaling.max_replicas"] == 2


def _write(tmp_path, tree) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(tree if isinstance(tree, str) else yaml.safe_dump(tree))
    return path


def _reference_tree():
    return yaml.safe_load(REFERENCE.read_text())


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda t: t["training"].update(bogus=1), "training.bogus: unknown key"),
        (lambda t: t["training"].update(epochs="many"), "training.epochs: Input should be"),
        (lambda t: t["training"].update(epochs=0), "training.epochs: Input should be greater"),
        (lambda t: t.update(extras={}), "extras: unknown key"),
        (lambda t: t.pop("experiment"), "experiment: Field required"),
        (
            lambda t: t["serving"]["autoscaling"].update(min_replicas=3, max_replicas=1),
            "serving.autoscaling: min_replicas (3) is larger than max_replicas (1)",
        ),
        (
            lambda t: t["serving"].update(max_batch_size=128, max_ongoing_requests=16),
            "serving: max_ongoing_requests (16) is smaller than max_batch_size (128)",
        ),
        (
            lambda t: t["model"].update(input_dim=32),
            "model.input_dim is 32 but sklearn-digits rows have 64 features",
        ),
        (
            lambda t: t["model"].update(kind="cnn", input_dim=60),
            "input_dim=60 is not a perfect square",
        ),
        (lambda t: t["parallelism"].update(strategy="zero3"), "parallelism.strategy: Input should"),
        (
            lambda t: t["parallelism"].update(resources_per_worker={"CPU": -1}),
            "resources_per_worker.CPU must not be negative",
        ),
    ],
)
def test_bad_config_gives_one_line_naming_file_and_field(tmp_path, mutate, expected):
    tree = _reference_tree()
    mutate(tree)
    path = _write(tmp_path, tree)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(str(path))
    assert expected in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [("training: [unclosed", "not valid YAML at line 1"), ("- a\n- b\n", "expected a mapping")],
)
def test_unparseable_files(tmp_path, text, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(_write(tmp_path, text))


def test_missing_file():
    with pytest.raises(ConfigError, match="nope.yaml: config file not found"):
        load_config("nope.yaml")


@pytest.mark.parametrize("item", ["training.epochs", "=3", "training..epochs=3"])
def test_malformed_overrides(item):
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        parse_overrides([item])


def test_override_into_a_scalar_is_refused():
    with pytest.raises(ConfigError, match="'training.epochs' is not a section"):
        load_config(REFERENCE, ["training.epochs.x=1"])


def test_every_field_is_described():
    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, RaylaneConfig.__base__):
                walk(annotation)

    walk(RaylaneConfig)


def test_cli_reports_bad_config_in_one_line_without_traceback(tmp_path):
    tree = _reference_tree()
    tree["training"]["epochs"] = "many"
    path = _write(tmp_path, tree)
    result = subprocess.run(
        [sys.executable, "-m", "raylane.cli", "train", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert str(path) in lines[0] and "training.epochs" in lines[0]
    assert "Traceback" not in result.stderr
    assert "ray" not in result.stderr.lower().replace("raylane", "")


def test_configuration_reference_and_json_schema_are_current():
    from raylane.config.reference import JSON_SCHEMA, REFERENCE_PAGE, config_json_schema_text
    from raylane.reference import render_page

    rerun = "run: PYTHONPATH=platform python -m raylane.reference"
    page = (ROOT / REFERENCE_PAGE).read_text()
    # A row of each file's schema: run config, Tune spec, cluster spec, hardware catalog.
    for row in ("| `experiment` | required |", "| `predict.top_k` | `3` |",
                "| `devices_per_node` | required | Accelerators per node. |",
                "| `<accelerator>.memory_gb` | required |"):  # fmt: skip
        assert row in page, row
    assert render_page(page) == page, rerun
    assert (ROOT / JSON_SCHEMA).read_text() == config_json_schema_text(), rerun


def test_shipped_configs_and_the_elastic_range_validate_against_the_json_schema():
    """What an editor checks against the schema file: every shipped run config passes, an
    elastic range passes, and an unknown key or a worker count of 0 is flagged."""
    import json

    import jsonschema

    from raylane.config.reference import JSON_SCHEMA

    schema = json.loads((ROOT / JSON_SCHEMA).read_text())
    validator = jsonschema.Draft202012Validator(schema)
    configs = [*TRAIN_CONFIGS, *sorted(ROOT.glob("configs/finetune/*.yaml")),
               *sorted(ROOT.glob("configs/plan/*.yaml"))]  # fmt: skip
    for path in configs:
        errors = [e.message for e in validator.iter_errors(yaml.safe_load(path.read_text()))]
        assert not errors, f"{path.name}: {errors}"
    elastic = {"experiment": "x", "parallelism": {"workers": {"min": 1, "max": 4}}}
    assert validator.is_valid(elastic)
    assert not validator.is_valid({"experiment": "x", "parallelism": {"workers": 0}})
    assert not validator.is_valid({"experiment": "x", "parallelism": {"workers": {"min": 1}}})
    assert not validator.is_valid({"experiment": "x", "trainig": {}})


LM_PIPELINE = ROOT / "configs" / "train" / "lm_pipeline.yaml"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["parallelism.microbatches=1"],
            "microbatches (1) must be at least pp (2)",
        ),
        (["model.n_layers=3"], "model.n_layers (3) is not divisible by parallelism.pp (2)"),
        (
            ["parallelism.workers=3"],
            "dp * pp = 1 * 2 = 2 but workers is 3",
        ),
        (
            ["training.batch_size=30"],
            "training.batch_size (30) is not divisible by parallelism.microbatches (4)",
        ),
        (["parallelism.pp=1"], "strategy 'pipeline' needs pp >= 2"),
        (["parallelism.dp=2", "parallelism.workers=4"], "use 'hybrid' for dp > 1"),
        (["parallelism.strategy=hybrid"], "strategy 'hybrid' needs dp >= 2"),
        (["parallelism.split_points=[1, 2]"], "split_points needs pp - 1 = 1 entries, got 2"),
        (["parallelism.split_points=[4]"], "must increase strictly within 1..3"),
        (["model.n_heads=3"], "d_model (64) must be divisible by n_heads (3)"),
        (
            ["model.kind=mlp", "data.source=sklearn-digits", "model.num_classes=10"],
            "model.kind must be 'gpt' or 'llama', not 'mlp'",
        ),
        (["model.num_classes=128"], "byte-level (256 tokens)"),
    ],
)
def test_impossible_pipeline_layouts_are_refused_with_a_sentence(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(LM_PIPELINE, overrides)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


LM_TP = ROOT / "configs" / "train" / "lm_tp.yaml"
LM_FSDP = ROOT / "configs" / "train" / "lm_fsdp.yaml"


@pytest.mark.parametrize(
    ("config", "overrides", "expected"),
    [
        (LM_TP, ["model.n_heads=8", "parallelism.tp=3", "parallelism.workers=3"],
         "model.n_heads (8) is not divisible by parallelism.tp (3)"),
        (LM_TP, ["parallelism.workers=3"], "workers (3) is not divisible by tp (2)"),
        (LM_TP, ["parallelism.dp=3", "parallelism.workers=4"],
         "dp * tp = 3 * 2 = 6 but workers is 4"),
        (LM_TP, ["parallelism.tp=1"], "strategy 'tp' needs tp >= 2"),
        (LM_TP, ["parallelism.pp=2"], "strategy 'tp' has no pipeline stages; pp must be 1"),
        (LM_FSDP, ["parallelism.tp=2", "parallelism.workers=3"],
         "workers (3) is not divisible by tp (2)"),
        (LM_PIPELINE, ["parallelism.tp=2"], "dp * pp * tp = 1 * 2 * 2 = 4 but workers is 2"),
        (LM_PIPELINE, ["parallelism.tp=3", "parallelism.workers=6"],
         "model.n_heads (4) is not divisible by parallelism.tp (3)"),
        (LM_TP, ["parallelism.strategy=ddp"], "parallelism.tp 2 needs strategy 'tp', 'fsdp', "
         "'pipeline' or 'hybrid' (got 'ddp')"),
        (LM_FSDP, ["parallelism.tp=2", "model.kind=mlp", "data.source=sklearn-digits",
                   "model.num_classes=10"],
         "model.kind must be 'gpt' or 'llama' (or 'custom' with a tp_plan), not 'mlp'"),
    ],
)  # fmt: skip
def test_impossible_sharded_layouts_are_refused_with_a_sentence(config, overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(config, overrides)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_sharded_layouts_are_described_and_count_their_replicas():
    from raylane.config.layout import describe_stages, replicas

    fsdp_2d = load_config(LM_FSDP, ["parallelism.workers=8", "parallelism.tp=2"])
    assert replicas(fsdp_2d) == 4
    assert describe_stages(fsdp_2d) == [
        "each block's heads and MLP split over 2 workers (2 heads each); parameters, "
        "gradients and optimizer state sharded over 4 workers"
    ]
    tp = load_config(LM_TP, ["parallelism.workers=4"])
    assert replicas(tp) == 2
    assert describe_stages(tp) == [
        "each block's heads and MLP split over 2 workers (2 heads each); 2 data-parallel replicas"
    ]


def test_uneven_split_points_are_accepted_and_described():
    from raylane.config.layout import describe_stages, stage_boundaries

    cfg = load_config(LM_PIPELINE, ["model.n_layers=3", "parallelism.split_points=[1]"])
    assert stage_boundaries(3, 2, [1]) == [0, 1, 3]
    assert describe_stages(cfg) == [
        "stage 0: embeddings, blocks 0-0 (x1 replicas)",
        "stage 1: blocks 1-2, norm + head (x1 replicas)",
    ]


def test_unreachable_tracking_server_stops_training_before_ray_starts(tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the block ends: nothing listens there
    uri = f"http://127.0.0.1:{port}"
    result = subprocess.run(
        [
            sys.executable, "-m", "raylane.cli", "train", "--config", str(REFERENCE),
            "--set", f"tracking.tracking_uri={uri}",
            "--set", f"data.train_path={tmp_path}/train.parquet",
            "--set", f"data.validation_path={tmp_path}/validation.parquet",
        ],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: MLflow tracking server {uri} is unreachable (ConnectionError)"]
    assert "Traceback" not in result.stderr and "Started a local Ray" not in result.stderr
