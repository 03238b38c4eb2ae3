"""Elastic worker counts: which ranges a config may ask for, each size's share of the constant
global batch, and the progress record that counts the steps a restart trains again."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from raylane.config import ConfigError, load_config
from raylane.train.checkpointing import Position, resume_position, save_checkpoint
from raylane.train.elastic import RunProgress, at_world_size
from tests.readme_blocks import ROOT

DIGITS = ROOT / "configs" / "train" / "digits_ddp.yaml"


def _load(*overrides: str):
    return load_config(DIGITS, ["training.checkpoint_every_steps=5", *overrides])


def test_a_worker_range_is_stored_as_max_and_min():
    cfg = _load("parallelism.workers={min: 1, max: 3}", "training.batch_size=16")
    assert (cfg.parallelism.workers, cfg.parallelism.min_workers) == (3, 1)
    assert cfg.parallelism.elastic and not _load().parallelism.elastic
    saved = _load(
        "parallelism.min_workers=null",
        "parallelism.workers={min: 2, max: 4}",
        "training.batch_size=12",
    )
    assert (saved.parallelism.workers, saved.parallelism.min_workers) == (4, 2)  # a resolved


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallelism.workers={min: 1}"], "takes exactly min and max"),
        (["parallelism.workers={min: 3, max: 2}"], r"min \(3\) is above max \(2\)"),
        (
            ["parallelism.workers={min: 1, max: 2}", "parallelism.strategy=local_sgd"],
            "resizes 'ddp' and 'fsdp' runs .* 'local_sgd' .* keeps a fixed worker count",
        ),
        (
            ["parallelism.workers={min: 2, max: 4}", "parallelism.strategy=tp", "parallelism.tp=2"],
            "'tp' with pp 1, tp 2, cp 1 keeps a fixed worker count",
        ),
        (
            ["parallelism.workers={min: 2, max: 4}", "training.batch_size=10"],
            r"global batch \(training.batch_size \* max = 40\) does not split evenly over 3 ",
        ),
        (
            ["parallelism.workers={min: 1, max: 2}", "training.checkpoint_every_steps=null"],
            "restarts the group from its latest checkpoint; set training.checkpoint_every_steps",
        ),
        (
            ["parallelism.workers={min: 1, max: 2}", "parallelism.straggler={rank: 1, delay_s: 1}"],
            r"straggler.rank 1 may name no worker: an elastic run can shrink to min \(1\)",
        ),
    ],
)
def test_impossible_worker_ranges_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        _load(*overrides)
    assert "\n" not in str(error.value)


def test_an_fsdp_run_resizes_with_its_shards():
    cfg = _load("parallelism.strategy=fsdp", "parallelism.workers={min: 1, max: 2}")
    for size in (2, 1):
        resized = at_world_size(cfg, size)
        assert resized.training.batch_size * size == cfg.training.batch_size * 2
        assert resized.parallelism.dims.dp_shard == size


def test_each_size_takes_its_share_of_one_global_batch():
    cfg = _load(
        "parallelism.workers={min: 1, max: 4}", "parallelism.dp=4", "training.batch_size=12"
    )
    for size, share in ((4, 12), (3, 16), (2, 24), (1, 48)):
        resized = at_world_size(cfg, size)  # dp, when given, follows the group
        assert (resized.parallelism.workers, resized.training.batch_size) == (size, share)
        assert resized.parallelism.dp == size
    with pytest.raises(RuntimeError, match="started with 5 workers; its range is 1-4"):
        at_world_size(cfg, 5)


def test_a_restart_counts_the_steps_trained_after_its_checkpoint(tmp_path):
    path = tmp_path / "run" / "raylane_progress.json"
    first = RunProgress(str(path))
    assert first.start(0, 2)["steps_lost"] == 0
    for step in range(1, 24):
        first.step_done(step)  # the group trained 23 steps; its last checkpoint was at 20
    again = RunProgress(str(path))  # a new worker group reads the file
    event = again.start(20, 1)
    assert (event["steps_lost"], event["previous_world_size"], event["world_size"]) == (3, 2, 1)
    again.step_done(21)
    assert RunProgress(str(path)).start(21, 2)["steps_lost"] == 0  # a notice checkpoint
    table = RunProgress(str(path)).table()
    assert [row[1:] for row in table["data"]] == [[0, 2, None, 0], [20, 1, 2, 3], [21, 2, 1, 0]]
    assert table["columns"][0] == "time"


def test_checkpoints_carry_the_global_step(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(tmp_path / "e", model, optimizer, 1, {"val_loss": 0.5, "global_step": 90})
    assert resume_position(tmp_path / "e") == Position(2, global_step=90)
    step = {"epoch": 2, "step": 5, "loss_sum": 1.5, "rows": 80, "global_step": 95}
    save_checkpoint(tmp_path / "s", model, optimizer, 2, step)
    assert resume_position(tmp_path / "s") == Position(2, 5, 1.5, 80, 95)


def test_the_spot_guide_excerpt_is_a_valid_elastic_config():
    text = (ROOT / "docs" / "guides" / "spot.md").read_text()
    excerpt = yaml.safe_load(text.split("```yaml\n", 1)[1].split("```", 1)[0])
    overrides = [
        f"{section}.{key}={json.dumps(value)}"
        for section, fields in excerpt.items()
        for key, value in fields.items()
    ]
    cfg = _load(*overrides)
    assert (cfg.parallelism.min_workers, cfg.parallelism.workers) == (1, 4)
    assert [at_world_size(cfg, n).training.batch_size for n in (4, 3, 2, 1)] == [12, 16, 24, 48]


def test_a_restart_takes_a_complete_checkpoint_ray_train_has_not_registered(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / "run"
    progress = RunProgress(str(run / "raylane_progress.json"))
    progress.start(0, 2)
    step = {"epoch": 0, "step": 10, "loss_sum": 2.0, "rows": 40, "global_step": 10}
    save_checkpoint(run / "epoch_0000_step_000010", model, optimizer, 0, step)
    progress.checkpointed(str(run / "epoch_0000_step_000010"), 10)
    progress.step_done(13)  # the group failed 3 steps later

    again = RunProgress(str(progress.path))  # the restarted group's rank 0
    assert again.newer_than_registered(5) == str(run / "epoch_0000_step_000010")
    assert again.newer_than_registered(None) == str(run / "epoch_0000_step_000010")
    assert again.newer_than_registered(10) is None  # Ray Train's is as new: take it
    assert again.start(10, 1)["steps_lost"] == 3
    assert RunProgress(str(progress.path)).state["checkpoint"]["global_step"] == 10  # kept

    progress.checkpointed(str(run / "epoch_0000_step_000015"), 15)  # recorded, since deleted
    assert RunProgress(str(progress.path)).newer_than_registered(10) is None


@pytest.mark.parametrize(
    ("overrides", "tolerated"),
    [
        ([], 0),
        (["parallelism.workers={min: 1, max: 2}", "training.checkpoint_every_steps=5"], 3),
        (["parallelism.workers={min: 1, max: 2}", "training.checkpoint_every_steps=5",
          "training.max_failures=0"], 0),  # as configured
        (["training.max_failures=-1"], -1),
    ],
)  # fmt: skip
def test_an_elastic_range_survives_nodes_lost_without_notice_by_default(
    tmp_path, overrides, tolerated
):
    from raylane.train.trainer import build_trainer

    cfg = load_config(
        ROOT / "configs" / "train" / "digits_ddp.yaml",
        ["training.max_failures=null", f"training.storage_path={tmp_path}", *overrides],
    )
    trainer = build_trainer(cfg, {}, "failures")
    assert trainer.run_config.failure_config.max_failures == tolerated
