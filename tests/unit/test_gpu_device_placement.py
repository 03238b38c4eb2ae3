"""Every tensor the generation and serving code makes names its device.

On a CPU machine a tensor made without `device=` lands where the model is, so nothing fails;
on a GPU it lands on the host and the first op that meets the model's tensors fails (as on an H200:
the KV cache, the engine's token tensors, the CPU `torch.Generator` of a seeded request, the
multi-LoRA stacks). This static check finds such a factory call in the modules that build
tensors for a model, before a GPU ever runs them. `*_like` factories inherit their argument's
device and pass; a host tensor that is meant is written `device="cpu"`, or carries a
`# host tensor: <why>` comment on the call's first line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.readme_blocks import ROOT

PACKAGE = ROOT / "platform" / "raylane"
CHECKED = [
    *sorted((PACKAGE / "serving").rglob("*.py")),  # the engine and inference with it
    *sorted((ROOT / "serving").glob("*.py")),
    PACKAGE / "models" / "kv_cache.py",
    PACKAGE / "models" / "multi_lora.py",
    PACKAGE / "models" / "gpt.py",
]
#: torch functions that make a tensor (or a generator) on a device they take as `device=`.
FACTORIES = {
    "arange", "as_tensor", "empty", "empty_strided", "eye", "full", "Generator", "linspace",
    "logspace", "ones", "rand", "randint", "randn", "randperm", "range", "scalar_tensor",
    "sparse_coo_tensor", "tensor", "tril_indices", "triu_indices", "zeros",
}  # fmt: skip
ALLOW = "# host tensor:"


def factory_calls_without_device(source: str, path: str = "<source>") -> list[str]:
    """`path:line torch.NAME(...)` for each torch factory call in `source` that passes no
    `device=` keyword and carries no `# host tensor:` comment on its first line."""
    lines = source.splitlines()
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "torch":
            imported = sorted({alias.name for alias in node.names} & FACTORIES)
            found += [(node.lineno, f"from torch import {name}") for name in imported]
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        base, name = node.func.value, node.func.attr
        if not (isinstance(base, ast.Name) and base.id == "torch" and name in FACTORIES):
            continue
        if any(keyword.arg == "device" for keyword in node.keywords):
            continue
        if ALLOW in lines[node.lineno - 1]:
            continue
        found.append((node.lineno, f"torch.{name}(...)"))
    return [f"{path}:{line} {what}" for line, what in sorted(found)]


def test_the_check_finds_a_factory_without_a_device_and_passes_the_rest():
    source = "\n".join(
        [
            "import torch",
            "a = torch.zeros(3)",
            "b = torch.zeros(3, device=x.device)",
            "c = torch.zeros_like(b)",
            "d = torch.Generator()",
            "e = torch.tensor([1], device='cpu')",
            "f = torch.arange(4)  # host tensor: an index the host reads",
            "g = torch.tensor([1], **placement)",
            "from torch import ones",
        ]
    )
    assert factory_calls_without_device(source) == [
        "<source>:2 torch.zeros(...)",
        "<source>:5 torch.Generator(...)",
        "<source>:8 torch.tensor(...)",
        "<source>:9 from torch import ones",
    ]


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_generation_and_serving_modules_name_the_device_of_every_tensor_they_make(path: Path):
    assert path.exists()
    assert factory_calls_without_device(path.read_text(), str(path.relative_to(ROOT))) == []
