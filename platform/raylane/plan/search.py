"""Every layout raylane can run on a cluster, predicted, pruned by memory and ranked."""

from __future__ import annotations

from dataclasses import dataclass

from raylane.config import RaylaneConfig
from raylane.config.dims import ParallelDims
from raylane.plan.cost import DEFAULT_EFFICIENCY, Layout, Prediction, Workload, predict
from raylane.plan.hardware import Cluster, Precision
from raylane.plan.memory import GPTShape

MICROBATCH_FACTORS = (1, 2, 4, 8)  # micro-batches per pipeline stage


@dataclass
class Plan:
    ranked: list[Prediction]  # fitting layouts, fastest first
    pruned: list[tuple[Layout, str]]  # did not fit (or cannot run), with the reason
    workload: Workload


def workload_for(cfg: RaylaneConfig, global_batch: int, precision: Precision) -> Workload:
    model = cfg.model
    if model.kind != "gpt":
        raise ValueError(f"model.kind must be 'gpt' to plan its layouts, not '{model.kind}'")
    shape = GPTShape(model.num_classes, model.input_dim, model.d_model, model.n_layers)
    return Workload(shape, model.n_heads, global_batch, precision)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(work: Workload, devices: int, devices_per_node: int) -> list[Layout]:
    """Layouts of exactly `devices` workers that raylane's strategies can run: every
    `ParallelDims` candidate (tp within a node, pp dividing the blocks) whose data-parallel
    workers split the batch, with and without activation checkpointing, and with each
    micro-batch count a pipeline's rows allow."""
    found = []
    tps = [t for t in _divisors(devices_per_node) if work.n_heads % t == 0]
    pps = [p for p in _divisors(work.shape.n_layers) if p <= devices]
    for dims in ParallelDims.candidates(devices, tps, pps):
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


def config_overrides(prediction: Prediction, work: Workload) -> list[str]:
    """The overrides that make a training config run this layout on GPUs."""
    layout = prediction.layout
    return [
        f"parallelism.strategy={layout.strategy}",
        f"parallelism.workers={layout.workers}",
        f"parallelism.dp={layout.dp}",
        f"parallelism.tp={layout.tp}",
        f"parallelism.pp={layout.pp}",
        f"parallelism.microbatches={layout.microbatches}",
        f"parallelism.schedule={layout.schedule}",
        "parallelism.use_gpu=true",
        "parallelism.resources_per_worker={GPU: 1}",
        f"training.batch_size={work.global_batch // layout.dp}",
        f"training.activation_checkpointing={str(layout.activation_checkpointing).lower()}",
        # tf32 is fp32 to the config (GPU matmuls' internal rounding, not a training setting).
        f"training.precision={'bf16' if work.precision == 'bf16' else 'fp32'}",
    ]
