"""Reproduce a recorded training run as a Ray job (see `raylane reproduce --help`).

    RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . \
        --runtime-env-json "$(raylane util runtime-env --tracking-uri sqlite:////srv/mlflow.db)" \
        -- python pipelines/reproduce.py RUN_ID

The job checks code, data, versions and cluster against the run's record, trains again and
prints `identical` or the first epoch and metric that differ.
"""

import sys

import _submitted  # noqa: F401  (the uploaded raylane first)

from raylane.cli import app

if __name__ == "__main__":
    sys.exit(app(["reproduce", *sys.argv[1:]]))
