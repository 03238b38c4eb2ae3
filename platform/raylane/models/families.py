"""The model families raylane knows, one `Family` each, looked up by `model.kind` or by a
checkpoint's config.json `model_type`: what the planner, the profile and Tune ask instead of
branching on a kind.

Torch-free, as the planner that reads it (`raylane.plan`): a family's module is imported only
where it is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from raylane.models.shape import HF_ATTENTION, DecoderShape

if TYPE_CHECKING:
    from raylane.config import ModelConfig


@dataclass(frozen=True)
class Family:
    """One model family: its `model.kind`, the config.json `model_type`s it loads, and how its
    shape is read from a `model:` section (None: no formula knows its cost, and `unplanned`
    says why in one line)."""

    kind: str
    summary: str
    shape: Callable[[ModelConfig], DecoderShape] | None = None
    model_types: tuple[str, ...] = ()
    unplanned: str = ""

    def shape_of(self, model: ModelConfig) -> DecoderShape:
        """The shape the planner reads.

        Raises:
            ValueError: one line: this family has no shape to plan from, or its checkpoint's
                config.json does not describe one.
        """
        if self.shape is None:
            raise ValueError(self.unplanned)
        return self.shape(model)


def _gpt_shape(model: ModelConfig) -> DecoderShape:
    return DecoderShape.gpt(
        model.num_classes, model.input_dim, model.d_model, model.n_layers, model.n_heads
    )


def _llama_shape(model: ModelConfig) -> DecoderShape:
    """The checkpoint's widths (`pretrained`: its config.json, no weights read) or the
    declared ones, at `input_dim` tokens per sequence."""
    if model.pretrained is not None:
        path = Path(model.pretrained) / "config.json"
        return DecoderShape.from_hf_config(model.pretrained_config(), model.input_dim, str(path))
    return DecoderShape.llama(
        model.num_classes, model.input_dim, model.d_model, model.n_layers,
        tied_embeddings=model.tie_embeddings, qkv_bias=model.qkv_bias,
        family="qwen2" if model.qkv_bias else "llama", **model.llama_widths(),
    )  # fmt: skip


_CLASSIFIER = (
    "model.kind '{kind}' is a classifier: `raylane plan` plans language models (gpt, llama), "
    "whose cost follows from their widths"
)

FAMILIES: dict[str, Family] = {
    family.kind: family
    for family in (
        Family("gpt", "raylane's byte-level GPT", _gpt_shape),
        Family(
            "llama",
            "Llama-family decoders: Llama 2/3, Mistral (no sliding window), Qwen2, Qwen3",
            _llama_shape,
            model_types=tuple(HF_ATTENTION),  # every checkpoint type the shape reads
        ),  # fmt: skip
        Family("mlp", "fully connected classifier", unplanned=_CLASSIFIER.format(kind="mlp")),
        Family("cnn", "convolutional classifier", unplanned=_CLASSIFIER.format(kind="cnn")),
        Family(
            "custom",
            "your own torch module, built by model.factory",
            unplanned="model.kind 'custom': no formula knows a custom module's FLOPs or "
            "activations; `raylane plan` predicts gpt and llama models (run `raylane train` "
            "and read its step-time split in MLflow instead)",
        ),
    )
}


def family(kind: str) -> Family:
    """The family of `model.kind` `kind`.

    Raises:
        ValueError: `kind` is not a registered family.
    """
    try:
        return FAMILIES[kind]
    except KeyError:
        raise ValueError(
            f"model.kind {kind!r} is not a model family ({', '.join(FAMILIES)})"
        ) from None


def family_for_model_type(model_type: str | None, source: str) -> Family:
    """The family that loads a checkpoint whose config.json (`source`) declares `model_type`.

    Raises:
        ValueError: one line naming `source`: no family loads that model_type.
    """
    for found in FAMILIES.values():
        if model_type in found.model_types:
            return found
    known = sorted(t for f in FAMILIES.values() for t in f.model_types)
    raise ValueError(
        f"{source}: model_type {model_type!r} is not a family raylane knows ({', '.join(known)})"
    )


def shape_of(model: ModelConfig) -> DecoderShape:
    """The planner's shape of a `model:` section (`Family.shape_of`)."""
    return family(model.kind).shape_of(model)
