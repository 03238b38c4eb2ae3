"""The Ray Serve deployment for language models: text generation over an OpenAI-compatible
API (`/v1/completions`, `/v1/chat/completions`, `/v1/models`, server-sent events when
`stream: true`) and the Open Inference Protocol's generate extension
(`/v2/models/{name}/generate`, `/generate_stream`).

Each replica loads one registry version and decodes with a KV cache under continuous batching
(`raylane.serving.generation.engine`, `raylane.serving.generation_loop`): `serving.generation
.max_num_seqs` sequences decode together; more wait for a slot, and past Serve's queue bound a
request gets 503 with Retry-After. The API-key guard and body limit are the inference routes'.
A replica given GPUs (`serving.replica_gpus`) holds its model, draft, cache and adapters on its
CUDA device, in `serving.dtype` (`raylane.serving.generation.placement`).

Text goes through the served version's codec (`raylane.serving.generation.text_codec`): bytes for a
byte-level GPT, its own tokenizer for a Llama-family model, whose chat template (when its
tokenizer_config.json has one) renders `/v1/chat/completions` conversations.
"""

# No `from __future__ import annotations` here: FastAPI must see the route parameters' real
# types (a string annotation of `Request` on a Serve ingress method becomes a query field).
import os
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

import raylane
from raylane.serving.adapter_routing import AdapterDirectory
from raylane.serving.errors import ProtocolError, route_path
from raylane.serving.generation.engine import MAX_MODEL_LEN, GenerationEngine
from raylane.serving.generation.loader import load_draft_model, load_generation_model
from raylane.serving.generation.placement import DTYPES, place_model
from raylane.serving.generation_loop import GenerationLoop
from raylane.serving.guard import GuardSettings, RequestGuard
from raylane.serving.metrics import GenerationMetrics
from raylane.serving.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    TextStream,
    completion_body,
    completion_id,
    openai_error,
    parse,
    sse,
    usage,
)
from raylane.serving.openapi import add_component_schemas, request_body
from raylane.serving.replica import ReplicaSetup

api = FastAPI(
    title="raylane generation",
    version=raylane.__version__,
    description="OpenAI-compatible completions and the OIP generate extension for raylane's "
    "language models.",
)
GUARD = GuardSettings()
api.add_middleware(RequestGuard, settings=GUARD)
# The routes parse their bodies themselves (a client's mistake answered in the API's own error
# format); the schemas are declared for /docs and schema-driven clients.
add_component_schemas(api, CompletionRequest, ChatCompletionRequest, GenerateRequest)
GENERATE_BODY = request_body("GenerateRequest", "OIP generate: text_input and parameters.")


@api.exception_handler(ProtocolError)
async def _protocol_error(request: Request, exc: ProtocolError) -> JSONResponse:
    if route_path(request.scope).startswith("/v1/"):  # under the app's route prefix too
        body = openai_error(str(exc), exc.status)
    else:
        body = {"error": str(exc)}
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


@serve.deployment(name="generator")
@serve.ingress(api)
class GenerationServer:
    """Answers generation requests from one continuously batched engine per replica."""

    def __init__(
        self,
        replica: ReplicaSetup,
        max_num_seqs: int,
        default_max_tokens: int,
        speculate: int = 0,
        quantization: str = "none",
        draft_model: str | None = None,
        max_adapters: int = 0,
        merge_adapter: bool = True,
        retry_after_s: float = 1.0,
        dtype: str = "fp32",
        cuda_graphs: bool = False,
        max_model_len: int = MAX_MODEL_LEN,
    ):
        self.device, self.dtype = replica.start(GUARD), dtype
        self.model_name = model_name = replica.model_name
        self.default_max_tokens = default_max_tokens
        tracking_uri = replica.tracking_uri
        # An imported checkpoint is read in the serving dtype onto the replica's device (no
        # fp32 copy on the host first); an unknown dtype is `place_model`'s to refuse.
        served = load_generation_model(
            tracking_uri, replica.registered_model, replica.version, merge=merge_adapter,
            dtype=DTYPES.get(dtype, DTYPES["fp32"]), device=self.device,
        )  # fmt: skip
        self.card, self.quantization = served.card, quantization
        self.codec = served.card.codec
        model = place_model(served.model, self.device, dtype, quantization)
        self.max_num_seqs = max_num_seqs
        metrics = GenerationMetrics(model_name, self.card.version)
        draft, self.draft_card = None, None
        if draft_model is not None:
            draft, self.draft_card = load_draft_model(tracking_uri, draft_model)
            place_model(draft, self.device, dtype)  # never quantized: it is small
        own = served.own_adapter is not None
        slots = (max_adapters if served.base else 0) + own
        decode = "cuda_graph" if cuda_graphs else "dynamic"
        draft_codec = self.draft_card.codec if self.draft_card is not None else None
        engine = GenerationEngine(model, max_num_seqs, speculate, draft, slots, decode,
                                  codec=self.codec, draft_codec=draft_codec,
                                  max_model_len=max_model_len)  # fmt: skip
        self.loop = GenerationLoop(engine, metrics)
        self.adapters = AdapterDirectory(model_name, served, self.loop, tracking_uri,
                                         retry_after_s, max_adapters)  # fmt: skip

    # OpenAI-compatible routes.

    @api.get("/v1/models")
    async def models(self) -> dict:
        adapters = [self._model_entry(name) for name in self.adapters.loaded()]
        return {"object": "list", "data": [self._model_entry(), *adapters]}

    @api.get("/v1/models/{name:path}")
    async def model(self, name: str) -> dict:
        if name in self.adapters.loaded():
            return self._model_entry(name)
        self._check_name(name)
        return self._model_entry()

    @api.post(
        "/v1/completions", openapi_extra=request_body("CompletionRequest", "OpenAI completions.")
    )
    async def completions(self, request: Request) -> Response:
        """Continue `prompt` (OpenAI's completions API)."""
        body = parse(CompletionRequest, await request.body())
        return await self._complete("text_completion", body)

    @api.post(
        "/v1/chat/completions",
        openapi_extra=request_body("ChatCompletionRequest", "OpenAI chat completions."),
    )
    async def chat_completions(self, request: Request) -> Response:
        """Answer `messages` (OpenAI's chat completions API)."""
        body = parse(ChatCompletionRequest, await request.body())
        return await self._complete("chat.completion", body)

    # Open Inference Protocol generate extension.

    async def _start_generate(self, name: str, request: Request):
        """A generate request's generation, started, and its text decoder."""
        body = parse(GenerateRequest, await request.body())
        params = body.sampling(self.default_max_tokens)
        return await self._start(name, self.codec.encode(body.text_input), params)

    @api.post("/v2/models/{name:path}/generate", openapi_extra=GENERATE_BODY)
    async def generate(self, name: str, request: Request) -> dict:
        generation, decoder = await self._start_generate(name, request)
        text = "".join([chunk async for chunk, _ in self._chunks(generation, decoder)])
        return {
            "model_name": name,
            "model_version": str(self.card.version),
            "text_output": text,
            "finish_reason": generation.sequence.finish_reason,
        }

    @api.post("/v2/models/{name:path}/generate_stream", openapi_extra=GENERATE_BODY)
    async def generate_stream(self, name: str, request: Request) -> StreamingResponse:
        generation, decoder = await self._start_generate(name, request)

        async def events() -> AsyncIterator[bytes]:
            async for chunk, finish in self._chunks(generation, decoder):
                yield sse(
                    {
                        "model_name": name,
                        "model_version": str(self.card.version),
                        "text_output": chunk,
                        "finish_reason": finish,
                    }
                )

        return StreamingResponse(events(), media_type="text/event-stream")

    # Health and metadata.

    @api.get("/v2/health/live")
    async def live(self) -> dict:
        return {"live": True}

    @api.get("/v2/health/ready")
    async def ready(self) -> dict:
        return {"ready": True}  # a replica exists once its constructor loaded the model

    @api.get("/v2/models/{name}")
    async def model_metadata(self, name: str) -> dict:
        self._check_name(name)
        card = self.card
        return {
            "name": name,
            "versions": [str(card.version)],
            "platform": "raylane_generation",
            "registered_model": card.registered_model,
            "run_id": card.run_id,
            "context": card.context,
            "parameters": card.parameters,
            "max_num_seqs": self.max_num_seqs,
            "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]}],
            "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}],
        }

    @api.get("/v2/models/{name}/stats")
    async def model_statistics(self, name: str) -> dict:
        """The scheduler of the replica that answers: sequences running and waiting, free
        cache slots, sequences ended by reason, tokens generated, batched forwards run."""
        self._check_name(name)
        engine = self.loop.engine
        return {
            "model_stats": [
                {
                    "name": name,
                    "version": self.card.version,
                    "running": len(engine.running),
                    "waiting": len(engine.waiting),
                    "free_slots": len(engine.free),
                    "max_num_seqs": self.max_num_seqs,
                    "finished": dict(engine.finished),
                    "generated_tokens": engine.tokens_generated,
                    "forwards": engine.forwards,
                    "speculate": engine.speculate,
                    "draft_model": self._draft_name(),
                    "quantization": self.quantization,
                    "device": str(self.device),
                    "dtype": self.dtype,
                    "acceptance_rate": engine.acceptance_rate,
                    "adapters": self.adapters.loaded(),
                    "replica_pid": os.getpid(),
                }
            ]
        }

    def statistics(self) -> dict:
        """The version and generation settings this replica serves (`raylane status`)."""
        settings = f"generate: {self.max_num_seqs} slots"
        speculate = self.loop.engine.speculate
        if speculate and self.draft_card is not None:
            settings += f", draft {self._draft_name()} proposing {speculate}"
        elif speculate:
            settings += f", prompt lookup {speculate}"
        if self.quantization != "none":
            settings += f", {self.quantization} weights"
        if self.dtype != "fp32":
            settings += f", {self.dtype}"
        if self.device.type != "cpu":
            settings += f", on {self.device}"
        if self.loop.engine.runner.static is not None:
            settings += ", CUDA graphs"
        loaded = self.adapters.loaded()
        if loaded:  # adapters requested so far, beside the model itself
            settings += f", adapters {', '.join(name.split(':', 1)[1] for name in loaded)}"
        return {"version": self.card.version, "settings": settings}

    def _draft_name(self) -> str | None:
        card = self.draft_card
        return None if card is None else f"{card.registered_model} v{card.version}"

    # The shared path.

    def _check_name(self, name: str) -> None:
        if name != self.model_name:
            raise ProtocolError(
                f"model {name!r} is not served here; available: {self.model_name!r}", 404
            )

    def _model_entry(self, name: str | None = None) -> dict:
        entry = {
            "id": name or self.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "raylane",
            "root": f"{self.card.registered_model}/{self.card.version}",
            "max_model_len": self.loop.engine.context,
        }
        if name:  # an adapter: its registered name and version, on the served model's base
            entry |= {"root": name.split(":", 1)[1], "parent": self.model_name}
        return entry

    def _prompt(self, body) -> list[int]:
        """A completion request's prompt ids: a chat through the model's chat template when it
        has one (else the plain `role: content` rendering), a prompt through the codec."""
        if isinstance(body, ChatCompletionRequest) and self.codec.has_chat_template:
            try:
                return self.codec.chat_prompt(body.template_messages())
            except ValueError as exc:
                raise ProtocolError(str(exc)) from None
        return self.codec.encode(body.text())

    async def _start(self, name: str, tokens: list[int], params):
        """Queue prompt `tokens` for model `name` (the served model or one of its base's
        adapters)."""
        try:  # a request that cannot run loads no adapter
            self.loop.engine.check(tokens, params)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        adapter = await self.adapters.acquire(name)
        try:
            generation = self.loop.start(tokens, params, adapter)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        return generation, TextStream()

    async def _chunks(self, generation, decoder) -> AsyncIterator[tuple[str, str | None]]:
        """`(text, finish_reason)` per step that released text, then the final one."""
        async for event in self.loop.events(generation):
            text = decoder.feed(event.text, final=event.finished)
            finish = event.sequence.finish_reason if event.finished else None
            if text or finish:
                yield text, finish

    async def _complete(self, kind: str, body) -> Response:
        params = body.sampling(self.default_max_tokens)
        generation, decoder = await self._start(body.model, self._prompt(body), params)
        request_id = completion_id("chatcmpl" if kind.startswith("chat") else "cmpl")
        prompt_count = len(generation.prompt)
        if not body.stream:
            text = "".join([chunk async for chunk, _ in self._chunks(generation, decoder)])
            finish = generation.sequence.finish_reason
            use = usage(prompt_count, len(generation.sequence.output))
            return JSONResponse(completion_body(kind, request_id, body.model, text, finish, use))

        async def events() -> AsyncIterator[bytes]:
            chunk_kind = f"{kind}.chunk"
            async for chunk, finish in self._chunks(generation, decoder):
                yield sse(completion_body(chunk_kind, request_id, body.model, chunk, finish,
                                          None))  # fmt: skip
            if body.include_usage:
                final = completion_body(
                    chunk_kind,
                    request_id,
                    body.model,
                    "",
                    None,
                    usage(prompt_count, len(generation.sequence.output)),
                )
                final["choices"] = []
                yield sse(final)  # fmt: skip
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")
