"""The hardware a plan is for: an accelerator catalog (YAML) and a cluster spec naming one.

Catalog figures are data-sheet peaks; a plan built from them says so (`basis`), unlike one
built from measurements of the cluster itself. An accelerator may also carry `pricing`: what
a device-hour costs on demand and on spot capacity, and how often spot capacity is taken
back; `raylane plan --objective cost` needs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from raylane.config.schema import StrictModel

Precision = Literal["fp32", "tf32", "bf16"]
DEFAULT_CATALOG = Path(__file__).resolve().parents[3] / "configs" / "hardware" / "catalog.yaml"


class Pricing(StrictModel):
    """What a device-hour costs: figures a user edits for their provider, never live prices."""

    on_demand_usd_per_hour: float = Field(gt=0, description="On-demand price per device-hour.")
    spot_usd_per_hour: float = Field(gt=0, description="Spot price per device-hour.")
    spot_interruptions_per_node_hour: float = Field(
        ge=0,
        description="Expected preemptions of one spot node (an instance of devices_per_node "
        "devices) per hour it runs; a job on N nodes is stopped N times as often.",
    )
    source: str = Field(min_length=1, description="Where the figures come from, and when.")

    @model_validator(mode="after")
    def _spot_is_not_dearer(self) -> Pricing:
        if self.spot_usd_per_hour > self.on_demand_usd_per_hour:
            raise ValueError(
                f"spot_usd_per_hour ({self.spot_usd_per_hour:g}) is above "
                f"on_demand_usd_per_hour ({self.on_demand_usd_per_hour:g})"
            )
        return self


class Accelerator(StrictModel):
    peak_flops: dict[Precision, float] = Field(description="Dense peak FLOP/s by precision.")
    memory_gb: float = Field(gt=0, description="Device memory (GB, 1e9 bytes).")
    intra_node_gbps: float = Field(gt=0, description="Per-device link within a node (GB/s).")
    inter_node_gbps: float = Field(gt=0, description="Per-device link between nodes (GB/s).")
    pricing: Pricing | None = Field(None, description="Prices per device-hour (optional).")


class ClusterSpec(StrictModel):
    nodes: int = Field(ge=1, description="Nodes in the cluster.")
    devices_per_node: int = Field(ge=1, description="Accelerators per node.")
    accelerator: str = Field(description="A key of the hardware catalog.")
    link_latency_us: float = Field(
        10.0, ge=0, description="Per-collective-step latency (alpha), microseconds."
    )


class Cluster:
    """A cluster spec with its accelerator resolved from the catalog."""

    def __init__(self, spec: ClusterSpec, device: Accelerator, basis: str):
        self.spec = spec
        self.device = device
        self.basis = basis  # 'catalog' or 'measured'

    @property
    def devices(self) -> int:
        return self.spec.nodes * self.spec.devices_per_node

    def with_nodes(self, nodes: int) -> Cluster:
        """The same cluster cut to `nodes` of its nodes."""
        return Cluster(self.spec.model_copy(update={"nodes": nodes}), self.device, self.basis)


class HardwareError(ValueError):
    """A catalog or cluster spec that cannot be used; the message names file and field."""


def _read(path: Path) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise HardwareError(f"{path}: no such file") from None
    except yaml.YAMLError as exc:
        raise HardwareError(f"{path}: not valid YAML ({exc.__class__.__name__})") from None
    if not isinstance(data, dict):
        raise HardwareError(f"{path}: expected a mapping at the top level")
    return data


def _first_error(path: Path, exc: ValidationError, entry: str = "") -> HardwareError:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in (entry, *error["loc"]) if part != "")
    message = error["msg"].removeprefix("Value error, ")
    return HardwareError(f"{path}: {where}: {message}")


def _catalog_device(accelerator: str, catalog: Path, where: str = "") -> Accelerator:
    """The catalog's entry for `accelerator`, validated; `where` prefixes a missing name."""
    entries = _read(catalog)
    if accelerator not in entries:
        raise HardwareError(
            f"{where}accelerator {accelerator!r} is not in {catalog} "
            f"(known: {', '.join(sorted(entries))})"
        )
    try:
        return Accelerator.model_validate(entries[accelerator])
    except ValidationError as exc:
        raise _first_error(catalog, exc, accelerator) from None


def catalog_cluster(
    accelerator: str, nodes: int = 1, devices_per_node: int = 1, catalog: Path = DEFAULT_CATALOG
) -> Cluster:
    """A cluster of `nodes` x `devices_per_node` of the catalog's `accelerator`, without a
    cluster file (what a check on the GPU at hand predicts for)."""
    device = _catalog_device(accelerator, catalog)
    spec = ClusterSpec(nodes=nodes, devices_per_node=devices_per_node, accelerator=accelerator)
    return Cluster(spec, device, basis="catalog")


def load_cluster(path: Path, catalog: Path = DEFAULT_CATALOG) -> Cluster:
    try:
        spec = ClusterSpec.model_validate(_read(path))
    except ValidationError as exc:
        raise _first_error(path, exc) from None
    device = _catalog_device(spec.accelerator, catalog, f"{path}: ")
    return Cluster(spec, device, basis="catalog")
