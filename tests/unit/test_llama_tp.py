"""The Llama split by its tensor-parallel plan (`raylane.models.llama_plan`, applied by
`apply_tensor_parallel`) against the same weights unsplit: logits, and the parameters after one
backward and SGD step, over a 2-process gloo mesh. Plain tensor parallelism, sequence
parallelism in the blocks, and sequence parallelism with the head split over the vocabulary
(the loss under `sharded_loss`); grouped-query attention, each worker 2 query heads and 1
key/value head."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from raylane.models.llama import LlamaConfig, LlamaForCausalLM
from raylane.models.losses import cross_entropy

CONFIG = LlamaConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                     ffn_dim=128, max_positions=16)  # fmt: skip
# Qwen3: per-head q/k norms (kept whole on every worker) and heads wider than d_model / n_heads.
QWEN3 = replace(CONFIG, head_dim=32, qk_norm=True, model_type="qwen3")
MODELS = {"": CONFIG, "qwen3 ": QWEN3}  # layout-name prefix: config
BATCH, SEQ, LR = 2, 16, 0.5
# Measured on CPU (fp32), every layout: logits differ by at most 1.8e-7, parameters after the
# step by at most 1.2e-7 (the matmuls' and all-reduces' summation orders), where the step moves
# them by up to 8e-2; about 10x the measured errors is asserted.
LOGITS_ATOL = PARAMS_ATOL = 2e-6
LAYOUTS = {  # name: (sequence_parallel, vocabulary_loss)
    "tp": (False, False),
    "tp+sp": (True, False),
    "tp+sp, vocabulary-split head": (True, True),
}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _step(model: torch.nn.Module, vocabulary_loss: bool = False):
    """Logits of the batch (whole), then one backward and SGD step; the parameters after it,
    whole (a tensor-parallel shard gathered)."""
    from torch.distributed.tensor import DTensor

    from raylane.parallel.parallelize import sharded_loss

    inputs, targets = _batch()
    logits = model(inputs)
    if vocabulary_loss:
        with sharded_loss():
            cross_entropy(logits, targets).backward()
    else:
        cross_entropy(logits, targets).backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    whole = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        for name, p in model.named_parameters()
    }
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return logits.detach(), whole


def _errors(plain, split) -> dict[str, float]:
    (logits, params), (split_logits, split_params) = plain, split
    assert split_params.keys() == params.keys()
    return {
        "logits": (split_logits - logits).abs().max().item(),
        "params": max((split_params[k] - params[k]).abs().max().item() for k in params),
    }


def _work(rank: int, world: int) -> dict:
    """The plain model's step, then each layout's on a copy of it."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from raylane.parallel.parallelize import apply_tensor_parallel

    mesh = DeviceMesh("cpu", list(range(world)))
    errors = {}
    for prefix, config in MODELS.items():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        if config.qk_norm:  # the norms start at one: make them count
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() == 1 and p.numel() == config.head_dim:
                        p.normal_(1.0, 0.5)
        initial = copy.deepcopy(model)
        plain = _step(model)
        moved = max((plain[1][k] - p).abs().max().item() for k, p in initial.named_parameters())
        for name, (sequence_parallel, vocabulary_loss) in LAYOUTS.items():
            split = copy.deepcopy(initial)
            apply_tensor_parallel(split, mesh, sequence_parallel, vocabulary_loss)
            local = split.blocks["0"].self_attn
            shapes = (local.q_proj.weight.to_local().shape, local.k_proj.weight.to_local().shape)
            head = split.head.weight
            head_rows = (head.to_local() if isinstance(head, DTensor) else head).shape[0]
            measured = _errors(plain, _step(split, vocabulary_loss))
            errors[prefix + name] = measured | {
                "shapes": shapes,
                "head_rows": head_rows,
                "moved": moved,
            }
    return errors


TWO_PROCESS_CHECKS = {"layouts": _work}


@pytest.fixture(scope="module")
def split_errors(two_processes) -> list[dict]:
    """Every process's errors per layout, in rank order."""
    return two_processes(__name__, "layouts")


@pytest.mark.parametrize("prefix", list(MODELS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tensor_parallel_llama_equals_the_plain_model(layout, prefix, split_errors):
    head_dim = MODELS[prefix].head_dim
    for rank, errors in enumerate(split_errors):
        measured = errors[prefix + layout]
        print(f"{prefix}{layout}, rank {rank}: max abs errors {measured}")
        # Each worker: 2 of the 4 query heads and 1 of the 2 key/value heads (16 wide; Qwen3's
        # 32).
        assert measured["shapes"] == (torch.Size([2 * head_dim, 64]), torch.Size([head_dim, 64]))
        # The head is split over the vocabulary only for a loss under `sharded_loss`.
        assert measured["head_rows"] == (48 if LAYOUTS[layout][1] else 96)
        assert measured["logits"] <= LOGITS_ATOL, measured
        assert measured["params"] <= PARAMS_ATOL < measured["moved"] / 1000, measured
