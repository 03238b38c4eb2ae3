"""Cross-field checks of the parallel layout: workers = dp * pp * tp, stages, micro-batches,
heads per tensor-parallel worker.

Each rule raises a sentence that names the fields, so an impossible layout is refused before
Ray starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from raylane.config.families import kinds_where, traits
from raylane.config.families import named as named_kinds
from raylane.config.presets import PRESETS, listed, names

#: The kinds raylane's own tensor-parallel, stage and context-parallel plans split.
PLANNED = named_kinds(kinds_where("plans"))

if TYPE_CHECKING:
    from raylane.config.parallelism import ParallelismConfig


class ModelShape(Protocol):
    """The `model:` values the layout rules read."""

    kind: str
    input_dim: int
    num_classes: int
    n_heads: int
    n_layers: int

    def block_count(self) -> int: ...

    def llama_tied(self) -> bool: ...


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
    par, n_layers = cfg.parallelism, cfg.model.block_count()
    shard = PRESETS[par.strategy].shard
    if par.pp == 1 and (shard or par.tp > 1):
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
        copies = f"sharded over {par.dp} workers" if shard else f"x{par.dp} replicas"
        lines.append(f"stage {stage}: {', '.join(parts)} ({copies}{split})")
    return lines


def _describe_sharded(cfg: LayoutConfig) -> str:
    par, dp = cfg.parallelism, replicas(cfg)
    parts = []
    if par.tp > 1 and traits(cfg.model.kind).factory:
        parts.append(f"each block split over {par.tp} workers by the model's tp_plan")
    elif par.tp > 1:
        parts.append(
            f"each block's heads and MLP split over {par.tp} workers "
            f"({cfg.model.n_heads // par.tp} heads each)"
        )
    if par.cp > 1:
        parts.append(f"each sequence split over {par.cp} workers (ring attention)")
    if PRESETS[par.strategy].shard:
        parts.append(f"parameters, gradients and optimizer state sharded over {dp} workers")
    else:
        parts.append(f"{dp} data-parallel replicas")
    return "; ".join(parts)


def check_layout(cfg: LayoutConfig) -> None:
    """Raise ValueError naming the first impossible combination of `cfg`'s layout: its options
    (compression, stragglers, tp), the degrees its strategy name takes, then how the degrees
    multiply to the workers (with pipeline stages or without)."""
    _check_options(cfg)
    if cfg.parallelism.elastic:
        _check_elastic(cfg)
    _check_preset(cfg.parallelism)
    if cfg.parallelism.pp > 1:
        _check_pipelined(cfg)
    else:
        _check_unpipelined(cfg)


def _check_preset(par: ParallelismConfig) -> None:
    """The degrees within the ranges its strategy name takes (`PRESETS`)."""
    preset, name = PRESETS[par.strategy], f"strategy '{par.strategy}'"
    hint = f"; {preset.hint}" if preset.hint else ""
    (pp_least, pp_most), (tp_least, tp_most) = preset.pp, preset.tp
    if par.pp < pp_least:
        raise ValueError(f"parallelism: {name} needs pp >= {pp_least} (got {par.pp})")
    if pp_most is not None and par.pp > pp_most:
        raise ValueError(
            f"parallelism: {name} has no pipeline stages; pp must be 1 (got {par.pp}); "
            f"stages run with strategy {listed(names('takes_stages'))}"
        )
    if tp_most is not None and par.tp > tp_most:
        raise ValueError(
            f"parallelism.tp {par.tp} needs strategy {listed(names('takes_tp'))} (got "
            f"'{par.strategy}')"
        )
    if par.tp < tp_least:
        raise ValueError(f"parallelism: {name} needs tp >= {tp_least} (got {par.tp})")
    if par.pp > 1:  # without stages dp follows from the workers
        dp_least, dp_most = preset.dp
        if dp_most is not None and par.dp > dp_most:
            raise ValueError(f"parallelism: {name} has dp {dp_most} (got {par.dp}){hint}")
        if par.dp < dp_least:
            raise ValueError(f"parallelism: {name} needs dp >= {dp_least} (got {par.dp})")


def _check_unpipelined(cfg: LayoutConfig) -> None:
    """Without stages: the workers split into whole groups of tp * cp, `dp` of them."""
    par = cfg.parallelism
    if par.tp > 1 and not traits(cfg.model.kind).tensor_parallel:
        raise ValueError(
            f"parallelism.tp {par.tp} splits transformer blocks; model.kind must be "
            f"{PLANNED} (or 'custom' with a tp_plan), not '{cfg.model.kind}'"
        )
    factors = {"dp": par.dp, "tp": par.tp, "cp": par.cp}
    split = [k for k in ("tp", "cp") if factors[k] > 1]
    group = par.tp * par.cp
    if par.workers % group:
        named = " * ".join(split) + f" ({' * '.join(str(factors[k]) for k in split)})"
        raise ValueError(f"parallelism: workers ({par.workers}) is not divisible by {named}")
    if par.dp != 1 and par.dp * group != par.workers:
        keys = ["dp", *split]
        product = f"{' * '.join(keys)} = {' * '.join(str(factors[k]) for k in keys)}"
        raise ValueError(
            f"parallelism: {product} = {par.dp * group} but workers is {par.workers} (dp 1 "
            "means workers / (tp * cp))"
        )


def _straggler_below(par: ParallelismConfig, workers: int, why: str) -> None:
    """The straggler's ranks below `workers`; else one line saying `why`."""
    if par.straggler is not None and max(par.straggler.ranks) >= workers:
        raise ValueError(f"parallelism.straggler.rank {max(par.straggler.ranks)} {why}")


def _check_elastic(cfg: LayoutConfig) -> None:
    """An elastic worker range: a data-parallel layout whose workers agree after every step
    (DDP's replicas, or FSDP's shards, which a checkpoint re-shards onto any count), and a
    global batch every size in the range splits evenly."""
    par = cfg.parallelism
    if not PRESETS[par.strategy].elastic or par.cp > 1 or par.pp > 1 or par.tp > 1:
        raise ValueError(
            f"parallelism.workers {{min, max}} resizes {listed(names('elastic'), 'and')} runs "
            "(pp, tp and cp "
            f"1); strategy '{par.strategy}' with pp {par.pp}, tp {par.tp}, cp {par.cp} keeps a "
            "fixed worker count: set workers to one number"
        )
    if cfg.training.checkpoint_every_steps is None:
        raise ValueError(
            "parallelism.workers {min, max}: every resize restarts the group from its latest "
            "checkpoint; set training.checkpoint_every_steps (else a resize costs up to an "
            "epoch, and drain notices are not watched)"
        )
    shrinks = f"an elastic run can shrink to min ({par.min_workers}) workers"
    _straggler_below(par, par.min_workers, f"may name no worker: {shrinks}")
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
    if not PRESETS[par.strategy].compression:
        raise ValueError(
            f"parallelism.grad_compression '{name}' compresses the gradients replicas "
            f"all-reduce (strategies {listed(names('compression'), 'and')}); strategy "
            f"'{par.strategy}' does not"
        )
    if name == "powersgd" and par.cp > 1:
        raise ValueError(
            "parallelism.grad_compression 'powersgd' compresses DDP's gradient buckets; with "
            "cp > 1 the replicas and cp workers average one buffer: use 'fp16' or 'topk'"
        )
    if par.tp > 1 and name == "powersgd":
        raise ValueError(
            "parallelism.grad_compression 'powersgd' compresses DDP's gradient buckets; "
            f"strategy '{par.strategy}' averages its replicas' gradients in one buffer: use "
            "'fp16' or 'topk'"
        )
    if par.tp > 1 and par.workers // par.tp < 2:
        raise ValueError(
            f"parallelism.grad_compression '{name}' compresses what tp replicas average; "
            f"{par.workers} workers at tp {par.tp} make one replica (raise workers)"
        )


def _check_options(cfg: LayoutConfig) -> None:
    par = cfg.parallelism
    if cfg.training.activation_checkpointing and not traits(cfg.model.kind).blocks:
        raise ValueError(
            "training.activation_checkpointing recomputes transformer blocks; model.kind must "
            f"be {named_kinds(kinds_where('blocks'))}, not '{cfg.model.kind}'"
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
    _straggler_below(par, par.workers, f"names no worker; ranks are 0-{par.workers - 1}")
    if par.sequence_parallel and (par.tp == 1 or not traits(cfg.model.kind).plans):
        raise ValueError(
            "parallelism.sequence_parallel splits the sequence inside tensor-parallel "
            f"blocks; it needs model.kind {PLANNED} and parallelism.tp > 1"
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
    if traits(cfg.model.kind).declared_heads and cfg.model.n_heads % par.tp:
        raise ValueError(
            f"model.n_heads ({cfg.model.n_heads}) is not divisible by parallelism.tp "
            f"({par.tp}): each tensor-parallel worker holds whole attention heads"
        )


def _check_context(cfg: LayoutConfig) -> None:
    """Context parallelism: a gpt's or llama's sequences split over `cp` workers of a ddp or tp
    layout."""
    par = cfg.parallelism
    if not PRESETS[par.strategy].cp or par.pp != 1:
        raise ValueError(
            f"parallelism.cp {par.cp} splits sequences over workers of a "
            f"{listed(names('cp'))} layout (replicas, tensor parallelism); not strategy "
            f"'{par.strategy}' with pp {par.pp}"
        )
    ring = "splits attention over workers (ring attention)"
    _split_plan(
        cfg.model.kind, f"parallelism.cp {par.cp} {ring}", "context-parallel plan: set cp 1"
    )
    if cfg.model.input_dim % (2 * par.cp):
        raise ValueError(
            f"parallelism.cp {par.cp} cuts each sequence into 2 * cp = {2 * par.cp} equal "
            f"chunks; model.input_dim ({cfg.model.input_dim}) is not divisible by it"
        )
    if cfg.finetune is not None:
        raise ValueError("parallelism.cp is not available for fine-tuning runs yet")


def _split_plan(kind: str, what: str, plan: str) -> None:
    """A layout that splits a language model's blocks (`what`) over workers: one line for
    a custom model, which has no such `plan`, and for a classifier."""
    if traits(kind).factory:
        raise ValueError(f"{what}; a custom model (model.kind '{kind}') has no {plan}")
    if not traits(kind).plans:
        raise ValueError(f"{what}; model.kind must be {PLANNED}, not '{kind}'")


def _check_pipelined(cfg: LayoutConfig) -> None:
    par = cfg.parallelism
    stages = "cuts transformer blocks into pipeline stages"
    _split_plan(cfg.model.kind, f"parallelism.pp {par.pp} {stages}", "stage plan: set pp 1")
    if cfg.model.llama_tied():
        raise ValueError(
            f"parallelism.pp {par.pp} puts the embedding on the first stage and the head on the "
            "last; a llama whose head is its embedding (tie_word_embeddings) cannot be split so"
        )
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
    par, n_layers = cfg.parallelism, cfg.model.block_count()
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
