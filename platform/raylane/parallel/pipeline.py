"""Pipeline parallelism (and its hybrid with data parallelism) with torch.distributed.pipelining.

Each worker holds one stage: the plain model with the other stages' blocks deleted, so its
parameter names are those of the whole model. Batches are cut into micro-batches and driven
through the stages by a GPipe or 1F1B schedule; with dp > 1, each stage's gradients are
all-reduced over its data-parallel replicas by FSDP2's `replicate` (strategy 'hybrid'), or each
stage is sharded over its dp workers by FSDP2, which reduce-scatters them (strategy 'fsdp' with
pp > 1): `parallelize`'s last step either way, and the schedule syncs only in a step's last
backward; with tp > 1 each stage's blocks are
also tensor parallel over `tp` workers (3D: dp x pp x tp on one mesh; activations pass between
the workers of equal tp rank in neighbouring stages). Every step records each stage's busy
time (forward/backward compute) and the activation bytes autograd holds, so the bubble can be
compared with the GPipe bound (p - 1) / (m + p - 1).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.nn import Module
from torch.optim import Optimizer

from raylane.config import RaylaneConfig
from raylane.config.layout import stage_boundaries
from raylane.parallel.base import LossFn, StrategyDefaults
from raylane.parallel.device import to_device, worker_device
from raylane.parallel.mesh import build_device_mesh
from raylane.parallel.meters import ActivationMeter, StageTimer
from raylane.parallel.parallelize import parallelize
from raylane.parallel.precision import autocast_method, fp32_loss

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def build_stage_module(model: nn.Module, stage: int, bounds: list[int]) -> nn.Module:
    """Stage `stage` of a GPT or Llama: blocks `[bounds[stage], bounds[stage + 1])`, the
    embeddings on the first stage, the final norm and head on the last; everything else
    deleted."""
    keep = {str(i) for i in range(bounds[stage], bounds[stage + 1])}
    for key in list(model.blocks.keys()):
        if key not in keep:
            del model.blocks[key]
    if stage > 0:
        model.tok_emb = model.pos_emb = None
    if stage < len(bounds) - 2:
        model.norm = model.head = None
    return model


class PipelineParallel(StrategyDefaults):
    """`pp` stages, `microbatches` per batch, optionally `dp` replicas (strategy 'hybrid') or
    `dp` shards of each stage (strategy 'fsdp')."""

    splits_dataset = False
    evaluates_ragged = False

    def __init__(self, cfg: RaylaneConfig, rank: int):
        par = cfg.parallelism
        self.name = par.strategy
        self.microbatches = par.microbatches
        self.activation_checkpointing = cfg.training.activation_checkpointing
        self.compile_blocks = cfg.training.compile
        self.precision = cfg.training.precision
        self.schedule_name = par.schedule
        self.device = worker_device(par.use_gpu)
        self.mesh = build_device_mesh(par.dims, self.device.type)
        synced = self.mesh.dims.fsdp_enabled or self.mesh.replicate_in_backward
        if self.mesh.dims.dp_replicate > 1 and not synced:
            raise ValueError(
                f"pipeline replicas sync by an all-reduce inside the schedule; layout "
                f"{self.mesh.dims.describe()} asks for {self.mesh.dims.sync.describe()}"
            )
        self.stage_index = self.mesh.pp_rank
        self.num_stages = par.pp
        self.bounds = stage_boundaries(cfg.model.block_count(), par.pp, par.split_points)
        self.is_first = self.stage_index == 0
        self.is_last = self.stage_index == par.pp - 1
        self.data_rank, self.data_world = self.mesh.dp_rank, par.dp
        # The tp workers of the last stage compute the same loss; one of them reports it.
        self.reports_loss = self.is_last and self.mesh.tp_rank == 0
        # Every worker writes its shards, and each stage's first worker that stage's part.
        self.checkpoint_part = self.stage_index
        self.writes_part = self.mesh.dp_rank == 0 and self.mesh.tp_rank == 0
        self.timer = StageTimer()
        self.activations = ActivationMeter()
        self.last_step_parts: dict[str, float] = {}
        self._schedule = None

    def wrap_model(self, model: nn.Module) -> nn.Module:
        module = build_stage_module(model, self.stage_index, self.bounds).to(self.device)
        parallelize(
            module,
            self.mesh,
            activation_checkpointing=self.activation_checkpointing,
            precision=self.precision,
            compile_blocks=self.compile_blocks,
        )
        self.stage = PipelineStage(
            module, self.stage_index, self.num_stages, self.device, group=self.mesh.pp_group
        )
        # bf16: the stage's forward chunks under autocast, not the schedule's backward ones.
        autocast_method(self.stage, "forward_one_chunk", self.precision, self.device)
        self.timer.instrument(self.stage)
        return module

    def _schedule_for(self, loss_fn: LossFn | None):
        if self._schedule is None:
            self._schedule = SCHEDULES[self.schedule_name](
                self.stage,
                n_microbatches=self.microbatches,
                loss_fn=None if loss_fn is None else fp32_loss(loss_fn),
                scale_grads=True,
            )
        return self._schedule

    def _run(self, method: str, inputs: torch.Tensor, targets: torch.Tensor | None, losses):
        args = (to_device(inputs, self.device),) if self.is_first else ()
        kwargs = {}
        if self.is_last and targets is not None:
            kwargs = {"target": to_device(targets, self.device), "losses": losses}
        return getattr(self._schedule, method)(*args, **kwargs)

    def train_step(
        self, model: Module, optimizer: Optimizer, loss_fn: LossFn, inputs: Tensor, targets: Tensor
    ) -> Tensor | None:
        self._schedule_for(loss_fn)
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        busy_before, synced_before = self.timer.busy_s, self.timer.sync_s
        start = time.perf_counter()
        with self.activations:
            self._run("step", inputs, targets, losses)  # replicas all-reduce at its end
        scheduled = time.perf_counter()
        synced = self.timer.sync_s - synced_before
        self.timer.end_step(scheduled - start - synced)
        optimizer.step()
        busy = self.timer.busy_s - busy_before
        # The schedule's time not spent in this stage's own compute or the replicas' all-reduce
        # went to waiting for (and exchanging activations with) its neighbours: the bubble.
        self.last_step_parts = {
            "compute": busy + (time.perf_counter() - scheduled),
            "bubble": max(scheduled - start - busy - synced, 0.0),
            "comm": synced,
        }
        return torch.stack(losses).mean().detach() if self.is_last else None

    chunked_validation = False  # its own evaluation forward, below

    def forward(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor | None:
        self._schedule_for(None)
        with self.timer.paused():
            # The last stage's schedule computes the loss whenever it has a loss function.
            output = self._run("eval", inputs, targets, [])
        return output.float() if self.reports_loss else None

    def epoch_stats(self) -> dict[str, float]:
        """Per-stage busy/idle time and activation peak, gathered from every worker; the
        measured bubble next to the GPipe bound. Resets the meters."""
        mine = {
            "stage": self.stage_index,
            "dp_rank": self.mesh.dp_rank,
            "busy_s": self.timer.busy_s,
            "wall_s": self.timer.wall_s,
            "steps": self.timer.steps,
            "peak_activation_bytes": self.activations.peak_bytes,
        }
        gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, mine)
        self.timer.reset()
        self.activations.reset()
        return summarise_stages(gathered, self.num_stages, self.microbatches)


def summarise_stages(records: list[dict], pp: int, microbatches: int) -> dict[str, float]:
    """Metrics from every worker's stage record (replicas of a stage are averaged)."""
    stats: dict[str, float] = {}
    busy_total = wall_total = 0.0
    for stage in range(pp):
        rows = [r for r in records if r["stage"] == stage]
        busy = sum(r["busy_s"] for r in rows) / len(rows)
        wall = sum(r["wall_s"] for r in rows) / len(rows)
        peak = max(r["peak_activation_bytes"] for r in rows)
        stats[f"stage{stage}_busy_s"] = busy
        stats[f"stage{stage}_idle_s"] = max(wall - busy, 0.0)
        stats[f"stage{stage}_peak_activation_mb"] = peak / 2**20
        busy_total += busy
        wall_total += wall
    efficiency = busy_total / wall_total if wall_total > 0 else 0.0
    bound = (pp - 1) / (microbatches + pp - 1)
    stats["pipeline_efficiency"] = efficiency
    stats["bubble_fraction"] = 1.0 - efficiency
    stats["bubble_bound_gpipe"] = bound
    stats["efficiency_vs_bound"] = efficiency / (1.0 - bound)
    return stats
