"""What makes a run what it is, as digests: the code that ran, the weights it produced, the
environment it ran in. Equal digests mean equal bytes; `raylane reproduce` compares them.
"""

from __future__ import annotations

import hashlib
from importlib import metadata
from pathlib import Path
from typing import Any

import raylane


def package_dir() -> Path:
    """The raylane package this process imported (which copy ran)."""
    return Path(raylane.__file__).resolve().parent


def code_digest(root: Path | None = None) -> str:
    """sha256 over every `.py` file of the package, by relative path and content."""
    root = root or package_dir()
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def weights_digest(state_dict: dict[str, Any]) -> str:
    """sha256 over a state dict: each tensor's name, dtype, shape and bytes, in name order."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def requirements() -> str:
    """`name==version` of every installed distribution, sorted: this environment, pip-style."""
    seen: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and name.lower() not in seen:
            seen[name.lower()] = f"{name}=={dist.version}"
    return "\n".join(seen[k] for k in sorted(seen)) + "\n"
