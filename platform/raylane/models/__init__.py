"""Plain torch models, with no parallelism inside them."""

from raylane.models.classifier import ConvClassifier, MLPClassifier, build_model

__all__ = ["ConvClassifier", "MLPClassifier", "build_model"]
