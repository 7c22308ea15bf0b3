"""OpenAI completions and chat completions on top of an ``EngineClient`` (``AsyncEngine`` or
``ReplicaSet``).

A handler validates the request, tokenises the prompt, submits it (the engine's own checks,
e.g. a prompt longer than max_model_len, become 400s before anything is streamed), then
either collects the outputs into one response body or yields SSE events in OpenAI's
framing: ``data: {json}\\n\\n`` per chunk and ``data: [DONE]\\n\\n`` at the end. No web
framework is imported here; ``app`` wraps the results into responses.

Chat template rendering and tokenisation run in a small thread pool, off the event loop: a
multi-megabyte prompt takes seconds to tokenise, and /health and the other requests must
keep being answered meanwhile. Grammars compile elsewhere, in worker processes under a time
budget (``grammar_workers``), so a schema never holds up this pool. A request's own chat template (``chat_template`` or
``chat_template_kwargs.chat_template``) runs arbitrary Jinja (a few nested loops stall a
server for minutes), so it is refused unless the operator trusts request templates.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any

from onecat.errors import OnecatError
from onecat.runtime.errors import RequestError
from onecat.runtime.layers.sampler import TokenLogprobs
from onecat.runtime.sampling_params import SEED_MIN, LogitsProcessor, SamplingParams
from onecat.runtime.server import structured_output
from onecat.runtime.server.api_errors import APIError, bad_request, clip, internal_error
from onecat.runtime.server.async_engine import (
    EngineClient,
    EngineDeadError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
    ShuttingDownError,
)
from onecat.runtime.server.chat_plan import ChatOptions, ChatPlan, template_message
from onecat.runtime.server.grammar_workers import (
    DEFAULT_COMPILE_TIMEOUT,
    CompileAbandoned,
    CompileFailed,
    CompileTimeout,
    GrammarCompilePool,
)
from onecat.runtime.server.logprob_format import LogprobFormatter
from onecat.runtime.server.metrics import ServerMetrics
from onecat.runtime.server.prompts import chat_token_ids, reserved_template_kwargs, text_token_ids
from onecat.runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from onecat.runtime.server.structured_output import (
    Constraint,
    GrammarBackend,
    StructuredOutputUnavailable,
    check_constraint,
    constraint_key,
    constraint_param,
)

logger = logging.getLogger(__name__)

DONE_EVENT = "data: [DONE]\n\n"
PROMPT_TAIL_TOKENS = 16  # decoded to see whether the chat template opened a think block
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
INLINE_TOKENIZE_CHARS = 4096
"""Prompts up to this many characters are tokenised on the event loop (``_tokenize``)."""


def sse_event(payload: dict[str, Any]) -> str:
    """One server-sent event in OpenAI's framing: ``data: {compact json}`` and a blank line."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def messages_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of a chat's messages as the template sees them (content, tool calls,
    anything else a message carries), to choose where to render and tokenise it."""
    return sum(len(value) if isinstance(value, str) else len(repr(value))
               for message in messages for value in message.values())


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class Submitted:
    """A request the engine accepted: one engine request per choice (``n``), and how to
    answer it. ``logprobs``: top alternatives to report per token (None: no logprobs)."""

    request_id: str
    choice_ids: list[str]
    streams: list[RequestStream]
    created: int
    model: str
    include_usage: bool
    logprobs: int | None = None
    chat_plan: ChatPlan | None = None  # tools / response_format / reasoning of a chat request
    arrival: float = field(default_factory=time.monotonic)  # when the server received it (/metrics)

    @property
    def finished(self) -> bool:
        """True once every choice's stream has ended."""
        return all(stream.finished for stream in self.streams)


@dataclass
class ChoiceResult:
    """One choice of a non-streamed response, gathered from its outputs."""

    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    final: Any = None

    @property
    def text(self) -> str:
        """The choice's whole text."""
        return "".join(self.parts)


def child_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` (vLLM: the request's seed plus the index), kept in int64."""
    if seed is None or index == 0:
        return seed
    return (seed + index - SEED_MIN) % 2**64 + SEED_MIN


class OpenAIServing:
    """The logic of /v1/completions and /v1/chat/completions for one served model."""

    def __init__(
        self,
        engine: EngineClient,
        metrics: ServerMetrics,
        executor: Executor,
        *,
        trust_request_chat_template: bool = False,
        chat_options: ChatOptions | None = None,
        grammar_compile_timeout: float = DEFAULT_COMPILE_TIMEOUT,
    ) -> None:
        self.engine = engine
        self.chat_options = chat_options or ChatOptions()
        self._grammar: tuple[GrammarBackend, GrammarCompilePool] | None = None
        self.grammar_compile_timeout = grammar_compile_timeout
        self._grammar_lock = threading.Lock()
        self.metrics = metrics
        self.executor = executor
        self.trust_request_chat_template = trust_request_chat_template
        self._reserved_kwargs: frozenset[str] | None = None
        self.logprob_format = LogprobFormatter(engine.tokenizer)

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the prompt thread pool (the event loop keeps serving meanwhile)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))

    async def _tokenize(self, chars: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` (tokenising ``chars`` characters of text): on the event loop when the
        text is short (``INLINE_TOKENIZE_CHARS``), where the two thread hops would cost more
        than the work (on CPU, 0.27 ms to tokenise 120 words, 0.65 ms through the pool);
        in the prompt thread pool otherwise."""
        if chars <= INLINE_TOKENIZE_CHARS:
            return fn(*args)
        return await self._off_loop(fn, *args)

    # ----- request preparation -------------------------------------------------------------

    def check_model(self, model: str | None) -> str:
        """The served name; a 400 when the request names another model."""
        served = self.engine.model_name
        if model is not None and model != served:
            raise APIError(
                400,
                f"The model `{clip(model)}` does not exist; this server serves `{served}` (see /v1/models)",
                param="model",
                code="model_not_found",
            )
        return served

    def sampling_params(self, req: SamplingFields, max_tokens: int, logprobs: int | None = None) -> SamplingParams:
        """The engine's SamplingParams for a validated request (one choice; no processors)."""
        top_k = req.top_k if req.top_k not in (None, -1) else 0
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=top_k,
                seed=req.seed,
                stop=req.stop_strings(),
                stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens,
                min_p=req.min_p or 0.0,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                logprobs=logprobs,
                logit_bias=req.token_biases(),
            )
            params.validate()
            return params
        except RequestError as exc:
            raise bad_request(str(exc), param=exc.param) from exc
        except ValueError as exc:
            raise bad_request(str(exc)) from exc

    async def submit(
        self,
        prefix: str,
        req: SamplingFields,
        prompt_ids: list[int],
        max_tokens: int,
        logprobs: int | None = None,
        logits_processors: Callable[[], list[LogitsProcessor]] | None = None,
        arrival: float | None = None,
    ) -> Submitted:
        """Submit a request whose model was checked, as ``req.n`` engine requests sharing the
        prompt (choice i seeded with ``seed + i``; ``logits_processors``, when given, is called
        once per choice, so stateful processors are never shared). The choices enter the
        engine together, before its next step (``EngineClient.add_requests``). Engine refusals
        become 400, a full queue 429, a dead engine 503; no choice is then left running.
        ``arrival``: ``time.monotonic()`` when the server received the request (default: now)."""
        params = self.sampling_params(req, max_tokens, logprobs)
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        choice_ids = [request_id] if req.n == 1 else [f"{request_id}-{i}" for i in range(req.n)]
        choices = []
        for index in range(len(choice_ids)):
            choice = replace(params, seed=child_seed(params.seed, index))
            if logits_processors is not None:
                choice.logits_processors = logits_processors()
            choices.append(choice)
        try:
            streams = await self.engine.add_requests(choice_ids, prompt_ids, choices)
        except Exception as exc:
            if isinstance(exc, RequestError):
                raise bad_request(str(exc), param=exc.param, code="invalid_request") from exc
            if isinstance(exc, QueueFullError):
                raise APIError(429, str(exc), type="rate_limit_error", code="queue_full") from exc
            if isinstance(exc, EngineDeadError):
                raise unavailable(exc) from exc
            raise
        return Submitted(
            request_id, choice_ids, streams, int(time.time()), self.engine.model_name, req.include_usage(), logprobs,
            arrival=time.monotonic() if arrival is None else arrival,
        )

    def abort_unfinished(self, sub: Submitted) -> None:
        """Abort the choices still running (a client gone, an error): frees their blocks and slots."""
        for choice_id, stream in zip(sub.choice_ids, sub.streams, strict=True):
            if not stream.finished:
                self.engine.abort(choice_id)

    async def prepare_completion(self, req: CompletionRequest) -> Submitted:
        """Validate, tokenise and submit a /v1/completions request."""
        arrival = time.monotonic()
        req.refuse_unsupported()
        self.check_model(req.model)
        prompt = req.single_prompt()  # the engine checks token ids and empty prompts
        if isinstance(prompt, str):
            prompt_ids = await self._tokenize(len(prompt), text_token_ids, self.engine.tokenizer, prompt)
        else:
            prompt_ids = list(prompt)
        max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
        return await self.submit("cmpl", req, prompt_ids, max_tokens, req.logprobs, arrival=arrival)

    async def prepare_chat(
        self, req: ChatCompletionRequest, is_disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> Submitted:
        """Validate, render the chat template, tokenise and submit a chat request
        (``is_disconnected`` is polled while a grammar compiles)."""
        arrival = time.monotonic()
        req.refuse_unsupported()
        self.check_model(req.model)
        plan = ChatPlan(req, self.chat_options)
        template, template_kwargs = self.template_of(req)
        template_kwargs = {**template_kwargs, **plan.template_kwargs()}
        try:
            prompt_ids = await self._tokenize(
                messages_chars(plan.messages) + len(repr(template_kwargs.get("tools") or "")), chat_token_ids, self.engine.tokenizer, plan.messages,
                template_kwargs, template,
            )
        except OnecatError as exc:
            raise bad_request(str(exc), param="messages") from exc
        plan.start(self.engine.tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:]))
        processors = await self.grammar_processors(plan, is_disconnected)
        max_tokens = req.max_new_tokens()
        if max_tokens is None:  # OpenAI's chat default: as many as the context allows
            max_tokens = max(1, self.engine.max_model_len - len(prompt_ids))
        sub = await self.submit("chatcmpl", req, prompt_ids, max_tokens, req.num_logprobs(), processors, arrival)
        sub.chat_plan = plan
        return sub

    async def grammar_processors(
        self, plan: ChatPlan, is_disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> Callable[[], list[LogitsProcessor]] | None:
        """The per-choice grammar mask of a constrained chat request (None: unconstrained).
        The schema is checked here, the grammar compiled in a worker process under the
        time budget (``grammar_workers``): 400 naming the field when the grammar library is
        missing, a schema keyword would not be enforced, the schema or tools do not compile
        or take longer than the budget; the compile is abandoned when the client leaves
        (499) or the server starts shutting down (503)."""
        constraint = plan.constraint()
        if constraint is None:
            return None
        param = constraint_param(constraint)
        try:
            structured_output.import_xgrammar()  # a server without it: 400, before anything else
            backend, pool, key = await self._off_loop(self._grammar_key, constraint)
            compiled = await pool.compile(
                key, constraint, is_disconnected=is_disconnected, is_draining=lambda: self.engine.draining
            )
        except StructuredOutputUnavailable as exc:
            raise bad_request(str(exc), param=plan.constrained_field, code="structured_output_unavailable") from exc
        except RequestError as exc:
            raise bad_request(str(exc), param=exc.param) from exc
        except CompileTimeout as exc:
            raise bad_request(
                f"{param} is too complex: its grammar {exc} (the server's "
                "--structured-outputs-compile-timeout); simplify the schema",
                param=param, code="schema_too_complex",
            ) from exc
        except CompileFailed as exc:
            raise bad_request(f"{param} cannot be compiled into a grammar: {exc}", param=param) from exc
        except CompileAbandoned as exc:
            if self.engine.draining:
                raise unavailable(ShuttingDownError("the server is shutting down: its grammar compile was ended")) from exc
            raise APIError(499, "the client closed the request", type="client_closed") from exc
        return lambda: [backend.logits_processor(compiled)]

    def _grammar_key(self, constraint: Constraint) -> tuple[GrammarBackend, GrammarCompilePool, str]:
        """The grammar backend and compile pool (made at the first constrained request: the
        tokenizer table takes a second for a large vocabulary); the constraint's schemas
        checked; its cache key. Runs in the prompt pool (tens of milliseconds for a
        megabyte of schema)."""
        with self._grammar_lock:
            if self._grammar is None:
                backend = GrammarBackend(self.engine.tokenizer, self.engine.vocab_size, self.engine.eos_token_ids)
                pool = GrammarCompilePool(backend.tokenizer_info(), timeout=self.grammar_compile_timeout)
                self._grammar = backend, pool
            backend, pool = self._grammar
        check_constraint(constraint)
        return backend, pool, constraint_key(constraint)

    def close(self) -> None:
        """Kill the grammar workers (server shutdown); nothing compiles past this."""
        if self._grammar is not None:
            self._grammar[1].close()

    def template_of(self, req: ChatCompletionRequest | TokenizeRequest) -> tuple[str | None, dict[str, Any]]:
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

    # ----- /tokenize and /detokenize (vLLM's) ------------------------------------------------

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        """vLLM's /tokenize: the token ids of a text prompt or of a chat rendered as
        /v1/chat/completions renders it, their count and the server's ``max_model_len``
        (``token_strs`` too when asked). 400 naming the field for a bad body or template."""
        req.refuse_unsupported()
        self.check_model(req.model)
        tokenizer = self.engine.tokenizer
        if req.prompt is not None:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await self._off_loop(text_token_ids, tokenizer, req.prompt, add_special)
        else:
            template, template_kwargs = self.template_of(req)
            if req.tools:
                template_kwargs = {**template_kwargs, "tools": [t.model_dump(exclude_none=True) for t in req.tools]}
            messages = [template_message(m) for m in req.messages or []]
            try:
                ids = await self._off_loop(
                    functools.partial(
                        chat_token_ids, tokenizer, messages, template_kwargs, template,
                        add_generation_prompt=req.add_generation_prompt,
                        continue_final_message=req.continue_final_message,
                        add_special_tokens=bool(req.add_special_tokens),
                    )
                )
            except OnecatError as exc:
                raise bad_request(str(exc), param="messages") from exc
        body: dict[str, Any] = {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids,
                                "token_strs": None}
        if req.return_token_strs:
            body["token_strs"] = list(tokenizer.convert_ids_to_tokens(ids))
        return body

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, str]:
        """vLLM's /detokenize: the text of ``tokens``; 400 naming ``tokens`` for an id outside
        the tokenizer's vocabulary."""
        self.check_model(req.model)
        tokenizer = self.engine.tokenizer
        vocab = len(tokenizer)
        bad = next((t for t in req.tokens if t >= vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of vocabulary: ids must be in 0..{vocab - 1}", param="tokens")
        return {"prompt": await self._off_loop(tokenizer.decode, req.tokens)}

    # ----- outputs of all choices ------------------------------------------------------------

    async def _outputs(self, sub: Submitted) -> AsyncIterator[tuple[int, Any]]:
        """``(choice index, RequestOutput)`` of every choice as they come, each observed by
        its choice's ``RequestTimer`` (/metrics); a stream's error (EngineDeadError,
        RequestFailedError) is raised here."""
        timers = [self.metrics.request_timer(sub.arrival) for _ in sub.streams]
        if len(sub.streams) == 1:
            stream = sub.streams[0]
            async for out in stream:
                timers[0].observe(out, stream.output_at, stream.engine_index)
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, Any, float, str]] = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((index, out, stream.output_at, stream.engine_index))
                queue.put_nowait((index, None, 0.0, ""))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((index, exc, 0.0, ""))

        tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(sub.streams)]
        try:
            running = len(tasks)
            while running:
                index, item, at, engine = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    timers[index].observe(item, at, engine)
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()

    def _usage(self, finals: list[Any]) -> dict[str, int]:
        """Usage over all choices: the prompt once, the completion tokens of every choice (vLLM)."""
        return usage_dict(finals[0].prompt_tokens, sum(f.completion_tokens for f in finals))

    # ----- full responses ------------------------------------------------------------------

    async def collect(
        self, sub: Submitted, is_disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> list[ChoiceResult]:
        """Gather every choice's text, logprobs and final output. Polls ``is_disconnected``
        twice a second and aborts the request when the client has gone."""
        results = [ChoiceResult() for _ in sub.streams]

        async def gather() -> None:
            async for index, out in self._outputs(sub):
                result = results[index]
                result.parts.append(out.new_text)
                if out.logprobs:
                    result.logprobs.extend(out.logprobs)
                result.final = out

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
            self.abort_unfinished(sub)
        if any(result.final is None for result in results):  # aborted before its first output
            raise APIError(499, "the request was aborted", type="client_closed")
        return results

    async def completion_body(
        self, sub: Submitted, is_disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> dict[str, Any]:
        """The non-streamed /v1/completions response."""
        results = await self.collect(sub, is_disconnected)
        choices = [
            {
                "index": i,
                "text": result.text,
                "logprobs": None if sub.logprobs is None else self.logprob_format.completion(result.logprobs, 0),
                "finish_reason": result.final.finish_reason,
            }
            for i, result in enumerate(results)
        ]
        return {
            "id": sub.request_id,
            "object": "text_completion",
            "created": sub.created,
            "model": sub.model,
            "choices": choices,
            "usage": self._usage([r.final for r in results]),
        }

    async def chat_body(
        self, sub: Submitted, is_disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> dict[str, Any]:
        """The non-streamed /v1/chat/completions response."""
        results = await self.collect(sub, is_disconnected)
        choices = []
        for i, result in enumerate(results):
            message, finish_reason = {"role": "assistant", "content": result.text}, result.final.finish_reason
            if sub.chat_plan is not None:  # reasoning_content / tool_calls split off
                message, finish_reason = sub.chat_plan.message(result.text, finish_reason)
            choices.append({
                "index": i,
                "message": message,
                "logprobs": None if sub.logprobs is None else {
                    "content": self.logprob_format.chat_content(result.logprobs)
                },
                "finish_reason": finish_reason,
            })
        return {
            "id": sub.request_id,
            "object": "chat.completion",
            "created": sub.created,
            "model": sub.model,
            "choices": choices,
            "usage": self._usage([r.final for r in results]),
        }

    # ----- streams -------------------------------------------------------------------------

    async def completion_events(self, sub: Submitted) -> AsyncIterator[str]:
        """SSE events of a streamed /v1/completions response (``text_completion`` chunks, each
        choice with its own ``index``)."""

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

        sent = [0] * len(sub.streams)  # characters of text sent per choice (text_offset)
        finals: dict[int, Any] = {}
        async for index, out, event in self._events(sub):
            if event is not None:
                yield event
                return
            logprobs = sub.logprobs is not None and bool(out.logprobs)
            if out.new_text or out.finished or logprobs:
                choice = {
                    "index": index,
                    "text": out.new_text,
                    "logprobs": self.logprob_format.completion(out.logprobs, sent[index]) if logprobs else None,
                    "finish_reason": out.finish_reason if out.finished else None,
                }
                sent[index] += len(out.new_text)
                yield sse_event(chunk([choice]))
            if out.finished:
                finals[index] = out
        if sub.include_usage and len(finals) == len(sub.streams):
            yield sse_event(chunk([], usage=self._usage(list(finals.values()))))
        yield DONE_EVENT

    async def chat_events(self, sub: Submitted) -> AsyncIterator[str]:
        """SSE events of a streamed chat response: a role chunk per choice, content chunks
        (with their tokens' logprobs when asked), a chunk with ``finish_reason`` per choice,
        optionally a usage chunk, then ``[DONE]``."""

        def chunk(
            index: int | None, delta: dict[str, Any] | None = None, finish_reason: str | None = None,
            logprobs: list[TokenLogprobs] | None = None, **extra: Any,
        ) -> dict[str, Any]:
            choices = [] if index is None else [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": None if logprobs is None else {
                        "content": self.logprob_format.chat_content(logprobs)
                    },
                    "finish_reason": finish_reason,
                }
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

        for index in range(len(sub.streams)):
            yield sse_event(chunk(index, {"role": "assistant", "content": ""}))
        finals: dict[int, Any] = {}
        # reasoning_content / tool_calls deltas per choice (None: the text is the content)
        parsers = [sub.chat_plan.delta_stream() if sub.chat_plan else None for _ in sub.streams]
        async for index, out, event in self._events(sub):
            if event is not None:
                yield event
                return
            logprobs = out.logprobs if sub.logprobs is not None and out.logprobs else None
            parser = parsers[index]
            delta = {"content": out.new_text} if parser is None else parser.feed(out.new_text, out.finished)
            if (delta and (parser is not None or out.new_text)) or logprobs:
                yield sse_event(chunk(index, delta or {}, logprobs=logprobs))
            if out.finished:
                finals[index] = out
                finish_reason = out.finish_reason
                if parser is not None and parser.called_tools and finish_reason == "stop":
                    finish_reason = "tool_calls"
                yield sse_event(chunk(index, {}, finish_reason))
        if sub.include_usage and len(finals) == len(sub.streams):
            yield sse_event(chunk(None, usage=self._usage(list(finals.values()))))
        yield DONE_EVENT

    async def guarded(self, sub: Submitted, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """``events`` with OpenAI's ending guaranteed: an exception raised while streaming
        (a bug, a parser, the engine) is logged with the request id and becomes one error
        event followed by ``data: [DONE]``; the status line (200) has left already."""
        try:
            async for event in events:
                yield event
        except Exception as exc:  # noqa: BLE001 - the client must still see the stream end
            logger.error("internal error while streaming %s", sub.request_id, exc_info=exc)
            self.metrics.request_errors.labels("500").inc()
            yield sse_event(internal_error(sub.request_id).body()) + DONE_EVENT

    async def _events(self, sub: Submitted) -> AsyncIterator[tuple[int, Any, str | None]]:
        """``(choice index, output, None)`` for every output; an engine failure becomes one
        error event (then the stream ends, as vLLM does: the HTTP status is already 200)."""
        try:
            async for index, out in self._outputs(sub):
                yield index, out, None
        except (EngineDeadError, RequestFailedError) as exc:
            error = unavailable(exc) if isinstance(exc, EngineDeadError) else internal_error(sub.request_id)
            self.metrics.request_errors.labels(str(error.status)).inc()
            yield 0, None, sse_event(error.body()) + DONE_EVENT


def unavailable(exc: EngineDeadError) -> APIError:
    """The 503 of a failed engine or of a server that is shutting down."""
    code = "server_shutting_down" if isinstance(exc, ShuttingDownError) else "engine_unavailable"
    return APIError(503, str(exc), type="server_error", code=code)
