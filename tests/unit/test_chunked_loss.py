"""The head and loss in chunks (`raylane.models.losses.head_cross_entropy`): the loss and every
gradient equal the whole logits' (fp32), no chunk holds the whole vocabulary's logits, and the
models and the strategies' step take it."""

from __future__ import annotations

import copy

import pytest
import torch

from raylane.config import load_config
from raylane.models import build_model
from raylane.models.llama import LlamaConfig, LlamaForCausalLM
from raylane.models.losses import (
    IGNORE_INDEX,
    cross_entropy,
    head_cross_entropy,
    head_token_sums,
    token_sums,
)
from raylane.parallel.registry import get_strategy
from tests.readme_blocks import ROOT

ROWS, SEQ, WIDTH, VOCAB = 3, 40, 32, 1000


def _inputs(masked: bool):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(ROWS, SEQ, WIDTH, generator=generator, requires_grad=True)
    targets = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
    if masked:  # a prompt's tokens are not learnt
        targets[:, : SEQ // 2] = IGNORE_INDEX
    torch.manual_seed(0)
    return hidden, torch.nn.Linear(WIDTH, VOCAB), targets


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 64, 119])
def test_chunked_loss_and_gradients_equal_the_whole_logits(chunk_tokens, masked):
    """fp32: the loss and the gradients of the hidden states, the weight and the bias within
    1e-6 of `cross_entropy` over the whole logits (only the summation order differs)."""
    hidden, head, targets = _inputs(masked)
    expected = cross_entropy(head(hidden).float(), targets)
    expected.backward()
    grads = [t.grad.clone() for t in (hidden, head.weight, head.bias)]
    for t in (hidden, head.weight, head.bias):
        t.grad = None
    loss = head_cross_entropy(hidden, head, targets, chunk_bytes=chunk_tokens * 4 * VOCAB)
    loss.backward()
    assert (loss - expected).abs().item() <= 1e-6
    for got, want in zip((hidden.grad, head.weight.grad, head.bias.grad), grads, strict=True):
        assert (got - want).abs().max().item() <= 1e-6


def test_no_chunk_holds_the_whole_logits():
    """What autograd saves and what the forward allocates at once: one chunk's logits (7
    tokens), never the 120 tokens' whole."""
    hidden, head, targets = _inputs(masked=False)
    largest = 0

    def keep(tensor):
        nonlocal largest
        largest = max(largest, tensor.numel() if tensor.shape[-1:] == (VOCAB,) else 0)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        head_cross_entropy(hidden, head, targets, chunk_bytes=7 * 4 * VOCAB).backward()
    assert largest == 0  # the chunks save their inputs only: the logits are recomputed
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        cross_entropy(head(hidden).float(), targets).backward()
    assert largest == ROWS * SEQ * VOCAB  # the whole logits, as every step held them


def test_one_chunk_is_the_plain_loss_exactly():
    hidden, head, targets = _inputs(masked=True)
    expected = cross_entropy(head(hidden).float(), targets)
    assert torch.equal(head_cross_entropy(hidden, head, targets), expected)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_models_forward_with_targets_is_its_loss(family):
    """`model(x, targets=t)` of either family: its logits' loss, in chunks or in one."""
    torch.manual_seed(0)
    if family == "gpt":
        model = build_model(load_config(ROOT / "configs" / "train" / "lm_pipeline.yaml").model)
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, d_model=32, n_layers=2,
                                             n_heads=4, n_kv_heads=2, ffn_dim=64,
                                             max_positions=SEQ))  # fmt: skip
    vocab = model.head.out_features
    tokens = torch.randint(0, vocab, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    x, t = tokens[:, :-1], tokens[:, 1:]
    expected = cross_entropy(model(x).float(), t)
    assert torch.equal(model(x, targets=t), expected)
    chunked = model(x, targets=t, chunk_bytes=5 * 4 * vocab)
    assert (chunked - expected).abs().item() <= 1e-6


def test_the_strategys_step_fuses_the_loss_where_the_layout_allows():
    """One worker's step with the loss in 8-token chunks equals the step with the whole
    logits (`training.loss_chunk_mb: 0`): the loss and every parameter after SGD, fp32 1e-6."""
    base = ["training.optimizer=sgd", "training.lr=0.5", "training.weight_decay=0",
            "parallelism.strategy=ddp", "parallelism.workers=1", "parallelism.dp=1",
            "parallelism.pp=1"]  # fmt: skip
    path = ROOT / "configs" / "train" / "lm_pipeline.yaml"
    chunk_mb = 8 * 4 * 256 / 2**20
    results = []
    torch.manual_seed(0)
    plain = build_model(load_config(path, base).model)
    tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(2))
    for mb in (0, chunk_mb):
        cfg = load_config(path, [*base, f"training.loss_chunk_mb={mb}"])
        strategy = get_strategy(cfg, 0)
        model = strategy.wrap_model(copy.deepcopy(plain))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        assert strategy._fuses_loss(model, cross_entropy) == bool(mb)
        loss = strategy.train_step(model, optimizer, cross_entropy, tokens[:, :-1], tokens[:, 1:])
        results.append((float(loss), {n: p.detach() for n, p in model.named_parameters()}))
    (whole, whole_params), (chunked, chunked_params) = results
    assert abs(chunked - whole) <= 1e-6
    assert max((chunked_params[n] - p).abs().max().item() for n, p in whole_params.items()) <= 1e-6


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 119, 1000])
def test_validation_sums_in_chunks_equal_the_whole_logits(chunk_tokens, masked):
    """`head_token_sums`: the summed loss within 1e-6 (relative) of `token_sums` over the whole
    logits, the correct and counted targets exactly."""
    hidden, head, targets = _inputs(masked)
    with torch.no_grad():
        whole = token_sums(head(hidden), targets)
    chunked = head_token_sums(hidden, head, targets, chunk_bytes=chunk_tokens * 4 * VOCAB)
    assert chunked[0].item() == pytest.approx(whole[0].item(), rel=1e-6)
    assert (chunked[1].item(), chunked[2].item()) == (whole[1].item(), whole[2].item())
    assert chunked[2].item() == (ROWS * SEQ // 2 if masked else ROWS * SEQ)


def test_the_strategys_validation_takes_the_sums_in_chunks_where_it_fuses_the_loss():
    """A DDP worker's validation of a batch, its logits in 8-token chunks, gives the whole
    logits' figures (`training.loss_chunk_mb: 0`)."""
    base = ["parallelism.strategy=ddp", "parallelism.workers=1", "parallelism.dp=1",
            "parallelism.pp=1"]  # fmt: skip
    path = ROOT / "configs" / "train" / "lm_pipeline.yaml"
    torch.manual_seed(0)
    plain = build_model(load_config(path, base).model).eval()
    tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(2))
    figures = []
    for mb in (0, 8 * 4 * 256 / 2**20):
        strategy = get_strategy(load_config(path, [*base, f"training.loss_chunk_mb={mb}"]), 0)
        model = strategy.wrap_model(copy.deepcopy(plain))
        with torch.no_grad():
            figures.append(strategy.validation_sums(model, tokens[:, :-1], tokens[:, 1:]))
    (loss, correct, counted), (chunked_loss, chunked_correct, chunked_counted) = figures
    assert chunked_loss.item() == pytest.approx(loss.item(), rel=1e-6)
    assert (chunked_correct.item(), chunked_counted.item()) == (correct.item(), counted.item())
    assert counted.item() == 4 * 64
