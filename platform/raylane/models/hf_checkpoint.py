"""Hugging Face checkpoints of Llama-family decoders, read into and written from raylane's
`LlamaForCausalLM` (`raylane.models.llama`).

A directory holds `config.json` (`model_type` llama, mistral, qwen2 or qwen3) and its weights in
`model.safetensors` or in shards listed by `model.safetensors.index.json`. Names map by prefix
alone (`model.embed_tokens.` <-> `tok_emb.`, `model.layers.` <-> `blocks.`, `model.norm.` <->
`norm.`, `lm_head.` <-> `head.`): inside a block raylane uses Hugging Face's names. Loading
builds the model on the meta device and assigns each tensor as it is read (no random
initialisation, no second copy); anything that does not fit (a missing, unexpected or
misshapen tensor, an architecture option raylane does not implement) is refused in one line
naming the file and the key. Writing gives a directory that
`transformers.AutoModelForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from raylane.models.llama import Llama3Rope, LlamaConfig, LlamaForCausalLM

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}  # fmt: skip
#: Hugging Face's prefix -> raylane's; what follows a prefix is the same on both sides.
PREFIXES = (
    ("model.embed_tokens.", "tok_emb."),
    ("model.layers.", "blocks."),
    ("model.norm.", "norm."),
    ("lm_head.", "head."),
)
#: Files beside the weights that a user of the model needs, copied on export when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "tokenizer.model")  # fmt: skip
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
#: `LlamaConfig` field -> the config.json key that must give it.
SIZES = {"vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
         "n_heads": "num_attention_heads", "ffn_dim": "intermediate_size",
         "max_positions": "max_position_embeddings"}  # fmt: skip


def raylane_name(key: str) -> str | None:
    """raylane's parameter name for a Hugging Face tensor name (None: not a model weight)."""
    for theirs, ours in PREFIXES:
        if key.startswith(theirs):
            return ours + key[len(theirs) :]
    return None


def hf_name(name: str) -> str:
    """Hugging Face's tensor name for a raylane parameter name."""
    for theirs, ours in PREFIXES:
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    raise ValueError(f"parameter {name!r} has no Hugging Face name")


def read_config(directory: str | Path) -> LlamaConfig:
    """The architecture a Hugging Face `config.json` describes.

    Raises:
        ValueError: one line naming the file: it is missing, or the model type, activation,
            rotary scaling or sliding window is one raylane does not implement.
    """
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ValueError(f"{path}: not found (a Hugging Face model directory holds config.json)")
    raw = json.loads(path.read_text())
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"{path}: model_type {model_type!r} is not supported; raylane reads "
            f"{', '.join(ARCHITECTURES)}"
        )
    _refuse_unsupported(path, raw)
    theta, scaling = _rope(path, raw)
    bias = bool(raw.get("attention_bias", False))
    sizes = {ours: _field(path, raw, theirs) for ours, theirs in SIZES.items()}
    try:
        return LlamaConfig(
            **sizes,
            n_kv_heads=raw.get("num_key_value_heads") or sizes["n_heads"],
            head_dim=raw.get("head_dim") or 0,
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bias,
            o_bias=model_type != "qwen2" and bias,
            qk_norm=model_type == "qwen3",
            model_type=model_type,
        )
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def _field(path: Path, raw: dict, key: str):
    if key not in raw:
        raise ValueError(f"{path}: {key} is missing")
    return raw[key]


def _refuse_unsupported(path: Path, raw: dict) -> None:
    """Options of these families that raylane's decoder does not implement."""
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"{path}: hidden_act {raw['hidden_act']!r}; raylane's MLP is SwiGLU (silu)"
        )
    if raw.get("mlp_bias"):
        raise ValueError(f"{path}: mlp_bias is set; raylane's MLP has no biases")
    window, context = raw.get("sliding_window"), raw.get("max_position_embeddings", 0)
    windowed = raw.get("use_sliding_window", raw.get("model_type") == "mistral")
    if windowed and window is not None and window < context:
        raise ValueError(
            f"{path}: sliding_window {window} is shorter than max_position_embeddings "
            f"{context}; raylane attends over the whole context (no sliding window)"
        )
    if any(kind != "full_attention" for kind in raw.get("layer_types") or []):
        raise ValueError(f"{path}: layer_types other than full_attention (a sliding window)")


def _rope(path: Path, raw: dict) -> tuple[float, Llama3Rope | None]:
    """rope_theta and Llama 3's scaling, from transformers 5's `rope_parameters` or the older
    `rope_theta` + `rope_scaling`."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError(f"{path}: rotary parameters per layer type are not supported")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{path}: partial_rotary_factor; raylane rotates whole heads")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(
            f"{path}: rope type {kind!r} is not implemented; raylane applies 'default' and "
            "'llama3' rotary embeddings"
        )
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in params]
    if missing:
        raise ValueError(f"{path}: llama3 rotary scaling without {', '.join(missing)}")
    scaling = Llama3Rope(
        factor=params["factor"],
        low_freq_factor=params["low_freq_factor"],
        high_freq_factor=params["high_freq_factor"],
        original_max_positions=params.get(
            "original_max_position_embeddings", _field(path, raw, "max_position_embeddings")
        ),
    )
    return theta, scaling


def weights_sha256(directory: str | Path) -> tuple[str, dict[str, str]]:
    """sha256 over the weight files' bytes in sorted name order, and each file's own sha256.

    Raises:
        ValueError: no safetensors weights (or a shard the index names is missing).
    """
    files, _ = weight_files(directory)
    total, each = hashlib.sha256(), {}
    for path in sorted(set(files.values()), key=lambda p: p.name):
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
                total.update(chunk)
        each[path.name] = digest.hexdigest()
    return total.hexdigest(), each


def weight_files(directory: str | Path) -> tuple[dict[str, Path], Path]:
    """Each tensor's file (`{hf key: path}`) and the file that lists them (the index, or the
    single `model.safetensors`).

    Raises:
        ValueError: neither file is there, or the index names a shard that is not.
    """
    directory = Path(directory)
    index, single = directory / INDEX, directory / SINGLE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {key: directory / name for key, name in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise ValueError(f"{index}: shard {shard.name} is not in {directory}")
        return files, index
    if single.is_file():
        with safe_open(single, framework="pt") as handle:
            return {key: single for key in handle.keys()}, single  # noqa: SIM118
    raise ValueError(
        f"{directory}: no {SINGLE} or {INDEX} (raylane reads safetensors weights only)"
    )


def load_pretrained(
    directory: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LlamaForCausalLM:
    """The model a Hugging Face directory holds, its weights in `dtype` on `device`.

    Raises:
        ValueError: one line naming the file and the key: an unsupported config (`read_config`),
            a missing or unexpected tensor, or a tensor of the wrong shape.
    """
    cfg = read_config(directory)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    expected = {
        name: tuple(tensor.shape)
        for name, tensor in model.state_dict().items()
        if not (cfg.tie_embeddings and name == "head.weight")
    }
    files, listing = weight_files(directory)
    wanted = _match_names(files, listing, expected, cfg)
    state = _read_tensors(wanted, files, expected, dtype, torch.device(device))
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    return model


def _match_names(files: dict[str, Path], listing: Path, expected: dict, cfg: LlamaConfig):
    """`{hf key: raylane name}` of the tensors to read; every expected name must be there and
    nothing unknown (an old checkpoint's rotary buffers, a tied head saved anyway, are skipped)."""
    wanted = {}
    for key in files:
        name = raylane_name(key)
        if key.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and name == "head.weight"):
            continue
        if name not in expected:
            raise ValueError(
                f"{files[key]}: unexpected tensor {key!r} (config.json has no such weight)"
            )
        wanted[key] = name
    found = set(wanted.values())
    for name in expected:
        if name not in found:
            raise ValueError(f"{listing}: tensor {hf_name(name)!r} is missing")
    return wanted


def _read_tensors(wanted, files, expected, dtype, device) -> dict[str, torch.Tensor]:
    """Read every wanted tensor, file by file, checking its shape before its data is read."""
    state = {}
    by_file: dict[Path, list[str]] = {}
    for key in wanted:
        by_file.setdefault(files[key], []).append(key)
    for path, keys in by_file.items():
        with safe_open(path, framework="pt", device=str(device)) as handle:
            for key in keys:
                name = wanted[key]
                shape = tuple(handle.get_slice(key).get_shape())
                if shape != expected[name]:
                    raise ValueError(
                        f"{path}: tensor {key!r} has shape {shape}; config.json makes it "
                        f"{expected[name]}"
                    )
                state[name] = handle.get_tensor(key).to(dtype)
    return state


def hf_config(cfg: LlamaConfig, dtype: torch.dtype) -> dict:
    """The `config.json` of `cfg` in transformers 5's form (`rope_parameters`), with
    `rope_theta` at the top level too for older readers."""
    if cfg.model_type not in ARCHITECTURES:
        raise ValueError(
            f"model_type {cfg.model_type!r}: raylane writes {', '.join(ARCHITECTURES)}"
        )
    if cfg.qk_norm != (cfg.model_type == "qwen3"):
        holds = "cannot hold" if cfg.qk_norm else "needs"
        raise ValueError(f"a {cfg.model_type} checkpoint {holds} per-head query and key norms")
    biases = (cfg.qkv_bias, cfg.o_bias)  # llama, qwen3: attention_bias, both or neither
    fixed = {"qwen2": (True, False), "mistral": (False, False)}.get(cfg.model_type)
    if biases != (fixed or (cfg.qkv_bias, cfg.qkv_bias)):
        raise ValueError(
            f"a {cfg.model_type} checkpoint cannot hold these attention biases (q/k/v "
            f"{cfg.qkv_bias}, o_proj {cfg.o_bias})"
        )
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope |= {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                 "high_freq_factor": s.high_freq_factor,
                 "original_max_position_embeddings": s.original_max_positions}  # fmt: skip
    config = {
        "architectures": [ARCHITECTURES[cfg.model_type]],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_embeddings,
        "dtype": str(dtype).removeprefix("torch."),
    }
    if cfg.model_type == "llama":
        config |= {"attention_bias": cfg.o_bias, "mlp_bias": False}
    elif cfg.model_type == "qwen3":
        config |= {"attention_bias": cfg.o_bias, "sliding_window": None,
                   "use_sliding_window": False}  # fmt: skip
    else:
        config |= {"sliding_window": None, "use_sliding_window": False}
    return config


def save_pretrained(
    model: LlamaForCausalLM,
    directory: str | Path,
    source: str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `model` as a Hugging Face directory: `config.json`, `model.safetensors` (in
    `dtype`, default the model's) and, from a `source` directory, its tokenizer and generation
    files and its bos/eos/pad token ids. Returns the directory.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    dtype = dtype or model.norm.weight.dtype
    config = hf_config(cfg, dtype)
    if source is not None:
        source = Path(source)
        theirs = source / "config.json"
        if theirs.is_file():
            raw = json.loads(theirs.read_text())
            config |= {
                k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in raw
            }
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, directory / name)
    tensors = {
        hf_name(name): tensor.detach().to(device="cpu", dtype=dtype).contiguous()
        for name, tensor in model.state_dict().items()
        if not (cfg.tie_embeddings and name == "head.weight")
    }
    save_file(tensors, directory / SINGLE, metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory
