"""Search parallelism layouts as a Ray job; writes the best config under configs/generated/.

    RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . \
        --runtime-env-json "$(raylane util runtime-env --tracking-uri sqlite:////srv/mlflow.db)" \
        -- python pipelines/tune_parallelism.py --config configs/tune/parallelism.yaml \
           --set output_dir=/srv/raylane/generated

Outputs written inside the job's copy of the working directory vanish with it: point
`output_dir` and `storage_path` at shared storage, as above.
"""

import sys

import _submitted  # noqa: F401  (the uploaded raylane first)

from raylane.cli import app

if __name__ == "__main__":
    sys.exit(app(["tune", *sys.argv[1:]]))
