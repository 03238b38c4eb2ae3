"""The strategy names a config may give (`parallelism.strategy`), as one table.

A name is a preset of the layout type (`raylane.config.dims.ParallelDims`): it says whether
the data-parallel workers shard the model or replicate it, how they agree, and which degrees
it takes. Everything else about a layout is decided on its degrees. This table is the only
place raylane reads a strategy name: configs, README commands, MLflow records and reproduced
runs keep their names, and a new name is one row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SyncKind = Literal["all_reduce", "periodic_average", "parameter_server"]

#: A degree's allowed range: (least, most); None: no upper bound.
Span = tuple[int, int | None]


@dataclass(frozen=True)
class Preset:
    """What one strategy name means."""

    #: The data-parallel workers shard parameters, gradients and optimizer state (FSDP2)
    #: instead of each holding the whole model.
    shard: bool = False
    #: How the data-parallel workers agree (see `raylane.config.dims.Sync`).
    sync: SyncKind = "all_reduce"
    #: parameter_server: at most `parallelism.staleness` steps ahead (else unbounded).
    bounded: bool = False
    pp: Span = (1, 1)
    tp: Span = (1, 1)
    dp: Span = (1, None)
    #: Sequences may be split over `cp` workers (ring attention).
    cp: bool = False
    #: The gradients replicas all-reduce may be compressed (`grad_compression`).
    compression: bool = False
    #: The worker count may be a range (`workers: {min, max}`).
    elastic: bool = False
    #: Said after an error about this name's degrees.
    hint: str = ""

    @property
    def needs_stages(self) -> bool:
        """Every layout of this name has pipeline stages (pp >= 2)."""
        return self.pp[0] > 1

    @property
    def takes_stages(self) -> bool:
        """Layouts of this name may have pipeline stages."""
        return self.pp[1] is None

    @property
    def takes_tp(self) -> bool:
        """Layouts of this name may split blocks over tensor-parallel workers."""
        return self.tp[1] is None


PRESETS: dict[str, Preset] = {
    "ddp": Preset(cp=True, compression=True, elastic=True),
    "tp": Preset(tp=(2, None), cp=True, compression=True),
    "fsdp": Preset(shard=True, pp=(1, None), tp=(1, None), elastic=True),
    "pipeline": Preset(pp=(2, None), tp=(1, None), dp=(1, 1), hint="use 'hybrid' for dp > 1"),
    "hybrid": Preset(pp=(2, None), tp=(1, None), dp=(2, None)),
    "local_sgd": Preset(sync="periodic_average"),
    "async": Preset(sync="parameter_server"),
    "ssp": Preset(sync="parameter_server", bounded=True),
}


def names(flag: str) -> list[str]:
    """The strategy names whose preset sets `flag` (a truthy field or property: 'cp',
    'takes_stages', 'takes_tp' ...), quoted, for error messages."""
    return [f"'{n}'" for n, p in PRESETS.items() if getattr(p, flag)]


def listed(quoted: list[str], conjunction: str = "or") -> str:
    """ "'a', 'b' or 'c'"."""
    if len(quoted) == 1:
        return quoted[0]
    return f"{', '.join(quoted[:-1])} {conjunction} {quoted[-1]}"
