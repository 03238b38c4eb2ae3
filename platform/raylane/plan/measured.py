"""Step time and peak worker memory of a runnable config, predicted from a profile of the
cluster it will run on (`raylane.profile`).

The catalog model (`raylane.plan.cost`) reasons in FLOPs and data-sheet bandwidths; this one
composes measured seconds, which is what small models on shared cores need: per-op overhead,
threads and workers sharing cores are all in the profile. Every strategy raylane runs is a
sum of the same measured parts:

* compute: blocks (forward+backward, plus a recomputed forward with activation
  checkpointing) at the rows each worker computes, the ends (embeddings, head, loss), and the
  optimizer step over the parameters the worker holds. A tensor-parallel or FSDP layout's
  blocks are the profile's own timing of a block as that layout wraps it
  (`raylane.profile.layouts`: DTensor's dispatch, FSDP's hooks and the collectives
  inside forward and backward included), where the profile has one of its shape;
* the pipeline schedule: m micro-batches through the slowest stage plus one pass of the
  others (the fill and drain bubble), and the activation sends between stages;
* exposed communication: the data-parallel gradient all-reduce (scaled by the compression's
  byte ratio; every `period` steps for local SGD; one reduce-scatter and two all-gathers for
  FSDP, only the ends' when the blocks' are in their profiled time), tensor parallelism's
  all-reduces of each block's activations where the block was not profiled wrapped (sequence
  parallelism's reduce-scatter + all-gather move the same bytes: the same time), and for
  async / ssp a parameter server's round trip as profiled (every worker pushing at once);
* the ring (context parallelism, its own part of the split): per attention layer, cp - 1
  key/value blocks forward and twice that backward, each a point-to-point transfer (the
  profile's `p2p` fit) that overlaps one ring step's attention compute and counts where it
  outlasts it (`raylane.plan.ring`).

Context parallelism (cp workers per sequence, each with T/cp of every row's tokens): a cp
worker does 1/cp of each row's block work, so its compute is the profile's per-row fits at
rows/cp (the fixed per-op cost kept); the attention core's share of it, the compute a ring
step hides a transfer behind, is Megatron's s/6h term at the whole sequence. The fits time
torch's fused attention, and raylane's ring kernel is slower per block (explicit matmuls, fp32
softmax: `benchmarks/README.md`, long_context), which the first measured trial's calibration
absorbs. The model's gradients are averaged over the dp x cp workers, charged after backward.

Memory is the worker's baseline (resident memory on CPUs; on a GPU run the device's, as
torch's allocator counts it) plus model state (parameters, gradients, optimizer state,
sharded as the strategy shards them; replicas of a split model also hold FSDP2 `replicate`'s
fp32 unsharded copy of the parameters) plus the activations autograd saves (per row, as
profiled) for the micro-batches a stage holds at once: 1/cp of them under context parallelism
(activations are linear in T: attention saves its output and log-sum-exp, never T x T
scores), and with sequence parallelism six T x d inputs per block (the two LayerNorms', and
those q, k, v and the MLP's first linear keep for backward) on 1/tp of the tokens, and outside
a pipeline the model's end (final norm, head, logits and their softmax) split tp ways.

The profile measures fp32. With `training.precision: bf16` the parameters, gradients and
optimizer state stay fp32 (`raylane.parallel.precision`); what changes is predicted from
measured ratios: a block's saved activations (matmul inputs in bf16), autocast's bf16 copy of
the weights held through backward, and FSDP's all-gathers in bf16. Compute stays the profiled
fp32 seconds, which a bf16 step can miss either way: on this AMX CPU it ran at 0.69x to 1.23x
of fp32's speed depending on the matrices' size (`benchmarks/finetune.py`), and without bf16
matrix instructions it is slower.
"""

from __future__ import annotations

from dataclasses import dataclass

from raylane.config import RaylaneConfig
from raylane.config.dims import ParallelDims
from raylane.models.families import shape_of
from raylane.models.shape import DecoderShape
from raylane.plan.ring import attention_core_share, exposed_ring_s, kv_block_bytes, ring_passes
from raylane.plan.wrapped import wrap_name

_FP32 = 4  # bytes of an activation or gradient element
_STATE_BYTES_PER_PARAM = {"adamw": 4 + 4 + 8, "sgd": 4 + 4}
#: Bytes autograd saves per row in a GPT block under bf16 autocast against fp32: 0.553-0.558
#: measured on blocks of width 32-256 (matmul inputs bf16; norms, softmax, the residual fp32).
_BF16_BLOCK_ACTIVATIONS = 0.56
#: autocast's bf16 copy of each weight, held from the forward to the backward.
_BF16_WEIGHT_COPY_BYTES = 2


class ProfileMismatch(ValueError):
    """The profile cannot predict this config (it was measured for other worker counts)."""


@dataclass(frozen=True)
class LocalPrediction:
    step_s: float
    parts: dict[str, float]
    memory_mb: float
    samples_per_s: float
    #: The part of memory_mb that is activations (what an activation budget limits).
    activation_mb: float = 0.0

    @property
    def step_ms(self) -> float:
        return 1000 * self.step_s

    def calibrated(
        self, step_scale: float, data_wait_s: float, memory_offset_mb: float
    ) -> LocalPrediction:
        """This prediction corrected by what a measured trial showed the profile misses: a
        factor on the step's work (the input pipeline's threads share the cores), its wait for
        input per step, and an offset on memory (the input pipeline's buffers)."""
        parts = {name: seconds * step_scale for name, seconds in self.parts.items()}
        parts["data_wait"] = data_wait_s
        step = sum(parts.values())
        return LocalPrediction(
            step_s=step,
            parts=parts,
            memory_mb=self.memory_mb + memory_offset_mb,
            samples_per_s=self.samples_per_s * self.step_s / step if step > 0 else 0.0,
            activation_mb=self.activation_mb,
        )


def _fit(fit: dict, x: float) -> float:
    """A profiled compute fit (`raylane.plan.fits.ComputeFit`) at `x` rows."""
    return fit["fixed_s"] + fit["per_row_s"] * x


def _link(fit: dict | None, nbytes: float) -> float:
    """A profiled link fit (`raylane.plan.fits.LinkFit`) for `nbytes`; no link costs 0."""
    if fit is None:
        return 0.0
    return fit["alpha_s"] + fit["beta_s_per_byte"] * nbytes


def _link_bytes(fit: dict | None, nbytes: float) -> float:
    """The bandwidth part of a transfer (what compression can save)."""
    return 0.0 if fit is None else fit["beta_s_per_byte"] * nbytes


def _level(profile: dict, workers: int) -> dict:
    level = profile["levels"].get(str(workers))
    if level is None:
        known = ", ".join(sorted(profile["levels"], key=int))
        raise ProfileMismatch(
            f"the profile measured {known} workers at a time, not {workers}: profile again "
            "with this worker count"
        )
    return level


def _compression_ratio(cfg: RaylaneConfig) -> float:
    par = cfg.parallelism
    kind = par.grad_compression
    if kind in ("fp16", "bf16"):
        return 0.5
    if kind == "topk":
        return 2 * par.topk_ratio  # a value and an index per kept element
    if kind == "powersgd":
        width = shape_of(cfg.model).d_model
        return min(1.0, 2 / width)  # rank 1: P (n x 1) and Q (m x 1) instead of n x m
    return 1.0


def predict_config(profile: dict, cfg: RaylaneConfig) -> LocalPrediction:
    """Predicted step time, samples/s and peak worker memory of `cfg` on the profiled cluster."""
    try:
        decoder = shape_of(cfg.model)  # a pretrained model's config.json, read once
    except ValueError as error:
        raise ProfileMismatch(str(error)) from None
    shape = _Shape.of(profile, cfg, decoder)
    parts = _compute_parts(profile, cfg, shape)
    parts["comm"] += _sync_comm(profile, cfg, shape)
    parts["ring"] = _ring_s(profile, cfg, shape)
    step = sum(parts.values())
    activations = _activation_bytes(profile, cfg, shape) / 2**20
    return LocalPrediction(
        step_s=step,
        parts=parts,
        memory_mb=_peak_memory_mb(profile, cfg, shape) + activations,
        samples_per_s=cfg.training.batch_size * shape.dp / step if step > 0 else 0.0,
        activation_mb=activations,
    )


@dataclass(frozen=True)
class _Shape:
    """What a layout makes of the model on one worker: degrees, rows per micro-batch,
    blocks per stage, parameters held, and the profile's figures at its worker count."""

    level: dict
    model: DecoderShape  # the family's widths
    pp: int
    tp: int
    dp: int
    cp: int
    sequence_parallel: bool
    pipelined: bool
    micro: int
    rows: float  # per micro-batch, per replica (its cp workers hold T/cp tokens of each)
    tokens: float  # of each row, on this worker: T/cp
    stage_layers: float
    params_held: float
    block_params_held: float  # of one block
    activation_bytes: float  # one block's input for `rows` rows
    #: The profile's fit of a block as this layout wraps it (`raylane.profile.layouts`),
    #: collectives inside forward and backward included; None: the plain block's fits.
    wrapped: dict | None = None

    @classmethod
    def of(cls, profile: dict, cfg: RaylaneConfig, model: DecoderShape) -> _Shape:
        par = cfg.parallelism
        dims = par.dims
        pp, tp, dp = dims.pp, dims.tp, dims.dp
        micro = par.microbatches if dims.pp_enabled else 1
        rows = cfg.training.batch_size / micro
        block_params, ends_params = profile["block_params"], profile["ends_params"]
        params_held = (model.n_layers / pp) * block_params / tp + ends_params / pp
        block_held = block_params / tp
        if dims.fsdp_enabled:  # the stage's (or whole model's) share, over its shards
            params_held /= dims.dp_shard
            block_held /= dims.dp_shard
        tokens = model.context_length / dims.cp
        level = _level(profile, par.workers)
        return cls(
            level=level, model=model, pp=pp, tp=tp, dp=dp, cp=dims.cp,
            sequence_parallel=dims.sequence_parallel, pipelined=dims.pp_enabled, micro=micro,
            rows=rows, tokens=tokens, stage_layers=model.n_layers / pp, params_held=params_held,
            block_params_held=block_held,
            activation_bytes=rows * tokens * model.d_model * _FP32,
            wrapped=_wrapped_fit(level, dims),
        )  # fmt: skip


def _wrapped_fit(level: dict, dims: ParallelDims) -> dict | None:
    """The profiled block of this layout's shape (`raylane.profile.layouts`): tensor
    parallel over 2 workers, FSDP, or both, with every worker of the level computing; None for
    other layouts and for profiles without it."""
    name = wrap_name(dims)
    return (level.get("wrapped") or {}).get(name) if name else None


def _compute_parts(profile: dict, cfg: RaylaneConfig, shape: _Shape) -> dict[str, float]:
    """Compute (blocks, ends, optimizer, tensor-parallel all-reduces), the pipeline bubble,
    and the pipeline's own communication (sends and the schedule's cost)."""
    level, rows = shape.level, shape.rows
    recompute = cfg.training.activation_checkpointing

    def plain_s(r: float) -> float:
        # Tensor and context parallelism split the per-row work; each op's fixed cost stays.
        seconds = _fit(level["block"], r / (shape.tp * shape.cp))
        if recompute:
            seconds += _fit(level["block_forward"], r / (shape.tp * shape.cp))
        return seconds

    def block_s(r: float) -> float:
        if shape.wrapped is None:
            return plain_s(r)
        seconds = _fit(shape.wrapped, r)  # as the layout runs it, its collectives included
        if recompute:
            seconds += _fit(level["block_forward"], r / (shape.tp * shape.cp))
        return seconds

    optimizer = _optimizer_s(level, shape)
    tp_comm = 0.0
    if shape.tp > 1:
        # Two all-reduces per block forward and two backward; the recomputed forward's two
        # more. A wrapped block's profiled time holds the first four. Sequence parallelism
        # turns each into a reduce-scatter + all-gather (the same bytes) and gathers the
        # sequence again in backward for q, k, v and the MLP's first linear (4 all-gathers:
        # the bytes of 2 all-reduces).
        per_block = (0 if shape.wrapped is not None else 4) + (2 if recompute else 0)
        per_block += 2 if shape.sequence_parallel else 0
        tp_comm = (
            shape.stage_layers * per_block * _link(level.get("all_reduce"), shape.activation_bytes)
        )
    if not shape.pipelined:
        blocks = shape.model.n_layers * block_s(rows)
        compute = blocks + _fit(level["ends"], rows / shape.cp) + optimizer + tp_comm
        return {"compute": compute, "bubble": 0.0, "comm": 0.0}
    pp, micro = shape.pp, shape.micro
    once = _fsdp_once_a_step(level, shape, cfg)  # per block: paid once a step, not per micro
    stage = shape.stage_layers * (block_s(rows) - once) + tp_comm
    last, first = stage + _fit(level["ends"], rows), stage
    optimizer += shape.stage_layers * once
    send = 2 * _link(profile.get("p2p"), shape.activation_bytes)
    # The schedule's own cost (sends, receives, its Python), measured on two stages.
    schedule = level.get("schedules", {}).get(cfg.parallelism.schedule)
    overhead = 0.0 if schedule is None else (pp - 1) * _fit(schedule, micro)
    return {
        "compute": micro * last + optimizer,
        "bubble": (pp - 1) * first,
        "comm": overhead + micro * send,
    }


def _fsdp_once_a_step(level: dict, shape: _Shape, cfg: RaylaneConfig) -> float:
    """The part of an FSDP block's fixed cost a pipeline stage pays once a step rather than per
    micro-batch. A wrapped block's profiled forward + backward holds 3 collectives (two
    all-gathers, a reduce-scatter) and FSDP's hooks, beyond the plain block's fixed cost; inside
    torch's pipeline stage, backward keeps the parameters gathered and reduce-scatters once, at
    the last micro-batch, so a step of m micro-batches runs about m + 2 of the 3m collectives
    (each forward's or backward's gather, plus the first backward's and the reduce-scatter):
    a third per micro-batch, two thirds once. Predicted per micro-batch, pipeline x FSDP came
    out 70-83 % slow in two of three runs (benchmarks/README.md, prediction_error). A stage
    of FSDP x tp blocks keeps the per-micro-batch figure: its fit mixes in tensor parallelism's
    all-reduces, which every micro-batch pays."""
    dims = cfg.parallelism.dims
    if shape.wrapped is None or not dims.fsdp_enabled or dims.tp_enabled:
        return 0.0
    return 2 / 3 * max(shape.wrapped["fixed_s"] - level["block"]["fixed_s"], 0.0)


def _optimizer_s(level: dict, shape: _Shape) -> float:
    """The optimizer step over the parameters this worker holds: its blocks' as the profile
    timed them wrapped (DTensors, where it did), the rest per parameter."""
    per_param = level["optimizer_s_per_param"]
    wrapped = (shape.wrapped or {}).get("optimizer_s")
    if wrapped is None:
        return per_param * shape.params_held
    blocks_held = shape.stage_layers * shape.block_params_held
    return shape.stage_layers * wrapped + per_param * max(shape.params_held - blocks_held, 0.0)


def _sync_comm(profile: dict, cfg: RaylaneConfig, shape: _Shape) -> float:
    """The exposed time of synchronising replicas, as the strategy does it."""
    par, level, dp = cfg.parallelism, shape.level, shape.dp
    layers = shape.model.n_layers
    block_params, ends_params = profile["block_params"], profile["ends_params"]
    grad_bytes = _FP32 * ((layers / shape.pp) * block_params / shape.tp + ends_params)
    # A sequence's cp workers average their gradients with the replicas'.
    ring = level.get("all_reduce") if dp * shape.cp > 1 else None
    # What a synchronous step waits beyond the collective itself (hooks, skew between workers
    # on shared cores): measured under DDP on the whole model at this worker count.
    ddp_wait = _fit(level["ddp_wait"], shape.rows) if "ddp_wait" in level else 0.0
    model_bytes = _FP32 * (layers * block_params + ends_params)
    skew = max(ddp_wait - _link(level.get("all_reduce"), model_bytes), 0.0)
    dims = par.dims
    if dims.sync.kind == "parameter_server":
        if "ps_push_s" in level:  # the shard's own round trip, every worker pushing at once
            return level["ps_push_s"]
        # Push the gradient, pull the weights: two point-to-point transfers of the model.
        return 2 * _link(profile.get("p2p"), grad_bytes)
    if dims.sync.kind == "periodic_average":
        return (_link(ring, grad_bytes) + skew) / dims.sync.period
    if dims.fsdp_enabled:  # reduce-scatter (fp32), the all-gathers forward and backward
        if shape.wrapped is not None:  # the blocks' are in their profiled time: the ends'
            grad_bytes = _FP32 * ends_params
        gathered = grad_bytes / 2 if cfg.training.precision == "bf16" else grad_bytes
        return 0.5 * _link(ring, grad_bytes) + _link(ring, gathered) + skew
    if dims.tp_enabled or dims.pp_enabled or dims.cp_enabled:  # all-reduced, charged exposed
        sent = _link(ring, grad_bytes * _compression_ratio(cfg))
        return sent + (skew if par.workers > 1 else 0.0)
    # DDP: what backward waits for after its last bucket, less what compression saves.
    saved = (1 - _compression_ratio(cfg)) * _link_bytes(ring, grad_bytes)
    return max(ddp_wait - saved, 0.0) if dp > 1 else 0.0


def _ring_s(profile: dict, cfg: RaylaneConfig, shape: _Shape) -> float:
    """Ring attention's exposed transfers (`raylane.plan.ring`): per layer, cp - 1 K/V blocks
    of this worker's tokens per pass, each a point-to-point transfer over one ring step's
    attention compute (the core's share of the block's forward, 1/cp of it per step)."""
    if shape.cp == 1 or shape.wrapped is not None:  # a wrapped block's time holds its ring
        return 0.0
    model = shape.model
    # The ring sends keys and values repeated to every query head (as `raylane.plan.cost`).
    block_bytes = kv_block_bytes(shape.rows, shape.tokens, model.q_width / shape.tp)
    transfer = _link(profile.get("p2p"), block_bytes)
    block = _fit(shape.level["block"], shape.rows / (shape.tp * shape.cp))  # forward + backward
    step_compute = attention_core_share(model.context_length, model.q_width) * block / 3 / shape.cp
    passes = ring_passes(cfg.training.activation_checkpointing)
    return model.n_layers * exposed_ring_s(shape.cp, passes, transfer, step_compute)


def _peak_memory_mb(profile: dict, cfg: RaylaneConfig, shape: _Shape) -> float:
    """Baseline and model state as the strategy holds it (activations: `_activation_bytes`).
    A GPU run's memory is its device's (what a GPU trial reports, `worker_device_peak_mb`):
    the baseline is what the device held before any model, not the process's RSS (the CUDA
    context and libraries live in host memory)."""
    state_per_param = _STATE_BYTES_PER_PARAM[cfg.training.optimizer]
    if cfg.training.precision == "bf16":
        state_per_param += _BF16_WEIGHT_COPY_BYTES
    if cfg.parallelism.dims.replicates_split_model:  # FSDP2 `replicate`'s unsharded copy
        state_per_param += _FP32
    return _baseline_mb(profile, cfg) + state_per_param * shape.params_held / 2**20


def _baseline_mb(profile: dict, cfg: RaylaneConfig) -> float:
    """A worker's memory before any model: on a GPU run the device's, as its profile measured
    it (0 for a profile measured on CPUs: nothing of a GPU run's was), else the RSS."""
    if cfg.parallelism.use_gpu:
        return profile.get("baseline_device_mb", 0.0)
    return profile["baseline_rss_mb"]


def _activation_bytes(profile: dict, cfg: RaylaneConfig, shape: _Shape) -> float:
    """Activations of the micro-batches a stage holds at once (1 when not pipelined), for
    this worker's T/cp tokens of each row."""
    par, bf16 = cfg.parallelism, cfg.training.precision == "bf16"
    in_flight = shape.micro if par.schedule == "gpipe" else min(shape.pp, shape.micro)
    ends_activations = profile["ends_activation_bytes_per_row"] * shape.rows / shape.cp
    if shape.sequence_parallel and not shape.pipelined:  # final norm, head and loss split
        ends_activations /= shape.tp
    if cfg.training.activation_checkpointing:  # each block keeps only its input
        return shape.activation_bytes * shape.stage_layers * in_flight + ends_activations
    per_layer = profile["block_activation_bytes_per_row"] / shape.cp
    if bf16:
        per_layer *= _BF16_BLOCK_ACTIVATIONS
    if shape.sequence_parallel:  # on 1/tp of the tokens: the two LayerNorms' fp32 inputs
        # and the inputs q, k, v and the MLP's first linear keep (bf16 under autocast)
        linear_input = 2 if bf16 else _FP32
        per_token = shape.model.d_model * (2 * _FP32 + 4 * linear_input)
        per_layer -= shape.tokens * per_token * (1 - 1 / shape.tp)
    return (per_layer * shape.stage_layers * shape.rows + ends_activations) * in_flight
