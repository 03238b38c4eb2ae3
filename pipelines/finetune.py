"""Fine-tune a registered model as a Ray job (a config with a `finetune:` section).

    RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . \
        --runtime-env-json "$(raylane util runtime-env --tracking-uri sqlite:////srv/mlflow.db)" \
        -- python pipelines/finetune.py --config configs/finetune/lm_lora.yaml

The base is read from the tracking store the job is given: give it an absolute tracking URI
(or a tracking server) and an absolute `training.storage_path`, or its results are lost with
the job's copy of the working directory.
"""

import sys

import _submitted  # noqa: F401  (the uploaded raylane first)

from raylane.cli import app

if __name__ == "__main__":
    sys.exit(app(["finetune", *sys.argv[1:]]))
