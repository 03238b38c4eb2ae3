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
from fastapi.responses import JSONResponse, Response
from ray import serve

import raylane
from raylane.serving.binary_tensors import HEADER_LENGTH
from raylane.serving.guard import GuardSettings, RequestGuard
from raylane.serving.infer_route import InferRoute, InferTarget
from raylane.serving.metrics import ReplicaMetrics
from raylane.serving.openapi import add_component_schemas, infer_request_body
from raylane.serving.protocol import (
    InferenceRequest,
    InferenceResponse,
    PredictRequest,
    PredictResponse,
    ProtocolError,
    decode_infer,
    encode_infer,
    instances_to_rows,
    softmax,
)
from raylane.serving.replica import ReplicaSetup

MAX_ROWS_PER_REQUEST = 1024


api = FastAPI(
    title="raylane inference",
    version=raylane.__version__,
    description="Open Inference Protocol (v2) REST endpoint for models in the raylane registry.",
)


# Filled in by the replica's constructor (one replica per process). The guard is added last so
# that it runs first: every route, the raw infer route included, sits behind it.
GUARD = GuardSettings()
INFER = InferTarget()
api.add_middleware(InferRoute, target=INFER)
api.add_middleware(RequestGuard, settings=GUARD)
add_component_schemas(api, InferenceRequest)
EXTENSIONS = ["binary_tensor_data", "statistics"]


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

    # The infer routes are answered by `InferRoute` before FastAPI's router; these route
    # definitions describe them in OpenAPI, name them in Serve's metrics, and answer the same
    # way should a request reach the router. They come first so Serve's per-request route
    # lookup matches them at once.
    @api.post(
        "/v2/models/{name}/infer",
        openapi_extra=infer_request_body(),
        responses={200: {"model": InferenceResponse}},
    )
    async def infer(self, name: str, request: Request) -> Response:
        """Run the model on one input tensor: JSON, or binary tensor data."""
        return await self._answer(name, None, request)

    @api.post(
        "/v2/models/{name}/versions/{version}/infer",
        openapi_extra=infer_request_body(),
        responses={200: {"model": InferenceResponse}},
    )
    async def infer_version(self, name: str, version: str, request: Request) -> Response:
        """The same, for a client that names the version (it must be the one served)."""
        return await self._answer(name, version, request)

    async def _answer(self, name: str, version: str | None, request: Request) -> Response:
        body, headers = await self.infer_body(
            name, version, await request.body(), request.headers.get(HEADER_LENGTH)
        )
        return Response(body, headers=headers)

    def __init__(self, replica: ReplicaSetup, max_batch_size: int, batch_wait_timeout_s: float):
        from raylane.serving.inference import Predictor  # lazy: torch, see ReplicaSetup.start

        device = replica.start(GUARD)
        self.model_name = replica.model_name
        self.predictor = Predictor.from_registry(
            replica.tracking_uri, replica.registered_model, alias="", version=replica.version,
            device=device,
        )  # fmt: skip
        self.predict_batch.set_max_batch_size(max_batch_size)
        self.predict_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)
        self.batch_sizes: Counter[int] = Counter()
        self.metrics = ReplicaMetrics(replica.model_name, self.predictor.card.version)
        INFER.handler = self

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
    async def predict_batch(self, requests: list[np.ndarray]) -> list[np.ndarray]:
        self.batch_sizes[len(requests)] += 1
        rows = requests[0] if len(requests) == 1 else np.concatenate(requests)
        # The forward runs on the event loop itself. Run in a worker thread (Serve's general
        # advice) it measured 0.6x on benchmarks/serve_load.py: torch gives up and retakes the
        # GIL around every op, each retake waits out the loop's switch interval, and batches
        # formed half as full.
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
            # Which replica answered: with several, each counts only its own batches.
            "replica": serve.get_replica_context().replica_id.unique_id,
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
        return {"name": "raylane", "version": raylane.__version__, "extensions": EXTENSIONS}

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

    async def infer_body(
        self, name: str, version: str | None, body: bytes, header_length: str | None
    ) -> tuple[bytes, dict[str, str]]:
        """Answer an infer request body (JSON, or JSON + binary tensors) for `InferRoute`."""
        self._check_name(name)
        card = self.predictor.card
        if version is not None and version != str(card.version):
            raise ProtocolError(
                f"model {name!r} version {version} is not served here; available: {card.version}",
                404,
            )
        call = decode_infer(
            body, header_length, card.input_dim, MAX_ROWS_PER_REQUEST, card.input_dtype
        )
        logits = await self.predict_batch(call.rows)
        return encode_infer(name, str(card.version), call, logits)

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
