"""What one worker of a decoder's data-parallel run (a fine-tune above all) holds at its peak,
predicted from the family's shape before anything runs: printed at the start of `raylane train`
and `raylane finetune` and logged beside the measured peak (`peak_rss_mb`) in the run.

The step's peak is the weights (a LoRA run's frozen base in the dtype it is held in, the rest
fp32), the trainable parameters' gradients and AdamW's two moments, the activations autograd
holds (every block's, or with recomputation every block's input and one block's), the loss's
share (one chunk of fp32 logits with its log-softmax and gradient, or the whole logits; a bf16
head's fp32 copy for the loss), and the runtime of a worker process. Validation holds the
weights, the runtime and one chunk of fp32 logits with their log-softmax (a whole batch's
where the loss is not chunked); the peak is the larger of the two. Torch-free: the preflight
reads it before Ray starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from raylane.models.families import family

if TYPE_CHECKING:
    from raylane.config import RaylaneConfig
    from raylane.models.shape import DecoderShape

MB = 2**20
#: A Ray Train worker of raylane at its peak with a 0.1 MB model (torch, DDP over gloo, the
#: loop's imports): the digits DDP run's `peak_rss_mb`, 484-486 MB (2026-12-08, this CPU).
WORKER_RUNTIME_MB = 485.0
#: What transformers, peft and safetensors add to a process once imported (a fine-tune of a
#: checkpoint): 390 MB against torch's 220 (2026-12-08).
HF_RUNTIME_MB = 170.0
#: fp32 gradient and AdamW's two fp32 moments, per trainable parameter.
TRAINABLE_STATE_BYTES = 4 + 8


@dataclass(frozen=True)
class WorkerPeak:
    """Predicted bytes, by what holds them."""

    weights: float
    trainable_state: float
    activations: float
    loss: float
    validation: float
    runtime: float

    @property
    def step(self) -> float:
        return self.weights + self.trainable_state + self.activations + self.loss + self.runtime

    @property
    def total(self) -> float:
        """The larger of a training step's peak and validation's."""
        return max(self.step, self.weights + self.validation + self.runtime)

    def describe(self) -> str:
        """`2.73 GB (weights 0.93, ...)`: the peak and what holds it, in GB."""
        parts = {
            "weights": self.weights,
            "gradients and optimizer": self.trainable_state,
            "activations": self.activations,
            "loss": self.loss,
            "runtime": self.runtime,
        }
        if self.total > self.step:  # validation's whole logits hold more than a step
            parts = {"weights": self.weights, "validation logits": self.validation,
                     "runtime": self.runtime}  # fmt: skip
        listed = ", ".join(f"{name} {value / 2**30:.2f}" for name, value in parts.items())
        return f"{self.total / 2**30:.2f} GB ({listed} GB)"


def predict_worker_peak(
    shape: DecoderShape,
    *,
    rows: int,
    trainable: int,
    frozen_bytes: float,
    recompute: bool,
    chunk_bytes: float,
    validation_rows: int,
    runtime: float,
) -> WorkerPeak:
    """One data-parallel worker's peak (no model splitting) for `rows` sequences a step:
    `trainable` parameters in fp32 with AdamW, the rest frozen at `frozen_bytes` a parameter
    (2: a bf16 base; a full fine-tune has none frozen); `chunk_bytes` 0 computes the whole
    logits."""
    total = shape.total()
    tokens, d, vocab = rows * shape.context_length, shape.d_model, shape.vocab_size
    split, whole = shape.activation_bytes_per_token()
    block = tokens * 2 * (split + whole)  # the shape's 16-bit bytes, held in fp32
    # Recomputed: every block's fp32 input, and one block's activations at a time.
    activations = shape.n_layers * (tokens * d * 4 if recompute else block) + recompute * block
    logits = tokens * vocab * 4
    head_copy = d * vocab * 4 if frozen_bytes < 4 else 0  # a bf16 head cast once per loss
    # The step: a chunk's logits, log-softmax and gradient, or the whole logits' four copies
    # (the logits, their log-softmax, both gradients); validation's sums: two of either.
    loss = _logits_held(logits, chunk_bytes, 3, 4, head_copy)
    validation_logits = validation_rows * shape.context_length * vocab * 4
    validation = _logits_held(validation_logits, chunk_bytes, 2, 2, head_copy)
    return WorkerPeak(
        weights=(total - trainable) * frozen_bytes + trainable * 4,
        trainable_state=trainable * TRAINABLE_STATE_BYTES,
        activations=activations,
        loss=loss,
        validation=validation,
        runtime=runtime,
    )


def _logits_held(
    logits: float, chunk_bytes: float, chunk_copies: int, whole_copies: int, head_copy: float
) -> float:
    """Bytes of fp32 logits held at once: `chunk_copies` chunks (and the bf16 head's fp32 copy)
    where the logits exceed a chunk, else `whole_copies` of the whole."""
    if chunk_bytes and logits > chunk_bytes:
        return chunk_copies * chunk_bytes + head_copy
    return whole_copies * logits


def predicted_peak(cfg: RaylaneConfig, validation_rows: int) -> WorkerPeak | None:
    """The prediction for a run of `cfg` whose validation split holds `validation_rows` rows
    (None where it does not apply: a family without a shape, or a layout that splits or
    shards the model, which the cost model predicts)."""
    found = family(cfg.model.kind)
    dims = cfg.parallelism.dims
    split = dims.pp_enabled or dims.tp_enabled or dims.cp_enabled or dims.dp_shard > 1
    if found.shape is None or split:
        return None
    shape = found.shape_of(cfg.model)
    finetune, frozen = cfg.finetune, cfg.frozen_base_dtype()
    lora = finetune is not None and finetune.method == "lora"
    trainable = shape.lora_params(finetune.target_modules, finetune.rank) if lora else shape.total()
    chunk = cfg.training.loss_chunk_mb * MB if cfg.training.loss_chunk_mb else 0.0
    return predict_worker_peak(
        shape,
        rows=cfg.training.batch_size,
        trainable=trainable,
        frozen_bytes=2.0 if frozen == "bf16" else 4.0,
        recompute=cfg.training.activation_checkpointing,
        chunk_bytes=chunk,
        validation_rows=min(cfg.training.batch_size, -(-validation_rows // dims.dp_replicate)),
        runtime=(WORKER_RUNTIME_MB + (HF_RUNTIME_MB if cfg.model.pretrained else 0.0)) * MB,
    )
