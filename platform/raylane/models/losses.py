"""The loss raylane trains and evaluates with, on plain tensors (no parallelism inside): the
strategies' steps take it, and the profile times the model's ends with it.

A target of -100 (PyTorch's `ignore_index`) is skipped by both: the tokens of a prompt or of a
chat's user turns, which the model reads but does not learn (`raylane.data.packing`).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from raylane.models.frozen import FrozenLinear, compute_dtype

#: The target the loss and the validation sums skip (PyTorch's default `ignore_index`).
IGNORE_INDEX = -100


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss every strategy's step takes: cross-entropy over the outputs' last dimension,
    which covers classification (`[B, C]` vs `[B]`) and language modelling (`[B, T, V]` vs
    `[B, T]`).

    `F.cross_entropy`'s default `ignore_index` (-100) is kept: the mean is over the targets
    that are not -100, which get no gradient, so a masked batch's loss is exactly the loss over
    its learnt tokens alone. A batch whose every target is -100 has no mean (NaN, with zero
    gradients); prepared data leaves such windows out.
    """
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


def token_sums(
    outputs: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(loss_sum, correct, counted)` over the targets that are not -100, as float64 tensors
    on the outputs' device (nothing read back): the summed cross-entropy, the argmax
    predictions that hit, and how many targets count. Validation adds them up over batches
    and workers, then divides: the mean loss and accuracy over the counted tokens."""
    flat_outputs = outputs.reshape(-1, outputs.shape[-1])
    flat_targets = targets.reshape(-1).to(outputs.device)
    counts = flat_targets != IGNORE_INDEX
    counted = counts.sum().double()
    # The batch's mean times its count, as the unmasked figures always were (a float32 sum
    # would round differently); a batch with nothing to count adds 0, not the mean's NaN.
    mean = F.cross_entropy(flat_outputs.float(), flat_targets).double()
    loss_sum = torch.where(counted > 0, mean * counted, torch.zeros_like(mean))
    correct = (flat_outputs.argmax(dim=-1) == flat_targets) & counts
    return loss_sum, correct.sum().double(), counted


#: `training.loss_chunk_mb`'s default: the fp32 logits one chunk of the fused head and loss
#: holds at most (a 151,936-token vocabulary: 110 tokens a chunk).
LOSS_CHUNK_MB = 64.0


def head_cross_entropy(
    hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor,
    chunk_bytes: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """`cross_entropy(head(hidden).float(), targets)` without ever holding the whole
    vocabulary's logits: the tokens go through the head in chunks of at most `chunk_bytes` of
    fp32 logits (default `LOSS_CHUNK_MB`), each chunk's loss summed and its logits freed at
    once, then recomputed in backward (activation checkpointing per chunk). The mean over the
    targets that are not -100, as `cross_entropy`'s; where every token fits in one chunk it is
    `cross_entropy` itself.

    `hidden` is `[..., d]` (the final norm's output), `targets` its `[...]` token ids.
    """
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).to(hidden.device)
    tokens, vocabulary = flat_targets.numel(), head.out_features
    chunk_bytes = LOSS_CHUNK_MB * 2**20 if chunk_bytes is None else chunk_bytes
    chunk = max(1, int(chunk_bytes // (4 * vocabulary)))
    if tokens <= chunk:
        return cross_entropy(head(flat_hidden).float(), flat_targets)
    from torch.utils.checkpoint import checkpoint

    if isinstance(head, FrozenLinear):  # a bf16 frozen head: cast once, not once per chunk
        head = _CastHead(head.weight.to(compute_dtype(hidden)), head.bias)
    # The chunks' sums added in float64: the mean then rounds once, as the whole logits' does.
    total = flat_hidden.new_zeros((), dtype=torch.float64)
    for start in range(0, tokens, chunk):
        part = slice(start, start + chunk)
        summed = checkpoint(
            _summed_loss, flat_hidden[part], flat_targets[part], head, use_reentrant=False
        )
        total = total + summed.double()
    return (total / (flat_targets != IGNORE_INDEX).sum()).float()


class _CastHead:
    """A frozen head's weight cast to the hidden states' dtype for the chunks of one loss."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(self.weight.dtype)
        return F.linear(hidden, self.weight, bias)


def _summed_loss(hidden: torch.Tensor, targets: torch.Tensor, head) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, reduction="sum")


@torch.no_grad()
def head_token_sums(
    hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor,
    chunk_bytes: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """`token_sums(head(hidden), targets)` without the whole vocabulary's logits: validation's
    sums over chunks of at most `chunk_bytes` of fp32 logits (as `head_cross_entropy`'s)."""
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).to(hidden.device)
    chunk_bytes = LOSS_CHUNK_MB * 2**20 if chunk_bytes is None else chunk_bytes
    chunk = max(1, int(chunk_bytes // (4 * head.out_features)))
    if flat_targets.numel() <= chunk:
        return token_sums(head(flat_hidden), flat_targets)
    if isinstance(head, FrozenLinear):
        head = _CastHead(head.weight.to(compute_dtype(hidden)), head.bias)
    sums = [flat_hidden.new_zeros((), dtype=torch.float64) for _ in range(3)]
    for start in range(0, flat_targets.numel(), chunk):
        part = slice(start, start + chunk)
        logits, wanted = head(flat_hidden[part]).float(), flat_targets[part]
        counts = wanted != IGNORE_INDEX
        sums[0] += F.cross_entropy(logits, wanted, reduction="sum").double()
        sums[1] += ((logits.argmax(dim=-1) == wanted) & counts).sum().double()
        sums[2] += counts.sum().double()
    return sums[0], sums[1], sums[2]
