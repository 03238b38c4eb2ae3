"""What the rest of raylane asks of a model family, by `model.kind`: the fields its `model:`
section reads and what it can do (read tokens or a table, be split by a tensor-parallel plan,
load a Hugging Face checkpoint, ...). The config's checks, the trainer, the data layer,
tracking and serving ask these traits instead of naming kinds.

Torch-free and at the bottom of the package's layers, so the config reads it; the families'
torch side (module, plans, shape, checkpoint adapter) is `raylane.models.families`, whose
registry holds one `Family` per kind of this table (a test holds the two to the same kinds).
"""

from __future__ import annotations

from dataclasses import dataclass

from raylane.config.presets import listed

#: The fields only a custom model reads.
CUSTOM_FIELDS = ("factory", "args", "block_class")
_DECODER = ("d_model", "n_heads", "n_layers")
_LLAMA_ONLY = ("pretrained", "n_kv_heads", "ffn_dim", "rope_theta", "rms_norm_eps",
               "tie_embeddings", "qkv_bias")  # fmt: skip
_CLASSIFIER = ("hidden_sizes", "input_scale")


@dataclass(frozen=True)
class Traits:
    """One family's traits. `fields`: what its `model:` section reads beyond `kind`,
    `input_dim` and `num_classes` (another family's field set is an error naming it)."""

    kind: str
    fields: tuple[str, ...]
    #: Token sequences in, a vocabulary's logits out (`num_classes` is the vocabulary).
    language: bool = False
    #: Rows of a table's feature columns in, one class out.
    tabular: bool = False
    #: Built by the user's `model.factory` (its blocks, plans and loss are the user's).
    factory: bool = False
    #: raylane's own tensor-parallel, sequence-parallel, stage and context-parallel plans.
    plans: bool = False
    #: Blocks that activation checkpointing recomputes one at a time.
    blocks: bool = False
    #: Plain multi-head attention with its head count declared (tp splits whole heads).
    declared_heads: bool = False
    #: Grouped-query attention and rotary positions: the Llama family's widths and checks.
    grouped_query: bool = False
    #: Trains only where its workers agree in lockstep (all-reduce or sharding).
    lockstep_only: bool = False
    #: Loads and exports Hugging Face checkpoints (`model.pretrained`).
    hf_checkpoint: bool = False
    #: Reads a square image (`input_dim` a perfect square).
    square_input: bool = False

    @property
    def tensor_parallel(self) -> bool:
        """A tensor-parallel layout splits it: raylane's plan, or the user's `tp_plan`."""
        return self.plans or self.factory


TRAITS: dict[str, Traits] = {
    traits.kind: traits
    for traits in (
        Traits("mlp", _CLASSIFIER, tabular=True),
        Traits("cnn", _CLASSIFIER, tabular=True, square_input=True),
        Traits("gpt", _DECODER, language=True, plans=True, blocks=True, declared_heads=True),
        Traits(
            "llama",
            (*_DECODER, *_LLAMA_ONLY),
            language=True,
            plans=True,
            blocks=True,
            grouped_query=True,
            lockstep_only=True,
            hf_checkpoint=True,
        ),  # fmt: skip
        Traits("custom", CUSTOM_FIELDS, factory=True, blocks=True),
    )
}

#: The fields each kind reads (`Traits.fields`).
KIND_FIELDS = {kind: traits.fields for kind, traits in TRAITS.items()}


def traits(kind: str) -> Traits:
    """The traits of `model.kind` `kind` (the config's `Literal` admits only these)."""
    return TRAITS[kind]


def kinds_where(trait: str) -> tuple[str, ...]:
    """The kinds that have `trait`, in the table's order: what an error says is allowed."""
    return tuple(kind for kind, found in TRAITS.items() if getattr(found, trait))


def named(kinds: tuple[str, ...]) -> str:
    """`'gpt' or 'llama'`: kinds as an error names them."""
    return listed([f"'{kind}'" for kind in kinds])
