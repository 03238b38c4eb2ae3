"""Train a raylane config as a Ray job.

    RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . \
        --runtime-env-json "$(raylane util runtime-env --tracking-uri sqlite:////srv/mlflow.db)" \
        -- python pipelines/train.py --config configs/train/digits_ddp.yaml --set training.epochs=3

The job runs in a copy of the working directory: give it an absolute tracking URI (or a tracking
server) and an absolute `training.storage_path`, or its results are lost with the copy.
"""

import sys

import _submitted  # noqa: F401  (the uploaded raylane first)

from raylane.cli import app

if __name__ == "__main__":
    sys.exit(app(["train", *sys.argv[1:]]))
