"""`model:`: the architecture (the classifiers, raylane's GPT, a Llama-family decoder built
from its hyperparameters or a Hugging Face checkpoint, or a user's own torch module built by a
factory function: `kind: custom`)."""

from __future__ import annotations

import difflib
import hashlib
import importlib
import json
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from raylane.config.families import KIND_FIELDS, traits
from raylane.config.strict import StrictModel

DIGITS_FEATURES = 64
DIGITS_CLASSES = 10

#: `package.module:function`: a dotted module path, a colon, the function's name.
FACTORY_FORM = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


class ModelConfig(StrictModel):
    kind: Literal["mlp", "cnn", "gpt", "llama", "custom"] = Field(
        "mlp",
        description="Architecture: 'mlp' (fully connected), 'cnn' (convolutions over a square "
        "image; more compute per parameter), 'gpt' (byte-level decoder-only transformer), "
        "'llama' (a Llama-family decoder: grouped-query attention, rotary positions, SwiGLU; "
        "random, or a Hugging Face checkpoint's with `pretrained`) or 'custom' (your own torch "
        "module, built by `factory`).",
    )
    factory: str | None = Field(
        None,
        description="custom: 'package.module:function' that builds the model, imported from the "
        "working directory or an installed package and called with `args` as keyword "
        "arguments. It returns an nn.Module, or a pair (module, loss_fn) where "
        "loss_fn(outputs, labels) is a scalar tensor (else cross-entropy over the outputs' last "
        "dimension). Validation reports and accuracy stay cross-entropy and argmax.",
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="custom: keyword arguments of `factory` (input_dim and num_classes are not "
        "passed: give them here too if the factory takes them).",
    )
    block_class: str | None = Field(
        None,
        description="custom: class name of the model's repeated blocks, the units FSDP shards "
        "one at a time, activation checkpointing recomputes and compile compiles. None: the "
        "children of one class (defined outside torch) that the model holds two or more of, "
        "if any; else the model is one unit.",
    )
    input_dim: int = Field(
        DIGITS_FEATURES,
        ge=1,
        description="Number of input features per row (gpt, llama: tokens per sequence; llama "
        "with `pretrained`: at most the checkpoint's max_position_embeddings).",
    )
    num_classes: int = Field(
        DIGITS_CLASSES,
        ge=2,
        description="Number of output classes (gpt, llama: vocabulary size; llama with "
        "`pretrained`: the checkpoint's vocab_size).",
    )
    d_model: int = Field(64, ge=1, description="gpt, llama: width of the residual stream.")
    n_heads: int = Field(4, ge=1, description="gpt, llama: attention (query) heads per block.")
    n_layers: int = Field(4, ge=1, description="gpt, llama: transformer blocks.")
    pretrained: Path | None = Field(
        None,
        description="llama: a Hugging Face model directory (config.json with model_type llama, "
        "mistral, qwen2 or qwen3, and safetensors weights) to start from. Its config.json "
        "decides the architecture: d_model, n_heads, n_layers and the llama fields below are "
        "then not read.",
    )
    n_kv_heads: int | None = Field(
        None,
        ge=1,
        description="llama: key/value heads per block, each shared by n_heads / n_kv_heads "
        "query heads (grouped-query attention). None: n_heads (multi-head attention).",
    )
    ffn_dim: int | None = Field(
        None,
        ge=1,
        description="llama: hidden width of the SwiGLU MLP. None: 8/3 of d_model rounded up to "
        "a multiple of 64 (about the parameters of a 4 x d_model two-matrix MLP).",
    )
    rope_theta: float = Field(
        10000.0, gt=0.0, description="llama: base of the rotary position embedding's angles."
    )
    rms_norm_eps: float = Field(
        1e-5, gt=0.0, description="llama: epsilon of the RMS norms, for numerical safety."
    )
    tie_embeddings: bool = Field(
        False, description="llama: the output head reuses the token embedding matrix."
    )
    qkv_bias: bool = Field(
        False,
        description="llama: biases on the query, key and value projections (Qwen2's layout; "
        "exported as a qwen2 checkpoint).",
    )
    hidden_sizes: list[int] = Field(
        default_factory=lambda: [128, 128],
        min_length=1,
        description="MLP: width of each hidden layer. CNN: channels of each conv layer.",
    )
    input_scale: float = Field(
        16.0,
        gt=0.0,
        description="Inputs are divided by this inside the model, so clients send raw values "
        "(digits pixels are 0-16).",
    )

    @model_validator(mode="after")
    def _check_shape(self) -> ModelConfig:
        if any(h < 1 for h in self.hidden_sizes):
            raise ValueError("every entry of hidden_sizes must be at least 1")
        if traits(self.kind).language and self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if traits(self.kind).square_input and math.isqrt(self.input_dim) ** 2 != self.input_dim:
            raise ValueError(
                f"kind '{self.kind}' needs a square image, but input_dim={self.input_dim} is not a "
                "perfect square"
            )
        return self

    @model_validator(mode="after")
    def _check_fields_of_the_kind(self) -> ModelConfig:
        """A field another kind reads, set to a value of its own (not its default: a resolved
        config lists every field), is a mistake: one line naming the kinds that read it."""
        mine = KIND_FIELDS[self.kind]
        for name in dict.fromkeys(f for fields in KIND_FIELDS.values() for f in fields):
            if name in mine or getattr(self, name) == _default(name):
                continue
            readers = [kind for kind, fields in KIND_FIELDS.items() if name in fields]
            kinds = " and ".join(f"'{kind}'" for kind in readers)
            noun = "kinds" if len(readers) > 1 else "kind"
            raise ValueError(f"model.{name} is read by {noun} {kinds}, not '{self.kind}'")
        return self

    @model_validator(mode="after")
    def _check_llama(self) -> ModelConfig:
        if not traits(self.kind).grouped_query:
            return self
        if self.pretrained is not None:
            return self._check_pretrained(self.pretrained)
        kv_heads = self.n_kv_heads or self.n_heads
        if self.n_heads % kv_heads:
            raise ValueError(
                f"model.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({kv_heads}): "
                "query heads share key/value heads in equal groups"
            )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"model.d_model / n_heads ({self.d_model // self.n_heads}) must be even: rotary "
                "embeddings turn pairs of dimensions"
            )
        return self

    @model_validator(mode="after")
    def _check_custom(self) -> ModelConfig:
        """A custom model names an importable factory (the other kinds take none of its
        fields: `_check_fields_of_the_kind`). Calling the factory (a model on the meta device,
        what it returns) is the preflight's (`raylane.models.custom.check_custom_model`):
        that needs torch."""
        if not traits(self.kind).factory:
            return self
        if self.factory is None:
            raise ValueError("model.kind 'custom' needs model.factory: 'package.module:function'")
        import_factory(self.factory)
        return self

    def factory_tags(self) -> dict[str, str]:
        """custom: the factory and the sha256 of its module's source file, as run tags (what
        built the weights, beside the run's `model.args` params); {} for the other kinds."""
        if not traits(self.kind).factory or self.factory is None:
            return {}
        module = sys.modules.get(self.factory.partition(":")[0])
        path = getattr(module, "__file__", None)
        tags = {"raylane.model_factory": self.factory}
        if path is not None:
            tags["raylane.model_factory_file"] = path
            tags["raylane.model_factory_sha256"] = hashlib.sha256(
                Path(path).read_bytes()
            ).hexdigest()
        return tags

    def factory_source(self) -> Path | None:
        """custom: what the workers on other nodes need shipped (`raylane.runtime.
        connect_ray`) when the factory comes from the working directory: its top-level
        package's directory, or its module's `.py` file. None otherwise (another kind, an
        installed package or anything outside the working directory, a compiled module)."""
        if not traits(self.kind).factory or self.factory is None:
            return None
        name = self.factory.partition(":")[0]
        if name not in sys.modules:
            import_factory(self.factory)  # from the working directory, as validation imports it
        path = Path(getattr(sys.modules[name], "__file__", None) or "")
        if path.name == "":
            return None
        path = path.resolve()
        depth = name.count(".") + (path.name == "__init__.py")
        top = path.parents[depth - 1] if depth else path  # the top-level package, or the file
        if top.is_file() and top.suffix != ".py":
            return None
        return top if top.is_relative_to(Path.cwd().resolve()) else None

    def pretrained_config(self) -> dict:
        """The `pretrained` checkpoint's config.json (a few hundred bytes)."""
        return json.loads((self.pretrained / "config.json").read_text())

    def stored_dtype(self) -> str | None:
        """The dtype a `pretrained` checkpoint's config.json says its weights are stored in
        ('bfloat16', 'float32', ...); None without one."""
        if self.pretrained is None:
            return None
        raw = self.pretrained_config()
        return raw.get("dtype") or raw.get("torch_dtype")

    def llama_widths(self) -> dict[str, int]:
        """llama: the widths a tensor-parallel split divides, by field name (n_heads, n_kv_heads,
        ffn_dim with its default), read from the checkpoint's config.json when `pretrained`."""
        if self.pretrained is not None:
            raw = self.pretrained_config()
            heads = raw.get("num_attention_heads", 0)
            kv_heads = raw.get("num_key_value_heads") or heads
            return {
                "n_heads": heads,
                "n_kv_heads": kv_heads,
                "ffn_dim": raw.get("intermediate_size", 0),
            }
        ffn_dim = self.ffn_dim or 64 * math.ceil(8 * self.d_model / 3 / 64)
        return {
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads or self.n_heads,
            "ffn_dim": ffn_dim,
        }

    def llama_tied(self) -> bool:
        """llama: whether the head is the embedding matrix (the checkpoint's when `pretrained`)."""
        if self.pretrained is not None:
            return bool(self.pretrained_config().get("tie_word_embeddings", False))
        return self.tie_embeddings

    def block_count(self) -> int:
        """The transformer blocks a pipeline cuts into stages: the checkpoint's
        num_hidden_layers when `pretrained`, else n_layers."""
        if self.pretrained is not None:
            return int(self.pretrained_config().get("num_hidden_layers", self.n_layers))
        return self.n_layers

    def _check_pretrained(self, directory: Path) -> ModelConfig:
        """The checkpoint's vocabulary is the classes; its context bounds the training one.
        Only sizes are read here (the architecture is checked when the model is built)."""
        path = directory / "config.json"
        if not path.is_file():
            raise ValueError(f"model.pretrained: {path} not found (a Hugging Face model directory)")
        raw = self.pretrained_config()
        vocab, context = raw.get("vocab_size"), raw.get("max_position_embeddings")
        if self.num_classes != vocab:
            raise ValueError(
                f"model.num_classes is {self.num_classes} but {path} has vocab_size {vocab}; "
                f"set model.num_classes: {vocab}"
            )
        if context is not None and self.input_dim > context:
            raise ValueError(
                f"model.input_dim {self.input_dim} is longer than {path}'s "
                f"max_position_embeddings {context}"
            )
        return self


def _default(name: str) -> Any:
    field = ModelConfig.model_fields[name]
    return field.get_default(call_default_factory=True)


def import_factory(spec: str) -> Callable[..., Any]:
    """The function `spec` ('package.module:function') names, imported from the working
    directory (added to `sys.path`, as `python -m` would) or an installed package. Raises
    ValueError, one line naming `model.factory`, when it cannot be."""
    if not FACTORY_FORM.fullmatch(spec):
        raise ValueError(
            f"model.factory {spec!r} is not 'package.module:function' (e.g. 'my_model:build')"
        )
    module_name, _, name = spec.partition(":")
    module = _import_module(module_name)
    if not hasattr(module, name):
        public = [n for n in dir(module) if not n.startswith("_")]
        close = difflib.get_close_matches(name, public, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"model.factory: module {module_name!r} ({getattr(module, '__file__', None)}) has "
            f"no attribute {name!r}{hint}"
        )
    factory = getattr(module, name)
    if not callable(factory):
        raise ValueError(
            f"model.factory: {spec} is a {type(factory).__name__}, not a function to call"
        )
    return factory


def _import_module(name: str):
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if name == missing or name.startswith(f"{missing}."):  # the module itself, or a parent
            raise ValueError(
                f"model.factory: module {name!r} is not importable from the working directory "
                f"({cwd}) nor an installed package"
            ) from None
        raise ValueError(f"model.factory: importing {name!r} raised {one_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed: say so in one line
        raise ValueError(f"model.factory: importing {name!r} raised {one_line(exc)}") from None


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message`."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
