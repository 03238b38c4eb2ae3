"""Deploy the champion model onto the cluster's Ray Serve as a Ray job, then return.

    RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . \
        --runtime-env-json "$(raylane util runtime-env --tracking-uri sqlite:////srv/mlflow.db)" \
        -- python pipelines/deploy.py --config configs/train/digits_ddp.yaml

The application stays on the cluster after the job ends (`serve status` shows it).
"""

import sys

import _submitted  # noqa: F401  (the uploaded raylane first)

from raylane.cli import app

if __name__ == "__main__":
    sys.exit(app(["deploy", "--detach", *sys.argv[1:]]))
