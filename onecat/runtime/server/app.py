"""The FastAPI application: OpenAI routes, health, version, metrics, API key and errors.

Every error leaves as an OpenAI-style body ``{"error": {"message", "type", "param",
"code"}}``: request validation (malformed JSON, wrong types, numbers out of range, invalid
Unicode) and engine refusals as 400, a missing or wrong API key as 401, a body over the size
limit as 413, a full queue as 429, a failed engine or a server shutting down as 503. A 500
says only "internal error" and a request id; the log has that id with the traceback. When
an API key is set it guards the ``/v1`` routes, ``/tokenize`` and ``/detokenize`` (as vLLM's
``--api-key`` does); /health, /version and /metrics stay open for probes and scrapers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

import onecat
from onecat.runtime.server.api_errors import APIError, clip, error_body, internal_error
from onecat.runtime.server.async_engine import EngineClient
from onecat.runtime.server.chat_plan import ChatOptions
from onecat.runtime.server.grammar_workers import DEFAULT_COMPILE_TIMEOUT
from onecat.runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from onecat.runtime.server.openai_serving import OpenAIServing, Submitted
from onecat.runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
PROMPT_THREADS = 2  # chat template rendering and tokenisation, off the event loop
RETRY_AFTER = {"Retry-After": "1"}
"""Sent with a 429 (queue full) and a 503 (no engine up, a replica failed, shutting down)."""
GUARDED_PATHS = ("/v1", "/tokenize", "/detokenize")
"""What the API key guards (vLLM guards every route but its public ones)."""


class _APIKeyMiddleware:
    """Answers 401 to /v1 requests without ``Authorization: Bearer <key>`` (pure ASGI, so
    streamed responses and disconnect detection pass through untouched)."""

    def __init__(self, app: ASGIApp, api_key: str, metrics: ServerMetrics) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(GUARDED_PATHS) and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                self.metrics.request_errors.labels("401").inc()
                message = "missing API key" if not given else "invalid API key"
                body = error_body(
                    f"{message}: send the header 'Authorization: Bearer <key>' with the server's --api-key",
                    type="authentication_error",
                    code="invalid_api_key",
                )
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _InternalErrorMiddleware:
    """Turns an exception no handler took into a 500 that says only "internal error" and a
    request id, and logs that id with the traceback. (Starlette's own last-resort handler
    re-raises, and uvicorn then resets the connection.)"""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            request_id = f"err-{uuid.uuid4().hex}"
            logger.error("internal error %s while serving %s", request_id, scope.get("path"), exc_info=exc)
            self.metrics.request_errors.labels("500").inc()
            if not started:  # otherwise the response is cut short, as nothing else can be done
                await JSONResponse(internal_error(request_id).body(), status_code=500)(scope, receive, send)


DRAIN_SECONDS = 5.0
"""How long a refused request's body is read and dropped before the 413 is sent."""


async def _drop_body(receive: Receive, seconds: float) -> None:
    """Read and drop a request's remaining body until it ends, the client leaves or
    ``seconds`` pass."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while (left := deadline - loop.time()) > 0:
        try:
            message = await asyncio.wait_for(receive(), left)
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


class _BodySizeLimitMiddleware:
    """Answers 413 to a request whose body exceeds ``max_bytes``: when its Content-Length says
    so, otherwise (chunked) as soon as the bytes received pass the limit. Before answering, the
    rest of the body is read and dropped for up to ``DRAIN_SECONDS`` (nothing is kept): a
    server that closes a connection with unread data resets it, and the client, still
    sending, may then lose the 413. Pure ASGI, so the app sees the body as it was sent."""

    def __init__(self, app: ASGIApp, max_bytes: int, metrics: ServerMetrics) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None:  # h11 has checked that it is a number and frames the body by it
            if int(length) > self.max_bytes:
                await self._refuse(int(length), scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        if b"chunked" not in headers.get(b"transfer-encoding", b""):
            await self.app(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left mid-body: let the app see it
                break
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._refuse(len(body), scope, receive, send, so_far=True)
                return
            if not message.get("more_body", False):
                message = {"type": "http.request", "body": bytes(body), "more_body": False}
                break
        pending = [message]

        async def replay() -> Any:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, size: int, scope: Scope, receive: Receive, send: Send, so_far: bool = False) -> None:
        self.metrics.request_errors.labels("413").inc()
        await _drop_body(receive, DRAIN_SECONDS)
        body = error_body(
            f"the request body ({size} bytes{' so far' if so_far else ''}) is larger than the "
            f"{self.max_bytes} bytes this server accepts (--max-request-body-bytes)",
            code="request_too_large",
        )
        await JSONResponse(body, status_code=413, headers={"Connection": "close"})(scope, receive, send)


class _AbortingStreamingResponse(StreamingResponse):
    """A streamed response that aborts its engine request however it ends (client gone,
    error, cancellation), so that the request's KV blocks and state slot are freed."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A readable message and the offending parameter for pydantic validation errors."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON: {detail}".rstrip(": "), None
    if tuple(first.get("loc", ())) == ("body",):
        return "the request body must be a JSON object (send Content-Type: application/json)", None
    parts = []
    for err in errors[:3]:
        loc = [clip(x, 64) for x in err.get("loc", ()) if x != "body"]  # a dict key may be huge
        parts.append(f"{'.'.join(loc) or 'body'}: {clip(err.get('msg', 'invalid'))}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    return "invalid request: " + "; ".join(parts) + more, (loc[0] if loc else None)


def create_app(
    engine: EngineClient,
    *,
    api_key: str | None = None,
    trust_request_chat_template: bool = False,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    chat_options: ChatOptions | None = None,
    grammar_compile_timeout: float | None = None,
) -> FastAPI:
    """The OpenAI-compatible app serving ``engine`` (whose thread the caller starts/stops).

    ``trust_request_chat_template`` lets requests bring their own chat template;
    ``max_request_body_bytes`` bounds a request body (413 beyond it); ``chat_options`` are the
    tool-call and reasoning parsers (vLLM's flags); ``grammar_compile_timeout`` bounds a
    grammar's compile in seconds (``--structured-outputs-compile-timeout``). The grammar
    worker processes are killed when the app shuts down.
    """
    metrics = ServerMetrics(model_name=engine.model_name, max_model_len=engine.max_model_len,
                            replica_stats=engine.replica_stats)
    executor = ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="onecat-prompt")
    serving = OpenAIServing(
        engine, metrics, executor, trust_request_chat_template=trust_request_chat_template,
        chat_options=chat_options, grammar_compile_timeout=grammar_compile_timeout or DEFAULT_COMPILE_TIMEOUT,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            serving.close()

    app = FastAPI(title="onecat", version=onecat.__version__, lifespan=lifespan)
    app.state.serving = serving
    app.state.engine = engine
    app.state.metrics = metrics
    created = int(time.time())
    app.add_middleware(_InternalErrorMiddleware, metrics=metrics)
    app.add_middleware(_BodySizeLimitMiddleware, max_bytes=max_request_body_bytes, metrics=metrics)
    if api_key:  # outermost: a client without the key gets nothing buffered
        app.add_middleware(_APIKeyMiddleware, api_key=api_key, metrics=metrics)

    def error_response(status: int, body: dict[str, Any]) -> JSONResponse:
        metrics.request_errors.labels(str(status)).inc()
        headers = RETRY_AFTER if status in (429, 503) else None
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.body())

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(list(exc.errors()))
        return error_response(400, error_body(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, error_body(str(exc.detail), type=kind))

    @app.get("/health")
    async def health() -> JSONResponse:
        body = engine.health()
        if engine.draining:
            body["status"] = "shutting_down"
            body["error"] = error_body("the server is shutting down", type="server_error",
                                       code="server_shutting_down")["error"]
            return JSONResponse(body, status_code=503, headers=RETRY_AFTER)
        if engine.error is not None or body["status"] == "down":
            body["error"] = error_body("no engine is up (see the server log)", type="server_error",
                                       code="engine_unavailable")["error"]
            return JSONResponse(body, status_code=503, headers=RETRY_AFTER)
        return JSONResponse(body)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": onecat.__version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": engine.model_name,
            "object": "model",
            "created": created,
            "owned_by": "onecat",
            "root": engine.model_root,
            "max_model_len": engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    def streamed(events: AsyncIterator[str], sub: Submitted) -> StreamingResponse:
        def on_close() -> None:
            serving.abort_unfinished(sub)

        return _AbortingStreamingResponse(serving.guarded(sub, events), on_close)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        sub = await serving.prepare_completion(body)
        if body.stream:
            return streamed(serving.completion_events(sub), sub)
        return JSONResponse(await serving.completion_body(sub, request.is_disconnected))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        return JSONResponse(await serving.tokenize(body))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        return JSONResponse(await serving.detokenize(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        sub = await serving.prepare_chat(body, request.is_disconnected)
        if body.stream:
            return streamed(serving.chat_events(sub), sub)
        return JSONResponse(await serving.chat_body(sub, request.is_disconnected))

    return app
