"""The bridge between asyncio request handlers and the single-threaded ``LLMEngine``.

One background thread ("onecat-engine") owns the engine: it is the only thread that calls
its methods. Handlers send it commands (add, abort, stop) through a thread-safe queue; it
answers each add with a future (so that the engine's own validation, e.g. a prompt longer
than max_model_len, reaches the client as a 400 before any byte is streamed), runs
``engine.step()`` while requests are unfinished, and hands every ``RequestOutput`` to the
request's ``RequestStream`` on the handler's event loop (one ``call_soon_threadsafe`` per
loop and step).
After every iteration it publishes a snapshot of ``engine.stats()`` for /metrics and the
queue limit. When idle it blocks on the command queue (no busy polling).

A request that fails inside the engine step (``finish_reason`` "error") ends its own stream
with ``RequestFailedError``; only an exception escaping ``engine.step()`` (the engine's state
is unknown) fails every request and makes the engine refuse new ones. While the server
shuts down (``start_draining``) new requests are refused and ``abort_all`` ends the
running ones with ``ShuttingDownError``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The bounded waiting queue is full; the server answers 429."""


class EngineDeadError(Exception):
    """The engine failed (or is shutting down); requests cannot be served."""


class ShuttingDownError(EngineDeadError):
    """The server is shutting down: new requests are refused, running ones may be ended."""


class RequestFailedError(Exception):
    """One request failed inside the engine step (the others carry on); ``detail`` says what
    failed and is for the log, not for the client."""

    def __init__(self, request_id: str, detail: str) -> None:
        super().__init__(f"request {request_id} failed in the engine: {detail}")
        self.request_id = request_id
        self.detail = detail


END_OF_STREAM = object()  # pushed to a stream whose request was aborted: iteration ends quietly


class RequestStream:
    """The outputs of one request, consumed by one asyncio task with ``async for``.

    Iteration yields ``RequestOutput`` objects and ends after the one with ``finished``; it
    raises ``EngineDeadError`` if the engine fails meanwhile. ``output_at`` is the
    ``time.monotonic()`` at which the engine thread handed over the step of the output
    last yielded (/metrics' token latencies); ``engine_index`` names the data-parallel
    replica serving the request (/metrics' ``engine`` label).
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.engine_index = "0"
        self.finished = False
        self.output_at = 0.0
        self._items: asyncio.Queue[Any] = asyncio.Queue()

    def push(self, item: Any, at: float | None = None) -> None:
        """Queue an output (handed over at ``at``), an exception or the end marker (called on
        ``self.loop``)."""
        self._items.put_nowait((item, time.monotonic() if at is None else at))

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Any:
        if self.finished:
            raise StopAsyncIteration
        item, self.output_at = await self._items.get()
        if item is END_OF_STREAM:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
            if item.error is not None:
                raise RequestFailedError(self.request_id, item.error)
        return item


@dataclass
class _Add:
    """Requests sharing a prompt (a request's ``n`` choices), added in one engine iteration:
    all of them or, when one is refused, none."""

    request_ids: list[str]
    prompt_token_ids: list[int]
    params: list[Any]
    streams: list[RequestStream]
    accepted: asyncio.Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _AbortAll:
    reason: BaseException


_STOP = object()
_DEAD = "the engine stopped after an internal error (see the server log); restart the server"


def call_on_loop(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    """Run ``fn(*args)`` on ``loop`` from another thread; a closed loop is ignored."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop has been closed: nobody is listening any more
        pass


def push_all(items: list[tuple[RequestStream, Any]], at: float) -> None:
    for stream, item in items:
        stream.push(item, at)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the handler was cancelled (client gone) meanwhile
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class EngineClient:
    """What request handlers call on an engine, the parts every kind shares: ``error`` (set
    once the engine can no longer serve), draining (new requests refused during shutdown)
    and ``add_request`` for one request. ``AsyncEngine`` (an ``LLMEngine`` in a thread) and
    ``onecat.runtime.core.replicas.ReplicaSet`` (engine-core processes) implement the rest:
    ``add_requests``, ``abort``, ``abort_all``, ``idle``, ``stats``, ``replica_stats``,
    ``health``, ``start`` and ``shutdown``."""

    _error: BaseException | None = None
    _draining: bool = False

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped the engine serving, or None while it can serve."""
        return self._error

    @property
    def draining(self) -> bool:
        """True once the server has begun shutting down (new requests are refused)."""
        return self._draining

    def start_draining(self) -> None:
        """Refuse new requests from now on; running ones carry on."""
        self._draining = True

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any) -> RequestStream:
        """Submit one request; ``add_requests`` says what it raises."""
        (stream,) = await self.add_requests([request_id], prompt_token_ids, [params])
        return stream

    async def add_requests(
        self, request_ids: list[str], prompt_token_ids: list[int], params: list[Any]
    ) -> list[RequestStream]:
        """Submit requests sharing a prompt; returns their streams."""
        raise NotImplementedError


class AsyncEngine(EngineClient):
    """Runs an ``LLMEngine`` in a background thread for asyncio request handlers.

    ``max_queue_len`` bounds the requests accepted but not yet running (the engine's
    waiting queue plus adds in flight); one more raises ``QueueFullError``.
    """

    def __init__(self, engine: Any, *, max_queue_len: int = 512) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name: str = engine.model_name
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.runner.model_config.vocab_size
        self.eos_token_ids: list[int] = sorted(engine.eos_token_ids)
        self.model_root = str(engine.config.model)
        self.max_queue_len = max_queue_len
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # touched by the engine thread only
        self._lock = threading.Lock()
        self._pending_adds = 0
        self._stats: dict[str, int] = dict(engine.stats())
        self._error: BaseException | None = None
        self._draining = False
        self._inbox: list[Any] = []  # commands drained from the queue, not yet handled
        self._thread = threading.Thread(target=self._run, name="onecat-engine", daemon=True)

    # ----- called from request handlers (any thread / event loop) -----------------------

    def start(self) -> None:
        """Start the engine thread."""
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort every request, stop the engine thread and wait for it."""
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout)

    def idle(self) -> bool:
        """True when no request is being added, waiting or running (as of the engine thread's
        latest stats snapshot)."""
        with self._lock:
            return self._pending_adds == 0 and not self._stats.get("running") and not self._stats.get("waiting")

    def abort_all(self, reason: BaseException) -> None:
        """End every request now; their streams raise ``reason``."""
        self._commands.put(_AbortAll(reason))

    def stats(self) -> dict[str, int]:
        """The latest ``engine.stats()`` snapshot (running, waiting, KV blocks, state slots,
        token totals), published by the engine thread after each iteration."""
        with self._lock:
            return dict(self._stats)

    def replica_stats(self) -> list[tuple[str, dict[str, int]]]:
        """``(engine index, stats)`` per engine for /metrics: this one engine, "0"."""
        return [("0", self.stats())]

    def health(self) -> dict[str, Any]:
        """/health's body: "ok" while the engine serves, "down" once it has failed."""
        state = "down" if self._error is not None else "up"
        return {"status": "ok" if state == "up" else "down", "replicas": [{"index": 0, "state": state}]}

    async def add_requests(
        self, request_ids: list[str], prompt_token_ids: list[int], params: list[Any]
    ) -> list[RequestStream]:
        """Submit requests sharing a prompt (the ``n`` choices of one API request) as one
        command: the engine thread adds them all before its next step, so they start together,
        or adds none when one is refused. Returns their streams. Raises QueueFullError when the
        waiting queue is full, EngineDeadError when the engine has failed, and whatever
        ``engine.add_request`` raised (RequestError for bad input). A caller cancelled
        meanwhile (client gone) aborts them all."""
        if self._draining:
            raise ShuttingDownError("the server is shutting down; send the request to another instance")
        if self._error is not None or not self._thread.is_alive():
            raise EngineDeadError(_DEAD if self._error is not None else "the engine is not running")
        with self._lock:
            queued = self._pending_adds + self._stats.get("waiting", 0)
            if queued >= self.max_queue_len:
                raise QueueFullError(
                    f"the server's queue is full ({queued} requests waiting, --max-queue-len "
                    f"{self.max_queue_len}); retry later"
                )
            self._pending_adds += len(request_ids)
        loop = asyncio.get_running_loop()
        streams = [RequestStream(request_id, loop) for request_id in request_ids]
        accepted = loop.create_future()
        self._commands.put(_Add(list(request_ids), list(prompt_token_ids), list(params), streams, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            for request_id in request_ids:  # the client left while the engine was accepting them
                self.abort(request_id)
            raise
        return streams

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op once it has finished); frees its KV blocks and state slot."""
        self._commands.put(_Abort(request_id))

    # ----- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                if not self._iterate():
                    return
            except Exception as exc:  # the engine's state is unknown now: stop serving
                logger.exception("the engine failed; the server stops accepting requests")
                self._error = exc
                self._abort_all(EngineDeadError(_DEAD))
                while self._inbox:  # commands drained but not handled: refuse their adds
                    command = self._inbox.pop(0)
                    if isinstance(command, _Add):
                        self._add(command)
            self._publish_stats()

    def _iterate(self) -> bool:
        """Handle the queued commands, then run one engine step if anything is unfinished.
        Returns False once asked to stop."""
        busy = self._error is None and self.engine.has_unfinished_requests()
        self._inbox = self._drain(block=not busy)
        while self._inbox:
            command = self._inbox.pop(0)
            if command is _STOP:
                self._abort_all(EngineDeadError("the server is shutting down"))
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _AbortAll):
                self._abort_all(command.reason)
            else:
                self._abort(command.request_id)
        if self._error is None and self.engine.has_unfinished_requests():
            self._dispatch(self.engine.step())
        return True

    def _drain(self, block: bool) -> list[Any]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _add(self, command: _Add) -> None:
        error: BaseException | None = None
        added: list[str] = []
        if self._error is not None:
            error = EngineDeadError(_DEAD)
        else:
            try:
                for request_id, params in zip(command.request_ids, command.params, strict=True):
                    self.engine.add_request(request_id, command.prompt_token_ids, params)
                    added.append(request_id)
            except Exception as exc:  # RequestError (bad input) or a bug: the handler decides
                error = exc
                for request_id in added:  # all or none
                    self.engine.abort_request(request_id)
            else:
                self._streams.update(zip(command.request_ids, command.streams, strict=True))
        with self._lock:
            self._pending_adds -= len(command.request_ids)
        call_on_loop(command.streams[0].loop, _settle, command.accepted, error)

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:  # already finished (or never accepted): nothing holds resources
            return
        self.engine.abort_request(request_id)
        call_on_loop(stream.loop, stream.push, END_OF_STREAM)

    def _abort_all(self, reason: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # a failed engine may not abort cleanly; the clients still learn
                logger.exception("could not abort %s", request_id)
            call_on_loop(stream.loop, stream.push, reason)
        self._streams.clear()

    def _dispatch(self, outputs: list[Any]) -> None:
        """Hand a step's outputs to their streams: one wake-up of each event loop per step,
        not one per request."""
        at = time.monotonic()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, items in by_loop.items():
            call_on_loop(loop, push_all, items, at)

    def _publish_stats(self) -> None:
        try:
            stats = dict(self.engine.stats())
        except Exception:  # a failed engine: keep the last snapshot
            return
        with self._lock:
            self._stats = stats
