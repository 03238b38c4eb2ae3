"""The shape of a decoder-only transformer: everything the cost and memory models read about a
model family, without torch (the planner runs where torch is not installed).

One dataclass covers raylane's GPT (learned positions, LayerNorm, a GELU MLP, biases on every
linear) and the Llama family (rotary positions, RMSNorm, grouped-query attention, a SwiGLU MLP;
Qwen2's biases on q, k and v; Qwen3's per-head norms on q and k). A family's spec
(`raylane.models.families`) builds it from a `model:` section or a checkpoint's config.json.

Counts, per block:

* parameters: the matrices and biases tensor parallelism splits (q, k, v and the MLP's input
  linears column-wise, with their biases; the attention output and the MLP's output linear
  row-wise) and what every tensor-parallel rank keeps whole (norms, the row-wise biases, the
  per-head q/k norms);
* FLOPs: 2 per matrix weight per token, plus the attention core, 4·s·(heads·head_dim) per token
  (QK^T and the probabilities times V, Megatron's count: non-causal). For the GPT this is
  Megatron-LM's 24·s·h²·(1 + s/6h) exactly;
* activations: bytes autograd saves per token at 16 bits (Korthikanti et al., MLSys 2023), split
  into what tensor parallelism divides and what it keeps whole (the norm and residual regions,
  which sequence parallelism divides). The GPT's are their eq. 2, 10·h whole and 24·h split.
  The Llama block saves no dropout masks: whole, each RMSNorm's input, its normalised input and
  its scaled output (6·h values); split, the rotated q, k and v and attention's output, which
  `o_proj` reads without a copy (a fused kernel returns it token-major: 2·hq + 2·hkv values),
  and the SwiGLU's gate, up, silu(gate) and product (4·ffn values). Counted from what
  autograd saves in raylane's block (`tests/unit/test_families.py` holds the count to it);
* KV cache: 2 · layers · kv_heads · head_dim values per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: A Hugging Face config.json's `model_type` -> how its attention projections carry biases:
#: (q/k/v biases, o_proj bias) when `attention_bias` is not given; and whether q and k are
#: normalised per head (Qwen3).
HF_ATTENTION = {
    "llama": {"qkv_bias": False, "qk_norm": False},
    "mistral": {"qkv_bias": False, "qk_norm": False},
    "qwen2": {"qkv_bias": True, "qk_norm": False},
    "qwen3": {"qkv_bias": False, "qk_norm": True},
}


@dataclass(frozen=True)
class DecoderShape:
    """The widths of a decoder-only transformer (Hugging Face's names in the comments)."""

    vocab_size: int  # vocab_size
    context_length: int  # the training sequence's tokens
    d_model: int  # hidden_size
    n_layers: int  # num_hidden_layers
    n_heads: int  # num_attention_heads
    n_kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim
    ffn_dim: int  # intermediate_size
    family: str = "gpt"
    gated_mlp: bool = False  # SwiGLU: gate, up and down matrices; else up and down
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"  # layernorm has a bias
    linear_bias: bool = True  # every linear (and the head) has a bias: the GPT
    qkv_bias: bool = False  # biases on q, k and v only (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on queries and keys (Qwen3)
    learned_positions: bool = True  # a position embedding table (the GPT); else rotary
    tied_embeddings: bool = False  # the head is the embedding matrix

    @classmethod
    def gpt(
        cls, vocab_size: int, context_length: int, d_model: int, n_layers: int, n_heads: int = 1
    ) -> DecoderShape:
        """raylane's GPT: multi-head attention, a 4·d GELU MLP, biases everywhere."""
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        return cls(
            vocab_size, context_length, d_model, n_layers, n_heads, n_heads,
            d_model // n_heads, 4 * d_model,
        )  # fmt: skip

    @classmethod
    def llama(
        cls, vocab_size: int, context_length: int, d_model: int, n_layers: int, n_heads: int,
        n_kv_heads: int, ffn_dim: int, head_dim: int = 0, tied_embeddings: bool = False,
        qkv_bias: bool = False, qk_norm: bool = False, family: str = "llama",
    ) -> DecoderShape:  # fmt: skip
        """A Llama-family decoder (`head_dim` 0: d_model / n_heads)."""
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        return cls(
            vocab_size, context_length, d_model, n_layers, n_heads, n_kv_heads,
            head_dim or d_model // n_heads, ffn_dim, family=family, gated_mlp=True,
            norm="rmsnorm", linear_bias=False, qkv_bias=qkv_bias, qk_norm=qk_norm,
            learned_positions=False, tied_embeddings=tied_embeddings,
        )  # fmt: skip

    @classmethod
    def from_hf_config(cls, raw: dict, context_length: int, source: str) -> DecoderShape:
        """The shape a Hugging Face config.json (`raw`, read from `source`) describes, trained
        at `context_length` tokens per sequence.

        Raises:
            ValueError: one line naming `source`: an unknown model_type or a missing width.
        """
        model_type = raw.get("model_type")
        if model_type not in HF_ATTENTION:
            raise ValueError(
                f"{source}: model_type {model_type!r} is not a family raylane knows "
                f"({', '.join(HF_ATTENTION)})"
            )
        missing = [key for key in REQUIRED_HF_KEYS if key not in raw]
        if missing:
            raise ValueError(f"{source}: {missing[0]} is missing")
        attention = HF_ATTENTION[model_type]
        heads = raw["num_attention_heads"]
        return cls.llama(
            vocab_size=raw["vocab_size"],
            context_length=context_length,
            d_model=raw["hidden_size"],
            n_layers=raw["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=raw.get("num_key_value_heads") or heads,
            ffn_dim=raw["intermediate_size"],
            head_dim=raw.get("head_dim") or 0,
            tied_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=attention["qkv_bias"] or bool(raw.get("attention_bias", False)),
            qk_norm=attention["qk_norm"],
            family=model_type,
        )

    # ---- widths ----------------------------------------------------------------------------

    @property
    def q_width(self) -> int:
        """Query heads x head_dim (the attention output's width)."""
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Key/value heads x head_dim: the width of K (and of V)."""
        return self.n_kv_heads * self.head_dim

    def splits_over(self, tp: int) -> bool:
        """Whether tensor parallelism over `tp` ranks divides every split width into whole
        heads and equal MLP shares."""
        return not (self.n_heads % tp or self.n_kv_heads % tp or self.ffn_dim % tp)

    # ---- parameters ------------------------------------------------------------------------

    def block_matrices(self) -> int:
        """Weights of one block's matrices: q, k, v, the attention output and the MLP's."""
        d, f = self.d_model, self.ffn_dim
        attention = 2 * d * self.q_width + 2 * d * self.kv_width
        return attention + (3 if self.gated_mlp else 2) * d * f

    def block_split(self) -> int:
        """Parameters of one block that tensor parallelism splits: the matrices and the
        column-wise linears' biases."""
        column_bias = 0
        if self.linear_bias or self.qkv_bias:
            column_bias += self.q_width + 2 * self.kv_width
        if self.linear_bias:
            column_bias += (2 if self.gated_mlp else 1) * self.ffn_dim
        return self.block_matrices() + column_bias

    def block_whole(self) -> int:
        """Parameters of one block every tensor-parallel rank keeps whole: the two norms, the
        row-wise linears' biases and the per-head q/k norms."""
        whole = 2 * self._norm_params()
        if self.linear_bias:
            whole += 2 * self.d_model
        if self.qk_norm:
            whole += 2 * self.head_dim
        return whole

    def embeddings(self) -> int:
        positions = self.context_length if self.learned_positions else 0
        return (self.vocab_size + positions) * self.d_model

    def head(self) -> int:
        """The final norm and the output layer (its matrix only when it is not the
        embedding's)."""
        matrix = 0 if self.tied_embeddings else self.d_model * self.vocab_size
        return self._norm_params() + matrix + (self.vocab_size if self.linear_bias else 0)

    def total(self) -> int:
        blocks = self.n_layers * (self.block_split() + self.block_whole())
        return self.embeddings() + blocks + self.head()

    def params_per_device(self, tp: int = 1, pp: int = 1, stage: int = 0) -> float:
        """Parameters on a device of pipeline stage `stage` (blocks split evenly, embeddings
        on the first stage, norm and head on the last: with tied embeddings and more than one
        stage, the last holds its own copy of the matrix), its blocks split over `tp`."""
        if self.n_layers % pp:
            raise ValueError(f"n_layers ({self.n_layers}) is not divisible by pp ({pp})")
        blocks = self.n_layers // pp
        count = blocks * (self.block_split() / tp + self.block_whole())
        if stage == 0:
            count += self.embeddings()
        if stage == pp - 1:
            count += self.head()
            if self.tied_embeddings and pp > 1:
                count += self.d_model * self.vocab_size
        return count

    def block_linears(self) -> dict[str, tuple[int, int]]:
        """Each linear of a block by its module name (what `finetune.target_modules` match):
        `(in, out)` features."""
        d, f, q, kv = self.d_model, self.ffn_dim, self.q_width, self.kv_width
        if self.family == "gpt":
            return {"q": (d, d), "k": (d, d), "v": (d, d), "proj": (d, d),
                    "mlp.0": (d, f), "mlp.2": (f, d)}  # fmt: skip
        return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
                "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}  # fmt: skip

    def lora_params(self, targets: list[str], rank: int) -> int:
        """The parameters of rank-`rank` LoRA adapters (A: rank x in, B: out x rank) on every
        block's linears named by `targets` (a name matches a linear's name or its end)."""
        linears = self.block_linears()
        adapted = [
            widths for name, widths in linears.items()
            if any(name == t or name.endswith("." + t) or t.endswith("." + name) for t in targets)
        ]  # fmt: skip
        return self.n_layers * sum(rank * (fan_in + fan_out) for fan_in, fan_out in adapted)

    def _norm_params(self) -> int:
        return (2 if self.norm == "layernorm" else 1) * self.d_model

    # ---- compute, activations, cache -------------------------------------------------------

    def forward_flops_per_token(self, seq: int | None = None) -> tuple[float, float]:
        """Forward FLOPs per token of (all blocks, the head) at a sequence of `seq` tokens
        (default: the context)."""
        s = self.context_length if seq is None else seq
        block = 2 * self.block_matrices() + 4 * s * self.q_width
        return self.n_layers * block, 2 * self.d_model * self.vocab_size

    def activation_bytes_per_token(self) -> tuple[float, float]:
        """Bytes one block saves for backward per token at 16-bit values, as (split by tensor
        parallelism, kept whole: the norm and residual regions). Attention's scores or its
        kernel's log-sum-exp are the cost model's to add (they depend on the kernel)."""
        d = self.d_model
        if self.family == "gpt":
            return 24 * d, 10 * d  # Korthikanti et al., eq. 2
        split_values = 2 * self.q_width + 2 * self.kv_width + 4 * self.ffn_dim
        if self.qk_norm:  # q and k before their per-head norms, and normalised
            split_values += 2 * (self.q_width + self.kv_width)
        return 2 * split_values, 2 * 6 * d

    def kv_cache_bytes_per_token(self, value_bytes: int) -> int:
        """KV-cache bytes one token holds over all layers at `value_bytes` per value."""
        return 2 * self.n_layers * self.kv_width * value_bytes


#: The widths a config.json must give for its shape.
REQUIRED_HF_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
)  # fmt: skip
