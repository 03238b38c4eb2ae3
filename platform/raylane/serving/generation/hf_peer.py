"""raylane's GPT as a Hugging Face `GPT2LMHeadModel`: the single-process peer that
`transformers`' own `generate()` (with its KV cache) runs, to check raylane's decoding token
for token and to time it against the same weights.

Built from a config, nothing downloaded. The mapping: separate q, k, v projections become
GPT-2's fused `c_attn`; GPT-2's `Conv1D` layers hold their weights transposed; GPT-2's head
has no bias and shares the embedding, so the peer gets an untied head with raylane's bias;
GELU is the exact one (`activation_function="gelu"`), as in raylane's blocks. The peer is built
on the model's device and in its dtype, so both run on the same GPU for a timing.
"""

from __future__ import annotations

import torch
from torch import nn


def _gpt2_config(model: nn.Module):
    """GPT-2's config of `model`'s shape: no dropout, exact GELU, an untied head."""
    from transformers import GPT2Config

    blocks = list(model.blocks.values())
    d_model = model.tok_emb.embedding_dim
    return GPT2Config(
        vocab_size=model.tok_emb.num_embeddings,
        n_positions=model.pos_emb.num_embeddings,
        n_embd=d_model,
        n_layer=len(blocks),
        n_head=d_model // blocks[0].attn.head_dim,
        n_inner=4 * d_model,
        activation_function="gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=blocks[0].ln1.eps,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )


def to_hf_gpt2(model: nn.Module):
    """A `transformers.GPT2LMHeadModel` holding `model`'s weights (eval mode), on the model's
    device and in its dtype (its final norm's: a plain model, not an int8 one)."""
    from transformers import GPT2LMHeadModel

    device, dtype = model.norm.weight.device, model.norm.weight.dtype
    blocks = list(model.blocks.values())
    d_model = model.tok_emb.embedding_dim
    config = _gpt2_config(model)
    peer = GPT2LMHeadModel(config).to(device=device, dtype=dtype)
    peer.lm_head = nn.Linear(d_model, config.vocab_size, bias=True, device=device, dtype=dtype)
    state = {
        "transformer.wte.weight": model.tok_emb.weight,
        "transformer.wpe.weight": model.pos_emb.weight,
        "transformer.ln_f.weight": model.norm.weight,
        "transformer.ln_f.bias": model.norm.bias,
        "lm_head.weight": model.head.weight,
        "lm_head.bias": model.head.bias,
    }
    for i, block in enumerate(blocks):
        attn, prefix = block.attn, f"transformer.h.{i}."
        state.update(
            {
                prefix + "ln_1.weight": block.ln1.weight,
                prefix + "ln_1.bias": block.ln1.bias,
                prefix + "ln_2.weight": block.ln2.weight,
                prefix + "ln_2.bias": block.ln2.bias,
                prefix + "attn.c_attn.weight": torch.cat(
                    [attn.q.weight, attn.k.weight, attn.v.weight]
                ).T,
                prefix + "attn.c_attn.bias": torch.cat([attn.q.bias, attn.k.bias, attn.v.bias]),
                prefix + "attn.c_proj.weight": attn.proj.weight.T,
                prefix + "attn.c_proj.bias": attn.proj.bias,
                prefix + "mlp.c_fc.weight": block.mlp[0].weight.T,
                prefix + "mlp.c_fc.bias": block.mlp[0].bias,
                prefix + "mlp.c_proj.weight": block.mlp[2].weight.T,
                prefix + "mlp.c_proj.bias": block.mlp[2].bias,
            }
        )
    missing, unexpected = peer.load_state_dict(
        {k: v.detach().contiguous() for k, v in state.items()}, strict=False
    )
    # GPT-2 keeps a causal-mask buffer in older versions; no weight may be left unset.
    if [m for m in missing if not m.endswith(".attn.bias")] or unexpected:
        raise RuntimeError(f"GPT-2 peer mapping incomplete: {missing} {unexpected}")
    return peer.eval()


def hf_greedy(peer, prompt: list[int], max_new_tokens: int) -> list[int]:
    """`generate()` with its KV cache, greedy: the new tokens only."""
    return hf_greedy_batch(peer, [prompt], max_new_tokens)[0]


@torch.no_grad()
def hf_greedy_batch(peer, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """`generate()` over prompts of one length in one batch, greedy: each one's new tokens."""
    inputs = torch.tensor(prompts, device=peer.lm_head.weight.device)
    out = peer.generate(
        inputs,
        attention_mask=torch.ones_like(inputs),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        use_cache=True,
    )
    return out[:, inputs.shape[1] :].tolist()
