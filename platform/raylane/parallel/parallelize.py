"""`parallelize`: a layout's parallelisms applied, in order, to a plain model or to one
pipeline stage of it.

1. context parallel: the model computes on this worker's chunks of each sequence, attention by
   ring attention over the `cp` sub-mesh (`raylane.parallel.ring_attention`);
2. tensor parallel: the model's own plan (the module its class names: `raylane.models.gpt_plan`,
   `raylane.models.llama_plan`) over the `tp` sub-mesh
   (with sequence parallelism: its norms and residuals on sequence shards);
3. activation checkpointing: each block recomputed in backward;
4. `training.compile`: each block's forward compiled by torch.compile (torchtitan's regional
   compile: every block has the same code, so one graph serves them all; compiled after the
   checkpointing it must trace, before FSDP, whose hooks stay outside it);
5. data-parallel sync (`apply_data_parallel`), last: FSDP2 over the `dp_shard` sub-mesh (HSDP
   over `dp_replicate x dp_shard`), block by block, then the rest as the root unit (with bf16
   `training.precision`, its mixed-precision policy: `raylane.parallel.precision`); for
   replicas of a split but unsharded model (tensor parallel, pipeline stages, context
   parallel), FSDP2's `replicate` over the replicas, the same units, all-reducing each one's
   gradients inside backward; or, for whole-model replicas that all-reduce, DDP over the
   process group (the strategy registers its communication hook on it:
   `raylane.parallel.grad_compression`).

Each step is one function and runs only where its degree (or setting) asks for it, so any
combination of them is this one sequence. Replicas that agree otherwise (periodic averaging, a
parameter server, the compressed average of a tensor-parallel mesh's replicas) do so in their
strategy, on what this returns. A pipeline first
cuts the model into its stage (`raylane.parallel.pipeline.build_stage_module`) and then calls
this on the stage. torch's DTensor and FSDP modules are imported by the step that needs them:
a data-parallel worker never pays their imports.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from raylane.parallel.activation_checkpoint import apply_activation_checkpointing
from raylane.parallel.precision import fsdp_mixed_precision
from raylane.parallel.ring_attention import positions_for, ring_attention

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from raylane.parallel.mesh import ParallelMesh

#: The attribute naming the class of a custom model's blocks, set by `raylane.models.custom`
#: (same name there: this module imports torch alone, that one the validated config).
BLOCK_CLASS_ATTRIBUTE = "raylane_block_class"


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The units a layout splits, checkpoints, compiles and shards one at a time: a GPT's or
    Llama's (or a stage's) `blocks`; a custom model's modules of the class it is marked with
    (`raylane.models.custom`: `model.block_class`, or its repeated children), outermost ones
    only; none for a model without blocks (the classifiers: one unit)."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    name = getattr(model, BLOCK_CLASS_ATTRIBUTE, None)
    if name is None:
        return []
    found: list[nn.Module] = []
    inside: list[str] = []  # names of the blocks found so far: their modules are not others
    for path, module in model.named_modules():
        if module is model or any(path.startswith(f"{outer}.") for outer in inside):
            continue
        if type(module).__name__ == name:
            found.append(module)
            inside.append(path)
    return found


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Activation checkpointing of `model_blocks(model)`: a GPT's by
    `apply_activation_checkpointing`, a custom model's blocks the same way, in place."""
    if isinstance(getattr(model, "blocks", None), nn.ModuleDict):
        return apply_activation_checkpointing(model)
    for block in model_blocks(model):
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


def _has_module(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    sequence_parallel: bool = False,
    vocabulary_loss: bool = False,
) -> nn.Module:
    """Split every block of a GPT or a Llama (or of a stage) over `tp_mesh` by the plan its
    class names (`tp_plan`: `block_plan`, `block_io`, `head_plan`), in place;
    with `sequence_parallel`, the blocks' norms and residuals over sequence shards, and with
    `vocabulary_loss` too (a whole model whose loss runs under torch's `loss_parallel`:
    `sharded_loss`) its final norm on the shards and its head split over the vocabulary."""
    from torch.distributed.tensor.parallel import parallelize_module

    if tp_mesh.size() == 1:
        return model
    # The model's class names its plan module (`GPT.tp_plan`), imported only here: a plan
    # imports DTensor (about 0.5 s per worker) that other layouts never need.
    where = getattr(model, "tp_plan", None)
    if where is None:
        raise ValueError(
            f"{type(model).__name__} names no tensor-parallel plan (a `tp_plan` module like "
            "raylane.models.gpt_plan): it cannot be split over tp workers"
        )
    plan = importlib.import_module(where)
    blocks = model_blocks(model)
    ends = sequence_parallel and vocabulary_loss and model.head is not None
    for index, block in enumerate(blocks):
        # A plan's entries for parts this block does not have are left out (a family's
        # optional modules: Qwen3's per-head q/k norms).
        styles = plan.block_plan(sequence_parallel).items()
        parallelize_module(block, tp_mesh, {n: s for n, s in styles if _has_module(block, n)})
        if sequence_parallel:
            last = ends and index == len(blocks) - 1
            parallelize_module(block, tp_mesh, plan.block_io(last=last))
    if ends:
        parallelize_module(model, tp_mesh, plan.head_plan())
    return model


def sharded_loss():
    """The context a vocabulary-split head's loss and its backward run in (torch's
    `loss_parallel`: the softmax over the classes each worker holds, combined by all-reduces)."""
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def apply_context_parallel(
    model: nn.Module, cp_group, cp_rank: int, cp: int, traffic=None
) -> nn.Module:
    """Make `model` (a whole GPT or Llama) compute on this worker's chunks of each sequence (in
    place): its positions are the chunks' own (`ring_attention.positions_for`), and every block's
    attention is ring attention over the `cp_group` workers, which hold the other chunks. The
    inputs it is given are already this worker's part (`shard_sequence`, by the strategy).
    `traffic` (a `RingTraffic`) counts the ring's bytes and the time spent waiting for them."""

    def positions(length: int, device) -> torch.Tensor:
        return positions_for(length * cp, cp_rank, cp).to(device)

    def attention(q, k, v):
        if k.shape[1] != q.shape[1]:  # grouped-query: each key/value head serves a group
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return ring_attention(q, k, v, cp_group, traffic=traffic)

    model.positions = positions
    for block in model.blocks.values():
        block_attention(block).attention = attention
    return model


def block_attention(block: nn.Module) -> nn.Module:
    """A transformer block's attention module: the GPT's `attn`, the Llama's `self_attn`."""
    attention = getattr(block, "attn", None) or getattr(block, "self_attn", None)
    if attention is None:
        raise ValueError(f"{type(block).__name__} has no attention module (attn or self_attn)")
    return attention


def apply_compile(model: nn.Module, backend: str = "inductor") -> nn.Module:
    """Compile each block's forward with torch.compile (`backend`: inductor in a run; tests pass
    a cheaper one), in place. The block's `forward` is replaced rather than the module
    compiled (`nn.Module.compile`), so parameter names stay the plain model's and an
    activation-checkpointed forward (a `checkpoint` partial, which `Module.compile`'s frame
    skips: nothing compiled) is traced, recomputation included. A model without blocks (the
    classifiers) is compiled whole, as one region."""
    for region in model_blocks(model) or [model]:
        region.forward = torch.compile(region.forward, backend=backend)
    return model


def apply_fsdp(model: nn.Module, shard_mesh: DeviceMesh, precision: str = "fp32") -> nn.Module:
    """Shard `model` (a whole GPT, a pipeline stage of one, a custom model) over `shard_mesh`,
    block by block (`model_blocks`) and then the rest as the root unit, in place: only one
    block's full parameters exist at a time, gathered before its forward (and again before its
    backward) and freed after; in bf16 when `precision` is (the shards, gradients and optimizer
    state stay fp32)."""
    from torch.distributed.fsdp import fully_shard

    policy = fsdp_mixed_precision(precision)
    options = {"mp_policy": policy} if policy is not None else {}
    return _block_by_block(fully_shard, model, shard_mesh, options)


def apply_replicate(model: nn.Module, replica_mesh: DeviceMesh) -> nn.Module:
    """Replicas of a split model (its tensor-parallel DTensors, a pipeline stage, a context-
    parallel worker's copy) over `replica_mesh`, in place: FSDP2's `replicate` (DDP built on
    FSDP2, which composes with DTensor parameters where DDP does not), block by block and then
    the rest as the root unit, each block's gradients all-reduced once its backward is done
    (a pipeline's, after the step's last micro-batch: the schedule's gradient reduction). No
    mixed-precision policy: a bf16 run computes under autocast over fp32 parameters, as DDP's
    replicas do. FSDP2 keeps a second, unsharded copy of the parameters from forward to the end
    of backward (its one-worker "all-gather")."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    return _block_by_block(replicate, model, replica_mesh, {})


def _block_by_block(apply, model: nn.Module, mesh: DeviceMesh, options: dict) -> nn.Module:
    """`apply` (FSDP2's `fully_shard` or `replicate`) with `options` to each of
    `model_blocks(model)`, then to the model as the root unit, on `mesh`."""
    for block in model_blocks(model):
        apply(block, mesh=mesh, **options)
    apply(model, mesh=mesh, **options)
    return model


def apply_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """Whole-model replicas over the default process group: `model` (already on `device`)
    wrapped in DDP, its gradients all-reduced bucket by bucket inside backward (on a GPU, DDP
    over that device alone). One worker has nothing to all-reduce: the model itself."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return model
    if device.type == "cuda":
        return DistributedDataParallel(model, device_ids=[device], output_device=device)
    return DistributedDataParallel(model)


def apply_data_parallel(
    model: nn.Module,
    mesh: ParallelMesh | None,
    precision: str = "fp32",
    ddp_device: torch.device | None = None,
) -> nn.Module:
    """The last apply step, how data-parallel workers agree: FSDP2 (or HSDP) where the layout
    shards, FSDP2's `replicate` where replicas of a split model all-reduce
    (`ParallelMesh.replicate_in_backward`), DDP on `ddp_device` where whole-model replicas do
    (`ddp_device` given), else nothing (one worker; a sync its strategy runs itself). Returns
    what is trained."""
    if mesh is not None and mesh.dims.fsdp_enabled:
        return apply_fsdp(model, mesh.shard_mesh, precision)
    if mesh is not None and mesh.replicate_in_backward:
        return apply_replicate(model, mesh.replica_mesh)
    if ddp_device is not None:
        return apply_ddp(model, ddp_device)
    return model


def parallelize(
    model: nn.Module,
    mesh: ParallelMesh | None,
    *,
    activation_checkpointing: bool = False,
    precision: str = "fp32",
    ring_traffic=None,
    vocabulary_loss: bool = False,
    compile_blocks: bool = False,
    compile_backend: str = "inductor",
    ddp_device: torch.device | None = None,
) -> nn.Module:
    """Apply the layout's parallelisms to `model` in order (in place, but for DDP's wrapper;
    returns what is trained). `mesh` is None for layouts whose workers each hold the whole
    model (nothing to split or shard). `ring_traffic` measures context parallelism's ring
    (`apply_context_parallel`); `vocabulary_loss`: the caller computes the loss under
    `sharded_loss`, so a sequence-parallel model's head may return vocabulary-sharded logits;
    `compile_blocks` (`training.compile`) compiles each block with `compile_backend`
    (`apply_compile`); `ddp_device`: whole-model replicas all-reducing by DDP on that device
    (`apply_data_parallel`)."""
    if mesh is not None and mesh.dims.cp_enabled:
        apply_context_parallel(model, mesh.cp_group, mesh.cp_rank, mesh.dims.cp, ring_traffic)
    if mesh is not None and mesh.dims.tp_enabled:
        apply_tensor_parallel(model, mesh.tp_mesh, mesh.dims.sequence_parallel, vocabulary_loss)
    if activation_checkpointing:
        checkpoint_blocks(model)
    if compile_blocks:
        apply_compile(model, compile_backend)
    return apply_data_parallel(model, mesh, precision, ddp_device)
