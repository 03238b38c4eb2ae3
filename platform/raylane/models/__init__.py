"""Plain torch models, with no parallelism inside them, and the optimizer that trains them
(`raylane.models.optim`).

The classifiers and `build_model` read the validated config (pydantic); they are imported on
first use, so the torch-only modules (`raylane.models.gpt`, `llama`, `kv_cache`, `multi_lora`;
`hf_checkpoint` with safetensors) import on a machine that has torch and nothing else
(`benchmarks/gpu.py` runs there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raylane.models.classifier import ConvClassifier, MLPClassifier, build_model

__all__ = ["ConvClassifier", "MLPClassifier", "build_model"]


def __getattr__(name: str):
    if name in __all__:
        # lazy: the classifiers need pydantic; the torch-only modules import without it
        from raylane.models import classifier

        return getattr(classifier, name)
    raise AttributeError(f"module 'raylane.models' has no attribute {name!r}")
