"""`raylane validate` on every kind of YAML the commands read: a cluster spec and the hardware
catalog (`raylane plan`), besides run configs and search specs; and a run config's data files,
which must exist. No Ray is started."""

import pytest
import yaml
from typer.testing import CliRunner

from raylane.cli import app
from raylane.plan.hardware import ClusterSpec

from .test_config import REFERENCE, ROOT
from .test_plan import A100_4X8

CATALOG = ROOT / "configs" / "hardware" / "catalog.yaml"
LM = ROOT / "configs" / "train" / "lm_fsdp.yaml"


def _validate(path, *sets: str):
    args = ["validate", "--config", str(path)]
    for item in sets:
        args += ["--set", item]
    return CliRunner().invoke(app, args)


def test_a_cluster_spec_is_checked_against_the_catalog_and_printed_resolved():
    result = _validate(A100_4X8, "nodes=2")
    assert result.exit_code == 0, result.output
    spec = ClusterSpec.model_validate(yaml.safe_load(result.stdout))
    assert (spec.nodes, spec.devices_per_node, spec.accelerator) == (2, 8, "a100-80gb")
    assert spec.link_latency_us == 10.0  # the default, filled in
    assert result.stderr == f"{A100_4X8}: 2 x 8 a100-80gb (16 devices, 80 GB each; priced)\n"


@pytest.mark.parametrize(
    ("sets", "line"),
    [
        (["accelerator=tpu-v9"], "{path}: accelerator 'tpu-v9' is not in {catalog} (known: "),
        (["nodes=0"], "{path}: nodes: Input should be greater than or equal to 1"),
        (["node=2"], "--set node=2: unknown key node (did you mean nodes?)"),
    ],
)
def test_a_bad_cluster_spec_is_one_line_naming_the_field(sets, line):
    result = _validate(A100_4X8, *sets)
    assert result.exit_code == 2
    assert result.output.startswith("error: " + line.format(path=A100_4X8, catalog=CATALOG))
    assert result.output.count("\n") == 1


def test_the_hardware_catalog_validates_and_a_bad_entry_is_named(tmp_path):
    result = _validate(CATALOG)
    assert result.exit_code == 0, result.output
    assert set(yaml.safe_load(result.stdout)) >= {"a100-80gb", "h100-80gb"}
    tree = yaml.safe_load(CATALOG.read_text())
    tree["h100-80gb"]["memory_gb"] = -1
    broken = tmp_path / "catalog.yaml"
    broken.write_text(yaml.safe_dump(tree))
    result = _validate(broken)
    assert result.exit_code == 2
    assert result.output == (
        f"error: {broken}: h100-80gb.memory_gb: Input should be greater than 0\n"
    )


def test_a_files_source_must_match_files_and_name_an_existing_tokenizer(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # globs are relative to the working directory
    files = ["--set", "data.source=files", "--set", "data.files=[corpus/*.txt]"]
    result = _validate(LM, *files[1::2])
    assert result.exit_code == 2
    assert result.output == f"error: {LM}: data.files[0]: 'corpus/*.txt' matches no file\n"
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("text\n")
    assert _validate(LM, *files[1::2]).exit_code == 0
    result = _validate(LM, *files[1::2], "data.tokenizer=tok/tokenizer.json")
    assert result.exit_code == 2
    assert result.output == f"error: {LM}: data.tokenizer: tok/tokenizer.json not found\n"


def test_a_parquet_source_must_name_existing_splits(tmp_path):
    train, validation = tmp_path / "train.parquet", tmp_path / "validation.parquet"
    sets = ["data.source=parquet", f"data.train_path={train}", f"data.validation_path={validation}"]
    result = _validate(REFERENCE, *sets)
    assert result.exit_code == 2
    assert result.output == f"error: {REFERENCE}: data.train_path: {train} not found\n"
    train.mkdir()  # a directory of Parquet files counts
    result = _validate(REFERENCE, *sets)
    assert result.output == f"error: {REFERENCE}: data.validation_path: {validation} not found\n"
    validation.write_bytes(b"")
    assert _validate(REFERENCE, *sets).exit_code == 0


def test_built_in_sources_need_no_files_yet(tmp_path):
    # sklearn-digits is materialised by `raylane prepare`: its splits need not exist to validate.
    missing = tmp_path / "not-yet.parquet"
    result = _validate(REFERENCE, f"data.train_path={missing}")
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout)["data"]["train_path"] == str(missing)
