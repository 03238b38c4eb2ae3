"""Build a Ray Train `TorchTrainer` from a validated config."""

from __future__ import annotations

import os
from pathlib import Path

from raylane.config import RaylaneConfig
from raylane.config.loader import with_absolute_paths
from raylane.train.journal import JOURNAL_FILE
from raylane.train.worker_spec import DriverLink, WorkerSpec

# Ray Train's controller checks on its workers every 2 s by default, and each change of state
# (group scheduled, started, finished) waits for the next check: seconds of every small job's
# wall time. raylane checks every 0.5 s unless the variable is set; Ray Train passes the
# driver's value on to the controller and the workers.
HEALTH_CHECK_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
HEALTH_CHECK_S = "0.5"
# Ray Train's watcher asks Ray for draining nodes every 5 s by default; a drain notice can
# leave under a minute to react, so raylane asks every second (one small GCS query).
PREEMPTION_POLL_ENV = "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"
PREEMPTION_POLL_S = "1"
# An elastic group restarted as a node leaves may still count it (a drained node is alive
# until its deadline passes; Ray's view of the nodes is refreshed every 20 s, or at once by
# `raylane.train.elastic.NodeWatch`) and wait for a worker there until this timeout (60 s by
# default) before it asks again. The timeout only covers the wait for the group's placement
# group (resources that exist are placed in well under a second) and Ray Train retries a
# timed-out start without limit, so elastic runs wait 5 s.
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
ELASTIC_START_TIMEOUT_S = "5"
PROGRESS_FILE = "raylane_progress.json"


def journal_path(cfg: RaylaneConfig, run_name: str) -> Path:
    """Where rank 0 journals the run for the driver (`raylane.train.journal`)."""
    return _run_dir(cfg, run_name) / JOURNAL_FILE


def prompt_health_checks() -> None:
    """Set raylane's health-check and drain-poll intervals for the Ray Train runs this
    process starts."""
    os.environ.setdefault(HEALTH_CHECK_ENV, HEALTH_CHECK_S)
    os.environ.setdefault(PREEMPTION_POLL_ENV, PREEMPTION_POLL_S)


def build_trainer(
    cfg: RaylaneConfig,
    datasets: dict,
    run_name: str,
    link: DriverLink | None = None,
    callbacks: list | None = None,
):
    """A TorchTrainer for `cfg`: worker group, datasets, storage, failure and checkpoint policy.

    `datasets` is what `raylane.data.ray_datasets.read_datasets` returns: Ray Datasets go to
    Ray Train, object-store splits (`MemorySplit`) to the workers' `WorkerSpec`.

    `run_name` must be unique per run: Ray Train resumes a run whose name already exists.
    `link` is what a tracked job's driver tells its workers (none for a Tune trial).
    `callbacks` are Ray Train user callbacks (a Tune trial passes its report callback).
    """
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    # lazy: torch and the worker loop; the Tune and profile drivers import this module
    # without building a trainer in their own process
    from raylane.data.memory import MemorySplit
    from raylane.parallel import splits_dataset  # lazy: as above
    from raylane.train.loop import train_loop_per_worker  # lazy: as above

    prompt_health_checks()
    _elastic_start_timeout(cfg.parallelism.elastic)
    memory = {k: v for k, v in datasets.items() if isinstance(v, MemorySplit)}
    datasets = {k: v for k, v in datasets.items() if k not in memory}
    spec = WorkerSpec.with_link(
        link,
        config=_worker_config(cfg),
        memory_splits=memory,
        # Where rank 0 notes the last step trained, so a restart counts the steps it lost.
        progress_path=str(_run_dir(cfg, run_name) / PROGRESS_FILE),
    )
    par = cfg.parallelism
    trainer_class = TorchTrainer if datasets else _without_ray_data(TorchTrainer)
    return trainer_class(
        train_loop_per_worker,
        train_loop_config=spec.as_loop_config(),
        torch_config=TorchConfig(backend="nccl" if par.use_gpu else "gloo"),
        scaling_config=_scaling_config(par),
        run_config=RunConfig(
            name=run_name,
            storage_path=str(_run_dir(cfg, run_name).parent),
            failure_config=FailureConfig(max_failures=cfg.failures_tolerated),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.training.checkpoints_to_keep),
            callbacks=callbacks,
        ),
        datasets=datasets,
        # Keep row order stable so a seeded CPU run repeats exactly.
        dataset_config=DataConfig(
            # Pipeline stages read the same rows (the first stage needs the inputs, the last
            # the targets), so their datasets are not sharded.
            datasets_to_split="all" if splits_dataset(par) else [],
            execution_options=_ordered_ingest_options(),
        ),
    )


def _without_ray_data(trainer_class):
    """`trainer_class` without Ray Train's datasets callback, for a run with no Ray Dataset
    (the memory feed): the callback starts a dataset-manager actor for every worker group even
    when there is nothing to shard, a process importing Ray Data, pandas and pyarrow beside the
    workers' own start (a 1-epoch digits run on 2 cores: 16.3 s with it, 15.6 s without,
    medians of 3 alternated runs)."""
    from ray.train.v2._internal.callbacks import DatasetsCallback

    class MemoryFeedTrainer(trainer_class):
        def _create_default_callbacks(self):
            callbacks = super()._create_default_callbacks()
            return [c for c in callbacks if not isinstance(c, DatasetsCallback)]

    return MemoryFeedTrainer


def _scaling_config(par):
    """The worker group. A range asks Ray Train for an elastic group: it starts with as many
    workers as fit (at least min) and restarts at a new size when nodes leave or room
    appears."""
    from ray.train import ScalingConfig

    resources = dict(par.resources_per_worker)
    if par.use_gpu:
        resources.setdefault("GPU", 1)
    return ScalingConfig(
        num_workers=(par.min_workers, par.workers) if par.elastic else par.workers,
        elastic_resize_monitor_interval_s=par.elastic_resize_monitor_s,
        use_gpu=par.use_gpu,
        resources_per_worker=resources,
        placement_strategy=par.placement_strategy,
    )


_timeout_set_here = False


def _elastic_start_timeout(elastic: bool) -> None:
    """Ray Train's worker-start timeout for the next run: 5 s for an elastic run unless the
    user set one; what it was otherwise (this process may start other runs after it)."""
    global _timeout_set_here
    if elastic and START_TIMEOUT_ENV not in os.environ:
        os.environ[START_TIMEOUT_ENV] = ELASTIC_START_TIMEOUT_S
        _timeout_set_here = True
    elif not elastic and _timeout_set_here:
        os.environ.pop(START_TIMEOUT_ENV, None)
        _timeout_set_here = False


def _run_dir(cfg: RaylaneConfig, run_name: str) -> Path:
    """Ray Train's directory of the run: its checkpoints, and raylane's progress file."""
    return Path(cfg.training.storage_path).resolve() / run_name


def _worker_config(cfg: RaylaneConfig) -> dict:
    """The config as workers see it: paths made absolute (workers run elsewhere)."""
    return with_absolute_paths(cfg).model_dump(mode="json")


def _ordered_ingest_options():
    # Train's DataConfig.default_ingest_options() copies Ray Data's deprecated
    # `exclude_resources` along (and warns on every run); these are the same options without it.
    from ray.data import ExecutionOptions
    from ray.data.context import DataContext

    current = DataContext.get_current().execution_options
    return ExecutionOptions(
        resource_limits=current.resource_limits,
        preserve_order=True,
        verbose_progress=current.verbose_progress,
    )
