"""The OpenAI-compatible HTTP server: FastAPI routes over one `EngineLoop`.

Routes: GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions,
GET /health, GET /metrics. With an API key every request needs `Authorization: Bearer KEY` (401
otherwise) except GET /health, which stays open for load balancers and probes.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from onboard.engine import GrammarSpec, LLMEngine, SamplingParams
from onboard.errors import OnboardError
from onboard.server.errors import APIError, bad_value, error_response, install_error_handlers
from onboard.server.loop import EngineDeadError, EngineLoop, RequestHandle
from onboard.server.metrics import Metrics
from onboard.server.protocol import SAMPLING_FIELDS, ChatCompletionRequest, CompletionRequest, GenerationRequest
from onboard.server.responses import DONE, Accumulated, Echo, Responder, TokenText, sse

OPEN_PATHS = {"/health"}
ROUTES = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics"}


class _Guard:
    """Pure ASGI middleware (streams pass through untouched): API key, then request counts by status."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: Metrics) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in ROUTES else "/v1/models/{id}" if path.startswith("/v1/models/") else "other"
        if self.expected and path not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = APIError("missing or incorrect API key", status=401, code="invalid_api_key")
                self.metrics.count_http(route, 401)
                await error_response(err, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        status = 500

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.count_http(route, status)


class Server:
    """The routes' shared state: the engine loop and what the handlers may read without it."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.model_name = model_name
        self.metrics = Metrics()
        self.loop = EngineLoop(engine, self.metrics)
        # Read once here, before the engine thread starts; afterwards only that thread touches the
        # engine. The tokenizer is used by handlers for encoding (this event loop only) and for
        # logprob token texts; the grammar factory compiles under its own lock.
        self.tokenizer = engine.tokenizer
        self.grammars = engine.grammars
        self.max_model_len = engine.config.max_model_len
        self.max_logprobs = engine.config.max_logprobs
        self.model_vocab_size = engine.vocab_size  # what -1 logprobs (the whole vocabulary) returns
        self.vocab_size = min(len(engine.tokenizer), engine.vocab_size)
        self.token_text = TokenText(engine.tokenizer)
        self.created = int(time.time())

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                f"The model `{name}` does not exist (this server serves `{self.model_name}`).",
                status=404,
                param="model",
                code="model_not_found",
            )

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "onboard",
            "max_model_len": self.max_model_len,
        }

    # -- prompts --------------------------------------------------------------------------------

    def encode_completion(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param="prompt")
        return list(prompt)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError("this model has no chat template; use /v1/completions", param="messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as err:  # jinja raises for roles or shapes the template refuses
            raise APIError(f"the chat template refused the messages: {err}", param="messages") from None
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def check_length(self, prompt: list[int], param: str) -> None:
        if len(prompt) >= self.max_model_len:
            raise APIError(
                f"the prompt has {len(prompt)} tokens; the context length is {self.max_model_len} (prompt + output)",
                param=param,
            )

    # -- submission -----------------------------------------------------------------------------

    def params(
        self, body: GenerationRequest, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
    ) -> SamplingParams:
        try:
            return body.sampling_params(
                max_tokens, logprobs, prompt_logprobs, max_logprobs=self.max_logprobs, vocab_size=self.model_vocab_size
            )
        except ValueError as err:
            raise bad_value(err, SAMPLING_FIELDS) from None

    async def submit(
        self, prompt: list[int], params: SamplingParams, grammar: GrammarSpec | None, arrival: float
    ) -> RequestHandle:
        if grammar is not None:
            # Compile off the event loop and off the engine thread (the factory caches it for add_request).
            try:
                await asyncio.to_thread(self.grammars.compile, grammar)
            except Exception as err:
                raise bad_value(err if isinstance(err, ValueError) else ValueError(str(err))) from None
        try:
            return await self.loop.add(prompt, params, grammar, arrival)
        except ValueError as err:
            raise bad_value(err, SAMPLING_FIELDS) from None
        except EngineDeadError as err:
            raise APIError(str(err), status=503, type_="server_error") from None


async def _respond(
    request: Request, body: GenerationRequest, handle: RequestHandle, responder: Responder, logprobs: bool
) -> Any:
    if body.stream:
        events = _stream(handle, responder, logprobs, body.include_usage)
        return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(handle.abort))
    acc = Accumulated()
    try:
        async for out in handle.outputs(disconnected=request.is_disconnected):
            acc.add(out)
    except EngineDeadError as err:
        raise APIError(str(err), status=503, type_="server_error") from None
    finally:
        handle.abort()  # a no-op once finished; frees the blocks if the client went away
    return JSONResponse(responder.full(acc, logprobs))


async def _stream(
    handle: RequestHandle, responder: Responder, logprobs: bool, include_usage: bool
) -> AsyncIterator[str]:
    """SSE events. A client that disconnects cancels this generator; `finally` aborts the request."""
    try:
        first = responder.first_chunk(include_usage)
        if first is not None:
            yield sse(first)
        prompt_tokens = completion_tokens = 0
        try:
            async for out in handle.outputs():
                prompt_tokens, completion_tokens = out.num_prompt_tokens, out.num_completion_tokens
                chunk = responder.chunk(out, logprobs, include_usage)
                if chunk is not None:
                    yield sse(chunk)
        except EngineDeadError as err:
            yield sse({"error": {"message": str(err), "type": "server_error", "param": None, "code": None}})
        else:
            if include_usage:
                yield sse(responder.usage_chunk(prompt_tokens, completion_tokens))
        yield DONE
    finally:
        handle.abort()


def build_app(engine: LLMEngine, model_name: str, *, api_key: str | None = None) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the engine thread."""
    server = Server(engine, model_name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.loop.stop)

    app = FastAPI(title="onboard", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    install_error_handlers(app)
    app.add_middleware(_Guard, api_key=api_key, metrics=server.metrics)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not server.loop.alive:
            return JSONResponse({"status": "engine dead"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        server.check_model(model_id)
        return server.model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        arrival = time.monotonic()
        server.check_model(body.model)
        body.check_unsupported()
        given = body.single_prompt()
        prompt = server.encode_completion(given)
        server.check_length(prompt, "prompt")
        params = server.params(body, body.engine_max_tokens(), body.logprobs, body.num_prompt_logprobs())
        handle = await server.submit(prompt, params, body.grammar(), arrival)
        echo = None
        if body.echo:
            text = given if isinstance(given, str) else server.tokenizer.decode(prompt)
            echo = Echo(text, prompt, only=body.echo_only, num_logprobs=body.logprobs)
        shown_ids = list(prompt) if body.return_token_ids else None
        responder = Responder("completion", server.model_name, server.token_text, echo, shown_ids)
        return await _respond(request, body, handle, responder, body.logprobs is not None)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        arrival = time.monotonic()
        server.check_model(body.model)
        body.check_unsupported()
        num_logprobs = body.num_logprobs(server.max_logprobs, server.model_vocab_size)
        grammar = body.grammar()
        prompt = server.encode_chat(body.chat_messages())
        server.check_length(prompt, "messages")
        max_tokens = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None), None)
        if max_tokens is None:  # as vLLM: whatever the context leaves (the engine refuses a prompt that fills it)
            max_tokens = max(1, server.max_model_len - len(prompt))
        params = server.params(body, max_tokens, num_logprobs, body.prompt_logprobs)
        handle = await server.submit(prompt, params, grammar, arrival)
        responder = Responder("chat", server.model_name, server.token_text)
        return await _respond(request, body, handle, responder, body.logprobs)

    return app


def serve(
    model_dir: Path,
    *,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    engine_config: Any = None,
    device: str = "cpu",
    speculator: Path | None = None,
    num_speculative_tokens: int | None = None,
) -> None:
    """Load the engine (with an EAGLE-3 draft, or for `mtp` its own MTP layers, when `speculator` is
    given) and serve it with uvicorn until interrupted."""
    from dataclasses import replace

    import uvicorn

    from onboard.engine import EngineConfig

    engine = LLMEngine(model_dir, replace(engine_config or EngineConfig(), device=device))
    if speculator is not None:
        from onboard.speculator.drafts import load_draft

        draft, default_k = load_draft(speculator, model_dir, engine)
        try:
            engine.set_speculator(draft.to(device), num_speculative_tokens or default_k)
        except ValueError as err:
            raise OnboardError(f"--speculator {speculator}: {err}") from None
    uvicorn.run(build_app(engine, model_name, api_key=api_key), host=host, port=port, log_level="info")
