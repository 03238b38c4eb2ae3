"""Write a small, randomly initialised Hugging Face checkpoint to try raylane's model path
without a download: a Llama (or Qwen2) directory as `save_pretrained` writes it, with a
byte-level BPE tokenizer trained here on the Python standard library's source.

    python tools/tiny_checkpoint.py checkpoints/tiny-llama
    python tools/tiny_checkpoint.py checkpoints/tiny-qwen2 --family qwen2 --vocab 1024
    python tools/tiny_checkpoint.py checkpoints/tiny-draft --layers 1 \
        --tokenizer-from checkpoints/tiny-llama

The directory holds `config.json`, `model.safetensors`, `generation_config.json`,
`tokenizer.json` and `tokenizer_config.json` (end-of-text token and raylane's chat template),
as a checkpoint from the Hub would; `raylane train --set model.pretrained=DIR` loads it.
`--tokenizer-from DIR` copies another checkpoint's tokenizer files instead of training one: a
smaller model of the same tokenizer, such as a speculative draft.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sysconfig
from pathlib import Path

from raylane.data.chat import DEFAULT_CHAT_TEMPLATE
from raylane.data.tokenizer import END_OF_TEXT, load_tokenizer, train_bpe

FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def stdlib_text(max_bytes: int) -> list[str]:
    """The standard library's top-level modules, in sorted order, up to `max_bytes`."""
    texts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if total >= max_bytes:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
    return texts


def write_tokenizer(directory: Path, vocab: int, max_bytes: int) -> int:
    """Train the BPE, write tokenizer.json and tokenizer_config.json; its end-of-text id."""
    tokenizer = train_bpe(stdlib_text(max_bytes), vocab)
    (directory / "tokenizer.json").write_bytes(tokenizer.file_bytes())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": END_OF_TEXT,
        "bos_token": None,
        "pad_token": END_OF_TEXT,
        "model_max_length": 2048,
        "chat_template": DEFAULT_CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tokenizer.eot_id


def copy_tokenizer(source: Path, directory: Path) -> tuple[int, int]:
    """Copy tokenizer.json and tokenizer_config.json from `source`; (end-of-text id, size)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (source / name).is_file():
            raise SystemExit(f"error: --tokenizer-from {source}: no {name} there")
        shutil.copyfile(source / name, directory / name)
    tokenizer = load_tokenizer(directory / "tokenizer.json")
    return tokenizer.eot_id, tokenizer.vocab_size


def write_model(directory: Path, family: str, vocab: int, eot: int, args) -> None:
    import torch
    import transformers

    torch.manual_seed(args.seed)
    common = dict(
        vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=2048,
        eos_token_id=eot, pad_token_id=eot, bos_token_id=None,
        tie_word_embeddings=family == "qwen2",
    )  # fmt: skip
    if family == "qwen2":
        config = transformers.Qwen2Config(**common, use_sliding_window=False)
    else:
        config = transformers.LlamaConfig(**common)
    model = getattr(transformers, FAMILIES[family])(config)
    model.save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    parser.add_argument("--vocab", type=int, default=512, help="BPE vocabulary size")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--text-bytes", type=int, default=1 << 19, help="BPE training text")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-from", type=Path, help="copy this checkpoint's tokenizer")
    args = parser.parse_args()
    args.directory.mkdir(parents=True, exist_ok=True)
    if args.tokenizer_from is None:
        eot = write_tokenizer(args.directory, args.vocab, args.text_bytes)
    else:
        eot, args.vocab = copy_tokenizer(args.tokenizer_from, args.directory)
    write_model(args.directory, args.family, args.vocab, eot, args)
    print(f"{args.family} checkpoint with a {args.vocab}-token BPE: {args.directory}")


if __name__ == "__main__":
    main()
