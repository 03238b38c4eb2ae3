"""Validation figures of every layout that splits the model equal one worker's, on a split
smaller than one global batch (3 rows; 4 per replica): each layout's evaluation keeps the last,
partial batch (a replica's slice may be empty), so every row counts once. Two gloo processes
run raylane's own strategies and evaluation (`raylane.train.loop._evaluate`) against the plain
model's mean over the same rows; a split with nothing to count is an error, never 0."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from raylane.config import load_config
from raylane.data import DataError
from raylane.data.memory import MemorySplit
from raylane.models import build_model
from raylane.parallel.registry import get_strategy
from raylane.train.loop import _evaluate
from raylane.train.preflight import check_whole_batches
from tests.readme_blocks import ROOT

from .gloo import by_rank

ROWS, SEQ, BATCH = 3, 16, 4
LLAMA = ["model.kind=llama", "model.n_kv_heads=2", "model.ffn_dim=64"]
# name: the layout's overrides (2 workers)
LAYOUTS = {
    "fsdp2": ["parallelism.strategy=fsdp", "parallelism.dp=2", "parallelism.tp=1"],
    "fsdp2 llama": ["parallelism.strategy=fsdp", "parallelism.dp=2", "parallelism.tp=1", *LLAMA],
    "tp2": ["parallelism.strategy=tp", "parallelism.dp=1", "parallelism.tp=2"],
    "cp2": ["parallelism.strategy=ddp", "parallelism.dp=1", "parallelism.cp=2"],
}


def _config(*overrides: str):
    return load_config(
        ROOT / "configs" / "train" / "lm_pipeline.yaml",
        [
            "parallelism.pp=1",
            f"training.batch_size={BATCH}",
            f"model.input_dim={SEQ}",
            "model.d_model=32",
            "model.n_layers=2",
            *overrides,
        ],
    )


def _split(rows: int) -> MemorySplit:
    tokens = np.random.default_rng(0).integers(0, 256, (rows, SEQ + 1))
    arrays = (tokens[:, :-1].astype(np.int64), tokens[:, 1:].astype(np.int64))
    return MemorySplit("validation", rows, None, None, _arrays=arrays)


def _check(rank: int, overrides: list[str]) -> dict:
    cfg = _config(*overrides)
    torch.manual_seed(0)
    plain = build_model(cfg.model)
    strategy = get_strategy(cfg, rank)
    model = strategy.wrap_model(copy.deepcopy(plain))
    loss, accuracy = _evaluate(strategy, model, _split(ROWS), cfg)
    features, labels = _split(ROWS).arrays()
    with torch.no_grad():
        logits = plain(torch.from_numpy(features))
    expected = F.cross_entropy(logits.flatten(0, 1), torch.from_numpy(labels).flatten())
    hits = (logits.argmax(-1) == torch.from_numpy(labels)).double().mean()
    try:
        _evaluate(strategy, model, _split(0), cfg)
        empty = None
    except ValueError as error:
        empty = str(error)
    return {"loss": loss, "expected": expected.item(), "accuracy": accuracy,
            "expected_accuracy": hits.item(), "empty": empty}  # fmt: skip


CHECKS = {name: functools.partial(_check, overrides=o) for name, o in LAYOUTS.items()}
TWO_PROCESS_CHECKS = {
    name: (lambda rank, _, check=check: check(rank)) for name, check in CHECKS.items()
}


@pytest.fixture(scope="module")
def results(two_processes) -> list[dict]:
    return by_rank(two_processes, __name__, CHECKS)


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_layouts_validation_on_a_small_split_is_one_workers(results, name):
    """Every worker gets the group's figures: the plain model's mean over all 3 rows (fp32
    sums in another order: 1e-6), and its accuracy exactly."""
    for worker in (by_worker[name] for by_worker in results):
        assert worker["loss"] == pytest.approx(worker["expected"], rel=1e-6)
        assert worker["accuracy"] == worker["expected_accuracy"]


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_split_with_nothing_to_count_is_an_error_not_zero(results, name):
    for worker in (by_worker[name] for by_worker in results):
        assert worker["empty"] == (
            "validation: no target was evaluated (the validation split is empty, or every "
            "label is -100); raise data.validation_fraction"
        )


def test_a_pipeline_refuses_splits_smaller_than_one_global_batch_before_ray():
    cfg = _config("parallelism.strategy=pipeline", "parallelism.pp=2", "parallelism.dp=1",
                  "parallelism.microbatches=2")  # fmt: skip
    check_whole_batches(cfg, train_rows=BATCH, val_rows=BATCH)  # one whole batch: runs
    with pytest.raises(
        DataError,
        match=r"validation.parquet: 3 validation rows, fewer than one "
        r"global batch of 4 \(training.batch_size 4 x 1 data-parallel replicas\), "
        r"which a pipeline layout evaluates on whole: lower training.batch_size",
    ):
        check_whole_batches(cfg, train_rows=100, val_rows=3)
    fsdp = _config(*LAYOUTS["fsdp2"])
    check_whole_batches(fsdp, train_rows=2 * BATCH, val_rows=1)  # evaluates a partial batch
    with pytest.raises(
        DataError,
        match=r"train.parquet: 7 training rows, fewer than one global "
        r"batch of 8 \(training.batch_size 4 x 2 data-parallel replicas\), which "
        r"a fsdp layout trains on whole",
    ):
        check_whole_batches(fsdp, train_rows=7, val_rows=100)
