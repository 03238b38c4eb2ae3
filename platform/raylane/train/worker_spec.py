"""What the driver hands each Ray Train worker: one typed, picklable `WorkerSpec`.

Ray Train passes its `train_loop_config` dict to `train_loop_per_worker`; raylane's holds a
single entry, `{SPEC_KEY: spec}`, which the worker takes out once. A tracked job's driver
adds a `DriverLink` (its MLflow run, journal and code identity, a fine-tuning run's base
weights); a Tune trial or a test has none, and its fields read as None.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from raylane.config import RaylaneConfig

if TYPE_CHECKING:
    from ray import ObjectRef

    from raylane.data.memory import MemorySplit

SPEC_KEY = "spec"  # the one key of the `train_loop_config` dict Ray Train hands the workers


@dataclass(frozen=True, kw_only=True)
class DriverLink:
    """What a tracked job's driver tells its workers; None where a run has no driver job."""

    tracking_uri: str | None = None  # the MLflow tracking URI of the job's run
    run_id: str | None = None  # the MLflow run that workers sample system metrics into
    journal_path: str | None = None  # where rank 0 journals the run for the driver's recorder
    driver_node: str | None = None  # the driver's Ray node id (it samples that node itself)
    driver_code: dict[str, str] | None = None  # the driver's `code_digest` and `code_path`
    base_state: ObjectRef | None = None  # a fine-tuning run's base weights, in the object store


@dataclass(frozen=True, kw_only=True)
class WorkerSpec(DriverLink):
    """Everything a worker of one run needs from the driver, with the `DriverLink` fields."""

    config: dict[str, Any]  # the resolved config as JSON (paths made absolute for workers)
    memory_splits: dict[str, MemorySplit] = field(default_factory=dict)  # object-store splits
    progress_path: str | None = None  # where rank 0 records its progress (`RunProgress`)

    @classmethod
    def with_link(cls, link: DriverLink | None, **own: Any) -> WorkerSpec:
        """A spec of the run's `own` fields and the driver's `link` (none: all None)."""
        shared = {} if link is None else {f.name: getattr(link, f.name) for f in fields(link)}
        return cls(**shared, **own)

    def raylane_config(self) -> RaylaneConfig:
        """The config, validated (on a worker: before an elastic group's `at_world_size`)."""
        return RaylaneConfig.model_validate(self.config)

    def as_loop_config(self) -> dict[str, WorkerSpec]:
        """The `train_loop_config` dict Ray Train passes on to `train_loop_per_worker`."""
        return {SPEC_KEY: self}

    @staticmethod
    def from_loop_config(loop_config: dict[str, Any]) -> WorkerSpec:
        """The spec out of the dict `as_loop_config` made."""
        spec = loop_config[SPEC_KEY]
        if not isinstance(spec, WorkerSpec):
            raise TypeError(f"train_loop_config[{SPEC_KEY!r}] is a {type(spec).__name__}")
        return spec
