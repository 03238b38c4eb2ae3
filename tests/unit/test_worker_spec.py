"""The spec the driver hands each Ray Train worker: it survives pickling (Ray ships it), its
config validates back to the driver's, and what a run without a driver job leaves out reads as
None."""

from __future__ import annotations

import pickle
from dataclasses import fields
from pathlib import Path

import pytest

from raylane.config import load_config
from raylane.config.loader import with_absolute_paths
from raylane.train.trainer import _without_ray_data, _worker_config
from raylane.train.worker_spec import DriverLink, WorkerSpec
from tests.readme_blocks import ROOT

CONFIG = ROOT / "configs" / "train" / "digits_ddp.yaml"
OVERRIDES = ["training.lr=0.0123", "training.epochs=7", "training.seed=31"]


def _driver_cfg(*overrides: str):
    return load_config(CONFIG, [*OVERRIDES, *overrides])


def _link() -> DriverLink:
    return DriverLink(
        tracking_uri="http://mlflow.example:5000",
        run_id="0123abcd",
        journal_path="/runs/r1/raylane_journal.jsonl",
        driver_node="node-of-the-driver",
        driver_code={"code_digest": "d1g35t", "code_path": "/src/raylane"},
        base_state=("weights", 42),  # an ObjectRef in a job; any picklable value here
    )


def test_a_spec_round_trips_through_pickle_with_its_config_and_link_intact():
    cfg = _driver_cfg()
    spec = WorkerSpec.with_link(
        _link(), config=_worker_config(cfg), progress_path="/runs/r1/progress.json"
    )
    back = pickle.loads(pickle.dumps(spec))
    assert back == spec
    assert back.config["training"]["lr"] == 0.0123
    assert back.driver_code == {"code_digest": "d1g35t", "code_path": "/src/raylane"}
    assert back.base_state == ("weights", 42)
    assert back.progress_path == "/runs/r1/progress.json"
    assert back.memory_splits == {}


def test_the_validated_config_is_the_drivers_with_paths_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _driver_cfg("training.resume_from=ckpt/epoch_0003")
    spec = pickle.loads(pickle.dumps(WorkerSpec(config=_worker_config(cfg))))
    on_worker = spec.raylane_config()
    resolved = (tmp_path / "ckpt" / "epoch_0003").resolve()
    assert Path(on_worker.training.resume_from) == resolved
    # Every path absolute (workers run in another directory), every other value the driver's.
    assert Path(on_worker.data.train_path) == (tmp_path / cfg.data.train_path).resolve()
    assert Path(on_worker.training.storage_path).is_absolute()
    assert on_worker == with_absolute_paths(cfg)
    assert on_worker.training.model_dump(
        exclude={"resume_from", "storage_path"}
    ) == cfg.training.model_dump(exclude={"resume_from", "storage_path"})


def test_driver_fields_a_trial_does_not_set_read_as_none():
    spec = WorkerSpec.with_link(None, config=_worker_config(_driver_cfg()))
    link_fields = [f.name for f in fields(DriverLink)]
    assert link_fields == [
        "tracking_uri", "run_id", "journal_path", "driver_node", "driver_code", "base_state",
    ]  # fmt: skip
    assert {name: getattr(spec, name) for name in link_fields} == dict.fromkeys(link_fields)
    assert spec.progress_path is None
    assert spec.raylane_config().training.epochs == 7


def test_every_link_field_reaches_the_spec():
    link = _link()
    spec = WorkerSpec.with_link(link, config={})
    for f in fields(DriverLink):
        assert getattr(spec, f.name) == getattr(link, f.name), f.name


def test_ray_trains_dict_carries_the_spec_and_nothing_else_passes_for_one():
    spec = WorkerSpec(config=_worker_config(_driver_cfg()))
    loop_config = pickle.loads(pickle.dumps(spec.as_loop_config()))
    assert list(loop_config) == ["spec"]
    assert WorkerSpec.from_loop_config(loop_config) == spec
    with pytest.raises(TypeError, match="dict"):
        WorkerSpec.from_loop_config({"spec": spec.config})
    with pytest.raises(KeyError):
        WorkerSpec.from_loop_config({"config": spec.config})


def test_a_run_without_ray_datasets_starts_no_dataset_manager():
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks import DatasetsCallback

    def callbacks(trainer_class) -> list[str]:
        trainer = trainer_class(lambda: None, scaling_config=ScalingConfig(num_workers=1))
        return [type(c).__name__ for c in trainer._create_default_callbacks()]

    plain, memory_feed = callbacks(TorchTrainer), callbacks(_without_ray_data(TorchTrainer))
    # Only the datasets callback (its actor imports Ray Data for nothing) is left out.
    assert DatasetsCallback.__name__ in plain
    assert memory_feed == [name for name in plain if name != DatasetsCallback.__name__]
