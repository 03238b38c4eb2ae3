"""Step time and peak worker memory of a runnable config, predicted from a profile of the
cluster it will run on (`raylane.plan.profile`).

The catalog model (`raylane.plan.cost`) reasons in FLOPs and data-sheet bandwidths; this one
composes measured seconds, which is what small models on shared cores need: per-op overhead,
threads and workers sharing cores are all in the profile. Every strategy raylane runs is a
sum of the same measured parts:

* compute: blocks (forward+backward, plus a recomputed forward with activation
  checkpointing) at the rows each worker computes, the ends (embeddings, head, loss), and the
  optimizer step over the parameters the worker holds;
* the pipeline schedule: m micro-batches through the slowest stage plus one pass of the
  others (the fill and drain bubble), and the activation sends between stages;
* exposed communication: the data-parallel gradient all-reduce (scaled by the compression's
  byte ratio; every `period` steps for local SGD; one reduce-scatter and two all-gathers for
  FSDP), tensor parallelism's all-reduces of each block's activations, and a parameter
  server's gradient push and weight pull for async / ssp.

Memory is the worker's resident baseline plus model state (parameters, gradients, optimizer
state, sharded as the strategy shards them) plus the activations autograd saves (per row, as
profiled) for the micro-batches a stage holds at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from raylane.config import RaylaneConfig
from raylane.config.dims import ParallelDims

_FP32 = 4  # bytes of an activation or gradient element
_STATE_BYTES_PER_PARAM = {"adamw": 4 + 4 + 8, "sgd": 4 + 4}


class ProfileMismatch(ValueError):
    """The profile cannot predict this config (it was measured for other worker counts)."""


@dataclass(frozen=True)
class LocalPrediction:
    step_s: float
    parts: dict[str, float]
    memory_mb: float
    samples_per_s: float

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
        )


def _fit(fit: dict, x: float) -> float:
    """A profiled compute fit (`raylane.plan.profile.ComputeFit`) at `x` rows."""
    return fit["fixed_s"] + fit["per_row_s"] * x


def _link(fit: dict | None, nbytes: float) -> float:
    """A profiled link fit (`raylane.plan.profile.LinkFit`) for `nbytes`; no link costs 0."""
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
        width = cfg.model.d_model
        return min(1.0, 2 / width)  # rank 1: P (n x 1) and Q (m x 1) instead of n x m
    return 1.0


def predict_config(profile: dict, cfg: RaylaneConfig) -> LocalPrediction:
    """Predicted step time, samples/s and peak worker memory of `cfg` on the profiled cluster."""
    model, par, training = cfg.model, cfg.parallelism, cfg.training
    if model.kind != "gpt":
        raise ProfileMismatch(f"the cost model predicts GPT layouts, not model.kind '{model.kind}'")
    level = _level(profile, par.workers)
    layers, seq, width = model.n_layers, model.input_dim, model.d_model
    recompute = training.activation_checkpointing
    strategy = par.strategy
    dims = ParallelDims.from_parallelism(par)
    pp, tp, dp = dims.pp, dims.tp, dims.dp
    micro = par.microbatches if dims.pp_enabled else 1
    rows = training.batch_size / micro  # per micro-batch, per replica

    def block_s(r: float) -> float:
        # Tensor parallelism splits the per-row work; each op's fixed cost stays.
        seconds = _fit(level["block"], r / tp)
        if recompute:
            seconds += _fit(level["block_forward"], r / tp)
        return seconds

    block_params, ends_params = profile["block_params"], profile["ends_params"]
    params_held = (layers / pp) * block_params / tp + ends_params / pp
    if strategy == "fsdp":
        params_held = (layers * block_params / tp + ends_params) / dp
    optimizer = level["optimizer_s_per_param"] * params_held

    activation_bytes = rows * seq * width * _FP32
    stage_layers = layers / pp
    tp_comm = 0.0
    if tp > 1:
        per_block = 6 if recompute else 4
        tp_comm = stage_layers * per_block * _link(level.get("all_reduce"), activation_bytes)

    if dims.pp_enabled:
        last = stage_layers * block_s(rows) + _fit(level["ends"], rows) + tp_comm
        first = stage_layers * block_s(rows) + tp_comm
        send = 2 * _link(profile.get("p2p"), activation_bytes)
        # The schedule's own cost (sends, receives, its Python), measured on two stages.
        schedule = level.get("schedules", {}).get(par.schedule)
        overhead = 0.0 if schedule is None else (pp - 1) * _fit(schedule, micro)
        compute = micro * last + optimizer
        bubble = (pp - 1) * first
        comm = overhead + micro * send
    else:
        compute = layers * block_s(rows) + _fit(level["ends"], rows) + optimizer + tp_comm
        bubble = 0.0
        comm = 0.0

    grad_bytes = _FP32 * ((layers / pp) * block_params / tp + ends_params)
    ring = level.get("all_reduce") if dp > 1 else None
    # What a synchronous step waits beyond the collective itself (hooks, skew between workers
    # on shared cores): measured under DDP on the whole model at this worker count.
    ddp_wait = _fit(level["ddp_wait"], rows) if "ddp_wait" in level else 0.0
    model_bytes = _FP32 * (layers * block_params + ends_params)
    skew = max(ddp_wait - _link(level.get("all_reduce"), model_bytes), 0.0)
    if strategy == "ddp":
        saved = (1 - _compression_ratio(cfg)) * _link_bytes(ring, grad_bytes)
        comm += max(ddp_wait - saved, 0.0) if dp > 1 else 0.0
    elif strategy == "fsdp":
        comm += 1.5 * _link(ring, grad_bytes) + (skew if dp > 1 else 0.0)
    elif strategy in ("async", "ssp"):
        # Push the gradient, pull the weights: two point-to-point transfers of the model.
        comm += 2 * _link(profile.get("p2p"), grad_bytes)
    elif strategy == "local_sgd":
        comm += (_link(ring, grad_bytes) + skew) / par.local_sgd_period
    else:  # tp, pipeline, hybrid: gradients averaged after backward
        comm += _link(ring, grad_bytes) + (skew if par.workers > 1 else 0.0)

    parts = {"compute": compute, "bubble": bubble, "comm": comm}
    step = sum(parts.values())

    state_per_param = _STATE_BYTES_PER_PARAM[training.optimizer]
    # Micro-batches a stage holds at once (1 when not pipelined: micro and pp are 1).
    in_flight = micro if par.schedule == "gpipe" else min(pp, micro)
    ends_activations = profile["ends_activation_bytes_per_row"] * rows
    if recompute:  # each block keeps only its input
        activations = activation_bytes * stage_layers * in_flight + ends_activations
    else:
        per_row = profile["block_activation_bytes_per_row"] * stage_layers
        activations = (per_row * rows + ends_activations) * in_flight
    memory_mb = profile["baseline_rss_mb"] + (state_per_param * params_held + activations) / 2**20
    return LocalPrediction(
        step_s=step,
        parts=parts,
        memory_mb=memory_mb,
        samples_per_s=training.batch_size * dp / step if step > 0 else 0.0,
    )
