"""Plain torch models, with no parallelism inside them, and the optimizer that trains them
(`raylane.models.optim`)."""

from raylane.models.classifier import ConvClassifier, MLPClassifier, build_model

__all__ = ["ConvClassifier", "MLPClassifier", "build_model"]
