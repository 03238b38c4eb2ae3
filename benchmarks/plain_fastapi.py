"""The baseline a user would write instead of raylane serving: FastAPI + uvicorn, one process,
one request per forward (no batching). Same model, same request parsing, same torch threads.

    RAYLANE_BENCH_TRACKING_URI=sqlite:///... RAYLANE_BENCH_MODEL=bench-mlp \
        uvicorn benchmarks.plain_fastapi:app --host 127.0.0.1 --port 8100
"""

import os

import torch
from fastapi import FastAPI

from raylane.serving.inference import Predictor
from raylane.serving.protocol import InferenceRequest, logits_to_outputs, tensor_to_rows

torch.set_num_threads(int(os.environ.get("RAYLANE_BENCH_TORCH_THREADS", "1")))
predictor = Predictor.from_registry(
    os.environ["RAYLANE_BENCH_TRACKING_URI"], os.environ["RAYLANE_BENCH_MODEL"], "champion"
)
app = FastAPI()


@app.post("/v2/models/{name}/infer")
def infer(name: str, request: InferenceRequest) -> dict:
    # A sync route: FastAPI runs it in its thread pool, which measured faster than async here.
    rows = tensor_to_rows(request.inputs[0], predictor.card.input_dim, 1024)
    outputs = logits_to_outputs(predictor.predict(rows))
    return {
        "model_name": name,
        "model_version": str(predictor.card.version),
        "outputs": [o.model_dump() for o in outputs],
    }
