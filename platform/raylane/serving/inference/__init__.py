"""Inference logic, separate from any serving framework: load a registered model, predict."""

from raylane.serving.inference.predictor import Predictor
from raylane.tracking.registry import ModelNotFoundError, resolve_version

__all__ = ["ModelNotFoundError", "Predictor", "resolve_version"]
