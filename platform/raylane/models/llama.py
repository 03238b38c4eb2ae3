"""A Llama-family decoder (Llama, Mistral without a sliding window, Qwen2, Qwen3): token
embedding, N blocks of grouped-query attention with rotary positions and a SwiGLU MLP, RMSNorm,
head; Qwen3 normalises each query and key head (`qk_norm`) before the rotation.

No parallelism inside, laid out as `raylane.models.gpt.GPT` is: blocks in a `ModuleDict` keyed
by their index, the ends `tok_emb`, `norm` and `head` (None on a pipeline stage without them),
the same forward (tokens `[B, T]` -> logits `[B, T, vocab]`) and the same KV-cache calls
(`extend`, `forward_step` over a `raylane.models.kv_cache.KVCache` holding the key/value heads
only). Inside a block the modules carry Hugging Face's names (`self_attn.q_proj` ...
`mlp.down_proj`, `input_layernorm`), so LoRA targets read as they do there and a checkpoint
maps by its prefixes alone (`raylane.models.hf_checkpoint`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from raylane.models.gpt import GPT
from raylane.models.kv_cache import KVCache
from raylane.models.losses import head_cross_entropy, head_token_sums

if TYPE_CHECKING:
    from raylane.config import ModelConfig


@dataclass(frozen=True)
class Llama3Rope:
    """Llama 3.1's rotary frequencies for a longer context than pre-training's: wavelengths
    longer than `original_max_positions / low_freq_factor` are stretched by `factor`, those
    shorter than `original_max_positions / high_freq_factor` kept, those between blended."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama-family decoder (Hugging Face's names in the comments)."""

    vocab_size: int  # vocab_size
    d_model: int  # hidden_size
    n_layers: int  # num_hidden_layers
    n_heads: int  # num_attention_heads
    n_kv_heads: int  # num_key_value_heads: query heads share them in groups
    ffn_dim: int  # intermediate_size
    max_positions: int  # max_position_embeddings: the context, and the KV cache's length
    head_dim: int = 0  # head_dim; 0: d_model // n_heads
    rope_theta: float = 10000.0
    rope_scaling: Llama3Rope | None = None
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False  # tie_word_embeddings: the head is the embedding matrix
    qkv_bias: bool = False  # Qwen2 (and Llama's attention_bias) add biases to q, k and v
    o_bias: bool = False  # Llama's attention_bias adds one to o_proj as well
    qk_norm: bool = False  # Qwen3: an RMSNorm over head_dim on every query and key head
    model_type: str = "llama"  # what an exported config.json declares: llama, mistral, qwen2, qwen3

    def __post_init__(self):
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"{self.n_heads} attention heads cannot share {self.n_kv_heads} key/value heads "
                "in equal groups"
            )
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, not {self.head_dim}")


def llama_config(model: ModelConfig) -> LlamaConfig:
    """The random Llama a raylane `model:` section describes (no `pretrained`): d_model,
    n_heads, n_layers and num_classes as width, heads, blocks and vocabulary, input_dim as the
    context. Biases on q, k and v make it Qwen2's layout (exported as qwen2)."""
    return LlamaConfig(
        vocab_size=model.num_classes,
        d_model=model.d_model,
        n_layers=model.n_layers,
        **model.llama_widths(),
        max_positions=model.input_dim,
        rope_theta=model.rope_theta,
        rms_norm_eps=model.rms_norm_eps,
        tie_embeddings=model.tie_embeddings,
        qkv_bias=model.qkv_bias,
        model_type="qwen2" if model.qkv_bias else "llama",
    )


def rope_frequencies(cfg: LlamaConfig, device: torch.device | None = None) -> torch.Tensor:
    """The rotary inverse frequencies `[head_dim / 2]` (fp32), computed as Hugging Face does so
    that positions rotate identically."""
    dim = cfg.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    wavelength = 2 * math.pi / inv_freq
    original = scaling.original_max_positions
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    stretched = torch.where(wavelength > original / low, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * stretched / scaling.factor + smooth * stretched
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(medium, blended, stretched)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[B, heads, T, head_dim]` by its positions' angles (`cos`, `sin`
    `[B, 1, T, head_dim]`), pairing dimension i with i + head_dim / 2 (Hugging Face's layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 and scaled in the input's dtype (as Llama's)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    """Grouped-query causal attention with rotary positions. The forward reads the number of
    heads from the projections' outputs, which is what a tensor-parallel rank would hold."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.d_model, bias=cfg.o_bias)
        # Qwen3: each head's queries and keys normalised (one weight over head_dim, shared by
        # the heads, so a tensor-parallel rank keeps it whole).
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries, keys and values `[B, heads, T, head_dim]` of `x`, q and k rotated."""
        hd = self.head_dim

        def heads(t: torch.Tensor, norm: RMSNorm | None = None) -> torch.Tensor:
            t = t.unflatten(-1, (t.shape[-1] // hd, hd))  # explicit: an empty batch has no -1
            return (t if norm is None else norm(t)).transpose(1, 2)

        q = heads(self.q_proj(x), self.q_norm)
        k, v = heads(self.k_proj(x), self.k_norm), heads(self.v_proj(x))
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        out = self.attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).flatten(2))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of queries over fewer key/value heads, each serving a group of
        query heads (SDPA's `enable_gqa`: the keys and values are never copied per group)."""
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1]
        )

    def forward_cached(self, x, cos, sin, cache: KVCache, layer: int, step) -> torch.Tensor:
        """Attention of new tokens `x` `[n, new, d]` over their slots' cached prefixes plus
        themselves; their keys and values (key/value heads only) are written to `cache`."""
        q, k, v = self.project(x, cos, sin)
        keys, values, visible = cache.append(layer, step, k, v)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=visible, is_causal=step.causal,
            enable_gqa=k.shape[1] != q.shape[1],
        )  # fmt: skip
        return self.o_proj(out.transpose(1, 2).flatten(2))


class SwiGLU(nn.Module):
    """The MLP: `down(silu(gate(x)) * up(x))`, no biases."""

    def __init__(self, d_model: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.up_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-norm block: RMSNorm, attention, residual; RMSNorm, SwiGLU, residual."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_cached(self, x, cos, sin, cache: KVCache, layer: int, step) -> torch.Tensor:
        x = x + self.self_attn.forward_cached(self.input_layernorm(x), cos, sin, cache, layer, step)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Decoder-only language model: tokens `[B, T]` (int64) -> logits `[B, T, vocab]`.

    When a stage has no embedding (a later pipeline stage), its input is the previous stage's
    hidden states `[B, T, d_model]`; when it has no head, it returns hidden states. With
    `tie_embeddings` the head's weight is the embedding's (one parameter).
    """

    tp_plan = "raylane.models.llama_plan"  # its tensor-parallel plan, as `GPT.tp_plan`

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.tok_emb: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): LlamaBlock(cfg) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.head: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.init_weights()

    def init_weights(self, std: float = 0.02) -> None:
        """Llama's initialisation: normal(0, `std`) matrices and embedding, zero biases, unit
        norms (on the meta device a no-op: the weights are a checkpoint's)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def tie_weights(self) -> None:
        """Make the head's weight the embedding's again when the config ties them (after a load
        that assigned new parameters, which unties them)."""
        if self.config.tie_embeddings and self.tok_emb is not None and self.head is not None:
            self.head.weight = self.tok_emb.weight

    takes_targets = True  # `forward(x, targets=...)` returns the loss, as `GPT.forward`

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor | None = None,
        targets: torch.Tensor | None = None, chunk_bytes: float | None = None,
        sums: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """Logits of tokens `x` `[B, T]` (or hidden states of a later stage). `positions`
        (`[T]` or `[B, T]`, int64): where the tokens sit in their sequences; default
        `self.positions`, 0..T-1. With `targets` (a whole model's), the mean cross-entropy,
        its head in chunks of at most `chunk_bytes` of logits (`head_cross_entropy`), or with
        `sums` validation's sums so (`head_token_sums`)."""
        if positions is None:
            positions = self.positions(x.shape[1], x.device)
        cos, sin = self.rotary(positions)
        if self.tok_emb is not None:
            x = self.tok_emb(x)
        for block in self.blocks.values():
            x = block(x, cos, sin)
        if self.head is not None:
            if targets is not None:  # validation's sums, or the training loss
                fused = head_token_sums if sums else head_cross_entropy
                return fused(self.norm(x), self.head, targets, chunk_bytes)
            x = self.head(self.norm(x))
        return x

    def positions(self, length: int, device: torch.device) -> torch.Tensor:
        """The positions of the `length` tokens a forward gets: 0..length-1 (a context-parallel
        worker's chunks sit elsewhere in the sequence and would replace this)."""
        return torch.arange(length, device=device)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cosines and sines `[B or 1, 1, T, head_dim]` of `positions` `[T]` or `[B, T]`.
        Computed per forward from the config, not held in a buffer: a model built on the meta
        device and loaded by assignment, or cast to bf16, still rotates by exact angles."""
        if positions.dim() == 1:
            positions = positions[None]
        inv_freq = rope_frequencies(self.config, positions.device)
        freqs = positions[..., None].float() * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]
        return angles.cos(), angles.sin()

    @property
    def max_positions(self) -> int:
        """The positions the model reads (max_position_embeddings)."""
        return self.config.max_positions

    def kv_cache(self, slots: int, max_len: int | None = None) -> KVCache:
        """A cache of `slots` sequences of up to `max_len` positions (default: the context),
        holding the key/value heads only, on the model's device and in its dtype."""
        weight = self.norm.weight
        return KVCache(
            n_layers=len(self.blocks),
            slots=slots,
            n_heads=self.config.n_kv_heads,
            max_len=max_len or self.config.max_positions,
            head_dim=self.config.head_dim,
            dtype=weight.dtype,
            device=weight.device,
        )

    # The cache bookkeeping around `forward_step` (plan, forward, advance) is the GPT's.
    extend = GPT.extend

    def forward_step(self, tokens: torch.Tensor, cache: KVCache, step) -> torch.Tensor:
        """Logits of `tokens` `[n, new]` placed in `cache` where `step` (a `CacheStep`) says,
        their keys and values written there; the cache's lengths are the caller's to advance.

        Raises:
            ValueError: for a pipeline stage (no embedding or head).
        """
        if self.tok_emb is None or self.head is None:
            raise ValueError("extend needs the whole model (embedding to head), not one stage")
        cos, sin = self.rotary(step.positions)
        x = self.tok_emb(tokens)
        for layer, block in enumerate(self.blocks.values()):
            x = block.forward_cached(x, cos, sin, cache, layer, step)
        return self.head(self.norm(x))
