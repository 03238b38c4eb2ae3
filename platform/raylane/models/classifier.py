"""Classifiers over fixed-width feature rows (the digits model and its compute-heavier twin),
and `build_model`: the configured architecture, whichever kind."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from raylane.config import ModelConfig
from raylane.models.custom import LossFn, build_custom
from raylane.models.gpt import GPT
from raylane.models.hf_checkpoint import load_pretrained, read_config
from raylane.models.llama import LlamaForCausalLM, llama_config
from raylane.models.losses import cross_entropy


class MLPClassifier(nn.Module):
    """Fully connected classifier; divides inputs by `input_scale` so clients send raw values."""

    def __init__(
        self, input_dim: int, hidden_sizes: list[int], num_classes: int, input_scale: float
    ):
        super().__init__()
        self.input_scale = input_scale
        layers: list[nn.Module] = []
        width = input_dim
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x / self.input_scale)


class ConvClassifier(nn.Module):
    """3x3 convolutions over a square image given as a flat row, then global pooling.

    Convolutions do far more compute per parameter than linear layers, so data-parallel
    scaling is limited by compute rather than by the gradient all-reduce.
    """

    def __init__(self, input_dim: int, channels: list[int], num_classes: int, input_scale: float):
        super().__init__()
        self.input_scale = input_scale
        self.side = math.isqrt(input_dim)
        layers: list[nn.Module] = []
        in_channels = 1
        for out_channels in channels:
            layers += [nn.Conv2d(in_channels, out_channels, 3, padding=1), nn.ReLU()]
            in_channels = out_channels
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(in_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        image = (x / self.input_scale).reshape(-1, 1, self.side, self.side)
        return self.head(self.features(image).mean(dim=(2, 3)))


def build_model(cfg: ModelConfig) -> nn.Module:
    """The configured architecture with freshly initialised weights (seed before calling), a
    llama with its Hugging Face checkpoint's weights (`pretrained`), or what a custom model's
    factory builds."""
    return build_model_and_loss(cfg)[0]


def build_model_and_loss(
    cfg: ModelConfig, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, LossFn]:
    """`build_model`'s model and the loss it trains with: a custom factory's own loss_fn when
    it returns one, else cross-entropy over the outputs' last dimension. `dtype`: a
    `pretrained` checkpoint's weights are read in it (every other model is built in fp32)."""
    if cfg.kind == "custom":
        model, loss_fn = build_custom(cfg)
        return model, loss_fn or cross_entropy
    return _built_in(cfg, dtype), cross_entropy


def build_with_blocks(cfg: ModelConfig, n_layers: int) -> nn.Module:
    """The configured language model with `n_layers` blocks and fresh weights (a `pretrained`
    checkpoint's widths, not its weights): what the profile times a family's blocks and ends
    on (`raylane.profile`)."""
    if cfg.pretrained is not None:
        return LlamaForCausalLM(replace(read_config(cfg.pretrained), n_layers=n_layers))
    return _built_in(cfg.model_copy(update={"n_layers": n_layers}))


def _built_in(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> nn.Module:
    if cfg.kind == "gpt":
        return GPT(cfg.num_classes, cfg.input_dim, cfg.d_model, cfg.n_heads, cfg.n_layers)
    if cfg.kind == "llama":
        if cfg.pretrained is not None:
            return load_pretrained(cfg.pretrained, dtype)
        return LlamaForCausalLM(llama_config(cfg))
    if cfg.kind == "cnn":
        return ConvClassifier(cfg.input_dim, cfg.hidden_sizes, cfg.num_classes, cfg.input_scale)
    return MLPClassifier(cfg.input_dim, cfg.hidden_sizes, cfg.num_classes, cfg.input_scale)
