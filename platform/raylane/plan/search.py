"""Every layout raylane can run on a cluster, predicted, pruned by memory and ranked: by step
time on the whole cluster, or by expected cost per epoch on any number of its nodes."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from raylane.config import RaylaneConfig
from raylane.config.dims import ParallelDims
from raylane.models.families import shape_of
from raylane.plan.cost import DEFAULT_EFFICIENCY, Layout, Prediction, Workload, predict
from raylane.plan.hardware import Cluster, Precision
from raylane.plan.pricing import CostTerms, LayoutCost, price_layout

MICROBATCH_FACTORS = (1, 2, 4, 8)  # micro-batches per pipeline stage


@dataclass
class Plan:
    ranked: list[Prediction]  # fitting layouts, fastest (or cheapest) first
    pruned: list[tuple[Layout, str]]  # did not fit (or cannot run), with the reason
    workload: Workload
    # Ranked by cost (`plan_by_cost`): each layout's expected cost, and what it rests on.
    costs: dict[Layout, LayoutCost] = field(default_factory=dict)
    terms: CostTerms | None = None


def workload_for(cfg: RaylaneConfig, global_batch: int, precision: Precision) -> Workload:
    """What a step of the config's model trains: its family's shape (`model.kind`), the
    global batch and the precision. Raises ValueError for a family with no shape to plan."""
    return Workload(shape_of(cfg.model), global_batch, precision)


STDLIB_SOURCES = ("python-stdlib", "python-stdlib-tests")


def epoch_tokens_for(cfg: RaylaneConfig, work: Workload) -> tuple[float, str]:
    """Tokens in one epoch of the config's training data, and where the figure comes from:
    `training.steps_per_epoch` steps, else the byte budget of a standard-library source (one
    token per byte, less the validation share). Other sources are not read: an error."""
    steps = cfg.training.steps_per_epoch
    if steps:
        return steps * work.global_batch * work.seq, f"training.steps_per_epoch ({steps})"
    data = cfg.data
    if data.source in STDLIB_SOURCES:
        tokens = data.max_bytes * (1 - data.validation_fraction)
        return tokens, f"data.max_bytes of {data.source}, less validation"
    raise ValueError(
        f"--objective cost needs --epoch-tokens: the size of data.source '{data.source}' "
        "is not known without reading it"
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _dims_for(work: Workload, devices: int, devices_per_node: int) -> list[ParallelDims]:
    """Every `ParallelDims` candidate (tp within a node dividing the heads, key/value heads and
    MLP width, pp dividing the blocks, cp where the sequence cuts into 2 * cp chunks), and each
    tensor-parallel one also with sequence parallelism where every cp worker's tokens split
    over tp."""
    tps = [t for t in _divisors(devices_per_node) if work.shape.splits_over(t)]
    pps = [p for p in _divisors(work.shape.n_layers) if p <= devices]
    cps = [c for c in _divisors(devices) if work.seq % (2 * c) == 0]
    found = []
    for dims in ParallelDims.candidates(devices, tps, pps, cps):
        found.append(dims)
        if dims.tp_enabled and (work.seq // dims.cp) % dims.tp == 0:
            found.append(replace(dims, sequence_parallel=True))
    return found


def layouts(work: Workload, devices: int, devices_per_node: int) -> list[Layout]:
    """Layouts of exactly `devices` workers that raylane's strategies can run: every candidate
    layout (`_dims_for`) whose data-parallel workers split the batch, with and without
    activation checkpointing, and with each micro-batch count a pipeline's rows allow."""
    found = []
    for dims in _dims_for(work, devices, devices_per_node):
        if work.global_batch % dims.dp:
            continue
        rows = work.global_batch // dims.dp
        micros = [dims.pp * f for f in MICROBATCH_FACTORS if rows % (dims.pp * f) == 0]
        for checkpointing in (False, True):
            for micro in micros if dims.pp_enabled else [1]:
                found.append(Layout(dims, micro, "1f1b", checkpointing))
    return found


def plan(work: Workload, cluster: Cluster, efficiency: float = DEFAULT_EFFICIENCY) -> Plan:
    ranked, pruned = [], []
    for layout in layouts(work, cluster.devices, cluster.spec.devices_per_node):
        prediction = predict(work, layout, cluster, efficiency)
        if prediction.fits:
            ranked.append(prediction)
        else:
            need = prediction.memory_bytes / 1e9
            pruned.append(
                (layout, f"needs {need:.1f} GB per device, has {cluster.device.memory_gb:g} GB")
            )
    ranked.sort(key=lambda p: (round(p.step_s, 6), p.memory_bytes))  # ties: less memory
    return Plan(ranked, pruned, work)


def plan_by_cost(
    work: Workload, cluster: Cluster, terms: CostTerms, efficiency: float = DEFAULT_EFFICIENCY
) -> Plan:
    """Layouts on 1 to all of the cluster's nodes (a node is what is rented), ranked by the
    expected cost per epoch of the cheaper capacity, spot or on-demand; ties: the faster."""
    pricing = cluster.device.pricing
    if pricing is None:
        raise ValueError(
            f"{cluster.spec.accelerator} has no pricing in the hardware catalog, which "
            "--objective cost needs"
        )
    ranked, pruned, costs = [], [], {}
    for nodes in range(1, cluster.spec.nodes + 1):
        found = plan(work, cluster.with_nodes(nodes), efficiency)
        pruned += found.pruned
        for prediction in found.ranked:
            costs[prediction.layout] = price_layout(
                prediction.step_s, work.global_batch * work.seq, prediction.layout.workers,
                nodes, pricing, terms,
            )  # fmt: skip
            ranked.append(prediction)
    ranked.sort(key=lambda p: (round(costs[p.layout].best.usd, 9), p.step_s))
    return Plan(ranked, pruned, work, costs, terms)


def _shard_override(dims: ParallelDims) -> str:
    """The layout's shards by their degree (HSDP's: the data-parallel workers beyond them are
    replicas), or none: a base config's own `dp_shard` must not change the planned layout."""
    return f"parallelism.dp_shard={dims.dp_shard if dims.fsdp_enabled else 'null'}"


def config_overrides(
    prediction: Prediction, work: Workload, checkpoint_steps: int | None = None
) -> list[str]:
    """The overrides that make a training config run this layout on GPUs (checkpointing
    every `checkpoint_steps` steps, where given)."""
    layout = prediction.layout
    checkpoints = []
    if checkpoint_steps is not None:
        checkpoints = [f"training.checkpoint_every_steps={checkpoint_steps}"]
    return [
        *checkpoints,
        f"parallelism.strategy={layout.strategy}",
        f"parallelism.workers={layout.workers}",
        f"parallelism.dp={layout.dp}",
        _shard_override(layout.dims),
        f"parallelism.tp={layout.tp}",
        f"parallelism.pp={layout.pp}",
        f"parallelism.cp={layout.cp}",
        f"parallelism.sequence_parallel={str(layout.dims.sequence_parallel).lower()}",
        f"parallelism.microbatches={layout.microbatches}",
        f"parallelism.schedule={layout.schedule}",
        "parallelism.use_gpu=true",
        "parallelism.resources_per_worker={GPU: 1}",
        f"training.batch_size={work.global_batch // layout.dp}",
        f"training.activation_checkpointing={str(layout.activation_checkpointing).lower()}",
        # The precision the prediction assumed: tf32 too (the run then enables TF32 matmuls).
        f"training.precision={work.precision}",
    ]
