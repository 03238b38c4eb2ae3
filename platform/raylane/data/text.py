"""Byte-level language-modelling data from text every Python installation ships: the standard
library's own source files. The file list and a digest of the bytes are written next to the
Parquet (manifest.json), so a run records exactly which text it learned from.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sysconfig
from pathlib import Path

import numpy as np

from raylane.config import RaylaneConfig
from raylane.data.errors import DataError
from raylane.data.packing import windows
from raylane.data.prepare import write_split

MANIFEST = "manifest.json"


#: The files of each built-in text source, under the standard library's directory: its
#: top-level modules, and its test suite (which no 'python-stdlib' run reads: a new domain).
SOURCES = {"python-stdlib": "*.py", "python-stdlib-tests": "test/test_*.py"}


def stdlib_source_files(max_bytes: int, source: str = "python-stdlib") -> list[Path]:
    """The `source`'s `*.py` files of the standard library in sorted order, up to `max_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen, total = [], 0
    for path in sorted(root.glob(SOURCES[source])):
        size = path.stat().st_size
        if total + size > max_bytes and chosen:
            break
        chosen.append(path)
        total += size
    if not chosen:
        hint = " (this Python ships without its test suite: install it, e.g. Debian's "
        hint += "libpython3-testsuite, or use data.source: parquet)" if "test" in source else ""
        raise DataError(f"data.source '{source}': no {SOURCES[source]} under {root}{hint}")
    return chosen


def token_windows(data: bytes, context_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping windows: inputs `[N, T]` and next-byte targets `[N, T]` (int64)."""
    return windows(np.frombuffer(data, dtype=np.uint8).astype(np.int64), context_length)


def prepare_stdlib_text(cfg: RaylaneConfig) -> tuple[int, int]:
    """Write train/validation windows of the stdlib source as Parquet plus a manifest."""
    data = cfg.data
    files = stdlib_source_files(data.max_bytes, data.source)
    text = b"".join(path.read_bytes() for path in files)
    inputs, targets = token_windows(text, cfg.model.input_dim)
    order = np.random.default_rng(data.split_seed).permutation(len(inputs))
    n_val = max(1, round(len(order) * data.validation_fraction))
    val, train = order[:n_val], order[n_val:]
    write_split(data.train_path, inputs[train], targets[train], data)
    write_split(data.validation_path, inputs[val], targets[val], data)
    manifest = {
        "source": data.source,
        "python": platform.python_version(),
        "root": str(files[0].parent),
        "files": [path.name for path in files],
        "bytes": len(text),
        "sha256": hashlib.sha256(text).hexdigest(),
        "context_length": cfg.model.input_dim,
        "windows": {"train": len(train), "validation": len(val)},
    }
    Path(data.train_path).parent.joinpath(MANIFEST).write_text(json.dumps(manifest, indent=2))
    return len(train), len(val)
