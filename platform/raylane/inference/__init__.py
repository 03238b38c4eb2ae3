"""Inference logic, separate from any serving framework: load a registered model, predict."""

from raylane.inference.predictor import ModelNotFoundError, Predictor, resolve_version

__all__ = ["ModelNotFoundError", "Predictor", "resolve_version"]
