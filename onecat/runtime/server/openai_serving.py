"""OpenAI completions and chat completions on top of ``AsyncEngine``.

A handler validates the request, tokenises the prompt, submits it (the engine's own checks,
e.g. a prompt longer than max_model_len, become 400s before anything is streamed), then
either collects the outputs into one response body or yields SSE events in OpenAI's
framing: ``data: {json}\\n\\n`` per chunk and ``data: [DONE]\\n\\n`` at the end. No web
framework is imported here; ``app`` wraps the results into responses.

Chat template rendering and tokenisation run in a small thread pool, off the event loop: a
multi-megabyte prompt takes seconds to tokenise, and /health and the other requests must
keep being answered meanwhile. A request's own chat template (``chat_template`` or
``chat_template_kwargs.chat_template``) runs arbitrary Jinja (a few nested loops stall a
server for minutes), so it is refused unless the operator trusts request templates.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from onecat.errors import OnecatError
from onecat.runtime.errors import RequestError
from onecat.runtime.sampling_params import SamplingParams
from onecat.runtime.server.api_errors import APIError, bad_request, internal_error
from onecat.runtime.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
    ShuttingDownError,
)
from onecat.runtime.server.metrics import ServerMetrics
from onecat.runtime.server.prompts import chat_token_ids, reserved_template_kwargs, text_token_ids
from onecat.runtime.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

DONE_EVENT = "data: [DONE]\n\n"
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def sse_event(payload: dict[str, Any]) -> str:
    """One server-sent event in OpenAI's framing: ``data: {compact json}`` and a blank line."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class Submitted:
    """A request the engine accepted: its stream and how to answer it."""

    request_id: str
    stream: RequestStream
    created: int
    model: str
    include_usage: bool


class OpenAIServing:
    """The logic of /v1/completions and /v1/chat/completions for one served model."""

    def __init__(
        self,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        executor: Executor,
        *,
        trust_request_chat_template: bool = False,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.executor = executor
        self.trust_request_chat_template = trust_request_chat_template
        self._reserved_kwargs: frozenset[str] | None = None

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the prompt thread pool (the event loop keeps serving meanwhile)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))

    # ----- request preparation -------------------------------------------------------------

    def check_model(self, model: str | None) -> str:
        """The served name; a 400 when the request names another model."""
        served = self.engine.model_name
        if model is not None and model != served:
            raise APIError(
                400,
                f"The model `{model}` does not exist; this server serves `{served}` (see /v1/models)",
                param="model",
                code="model_not_found",
            )
        return served

    def sampling_params(self, req: SamplingFields, max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams for a validated request."""
        top_k = req.top_k if req.top_k not in (None, -1) else 0
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=top_k,
                seed=req.seed,
                stop=req.stop_strings(),
                stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=req.ignore_eos,
            )
        except RequestError as exc:
            raise bad_request(str(exc), param=exc.param) from exc
        except ValueError as exc:
            raise bad_request(str(exc)) from exc

    async def submit(
        self, prefix: str, req: SamplingFields, prompt_ids: list[int], max_tokens: int
    ) -> Submitted:
        """Submit a request whose model was checked; engine refusals become 400, a full queue
        429, a dead engine 503."""
        params = self.sampling_params(req, max_tokens)
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            stream = await self.engine.add_request(request_id, prompt_ids, params)
        except RequestError as exc:
            raise bad_request(str(exc), param=exc.param, code="invalid_request") from exc
        except QueueFullError as exc:
            raise APIError(429, str(exc), type="rate_limit_error", code="queue_full") from exc
        except EngineDeadError as exc:
            raise unavailable(exc) from exc
        return Submitted(request_id, stream, int(time.time()), self.engine.model_name, req.include_usage())

    async def prepare_completion(self, req: CompletionRequest) -> Submitted:
        """Validate, tokenise and submit a /v1/completions request."""
        req.refuse_unsupported()
        self.check_model(req.model)
        prompt = req.single_prompt()  # the engine checks token ids and empty prompts
        if isinstance(prompt, str):
            prompt_ids = await self._off_loop(text_token_ids, self.engine.tokenizer, prompt)
        else:
            prompt_ids = list(prompt)
        max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
        return await self.submit("cmpl", req, prompt_ids, max_tokens)

    async def prepare_chat(self, req: ChatCompletionRequest) -> Submitted:
        """Validate, render the chat template, tokenise and submit a chat request."""
        req.refuse_unsupported()
        self.check_model(req.model)
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in req.messages
        ]
        template, template_kwargs = self.template_of(req)
        try:
            prompt_ids = await self._off_loop(
                chat_token_ids, self.engine.tokenizer, messages, template_kwargs, template
            )
        except OnecatError as exc:
            raise bad_request(str(exc), param="messages") from exc
        max_tokens = req.max_new_tokens()
        if max_tokens is None:  # OpenAI's chat default: as many as the context allows
            max_tokens = max(1, self.engine.max_model_len - len(prompt_ids))
        return await self.submit("chatcmpl", req, prompt_ids, max_tokens)

    def template_of(self, req: ChatCompletionRequest) -> tuple[str | None, dict[str, Any]]:
        """The request's own chat template (None: the model's) and the template variables
        from ``chat_template_kwargs``; 400 for a request template the operator does not
        trust and for kwargs that are ``apply_chat_template``'s own arguments."""
        kwargs = dict(req.chat_template_kwargs or {})
        template = req.chat_template
        param = "chat_template"
        if "chat_template" in kwargs:
            template, param = kwargs.pop("chat_template"), "chat_template_kwargs"
        if template is not None and not self.trust_request_chat_template:
            raise bad_request(
                "a chat template sent with the request is refused: this server renders only its "
                "model's own template (the operator can allow request templates with "
                "--trust-request-chat-template)",
                param=param,
                code="chat_template_not_allowed",
            )
        if template is not None and not isinstance(template, str):
            raise bad_request("chat_template must be a string (a Jinja template)", param=param)
        if kwargs and self._reserved_kwargs is None:
            self._reserved_kwargs = reserved_template_kwargs(self.engine.tokenizer)
        reserved = sorted(self._reserved_kwargs & kwargs.keys()) if kwargs else []
        if reserved:
            raise bad_request(
                f"chat_template_kwargs may not set {', '.join(reserved)}: these are arguments of "
                "the server's template rendering, not template variables",
                param="chat_template_kwargs",
            )
        return template, kwargs

    # ----- full responses ------------------------------------------------------------------

    async def collect(
        self, sub: Submitted, is_disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> tuple[str, Any]:
        """Gather a request's text and final output. Polls ``is_disconnected`` twice a second
        and aborts the request when the client has gone."""
        parts: list[str] = []
        final = None

        async def gather() -> None:
            nonlocal final
            async for out in sub.stream:
                parts.append(out.new_text)
                final = out

        task = asyncio.ensure_future(gather())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and is_disconnected is not None and await is_disconnected():
                    raise APIError(499, "the client closed the request", type="client_closed")
            task.result()
        except EngineDeadError as exc:
            raise unavailable(exc) from exc
        except RequestFailedError as exc:
            raise internal_error(sub.request_id) from exc
        finally:
            task.cancel()
            if not sub.stream.finished:
                self.engine.abort(sub.request_id)
        if final is None:  # aborted before its first output
            raise APIError(499, "the request was aborted", type="client_closed")
        self.metrics.request_success.labels(final.finish_reason or "unknown").inc()
        return "".join(parts), final

    async def completion_body(
        self, sub: Submitted, is_disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> dict[str, Any]:
        """The non-streamed /v1/completions response."""
        text, final = await self.collect(sub, is_disconnected)
        return {
            "id": sub.request_id,
            "object": "text_completion",
            "created": sub.created,
            "model": sub.model,
            "choices": [
                {"index": 0, "text": text, "logprobs": None, "finish_reason": final.finish_reason}
            ],
            "usage": usage_dict(final.prompt_tokens, final.completion_tokens),
        }

    async def chat_body(
        self, sub: Submitted, is_disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> dict[str, Any]:
        """The non-streamed /v1/chat/completions response."""
        text, final = await self.collect(sub, is_disconnected)
        return {
            "id": sub.request_id,
            "object": "chat.completion",
            "created": sub.created,
            "model": sub.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": final.finish_reason,
                }
            ],
            "usage": usage_dict(final.prompt_tokens, final.completion_tokens),
        }

    # ----- streams -------------------------------------------------------------------------

    async def completion_events(self, sub: Submitted) -> AsyncIterator[str]:
        """SSE events of a streamed /v1/completions response (``text_completion`` chunks)."""

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            body = {
                "id": sub.request_id,
                "object": "text_completion",
                "created": sub.created,
                "model": sub.model,
                "choices": choices,
            }
            if sub.include_usage:
                body["usage"] = None
            body.update(extra)
            return body

        async for out, event in self._events(sub):
            if event is not None:
                yield event
                return
            if out.new_text or out.finished:
                choice = {
                    "index": 0,
                    "text": out.new_text,
                    "logprobs": None,
                    "finish_reason": out.finish_reason if out.finished else None,
                }
                yield sse_event(chunk([choice]))
            if out.finished and sub.include_usage:
                yield sse_event(chunk([], usage=usage_dict(out.prompt_tokens, out.completion_tokens)))
        yield DONE_EVENT

    async def chat_events(self, sub: Submitted) -> AsyncIterator[str]:
        """SSE events of a streamed chat response: a role chunk, content chunks, a chunk with
        ``finish_reason``, optionally a usage chunk, then ``[DONE]``."""

        def chunk(delta: dict[str, Any] | None, finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
            choices = [] if delta is None else [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ]
            body = {
                "id": sub.request_id,
                "object": "chat.completion.chunk",
                "created": sub.created,
                "model": sub.model,
                "choices": choices,
            }
            if sub.include_usage:
                body["usage"] = None
            body.update(extra)
            return body

        yield sse_event(chunk({"role": "assistant", "content": ""}))
        async for out, event in self._events(sub):
            if event is not None:
                yield event
                return
            if out.new_text:
                yield sse_event(chunk({"content": out.new_text}))
            if out.finished:
                yield sse_event(chunk({}, out.finish_reason))
                if sub.include_usage:
                    yield sse_event(chunk(None, usage=usage_dict(out.prompt_tokens, out.completion_tokens)))
        yield DONE_EVENT

    async def _events(self, sub: Submitted) -> AsyncIterator[tuple[Any, str | None]]:
        """The request's outputs; an engine failure becomes one error event (then the stream
        ends, as vLLM does: the HTTP status is already 200)."""
        try:
            async for out in sub.stream:
                if out.finished:
                    self.metrics.request_success.labels(out.finish_reason or "unknown").inc()
                yield out, None
        except (EngineDeadError, RequestFailedError) as exc:
            error = unavailable(exc) if isinstance(exc, EngineDeadError) else internal_error(sub.request_id)
            self.metrics.request_errors.labels(str(error.status)).inc()
            yield None, sse_event(error.body()) + DONE_EVENT


def unavailable(exc: EngineDeadError) -> APIError:
    """The 503 of a failed engine or of a server that is shutting down."""
    code = "server_shutting_down" if isinstance(exc, ShuttingDownError) else "engine_unavailable"
    return APIError(503, str(exc), type="server_error", code=code)
