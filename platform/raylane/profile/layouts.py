"""The strategies' own code, timed inside the profile job: a transformer block as each sharded
layout wraps it, a parameter server's round trip, the pipeline schedules, and DDP's wait for
its last gradient bucket.

A plain block's fits at rows / tp plus the measured collectives predict tensor-parallel and
FSDP steps several times too fast on small models: DTensor's per-op dispatch, FSDP2's hooks,
its all-gathers before forward and backward and its reduce-scatter after, and a tensor-parallel
block's all-reduces all run inside forward and backward, and each has a fixed cost the plain
block does not pay. So the profile also builds one block the way `raylane.parallel.parallelize`
builds a run's blocks (the same function, on a mesh from the same `build_device_mesh`) and
times its forward and backward at the same row counts:

* ``tp2``: the block split over 2 workers by the GPT's plan;
* ``fsdp<n>``: the block fully sharded over `n` workers (the level's `k`, and `k / 2` for a
  pipeline's stages);
* ``fsdp<n>_tp2``: the block split over 2 workers, then sharded over `n = k / 2` such pairs.

At a level of `k` workers, every one of the first `k` measures at once, in groups of the
layout's shape, so that a 4-worker level has two tensor-parallel pairs computing side by side
as a 2 x tp2 run has. `raylane.plan.measured` uses these fits in place of the plain block's
for the layouts they describe.

The async and ssp strategies' synchronisation is a push of the gradients to a Ray actor that
applies them one worker at a time and returns the parameters: its cost is Ray's call, the
arrays' trip through the object store and the queue behind the other workers' pushes, none of
which a point-to-point link fit sees. So the profile starts the strategies' own parameter shard
and times a push from every worker of a level at once. The pipeline schedules are timed as
before, on torch's own schedules over a one-layer stage.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from raylane.config.dims import ParallelDims
from raylane.models import build_model
from raylane.models.classifier import build_with_blocks
from raylane.models.families import shape_of
from raylane.models.losses import cross_entropy
from raylane.models.optim import build_optimizer
from raylane.parallel.device import StreamClock
from raylane.parallel.mesh import build_device_mesh
from raylane.parallel.parallelize import parallelize
from raylane.parallel.param_server import ParameterShard
from raylane.parallel.pipeline import SCHEDULES, build_stage_module
from raylane.plan.wrapped import wrap_dims

if TYPE_CHECKING:
    from raylane.parallel.mesh import ParallelMesh


def build_meshes(
    world: int, levels: list[int], splits: bool, device_type: str = "cpu", ring: bool = False
) -> dict[int, dict[str, ParallelMesh]]:
    """Every level's meshes on `device_type` (the workers' devices: 'cuda' under NCCL), built
    on every rank up front (creating a mesh is collective); tensor-parallel ones where the
    model `splits` over 2 (`raylane.plan.wrapped.wrap_dims`)."""
    built: dict[ParallelDims, ParallelMesh] = {}
    meshes: dict[int, dict[str, ParallelMesh]] = {}
    for k in levels:
        meshes[k] = {}
        for name, dims in wrap_dims(world, k, splits, ring).items():
            if dims not in built:
                # Only the level's first k workers time the block; the replicas that fill
                # the world sit it out, so its shards must not all-reduce over them (HSDP).
                built[dims] = build_device_mesh(dims, device_type, hybrid_shard=False)
            meshes[k][name] = built[dims]
    return meshes


def one_block(model_cfg):
    """One block of the configured family as a module of hidden states to hidden states: the
    model with one block and no ends (a middle pipeline stage's form, split by the family's
    own tensor-parallel plan)."""
    return build_stage_module(build_with_blocks(model_cfg, 1), 1, [0, 0, 1, 1])


def _wrapped_block(cfg, mesh: ParallelMesh, device):
    """One block of the config's model (`one_block`) on `device`, parallelized by the layout
    of `mesh` exactly as a run's blocks are (FSDP's root unit included)."""
    import torch

    torch.manual_seed(cfg.training.seed)  # every worker of a group starts from the same block
    return parallelize(one_block(cfg.model).to(device), mesh, activation_checkpointing=False)


def time_wrapped_blocks(
    cfg, meshes: dict[str, ParallelMesh], rows_list, median_s, sync=None, device="cpu"
) -> tuple[dict, dict]:
    """Forward + backward seconds of each layout's block at each row count (whole rows: a
    tensor-parallel pair computes the same rows, FSDP's shards each their own), every
    repetition started on all the level's workers at once (`sync`); and the seconds of the
    optimizer's step over each block's parameters as the layout holds them (DTensors: their
    per-op dispatch is most of a small model's step)."""
    import torch

    m, training = cfg.model, cfg.training
    width = shape_of(m).d_model
    found: dict[str, dict[int, float]] = {}
    optimizer_s: dict[str, float] = {}
    for name, mesh in meshes.items():
        block = _wrapped_block(cfg, mesh, device)
        found[name] = {}
        for rows in rows_list:
            tokens = m.input_dim // mesh.dims.cp  # a ring worker holds its chunks of each row
            hidden = torch.randn(rows, tokens, width, device=device, requires_grad=True)

            def train_block(block=block, hidden=hidden):
                block(hidden).sum().backward()

            found[name][rows] = median_s(train_block, sync=sync)
        optimizer = build_optimizer(
            list(block.parameters()), training.optimizer, training.lr, training.weight_decay
        )
        optimizer_s[name] = median_s(optimizer.step, sync=sync)  # the last backward's grads
    return found, optimizer_s


def start_param_server(cfg, rank: int, distributed: bool):
    """One parameter shard holding the whole model, as an async or ssp run starts it (rank 0
    starts it; every rank gets its handle: collective). Rank 0's handle keeps it alive."""
    import ray
    import torch.distributed as dist

    handle = [None]
    if rank == 0:
        training = cfg.training
        params = [p.detach().numpy() for p in build_model(cfg.model).parameters()]
        actor = ParameterShard.remote(
            params, training.lr, training.weight_decay, False, training.optimizer
        )
        ray.get(actor.__ray_ready__.remote())
        handle = [actor]
    if distributed:
        dist.broadcast_object_list(handle, src=0)
    return handle[0]


def time_param_server(cfg, shard, median_s, sync=None) -> float:
    """Seconds of one worker's push of the model's gradients and the parameters' return, with
    every worker of the level pushing at once (the shard applies them one after another)."""
    import numpy as np
    import ray

    grads = [np.ones(tuple(p.shape), np.float32) for p in build_model(cfg.model).parameters()]
    version = [0]

    def push():
        _, version[0] = ray.get(shard.push.remote(grads, version[0]))

    return median_s(push, sync=sync)


def time_schedules(
    cfg, rank: int, group, microbatches, rows_per_micro: int, median_s, device="cpu"
) -> dict[str, dict[int, float]]:
    """Seconds per step of each pipeline schedule over two one-layer stages (ranks 0, 1) on
    `device`: almost all of it is the schedule's own cost."""
    import torch
    from torch.distributed.pipelining import PipelineStage

    width, device = shape_of(cfg.model).d_model, torch.device(device)
    layer = torch.nn.Linear(width, width).to(device)
    stage = PipelineStage(layer, rank, 2, device, group=group)
    found: dict[str, dict[int, float]] = {}
    for name, schedule_cls in SCHEDULES.items():
        found[name] = {}
        for micro in microbatches:
            schedule = schedule_cls(
                stage,
                n_microbatches=micro,
                loss_fn=lambda out, target: (out - target).pow(2).mean(),
            )
            rows = rows_per_micro * micro
            inputs = torch.randn(rows, cfg.model.input_dim, width, device=device)

            def step(schedule=schedule, inputs=inputs):
                if rank == 0:
                    schedule.step(inputs)
                else:
                    schedule.step(target=torch.zeros_like(inputs))

            found[name][micro] = median_s(step)
    return found


def _ready_then_all_reduce(state, bucket):
    """DDP comm hook: mark when the bucket was ready (on the device's stream), then torch's
    all-reduce on the group. (raylane's training hooks reduce over the whole world; the
    profile's groups are subsets.)"""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    group, clock, ready = state
    ready.append(clock.mark())
    return allreduce_hook(group, bucket)


def time_ddp(cfg, group, rows_list, repeats: int, device="cpu") -> dict[int, float]:
    """Seconds per step that backward waits for gradients after its last bucket is ready,
    under DDP on `group`, measured as `raylane.parallel.ddp` measures it in a run (the median
    of `repeats` steps after one, at each of `rows_list`). On a GPU the marks are CUDA events
    (`StreamClock`): backward returns when its kernels are queued, not done."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    m, device = cfg.model, torch.device(device)
    ids = [device] if device.type == "cuda" else None
    model = DistributedDataParallel(build_model(m).to(device), device_ids=ids, process_group=group)
    clock, ready = StreamClock(device), []
    model.register_comm_hook((group, clock, ready), _ready_then_all_reduce)
    found = {}
    for rows in rows_list:
        tokens = torch.randint(0, m.num_classes, (rows, m.input_dim), device=device)
        waits = []
        for _ in range(repeats + 1):
            model.zero_grad(set_to_none=True)
            loss = cross_entropy(model(tokens), tokens)
            ready.clear()  # marks from this backward only: the last is its last bucket's
            loss.backward()
            done = clock.mark()
            waits.append(clock.seconds(ready[-1], done) if ready else 0.0)
        found[rows] = statistics.median(waits[1:])
    return found
