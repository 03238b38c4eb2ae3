"""The profile's wrapped blocks: which sharded layouts' blocks a level of the profile times
(`raylane.profile.layouts` times them) and the names a profile stores them under, which
`raylane.plan.measured` looks a layout's block up by."""

from __future__ import annotations

from dataclasses import replace

from raylane.config.dims import ParallelDims

#: The tensor-parallel degree the profile measures (the degree Tune searches by default).
TP = 2
#: The context-parallel degree the profile measures.
CP = 2


def wrap_dims(
    world: int, k: int, splits: bool = True, ring: bool = False
) -> dict[str, ParallelDims]:
    """The layouts whose blocks a level of `k` of `world` workers times, by name (`wrap_name`):
    FSDP over all `k` and over `k / 2` (a pipeline's stages of `k / 2` shards), tensor parallel
    over 2, FSDP over `k / 2` pairs of those, and with `ring` a sequence split over 2 workers
    (context parallelism: ring attention, whose kernel and transfers the plain block's time
    knows nothing of). Their groups cover the first `k` ranks; the rest of the world sits in
    replicas of the same shape (every rank takes part in building a mesh; only the first `k`
    time). Tensor parallel only where the model `splits` over 2 (`DecoderShape.splits_over`:
    its heads, key/value heads and MLP width); `ring` where the sequence cuts into 2 x 2
    chunks."""
    if k < 2 or world % k:
        return {}
    shape: list[ParallelDims] = [ParallelDims(dp_shard=k)]
    if k % 2 == 0 and k > 2:  # a pipeline's 2 stages, each sharded over k / 2
        shape.append(ParallelDims(dp_shard=k // 2))
    if k % TP == 0 and splits:
        shape.append(ParallelDims(tp=TP))
        if k > TP:
            shape.append(ParallelDims(dp_shard=k // TP, tp=TP))
    if k % CP == 0 and ring:
        shape.append(ParallelDims(cp=CP))
    return {wrap_name(dims): replace(dims, dp_replicate=world // dims.world_size) for dims in shape}


def wrap_name(dims: ParallelDims) -> str | None:
    """The profile's name for the block of a layout with these degrees ('fsdp4', 'tp2',
    'fsdp2_tp2', 'cp2'), or None where a block is not wrapped (data parallel, sequence
    parallel, context parallel with any other split)."""
    if dims.sequence_parallel:
        return None
    if dims.cp_enabled:
        return (
            f"cp{dims.cp}" if dims.cp == CP and not (dims.fsdp_enabled or dims.tp_enabled) else None
        )
    parts = [f"fsdp{dims.dp_shard}"] if dims.fsdp_enabled else []
    parts += [f"tp{dims.tp}"] if dims.tp_enabled else []
    return "_".join(parts) or None
