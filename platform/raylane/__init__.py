"""raylane: parallel training on Ray Train, runs and models in MLflow, serving on Ray Serve."""

__version__ = "0.1.0"
