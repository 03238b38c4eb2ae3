"""The hardware a plan is for: an accelerator catalog (YAML) and a cluster spec naming one.

Catalog figures are data-sheet peaks; a plan built from them says so (`basis`), unlike one
built from measurements of the cluster itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError

from raylane.config.schema import StrictModel

Precision = Literal["fp32", "tf32", "bf16"]
DEFAULT_CATALOG = Path(__file__).resolve().parents[3] / "configs" / "hardware" / "catalog.yaml"


class Accelerator(StrictModel):
    peak_flops: dict[Precision, float] = Field(description="Dense peak FLOP/s by precision.")
    memory_gb: float = Field(gt=0, description="Device memory (GB, 1e9 bytes).")
    intra_node_gbps: float = Field(gt=0, description="Per-device link within a node (GB/s).")
    inter_node_gbps: float = Field(gt=0, description="Per-device link between nodes (GB/s).")


class ClusterSpec(StrictModel):
    nodes: int = Field(ge=1)
    devices_per_node: int = Field(ge=1)
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


def _first_error(path: Path, exc: ValidationError) -> HardwareError:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    return HardwareError(f"{path}: {where}: {error['msg']}")


def load_cluster(path: Path, catalog: Path = DEFAULT_CATALOG) -> Cluster:
    try:
        spec = ClusterSpec.model_validate(_read(path))
    except ValidationError as exc:
        raise _first_error(path, exc) from None
    entries = _read(catalog)
    if spec.accelerator not in entries:
        raise HardwareError(
            f"{path}: accelerator {spec.accelerator!r} is not in {catalog} "
            f"(known: {', '.join(sorted(entries))})"
        )
    try:
        device = Accelerator.model_validate(entries[spec.accelerator])
    except ValidationError as exc:
        raise _first_error(catalog, exc) from None
    return Cluster(spec, device, basis="catalog")
