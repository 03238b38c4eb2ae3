"""Step time and per-device memory of a decoder's training layout (any family's: its
`raylane.models.shape.DecoderShape`), predicted from its shape and the cluster's figures.

Compute is the model's FLOPs (Narayanan et al., "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", SC 2021, eq. 3: 24·B·s·l·h²·(1 + s/6h) + 2·B·s·h·V per
forward for a GPT; the shape's own matrices and attention width for other families, grouped-
query attention's narrower keys and values and a SwiGLU's three matrices included; backward
twice that; activation checkpointing recomputes the blocks' forward) shared
evenly by the devices, at `efficiency` of the accelerator's peak. On top of it, what each
parallelism adds on the critical path: the pipeline bubble, (p - 1)/m of the compute for GPipe
and 1F1B; tensor parallelism's all-reduces of each block's activations (two forward, two
backward, two more when recomputing); the data-parallel gradient all-reduce (FSDP: one
reduce-scatter and two all-gathers), hidden behind the backward pass where raylane's strategy
overlaps it (DDP's buckets, FSDP's prefetch) and exposed where it follows it (tp, pipeline);
pipeline stages' activation sends; context parallelism's ring attention, whose key/value
transfers overlap each ring step's attention compute and count only where they outlast it
(`raylane.plan.ring`). Collectives are rings: 2(n - 1)/n of the bytes over the slowest link
the group spans, plus a latency per ring step.

Context parallelism (cp workers per sequence, each holding T/cp tokens of the same rows) divides
every token's compute, every activation and the tensor-parallel all-reduces by cp; the model's
gradients are averaged over the dp x cp workers that hold them, charged as exposed after backward
(raylane's cp layouts all-reduce them by FSDP2's `replicate` as tensor-parallel replicas do:
block by block inside backward, which NCCL may overlap and gloo does not; the model keeps the
conservative charge).

Activation memory follows Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (MLSys 2023), eq. 2: s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes per layer for
16-bit activations of a GPT (another family's block saves what its shape counts,
`DecoderShape.activation_bytes_per_token`, split and whole as these two terms), 2·s·b·h with
full recomputation (plus, once, the whole activations of the block being recomputed in
backward); with sequence parallelism (their eq. 4) the norm and
residual regions' 10·s·b·h are divided by t too, for the same tensor-parallel bytes (a reduce-
scatter and an all-gather in place of each all-reduce), so sequence parallelism's extra time is
the backward's second all-gather of the column-wise matmuls' inputs (raylane's waits for it;
Megatron overlaps it with the weight gradients); outside a pipeline the head is split over the
vocabulary too, so the fp32 logits and their softmax are divided by t. The formula's 5·a·s²·b/t
term is the score matrix that attention without a fused kernel saves. raylane's attention is
torch's `scaled_dot_product_attention`, which takes a fused kernel on every device it trains on
(flash, cuDNN or memory-efficient on CUDA, the flash kernel on CPUs; seen in its autograd
graph: q, k, v, the output and an fp32 log-sum-exp are saved): it never stores the T x T
scores, so a fused workload (`Workload.fused_attention`, the default) charges the log-sum-exp,
4·a·s·b/t bytes, in their place (charging the scores had put an H200 step of an 86M GPT at T
1,024 at 35.9 GB against 13.9 GB measured). Under context parallelism s is the worker's T/cp
and ring attention saves no scores either (its backward recomputes them from the log-sum-exp
it keeps), so that term is replaced by what its kernel holds: the log-sum-exp, fp32 copies of
q, k, v and its output under bf16, and one ring step's fp32 (T/cp)² blocks per head while a
layer computes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from raylane.config.dims import ParallelDims
from raylane.models.shape import DecoderShape
from raylane.plan.hardware import Cluster, Precision
from raylane.plan.memory import FP32_ADAM, MIXED_PRECISION_ADAM, ModelState, sharded_state
from raylane.plan.ring import RING_VALUE_BYTES, exposed_ring_s, kv_block_bytes, ring_passes

#: Fraction of the accelerator's peak FLOP/s that the model's matrix multiplications reach.
#: An assumption, not a measurement: large GEMMs on current GPUs reach 60-80 % of peak.
DEFAULT_EFFICIENCY = 0.7
#: Bytes of a fused attention kernel's log-sum-exp per head and token (fp32 in every precision).
LSE_BYTES = 4
FP32_BYTES = 4
#: Share of device memory a plan may fill (the rest: allocator, workspaces, fragmentation).
MEMORY_HEADROOM = 0.9


@dataclass(frozen=True)
class Layout:
    """A layout to predict: its degrees (`ParallelDims`) and how a pipeline drives it."""

    dims: ParallelDims
    microbatches: int = 1
    schedule: str = "1f1b"
    activation_checkpointing: bool = False

    @classmethod
    def of(
        cls, strategy: str, dp: int, tp: int = 1, pp: int = 1, cp: int = 1,
        sequence_parallel: bool = False, **settings,
    ) -> Layout:  # fmt: skip
        """The layout a config's strategy name and degrees resolve to (`dp` data-parallel
        workers, each sequence split over `cp` more)."""
        dims = ParallelDims.preset(strategy, dp=dp, pp=pp, tp=tp)
        return cls(replace(dims, cp=cp, sequence_parallel=sequence_parallel), **settings)

    @property
    def strategy(self) -> str:
        return self.dims.preset_name

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def cp(self) -> int:
        return self.dims.cp

    @property
    def workers(self) -> int:
        return self.dims.world_size

    @property
    def zero_stage(self) -> int:
        return 3 if self.dims.fsdp_enabled else 0

    def describe(self) -> str:
        dims = self.dims
        hsdp = dims.fsdp_enabled and dims.dp_replicate > 1
        dp = f"dp{dims.dp_replicate}x{dims.dp_shard}" if hsdp else f"dp{self.dp}"
        parts = [self.strategy, dp]
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("-sp" if self.dims.sequence_parallel else ""))
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.pp > 1:
            parts += [f"pp{self.pp}", f"m{self.microbatches}", self.schedule]
        if self.activation_checkpointing:
            parts.append("ac")
        return " ".join(parts)


@dataclass(frozen=True)
class Workload:
    shape: DecoderShape
    global_batch: int  # sequences per optimizer step, all replicas together
    precision: Precision = "fp32"
    #: The output layer split over tp (Megatron's vocab-parallel head) in every layout; raylane
    #: splits it only under sequence parallelism outside a pipeline, and keeps it whole otherwise.
    head_split_by_tp: bool = False
    #: Attention by a fused kernel that keeps a log-sum-exp instead of the T x T scores (torch's
    #: SDPA on CUDA and on CPUs, raylane's attention); False: an unfused (math) attention that
    #: saves the scores, their softmax and its dropout, Korthikanti's 5·a·s²·b.
    fused_attention: bool = True

    @property
    def seq(self) -> int:
        return self.shape.context_length

    @property
    def n_heads(self) -> int:
        return self.shape.n_heads

    @property
    def value_bytes(self) -> int:
        """Bytes of an activation or a communicated value."""
        return 2 if self.precision == "bf16" else 4

    def model_flops(self, recompute: bool) -> float:
        """FLOPs of one optimizer step (forward, backward, and the recomputed forward)."""
        blocks, head = self.shape.forward_flops_per_token(self.seq)
        tokens = self.global_batch * self.seq
        return tokens * ((4 if recompute else 3) * blocks + 3 * head)


@dataclass
class Prediction:
    layout: Layout
    step_s: float
    parts: dict[str, float]
    state: ModelState
    activation_bytes: float
    memory_bytes: float
    fits: bool
    tokens_per_s: float
    flops_per_device: float  # achieved model FLOP/s per device


def _ring_s(nbytes: float, ranks: int, gbps: float, latency_s: float, passes: float = 2.0) -> float:
    """A ring collective over `ranks`: `passes` x (n - 1)/n of the bytes over the link.
    An all-reduce is 2 passes, a reduce-scatter or an all-gather 1."""
    if ranks <= 1:
        return 0.0
    return passes * (ranks - 1) / ranks * nbytes / (gbps * 1e9) + passes * (ranks - 1) * latency_s


def predict(
    work: Workload, layout: Layout, cluster: Cluster, efficiency: float = DEFAULT_EFFICIENCY
) -> Prediction:
    """Step time (compute, bubble, each axis's communication) and memory per device of
    `layout` for `work` on `cluster`."""
    recompute = layout.activation_checkpointing
    micro_rows = work.global_batch / layout.dp / layout.microbatches
    compute = _compute_s(work, layout, cluster, efficiency)
    params = work.shape.params_per_device(tp=layout.tp, pp=layout.pp, stage=0)
    parts = {
        "compute": compute,
        "bubble": compute * (layout.pp - 1) / layout.microbatches,
        **_comm_s(work, layout, cluster, compute, params, micro_rows),
        "cp_comm": _ring_comm_s(work, layout, cluster, micro_rows, efficiency),
    }
    step = sum(parts.values())

    per_param = MIXED_PRECISION_ADAM if work.precision == "bf16" else FP32_ADAM
    state = sharded_state(params, layout.dims.dp_shard, layout.zero_stage, per_param)
    activations = _activation_bytes(work, layout, micro_rows)
    # FSDP2's `replicate` (replicas of a split model) holds its parameters' fp32 unsharded
    # copy from forward to the end of backward, beside the model state.
    gathered = FP32_BYTES * params if layout.dims.replicates_split_model else 0.0
    memory = state.total + activations + gathered
    fits = memory <= cluster.device.memory_gb * 1e9 * MEMORY_HEADROOM
    return Prediction(
        layout=layout,
        step_s=step,
        parts=parts,
        state=state,
        activation_bytes=activations,
        memory_bytes=memory,
        fits=fits,
        tokens_per_s=work.global_batch * work.seq / step,
        flops_per_device=work.model_flops(recompute) / step / layout.workers,
    )


def _compute_s(work: Workload, layout: Layout, cluster: Cluster, efficiency: float) -> float:
    """One device's share of the step's FLOPs at `efficiency` of its peak; raylane's whole
    head is computed on every tp worker (for its cp worker's tokens) unless the workload
    splits it."""
    shape, device = work.shape, cluster.device
    flops = work.model_flops(layout.activation_checkpointing)
    head = 3 * work.global_batch * work.seq * shape.forward_flops_per_token()[1]
    split = work.head_split_by_tp or (layout.dims.sequence_parallel and layout.pp == 1)
    per_device = (flops - head) / layout.workers + head / (
        layout.workers if split else layout.dp * layout.pp * layout.cp
    )
    return per_device / (device.peak_flops[work.precision] * efficiency)


def _comm_s(
    work: Workload, layout: Layout, cluster: Cluster, compute: float, params: float,
    micro_rows: float,
) -> dict[str, float]:  # fmt: skip
    """Each parallel axis's communication on the critical path: tp_comm, dp_comm, pp_comm."""
    shape, spec, device = work.shape, cluster.spec, cluster.device
    latency = spec.link_latency_us * 1e-6
    intra, inter = device.intra_node_gbps, device.inter_node_gbps

    # Tensor parallel: each block's activations (this cp worker's tokens) all-reduced on the
    # critical path; sequence parallelism's reduce-scatter + all-gather move the same bytes,
    # and its backward gathers the four column-wise inputs again (two all-reduces' bytes).
    activation = micro_rows * work.seq / layout.cp * shape.d_model * work.value_bytes
    tp_link = intra if layout.tp <= spec.devices_per_node else inter
    per_block = 6 if layout.activation_checkpointing else 4
    per_block += 2 if layout.dims.sequence_parallel else 0
    tp_comm = (
        (shape.n_layers / layout.pp)
        * layout.microbatches
        * per_block
        * _ring_s(activation, layout.tp, tp_link, latency)
    )

    # Data parallel: this device's gradients (FSDP: reduce-scatter + 2 all-gathers).
    dp_link = inter if layout.workers > spec.devices_per_node else intra
    dp_total = _dp_sync_s(params * work.value_bytes, layout, spec.devices_per_node, intra,
                          dp_link, latency)  # fmt: skip
    # Overlapped with backward where it runs per block as backward goes (DDP's buckets, FSDP's
    # reduce-scatters: in a pipeline, during the last micro-batch's backward); charged after it
    # for tensor-parallel, pipeline and context-parallel replicas (FSDP2's `replicate`: a
    # pipeline's all-reduce follows the last backward; tp and cp replicas' runs block by block,
    # which the model does not credit).
    dims = layout.dims
    overlapped = dims.fsdp_enabled or not (dims.tp_enabled or dims.pp_enabled or dims.cp_enabled)
    window = compute * 2 / 3 / layout.microbatches
    dp_comm = max(dp_total - window, 0.0) if overlapped else dp_total

    # Pipeline: each micro-batch's activations forward and gradients back across a boundary.
    pp_link = inter if layout.tp * layout.pp > spec.devices_per_node else intra
    pp_comm = 0.0
    if layout.pp > 1:
        pp_comm = 2 * layout.microbatches * (activation / (pp_link * 1e9) + latency)
    return {"tp_comm": tp_comm, "dp_comm": dp_comm, "pp_comm": pp_comm}


def _dp_sync_s(
    nbytes: float, layout: Layout, per_node: int, intra: float, link: float, latency: float
) -> float:
    """The data-parallel workers' synchronisation of `nbytes` of gradients (and, sharded, of
    parameters): an all-reduce over the replicas (and a sequence's cp workers); FSDP's
    reduce-scatter + 2 all-gathers over its shards; HSDP both, the all-reduce of one shard's
    bytes over the replicas. A shard group's workers are `pp * cp * tp` ranks apart: one node
    while `dp_shard` of those strides fit in it."""
    dims = layout.dims
    if not dims.fsdp_enabled:
        return _ring_s(nbytes, dims.dp * dims.cp, link, latency, 2.0)
    span = dims.dp_shard * dims.pp * dims.cp * dims.tp
    shard_link = intra if span <= per_node else link
    sharded = _ring_s(nbytes, dims.dp_shard, shard_link, latency, 3.0)
    return sharded + _ring_s(nbytes / dims.dp_shard, dims.dp_replicate, link, latency, 2.0)


def _ring_comm_s(
    work: Workload, layout: Layout, cluster: Cluster, micro_rows: float, efficiency: float
) -> float:
    """Ring attention's exposed transfers: per attention layer and micro-batch, cp - 1 K/V
    blocks per pass, each over one ring step's attention compute (`raylane.plan.ring`). The
    ring's cp workers are tp apart in the mesh: one node while cp x tp devices fit in one."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    spec, device, s = cluster.spec, cluster.device, work.seq
    link = (
        device.intra_node_gbps
        if cp * layout.tp <= spec.devices_per_node
        else (device.inter_node_gbps)
    )
    # raylane's ring sends a grouped-query model's keys and values repeated to every query
    # head (`raylane.parallel.parallelize.apply_context_parallel`): the query heads' width.
    block = kv_block_bytes(micro_rows, s / cp, work.shape.q_width / layout.tp)
    transfer = block / (link * 1e9) + spec.link_latency_us * 1e-6
    # Megatron's attention core, 4·b·s²·h per layer forward (h: the query heads' width):
    # 1/(cp·tp) per worker, in cp steps.
    step_flops = 4 * micro_rows * s * s * work.shape.q_width / (cp * cp * layout.tp)
    step_compute = step_flops / (device.peak_flops[work.precision] * efficiency)
    passes = ring_passes(layout.activation_checkpointing)
    per_layer = exposed_ring_s(cp, passes, transfer, step_compute)
    return per_layer * work.shape.n_layers / layout.pp * layout.microbatches


def _activation_bytes(work: Workload, layout: Layout, micro_rows: float) -> float:
    """Peak activations on the first device (the first pipeline stage holds the most), for the
    T/cp tokens of each sequence it holds. With activation checkpointing each block keeps its
    input, and the block that backward recomputes holds its whole activations meanwhile."""
    s, h, a, t = work.seq / layout.cp, work.shape.d_model, work.n_heads, layout.tp
    scale = work.value_bytes / 2  # the formula counts 16-bit activations
    ring_saved, ring_working = _ring_attention_bytes(work, layout, micro_rows)
    split, regions = work.shape.activation_bytes_per_token()  # per token, 16-bit
    if layout.dims.sequence_parallel:  # norms, residuals
        regions /= t
    unfused = layout.cp == 1 and not work.fused_attention  # ring attention saves no scores
    scores = 5 * a * s / t if unfused else 0.0
    # A fused kernel's fp32 log-sum-exp per head and token (ring attention's: `ring_saved`).
    lse = LSE_BYTES * micro_rows * s * a / t if layout.cp == 1 and not unfused else 0.0
    whole = s * micro_rows * (regions + split / t + scores) * scale + ring_saved + lse
    per_layer, recomputed = whole, 0.0
    if layout.activation_checkpointing:
        per_layer, recomputed = 2 * s * micro_rows * h * scale, whole
    if layout.pp == 1:
        in_flight = 1
    elif layout.schedule == "gpipe":
        in_flight = layout.microbatches
    else:
        in_flight = min(layout.pp, layout.microbatches)
    logits = s * micro_rows * work.shape.vocab_size * 4 * 2  # fp32 logits and their softmax
    if layout.dims.sequence_parallel and layout.pp == 1:  # the head split over the vocabulary
        logits /= t
    layers = per_layer * (work.shape.n_layers / layout.pp) * in_flight
    return layers + recomputed + logits + ring_working


def _ring_attention_bytes(work: Workload, layout: Layout, micro_rows: float) -> tuple[float, float]:
    """What ring attention holds beyond the formula's terms: saved per layer (the fp32
    log-sum-exp per head and token; under bf16, fp32 q, k, v and output where the formula
    counts 16-bit ones: 18 bytes per value against 8), and the working set of the layer that
    computes: raylane's kernel materialises a ring step's fp32 (T/cp)² block per head and row,
    up to three at once (forward: scores, their shifted copy, probabilities; backward: the
    probabilities, dP and dS)."""
    if layout.cp == 1:
        return 0.0, 0.0
    s, heads = work.seq / layout.cp, work.n_heads / layout.tp
    values = micro_rows * s * work.shape.d_model / layout.tp
    saved = RING_VALUE_BYTES * micro_rows * s * heads
    if work.value_bytes == 2:
        saved += (4 * RING_VALUE_BYTES + 2 - 8) * values
    working = 3 * RING_VALUE_BYTES * micro_rows * heads * s * s
    return saved, working
