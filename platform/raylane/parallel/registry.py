"""Which implementation trains a layout: chosen from its degrees and synchronisation, never
from a strategy name.

With pipeline stages a schedule drives each step, whatever else each stage is (replicated,
tensor parallel, sharded). Without them, a model split over workers (tensor or context
parallel) or sharded (FSDP, also at one worker, as of an elastic range: the same batches as
its sharded group, so a run and its reproduction agree) trains on a device mesh; whole-model
replicas agree as the layout's sync says: DDP's all-reduce, periodic averages, or a parameter
server.
"""

from __future__ import annotations

from importlib import import_module

from raylane.config import RaylaneConfig
from raylane.config.parallelism import ParallelismConfig
from raylane.config.presets import PRESETS
from raylane.parallel.base import ParallelStrategy

# Where each implementation lives: a job imports only its own (the FSDP, DTensor and
# pipelining modules cost a worker seconds of imports that a DDP run never uses).
PIPELINE = "raylane.parallel.pipeline:PipelineParallel"
MESH = "raylane.parallel.mesh_parallel:MeshParallel"
REPLICAS = {
    "all_reduce": "raylane.parallel.ddp:DataParallel",
    "periodic_average": "raylane.parallel.local_sgd:LocalSGD",
    "parameter_server": "raylane.parallel.async_sgd:ParameterServerTraining",
}


def implementation(par: ParallelismConfig) -> str:
    """`module:Class` of what trains `par`'s layout."""
    dims = par.dims
    if dims.pp_enabled:
        return PIPELINE
    if dims.tp_enabled or dims.cp_enabled or dims.fsdp_enabled or PRESETS[par.strategy].shard:
        return MESH
    return REPLICAS[dims.sync.kind]


def _load(where: str) -> type[ParallelStrategy]:
    module, _, attribute = where.partition(":")
    return getattr(import_module(module), attribute)


def available_strategies() -> list[str]:
    """The strategy names a config may give."""
    return sorted(PRESETS)


def splits_dataset(par: ParallelismConfig) -> bool:
    """Whether Ray Train should shard the datasets across the workers of this layout (never
    with context parallelism: a sequence's chunks are read by several workers; never in an
    elastic run: every worker reads the same global batches, whatever their number)."""
    if par.dims.cp_enabled or par.elastic:
        return False
    return _load(implementation(par)).splits_dataset


def get_strategy(cfg: RaylaneConfig, rank: int) -> ParallelStrategy:
    """What trains the worker of global `rank` (process group initialised)."""
    return _load(implementation(cfg.parallelism))(cfg, rank)
