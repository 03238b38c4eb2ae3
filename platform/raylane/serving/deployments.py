"""The Ray Serve deployment: OIP v2 FastAPI routes on the batched model replica itself.

One deployment, not an ingress in front of a model deployment: on small machines the extra
hop cost more than half the throughput (see benchmarks/serve_load.py). Each replica loads one
registry version; an upgrade is a redeploy that Serve rolls out replica by replica, starting
new replicas before old ones stop (`serving.surge_percent`).
"""

import time
from collections import Counter
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve

import raylane
from raylane.serving.guard import GuardSettings, RequestGuard
from raylane.serving.metrics import ReplicaMetrics
from raylane.serving.protocol import (
    InferenceRequest,
    InferenceResponse,
    PredictRequest,
    PredictResponse,
    ProtocolError,
    instances_to_rows,
    logits_to_outputs,
    softmax,
    tensor_to_rows,
)

MAX_ROWS_PER_REQUEST = 1024


api = FastAPI(
    title="raylane inference",
    version=raylane.__version__,
    description="Open Inference Protocol (v2) REST endpoint for models in the raylane registry.",
)


# Filled in by the replica's constructor (one replica per process).
GUARD = GuardSettings()
api.add_middleware(RequestGuard, settings=GUARD)


@api.exception_handler(ProtocolError)
async def _protocol_error(_: Request, exc: ProtocolError) -> JSONResponse:
    return JSONResponse({"error": str(exc)}, status_code=exc.status)


@api.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = f"{where}: {first['msg']}" if where else first["msg"]
    return JSONResponse({"error": message}, status_code=422)


@serve.deployment(name="model")
@serve.ingress(api)
class InferenceServer:
    """Checks requests (4xx for client mistakes) and answers them with batched forwards.

    Concurrent requests are merged by `@serve.batch` into one forward of up to
    `max_batch_size` requests; the sizes formed are counted for the statistics route and
    exported as metrics.
    """

    def __init__(
        self,
        tracking_uri: str,
        registered_model: str,
        version: int,
        model_name: str,
        max_batch_size: int,
        batch_wait_timeout_s: float,
        api_key_digest: str | None = None,
        max_body_bytes: int = 4 * 1024 * 1024,
        torch_threads: int = 1,
    ):
        import torch

        from raylane.inference import Predictor

        torch.set_num_threads(torch_threads)
        GUARD.key_digest = api_key_digest
        GUARD.max_body_bytes = max_body_bytes
        self.model_name = model_name
        self.predictor = Predictor.from_registry(
            tracking_uri, registered_model, alias="", version=version
        )
        self.predict_batch.set_max_batch_size(max_batch_size)
        self.predict_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)
        self.batch_sizes: Counter[int] = Counter()
        self.metrics = ReplicaMetrics(model_name, self.predictor.card.version)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
    async def predict_batch(self, requests: list[np.ndarray]) -> list[np.ndarray]:
        self.batch_sizes[len(requests)] += 1
        rows = np.concatenate(requests)
        started = time.perf_counter()
        logits = self.predictor.predict(rows)
        self.metrics.record_forward(len(rows), time.perf_counter() - started)
        return np.split(logits, np.cumsum([len(r) for r in requests])[:-1])

    def card(self) -> dict[str, Any]:
        card = self.predictor.card
        return {
            "registered_model": card.registered_model,
            "version": card.version,
            "run_id": card.run_id,
            "input_dim": card.input_dim,
            "num_classes": card.num_classes,
            "input_datatype": "INT64" if card.input_dtype == "int64" else "FP32",
        }

    def statistics(self) -> dict[str, Any]:
        batches = sum(self.batch_sizes.values())
        requests = sum(size * count for size, count in self.batch_sizes.items())
        return {
            "version": self.predictor.card.version,
            "batches": batches,
            "requests": requests,
            "mean_batch_size": requests / batches if batches else 0.0,
            "max_batch_size": max(self.batch_sizes, default=0),
            "batch_size_counts": {str(k): v for k, v in sorted(self.batch_sizes.items())},
        }

    def _check_name(self, name: str) -> None:
        if name != self.model_name:
            raise ProtocolError(
                f"model {name!r} is not served here; available: {self.model_name!r}", 404
            )

    @api.get("/v2/health/live")
    async def live(self) -> dict:
        return {"live": True}

    @api.get("/v2/health/ready")
    async def ready(self) -> dict:
        # A replica exists only once its constructor has loaded the model.
        return {"ready": True}

    @api.get("/v2")
    async def server_metadata(self) -> dict:
        return {"name": "raylane", "version": raylane.__version__, "extensions": ["statistics"]}

    @api.get("/v2/models/{name}")
    async def model_metadata(self, name: str) -> dict:
        self._check_name(name)
        card = self.card()
        return {
            "name": name,
            "versions": [str(card["version"])],
            "platform": "pytorch_torch_export",
            "registered_model": card["registered_model"],
            "run_id": card["run_id"],
            "inputs": [
                {
                    "name": "features",
                    "datatype": card["input_datatype"],
                    "shape": [-1, card["input_dim"]],
                }
            ],
            "outputs": [
                {"name": "logits", "datatype": "FP32", "shape": [-1, card["num_classes"]]},
                {"name": "label", "datatype": "INT64", "shape": [-1]},
            ],
        }

    @api.get("/v2/models/{name}/ready")
    async def model_ready(self, name: str) -> dict:
        self._check_name(name)
        return await self.ready()

    @api.get("/v2/models/{name}/stats")
    async def model_statistics(self, name: str) -> dict:
        """Batch sizes formed by the replica that answers (Triton's statistics extension)."""
        self._check_name(name)
        return {"model_stats": [{"name": name, **self.statistics()}]}

    @api.post("/v2/models/{name}/infer", response_model=InferenceResponse)
    async def infer(self, name: str, request: InferenceRequest) -> InferenceResponse:
        self._check_name(name)
        card = self.predictor.card
        rows = tensor_to_rows(request.inputs[0], card.input_dim, MAX_ROWS_PER_REQUEST)
        if request.outputs:
            wanted = {o.name for o in request.outputs}
            unknown = wanted - {"logits", "label"}
            if unknown:
                raise ProtocolError(f"unknown output {sorted(unknown)[0]!r}; known: logits, label")
        outputs = logits_to_outputs(await self.predict_batch(rows))
        if request.outputs:
            outputs = [o for o in outputs if o.name in wanted]
        return InferenceResponse(
            model_name=name, model_version=str(card.version), id=request.id, outputs=outputs
        )

    @api.post("/predict", response_model=PredictResponse)
    async def predict(self, request: PredictRequest) -> PredictResponse:
        card = self.predictor.card
        rows = instances_to_rows(request, card.input_dim, MAX_ROWS_PER_REQUEST)
        logits = await self.predict_batch(rows)
        return PredictResponse(
            model_name=self.model_name,
            model_version=str(card.version),
            predictions=logits.argmax(axis=1).tolist(),
            probabilities=softmax(logits).round(6).tolist(),
        )
