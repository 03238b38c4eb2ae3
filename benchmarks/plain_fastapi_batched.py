"""The strongest single-process alternative to raylane serving a user could write: FastAPI +
uvicorn with its own asyncio micro-batcher (requests queue up; one task takes up to
`RAYLANE_BENCH_BATCH` of them, or what arrived within `RAYLANE_BENCH_BATCH_WAIT` seconds, and
runs one forward). Same model, same request parsing and encoding as raylane's replica.

    RAYLANE_BENCH_TRACKING_URI=sqlite:///... RAYLANE_BENCH_MODEL=bench-mlp \
        uvicorn benchmarks.plain_fastapi_batched:app --host 127.0.0.1 --port 8100
"""

import asyncio
import os

import numpy as np
import torch
from fastapi import FastAPI, Request, Response

from raylane.serving.inference import Predictor
from raylane.serving.protocol import ProtocolError, decode_infer, encode_infer

torch.set_num_threads(int(os.environ.get("RAYLANE_BENCH_TORCH_THREADS", "1")))
MAX_BATCH = int(os.environ.get("RAYLANE_BENCH_BATCH", "32"))
BATCH_WAIT_S = float(os.environ.get("RAYLANE_BENCH_BATCH_WAIT", "0.005"))
predictor = Predictor.from_registry(
    os.environ["RAYLANE_BENCH_TRACKING_URI"], os.environ["RAYLANE_BENCH_MODEL"], "champion"
)
app = FastAPI()
queue: asyncio.Queue = asyncio.Queue()


async def batcher() -> None:
    loop = asyncio.get_running_loop()
    while True:
        batch = [await queue.get()]
        deadline = loop.time() + BATCH_WAIT_S
        while len(batch) < MAX_BATCH:
            timeout = deadline - loop.time()
            if timeout <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(queue.get(), timeout))
            except TimeoutError:
                break
        rows = [item[0] for item in batch]
        logits = predictor.predict(np.concatenate(rows))
        for (_, future), part in zip(
            batch, np.split(logits, np.cumsum([len(r) for r in rows])[:-1]), strict=True
        ):
            future.set_result(part)


@app.on_event("startup")
async def start_batcher() -> None:
    app.state.batcher = asyncio.create_task(batcher())


@app.post("/v2/models/{name}/infer")
async def infer(name: str, request: Request) -> Response:
    card = predictor.card
    try:
        call = decode_infer(
            await request.body(),
            request.headers.get("inference-header-content-length"),
            card.input_dim,
            1024,
            card.input_dtype,
        )
    except ProtocolError as exc:
        return Response(str(exc), status_code=exc.status)
    future = asyncio.get_running_loop().create_future()
    await queue.put((call.rows, future))
    body, headers = encode_infer(name, str(card.version), call, await future)
    return Response(body, headers=headers)
