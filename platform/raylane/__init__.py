"""raylane: parallel training on Ray Train, runs and models in MLflow, serving on Ray Serve."""

import os

__version__ = "0.1.0"

# MLflow draws a progress bar for every artifact download and upload when tqdm is installed
# (transformers brings it): dozens of lines on a console that shows one line per epoch. A
# user's own setting wins.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
