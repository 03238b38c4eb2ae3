"""Cross-field checks of the parallel layout: workers = dp * pp * tp, stages, micro-batches,
heads per tensor-parallel worker.

Each rule raises a sentence that names the fields, so an impossible layout is refused before
Ray starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from raylane.config.parallelism import ParallelismConfig


class ModelShape(Protocol):
    """The `model:` values the layout rules read."""

    kind: str
    input_dim: int
    num_classes: int
    n_heads: int
    n_layers: int


class TrainingOptions(Protocol):
    """The `training:` values the layout rules read."""

    batch_size: int
    activation_checkpointing: bool
    precision: str
    compile: bool
    checkpoint_every_steps: int | None


class LayoutConfig(Protocol):
    """What the layout rules read of a run configuration: its `parallelism:` section, model
    and training values, and whether it fine-tunes. A whole run configuration is one."""

    parallelism: ParallelismConfig
    model: ModelShape
    training: TrainingOptions
    finetune: object | None


PIPELINED = ("pipeline", "hybrid")
DATA_PARALLEL = ("ddp", "local_sgd", "async", "ssp")
SHARDED = ("tp", "fsdp")


def replicas(cfg: LayoutConfig) -> int:
    """How many data-parallel workers (each reading different batches) a layout has."""
    return cfg.parallelism.dims.dp


def stage_boundaries(n_layers: int, pp: int, split_points: list[int] | None) -> list[int]:
    """`[0, s1, ..., n_layers]`: stage k holds blocks `[b[k], b[k+1])`."""
    points = (
        split_points if split_points is not None else [n_layers * k // pp for k in range(1, pp)]
    )
    return [0, *points, n_layers]


def describe_stages(cfg: LayoutConfig) -> list[str]:
    """One line per pipeline stage naming what it holds, e.g. 'stage 0: embeddings, blocks 0-1'.

    A single line for unpipelined strategies."""
    par, n_layers = cfg.parallelism, cfg.model.n_layers
    if par.strategy in SHARDED and par.pp == 1:
        return [_describe_sharded(cfg)]
    if par.pp == 1 and par.cp > 1:
        return [
            f"every worker: the whole model, 2 of each sequence's {2 * par.cp} chunks "
            f"(ring attention over {par.cp} workers); data-parallel replicas: {replicas(cfg)}"
        ]
    if par.pp == 1:
        return [f"every worker: the whole model ({par.workers} data-parallel replicas)"]
    bounds = stage_boundaries(n_layers, par.pp, par.split_points)
    lines = []
    for stage in range(par.pp):
        parts = ["embeddings"] if stage == 0 else []
        parts.append(f"blocks {bounds[stage]}-{bounds[stage + 1] - 1}")
        if stage == par.pp - 1:
            parts.append("norm + head")
        split = f", blocks split over {par.tp} workers" if par.tp > 1 else ""
        copies = (
            f"sharded over {par.dp} workers" if par.strategy == "fsdp" else f"x{par.dp} replicas"
        )
        lines.append(f"stage {stage}: {', '.join(parts)} ({copies}{split})")
    return lines


def _describe_sharded(cfg: LayoutConfig) -> str:
    par, dp = cfg.parallelism, replicas(cfg)
    parts = []
    if par.tp > 1:
        parts.append(
            f"each block's heads and MLP split over {par.tp} workers "
            f"({cfg.model.n_heads // par.tp} heads each)"
        )
    if par.cp > 1:
        parts.append(f"each sequence split over {par.cp} workers (ring attention)")
    if par.strategy == "fsdp":
        parts.append(f"parameters, gradients and optimizer state sharded over {dp} workers")
    else:
        parts.append(f"{dp} data-parallel replicas")
    return "; ".join(parts)


def _check_sharded(cfg: LayoutConfig) -> None:
    par = cfg.parallelism
    if par.pp != 1 and par.strategy == "fsdp":  # pp x fsdp: every stage sharded over dp
        _check_pipelined(cfg)
        return
    if par.pp != 1:
        raise ValueError(
            f"parallelism: strategy '{par.strategy}' has no pipeline stages; pp must be 1 "
            f"(got {par.pp}); 'fsdp' with pp > 1 shards each stage over dp"
        )
    if par.tp > 1 and cfg.model.kind != "gpt":
        raise ValueError(
            f"parallelism.tp {par.tp} splits transformer blocks; model.kind must be 'gpt', not "
            f"'{cfg.model.kind}'"
        )
    if par.strategy == "tp" and par.tp < 2:
        raise ValueError(f"parallelism: strategy 'tp' needs tp >= 2 (got {par.tp})")
    split = par.tp * par.cp
    named = f"tp * cp ({par.tp} * {par.cp})" if par.cp > 1 else f"tp ({par.tp})"
    if par.workers % split:
        raise ValueError(f"parallelism: workers ({par.workers}) is not divisible by {named}")
    if par.dp * split != par.workers and par.dp != 1:
        factors = f"dp * tp = {par.dp} * {par.tp}"
        if par.cp > 1:
            factors = f"dp * tp * cp = {par.dp} * {par.tp} * {par.cp}"
        raise ValueError(f"parallelism: {factors} = {par.dp * split} but workers is {par.workers}")


def check_layout(cfg: LayoutConfig) -> None:
    """Raise ValueError naming the first impossible combination of `cfg`'s layout: its options
    (compression, stragglers, tp), then the rules of its kind of strategy."""
    _check_options(cfg)
    if cfg.parallelism.elastic:
        _check_elastic(cfg)
    strategy = cfg.parallelism.strategy
    if strategy in SHARDED:
        _check_sharded(cfg)
    elif strategy in DATA_PARALLEL:
        _check_data_parallel(cfg)
    else:
        _check_pipelined(cfg)


def _check_elastic(cfg: LayoutConfig) -> None:
    """An elastic worker range: a data-parallel layout whose workers agree after every step
    (DDP's replicas, or FSDP's shards, which a checkpoint re-shards onto any count), and a
    global batch every size in the range splits evenly."""
    par = cfg.parallelism
    if par.strategy not in ("ddp", "fsdp") or par.cp > 1 or par.pp > 1 or par.tp > 1:
        raise ValueError(
            f"parallelism.workers {{min, max}} resizes 'ddp' and 'fsdp' runs (pp, tp and cp "
            f"1); strategy '{par.strategy}' with pp {par.pp}, tp {par.tp}, cp {par.cp} keeps a "
            "fixed worker count: set workers to one number"
        )
    if cfg.training.checkpoint_every_steps is None:
        raise ValueError(
            "parallelism.workers {min, max}: every resize restarts the group from its latest "
            "checkpoint; set training.checkpoint_every_steps (else a resize costs up to an "
            "epoch, and drain notices are not watched)"
        )
    if par.straggler is not None and max(par.straggler.ranks) >= par.min_workers:
        raise ValueError(
            f"parallelism.straggler.rank {max(par.straggler.ranks)} may name no worker: an "
            f"elastic run can shrink to min ({par.min_workers}) workers"
        )
    global_batch = cfg.training.batch_size * par.workers
    uneven = [n for n in range(par.min_workers, par.workers + 1) if global_batch % n]
    if uneven:
        raise ValueError(
            f"parallelism.workers {{min: {par.min_workers}, max: {par.workers}}}: the global "
            f"batch (training.batch_size * max = {global_batch}) does not split evenly over "
            f"{', '.join(map(str, uneven))} workers"
        )


def _check_compression(par: ParallelismConfig) -> None:
    """Gradient compression compresses what replicas all-reduce: DDP's buckets (every scheme)
    or a tensor-parallel model's replicas' flat gradient (every scheme but PowerSGD, which
    needs DDP's buckets)."""
    name = par.grad_compression
    if name == "powersgd" and par.cp > 1:
        raise ValueError(
            "parallelism.grad_compression 'powersgd' compresses DDP's gradient buckets; with "
            "cp > 1 the replicas and cp workers average one buffer: use 'fp16' or 'topk'"
        )
    if par.strategy == "tp":
        if name == "powersgd":
            raise ValueError(
                "parallelism.grad_compression 'powersgd' compresses DDP's gradient buckets; "
                "strategy 'tp' averages its replicas' gradients in one buffer: use 'fp16' or "
                "'topk'"
            )
        if par.workers // par.tp < 2:
            raise ValueError(
                f"parallelism.grad_compression '{name}' compresses what tp replicas average; "
                f"{par.workers} workers at tp {par.tp} make one replica (raise workers)"
            )
    elif par.strategy != "ddp":
        raise ValueError(
            f"parallelism.grad_compression '{name}' compresses the gradients replicas "
            f"all-reduce (strategies 'ddp' and 'tp'); strategy '{par.strategy}' does not"
        )


def _check_options(cfg: LayoutConfig) -> None:
    par = cfg.parallelism
    if cfg.training.activation_checkpointing and cfg.model.kind != "gpt":
        raise ValueError(
            "training.activation_checkpointing recomputes transformer blocks; model.kind must "
            f"be 'gpt', not '{cfg.model.kind}'"
        )
    if par.grad_compression != "none":
        _check_compression(par)
    if cfg.training.precision == "tf32" and not par.use_gpu:
        raise ValueError(
            "training.precision 'tf32' is a GPU matmul mode (tensor cores); it needs "
            "parallelism.use_gpu: true, and a CPU run trains in fp32"
        )
    if cfg.training.compile and par.cp > 1:
        raise ValueError(
            "training.compile cannot trace ring attention's sends and receives (parallelism.cp "
            f"{par.cp}); compile a layout without context parallelism"
        )
    if par.grad_compression == "bf16" and not par.use_gpu:
        raise ValueError(
            "parallelism.grad_compression 'bf16' needs NCCL (parallelism.use_gpu: true); "
            "gloo on CPU cannot all-reduce bf16, use 'fp16' or 'powersgd'"
        )
    if par.straggler is not None and max(par.straggler.ranks) >= par.workers:
        raise ValueError(
            f"parallelism.straggler.rank {max(par.straggler.ranks)} names no worker; "
            f"ranks are 0-{par.workers - 1}"
        )
    if par.sequence_parallel and (par.tp == 1 or cfg.model.kind != "gpt"):
        raise ValueError(
            "parallelism.sequence_parallel splits the sequence inside tensor-parallel gpt "
            "blocks; it needs model.kind 'gpt' and parallelism.tp > 1"
        )
    if par.sequence_parallel and (cfg.model.input_dim // par.cp) % par.tp:
        raise ValueError(
            f"parallelism.sequence_parallel cuts each worker's {cfg.model.input_dim // par.cp} "
            f"tokens (model.input_dim / cp) into tp ({par.tp}) equal parts; they must divide"
        )
    if par.sequence_parallel and par.pp == 1 and cfg.model.num_classes % par.tp:
        raise ValueError(
            f"parallelism.sequence_parallel splits the head's {cfg.model.num_classes} classes "
            f"(model.num_classes) over tp ({par.tp}) workers; they must divide"
        )
    if par.cp > 1:
        _check_context(cfg)
    if par.tp > 1 and par.strategy not in (*SHARDED, *PIPELINED):
        raise ValueError(
            f"parallelism.tp {par.tp} needs strategy 'tp', 'fsdp', 'pipeline' or 'hybrid' (got "
            f"'{par.strategy}')"
        )
    if cfg.model.kind == "gpt" and cfg.model.n_heads % par.tp:
        raise ValueError(
            f"model.n_heads ({cfg.model.n_heads}) is not divisible by parallelism.tp "
            f"({par.tp}): each tensor-parallel worker holds whole attention heads"
        )


def _check_context(cfg: LayoutConfig) -> None:
    """Context parallelism: a gpt's sequences split over `cp` workers of a ddp or tp layout."""
    par = cfg.parallelism
    if par.strategy not in ("ddp", "tp") or par.pp != 1:
        raise ValueError(
            f"parallelism.cp {par.cp} splits sequences over workers of a 'ddp' or 'tp' layout "
            f"(replicas, tensor parallelism); not strategy '{par.strategy}' with pp {par.pp}"
        )
    if cfg.model.kind != "gpt":
        raise ValueError("parallelism.cp splits token sequences; model.kind must be 'gpt'")
    if cfg.model.input_dim % (2 * par.cp):
        raise ValueError(
            f"parallelism.cp {par.cp} cuts each sequence into 2 * cp = {2 * par.cp} equal "
            f"chunks; model.input_dim ({cfg.model.input_dim}) is not divisible by it"
        )
    if cfg.finetune is not None:
        raise ValueError("parallelism.cp is not available for fine-tuning runs yet")


def _check_data_parallel(cfg: LayoutConfig) -> None:
    par = cfg.parallelism
    replicas = par.workers // par.cp
    if par.workers % par.cp:
        raise ValueError(f"parallelism: workers ({par.workers}) is not divisible by cp ({par.cp})")
    if par.pp != 1 or par.dp not in (1, replicas):
        uses = f"all {par.workers} workers" if par.cp == 1 else f"workers / cp = {replicas}"
        raise ValueError(
            f"parallelism: strategy '{par.strategy}' uses {uses} as data-parallel replicas; "
            f"pp must be 1 (got {par.pp}) and dp 1 or {replicas} (got {par.dp})"
        )


def _check_pipelined(cfg: LayoutConfig) -> None:
    par = cfg.parallelism
    if cfg.model.kind != "gpt":
        raise ValueError(
            f"parallelism: strategy '{par.strategy}' splits transformer blocks into stages; "
            f"model.kind must be 'gpt', not '{cfg.model.kind}'"
        )
    if par.pp < 2:
        raise ValueError(f"parallelism: strategy '{par.strategy}' needs pp >= 2 (got {par.pp})")
    if par.strategy == "pipeline" and par.dp != 1:
        raise ValueError(
            f"parallelism: strategy 'pipeline' has dp 1 (got {par.dp}); use 'hybrid' for dp > 1"
        )
    if par.strategy == "hybrid" and par.dp < 2:
        raise ValueError(f"parallelism: strategy 'hybrid' needs dp >= 2 (got {par.dp})")
    if par.dp * par.pp * par.tp != par.workers:
        product = par.dp * par.pp * par.tp
        factors = (
            f"dp * pp * tp = {par.dp} * {par.pp} * {par.tp}"
            if par.tp > 1
            else (f"dp * pp = {par.dp} * {par.pp}")
        )
        raise ValueError(f"parallelism: {factors} = {product} but workers is {par.workers}")
    if par.microbatches < par.pp:
        raise ValueError(
            f"parallelism: microbatches ({par.microbatches}) must be at least pp ({par.pp}), "
            "or some stages never have work"
        )
    if cfg.training.batch_size % par.microbatches:
        raise ValueError(
            f"training.batch_size ({cfg.training.batch_size}) is not divisible by "
            f"parallelism.microbatches ({par.microbatches})"
        )
    _check_split(cfg)


def _check_split(cfg: LayoutConfig) -> None:
    """The blocks divide evenly over the stages, or `split_points` says where to cut."""
    par, n_layers = cfg.parallelism, cfg.model.n_layers
    if par.split_points is None:
        if n_layers % par.pp:
            raise ValueError(
                f"model.n_layers ({n_layers}) is not divisible by parallelism.pp ({par.pp}); "
                "set parallelism.split_points for an uneven split"
            )
        return
    points = par.split_points
    if len(points) != par.pp - 1:
        raise ValueError(
            f"parallelism.split_points needs pp - 1 = {par.pp - 1} entries, got {len(points)}"
        )
    bounds = [0, *points, n_layers]
    if any(a >= b for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(
            f"parallelism.split_points {points} must increase strictly within 1..{n_layers - 1} "
            "so every stage holds at least one block"
        )
