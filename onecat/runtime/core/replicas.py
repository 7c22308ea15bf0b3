"""``ReplicaSet``: the server's engine when engines run in their own processes.

One engine-core process per data-parallel replica (``client.EngineCoreClient``), behind the
interface request handlers already use for the in-process engine (``AsyncEngine``):
``add_requests`` returns ``RequestStream`` objects, ``abort``, ``stats``, ``idle``,
draining. What it adds:

- **The API side of a request.** Requests are checked here (``check_request``: a 400 before
  anything is sent). Outputs arrive as token ids; each request's ``IncrementalDetokenizer``
  turns them into text and finds stop strings here, and a request that meets one is
  finished here and aborted in its core (the core may have computed a token or two more,
  which are dropped). A core stops a request on a stop token (EOS, ``stop_token_ids``) on
  its own; that token's text is not output, as in the in-process engine.
- **Routing** (``routing.PrefixRouter``): the least loaded live replica, or the one that
  holds the prompt's prefix while it is not much busier. The ``n`` choices of a request go
  to one replica together.
- **Failover.** When a core dies (killed, a CUDA error, out of memory; the receiver thread
  sees its process end), no new request goes to it; its requests that had produced no
  output yet are sent once to a live replica (a request that kills its replica twice is
  failed, not passed on); the others end with ``EngineDeadError`` (a stream gets an error
  event and ``[DONE]``, a plain request a 503 with ``Retry-After``). A supervisor thread
  restarts it after 1, 2, 4 ... ``BACKOFF_MAX`` seconds; after ``MAX_FAILURES`` failures in a
  row (a replica up for ``STABLE_SECONDS`` starts counting afresh) it stays down, and the
  log says why. ``health()`` lists each replica's state for /health.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from onecat.errors import OnecatError
from onecat.runtime.config import EngineConfig
from onecat.runtime.core.client import EngineCoreClient
from onecat.runtime.core.messages import (
    AbortRequests,
    AddRequests,
    NewRequest,
    Outputs,
    params_fields,
)
from onecat.runtime.core.placement import Placement, place_replicas
from onecat.runtime.core.routing import PrefixRouter
from onecat.runtime.engine.detokenizer import IncrementalDetokenizer
from onecat.runtime.engine.request_check import check_request
from onecat.runtime.errors import RequestError
from onecat.runtime.server.async_engine import (
    END_OF_STREAM,
    EngineClient,
    EngineDeadError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
    ShuttingDownError,
    call_on_loop,
    push_all,
)

logger = logging.getLogger(__name__)

BACKOFF_BASE = 1.0
BACKOFF_MAX = 30.0
MAX_FAILURES = 4
"""Failures in a row (deaths or failed restarts) after which a replica stays down."""
STABLE_SECONDS = 120.0
"""A replica up this long has its failure count reset."""
GRAMMAR_PAYLOADS = 64


@dataclass
class _Replica:
    placement: Placement
    client: EngineCoreClient | None = None
    state: str = "starting"  # starting | up | restarting | down
    load: int = 0  # requests in flight (added, not finished)
    stats: dict[str, Any] = field(default_factory=dict)
    adds_since_stats: int = 0
    restarts: int = 0
    failures: int = 0
    up_since: float = 0.0
    reason: str | None = None  # why it last failed
    died: threading.Event = field(default_factory=threading.Event)

    @property
    def index(self) -> int:
        return self.placement.index


@dataclass
class _Request:
    request_id: str
    stream: RequestStream
    prompt_token_ids: list[int]
    params: Any
    grammar: str | None
    detokenizer: IncrementalDetokenizer
    replica: _Replica
    hashes: list[int]
    started: bool = False  # an output reached the stream
    retried: bool = False
    emitted: int = 0  # completion tokens handed to the stream


def _sum_stats(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """Counters and gauges added over replicas (lists element by element)."""
    total: dict[str, Any] = {}
    for stats in snapshots:
        for key, value in stats.items():
            if isinstance(value, list):
                mine = total.setdefault(key, [])
                mine.extend([0] * (len(value) - len(mine)))
                for i, v in enumerate(value):
                    mine[i] += v
            elif isinstance(value, (int, float)):
                total[key] = total.get(key, 0) + value
    return total


class ReplicaSet(EngineClient):
    """N engine-core processes serving one model (module docstring).

    ``config`` is every replica's engine configuration (``tensor_parallel_size`` GPUs each);
    ``max_queue_len`` bounds the requests accepted but not yet running, over all replicas.
    ``engine_factory`` (``("module:function", kwargs)``, see ``process``) builds each
    replica's engine instead of loading ``config.model``, which then only names the
    tokenizer's folder (benchmarks over random models).
    """

    def __init__(
        self,
        config: EngineConfig,
        data_parallel_size: int = 1,
        *,
        max_queue_len: int = 512,
        log_level: str = "info",
        engine_factory: tuple[str, dict[str, Any]] | None = None,
    ) -> None:
        import torch
        from transformers import AutoTokenizer

        from onecat.runtime.loader import read_model_config

        path = Path(config.model)
        if engine_factory is None:
            read_model_config(path)  # a broken config.json is named before any process starts
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as exc:
            raise OnecatError(f"{path}: cannot load the tokenizer ({exc}); copy the tokenizer files next to config.json") from None
        gpus = torch.cuda.device_count() if config.device in ("auto", "cuda") else 0
        self.config = config
        self.model_root = str(config.model)
        self.max_queue_len = max_queue_len
        self._log_level = log_level
        self._factory = engine_factory
        self._replicas = [_Replica(p) for p in place_replicas(
            data_parallel_size, config.tensor_parallel_size, config.device, gpus)]
        self._router = PrefixRouter(config.kv_block_size)
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._context: zmq.Context | None = None
        self._socket_dir: Path | None = None
        self._supervisors: list[threading.Thread] = []
        self._grammar_payloads: OrderedDict[int, tuple[Any, str]] = OrderedDict()
        self.model_name = config.served_model_name or path.name
        self.max_model_len = 0
        self.vocab_size = 0
        self.eos_token_ids: list[int] = []

    # ----- life cycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Start every replica and return once all are ready (replicas sharing a GPU start
        one after the other); EngineStartError (naming the replica and why) when one cannot
        start, after stopping the others. A second call does nothing."""
        if self._context is not None:
            return
        self._context = zmq.Context()
        self._socket_dir = Path(tempfile.mkdtemp(prefix="onecat-core-"))
        try:
            if any(r.placement.sharing > 1 for r in self._replicas):
                for replica in self._replicas:
                    self._start_replica(replica)
            else:
                errors: list[BaseException] = []

                def start(replica: _Replica) -> None:
                    try:
                        self._start_replica(replica)
                    except BaseException as exc:  # noqa: BLE001 - raised below
                        errors.append(exc)

                threads = [threading.Thread(target=start, args=(r,)) for r in self._replicas]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                if errors:
                    raise errors[0]
        except BaseException:
            self.shutdown()
            raise
        ready = self._replicas[0].client.ready
        self.model_name = self.config.served_model_name or ready.model_name
        self.max_model_len = min(r.client.ready.max_model_len for r in self._replicas)
        self.vocab_size = ready.vocab_size
        self.eos_token_ids = list(ready.eos_token_ids)
        for replica in self._replicas:
            thread = threading.Thread(target=self._supervise, args=(replica,), daemon=True,
                                      name=f"onecat-supervisor-{replica.index}")
            thread.start()
            self._supervisors.append(thread)

    def _start_replica(self, replica: _Replica) -> None:
        with self._lock:
            others = sum(1 for r in self._replicas if r is not replica and r.state == "up"
                         and set(r.placement.gpus) & set(replica.placement.gpus))
        utilization = replica.placement.memory_utilization(self.config.gpu_memory_utilization, others)
        config = dataclasses.replace(self.config, gpu_memory_utilization=utilization)
        client = EngineCoreClient(
            self._context, self._socket_dir, config, replica.placement,
            on_message=self._on_message, on_exit=self._on_exit, log_level=self._log_level,
            factory=self._factory,
        )
        client.start()
        with self._lock:
            replica.client = client
            replica.state = "up"
            replica.up_since = time.monotonic()
            replica.stats = {}
            replica.adds_since_stats = 0

    @property
    def data_parallel_size(self) -> int:
        """The number of replicas."""
        return len(self._replicas)

    def close(self) -> None:
        """Same as ``shutdown`` (the name ``LLMEngine`` has)."""
        self.shutdown()

    def shutdown(self, timeout: float = 30.0) -> None:
        """End every request, stop the cores (they exit; killed after a timeout) and remove
        the sockets. Later calls do nothing."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._abort_all(EngineDeadError("the server is shutting down"))
        for replica in self._replicas:
            replica.died.set()  # wakes its supervisor, which sees the closing flag
            if replica.client is not None:
                replica.client.stop()
        for thread in self._supervisors:
            thread.join(timeout)
        if self._context is not None:
            self._context.term()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def _supervise(self, replica: _Replica) -> None:
        """Restart ``replica`` after each death, with backoff, until it fails
        ``MAX_FAILURES`` times in a row (module docstring)."""
        while True:
            replica.died.wait()
            replica.died.clear()
            if self._closing.is_set():
                return
            if time.monotonic() - replica.up_since >= STABLE_SECONDS:
                replica.failures = 0
            replica.failures += 1
            if replica.failures >= MAX_FAILURES:
                with self._lock:
                    replica.state = "down"
                    all_down = all(r.state == "down" for r in self._replicas)
                logger.error("engine replica %d stays down: it failed %d times in a row; last: %s",
                             replica.index, replica.failures, replica.reason)
                if all_down:
                    self._error = EngineDeadError(
                        f"every engine replica failed (last: {replica.reason}); restart the server")
                return
            delay = min(BACKOFF_MAX, BACKOFF_BASE * 2 ** (replica.failures - 1))
            logger.warning("engine replica %d failed (%s); restarting it in %g s", replica.index,
                           replica.reason, delay)
            if self._closing.wait(delay):
                return
            try:
                self._start_replica(replica)
            except Exception as exc:  # EngineStartError, or the sockets could not be made
                replica.reason = str(exc)
                replica.died.set()
                continue
            replica.restarts += 1
            if self._closing.is_set():
                replica.client.stop()
                return
            logger.info("engine replica %d is up again (pid %d)", replica.index, replica.client.pid)

    # ----- what handlers see ---------------------------------------------------------------

    def idle(self) -> bool:
        """True when no request is in flight."""
        with self._lock:
            return not self._requests

    def stats(self) -> dict[str, Any]:
        """The replicas' latest ``engine.stats()`` snapshots, added up."""
        with self._lock:
            return _sum_stats([r.stats for r in self._replicas if r.state == "up"])

    def replica_stats(self) -> list[tuple[str, dict[str, Any]]]:
        """``(replica index, latest stats)`` of each replica that is up (/metrics labels)."""
        with self._lock:
            return [(str(r.index), dict(r.stats)) for r in self._replicas if r.state == "up" and r.stats]

    def health(self) -> dict[str, Any]:
        """Each replica's state (up, starting, restarting, down), pid, restarts and last
        failure; ``status`` "ok" when all are up, "degraded" when some are, "down" else."""
        with self._lock:
            rows = [{"index": r.index, "state": r.state, "pid": r.client.pid if r.client else None,
                     "gpus": list(r.placement.gpus), "restarts": r.restarts, "in_flight": r.load,
                     "last_failure": r.reason} for r in self._replicas]
        up = sum(row["state"] == "up" for row in rows)
        status = "ok" if up == len(rows) else "degraded" if up else "down"
        return {"status": status, "replicas": rows}

    def kill_replica(self, index: int) -> None:
        """SIGKILL one replica's core (failover tests and benchmarks)."""
        client = self._replicas[index].client
        if client is not None:
            client.kill()

    async def add_requests(
        self, request_ids: list[str], prompt_token_ids: list[int], params: list[Any]
    ) -> list[RequestStream]:
        """Check and send requests sharing a prompt (the ``n`` choices of one API request) to
        one replica; returns their streams. Raises RequestError for a request the engine
        would refuse, QueueFullError, ShuttingDownError while draining and EngineDeadError
        when no replica is up (``error``: every replica stayed down)."""
        if self._draining:
            raise ShuttingDownError("the server is shutting down; send the request to another instance")
        if self._error is not None:
            raise self._error
        for choice in params:
            check_request(prompt_token_ids, choice, self.vocab_size, self.max_model_len)
        grammars = [self._grammar_payload(choice) for choice in params]
        loop = asyncio.get_running_loop()
        with self._lock:
            live = {r.index: r.load for r in self._replicas if r.state == "up"}
            if not live:
                restarting = sum(r.state in ("starting", "restarting") for r in self._replicas)
                raise EngineDeadError(
                    f"no engine replica is up ({restarting} restarting); retry in a few seconds")
            queued = sum(r.stats.get("waiting", 0) + r.adds_since_stats for r in self._replicas if r.state == "up")
            if queued >= self.max_queue_len:
                raise QueueFullError(
                    f"the server's queue is full ({queued} requests waiting, --max-queue-len "
                    f"{self.max_queue_len}); retry later")
            if any(request_id in self._requests for request_id in request_ids):
                raise RequestError("request id is already in use")
            index, hashes = self._router.choose(prompt_token_ids, live)
            replica = self._replicas[index]
            self._router.record(hashes, index)
            tracked = []
            for request_id, choice, grammar in zip(request_ids, params, grammars, strict=True):
                stream = RequestStream(request_id, loop)
                stream.engine_index = str(index)
                request = _Request(
                    request_id, stream, list(prompt_token_ids), choice, grammar,
                    IncrementalDetokenizer(self.tokenizer, choice.stop, min_tokens=choice.min_tokens),
                    replica, hashes,
                )
                self._requests[request_id] = request
                tracked.append(request)
            replica.load += len(tracked)
            replica.adds_since_stats += len(tracked)
            client = replica.client
        client.send(AddRequests([self._new_request(r) for r in tracked]))
        return [r.stream for r in tracked]

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op once finished): its stream ends, its core frees it."""
        with self._lock:
            request = self._requests.pop(request_id, None)
            if request is None:
                return
            request.replica.load -= 1
            client = request.replica.client if request.replica.state == "up" else None
        if client is not None:
            client.send(AbortRequests([request_id]))
        call_on_loop(request.stream.loop, request.stream.push, END_OF_STREAM)

    def abort_all(self, reason: BaseException) -> None:
        """End every request now; their streams raise ``reason``."""
        self._abort_all(reason)

    def _abort_all(self, reason: BaseException) -> None:
        with self._lock:
            requests = list(self._requests.values())
            self._requests.clear()
            by_client: dict[Any, list[str]] = {}
            for request in requests:
                request.replica.load -= 1
                if request.replica.state == "up":
                    by_client.setdefault(request.replica.client, []).append(request.request_id)
        for client, ids in by_client.items():
            client.send(AbortRequests(ids))
        for request in requests:
            call_on_loop(request.stream.loop, request.stream.push, reason)

    # ----- the wire ------------------------------------------------------------------------

    def _grammar_payload(self, params: Any) -> str | None:
        """The serialised compiled grammar of a request's grammar mask (None: unconstrained);
        RequestError for a logits processor that cannot cross to a core process."""
        if not params.logits_processors:
            return None
        (processor,) = params.logits_processors
        compiled = getattr(processor, "compiled", None)
        if compiled is None:
            raise RequestError("only grammar masks can be sent to an engine-core process")
        with self._lock:
            cached = self._grammar_payloads.get(id(compiled))
        if cached is not None and cached[0] is compiled:
            return cached[1]
        payload = compiled.serialize_json()
        with self._lock:
            self._grammar_payloads[id(compiled)] = (compiled, payload)
            while len(self._grammar_payloads) > GRAMMAR_PAYLOADS:
                self._grammar_payloads.popitem(last=False)
        return payload

    @staticmethod
    def _new_request(request: _Request) -> NewRequest:
        return NewRequest(request.request_id, request.prompt_token_ids, params_fields(request.params), request.grammar)

    def _on_message(self, client: EngineCoreClient, message: Any, received_at: float) -> None:
        """A core's outputs (receiver thread): text and stop strings, then the streams."""
        if not isinstance(message, Outputs):
            return
        replica = self._replicas[client.index]
        with self._lock:
            if message.stats is not None:
                replica.stats = message.stats
                replica.adds_since_stats = 0
            pairs = [(out, self._requests.get(out.request_id)) for out in message.outputs]
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        stopped: list[str] = []
        finished: list[_Request] = []
        for out, request in pairs:
            if request is None or request.replica is not replica:  # aborted, or passed on
                continue
            try:
                hit_stop = self._text(request, out)
            except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                logger.error("request %s: its tokens could not be turned into text", request.request_id, exc_info=exc)
                stopped.append(request.request_id)
                finished.append(request)
                failure = RequestFailedError(request.request_id, f"{type(exc).__name__}: {exc}")
                by_loop.setdefault(request.stream.loop, []).append((request.stream, failure))
                continue
            if hit_stop:
                stopped.append(request.request_id)
            request.started = True
            if out.finished:
                finished.append(request)
            by_loop.setdefault(request.stream.loop, []).append((request.stream, out))
        if finished:
            with self._lock:
                for request in finished:
                    if self._requests.pop(request.request_id, None) is not None:
                        replica.load -= 1
        if stopped:
            client.send(AbortRequests(stopped))
        for loop, items in by_loop.items():
            call_on_loop(loop, push_all, items, received_at)

    @staticmethod
    def _text(request: _Request, out: Any) -> bool:
        """Fill ``out.new_text`` from its token ids; True when a stop string ended the
        request in the core's unfinished output (tokens after it are dropped)."""
        detokenizer = request.detokenizer
        tokens = out.new_token_ids
        core_stopped = out.finished and out.finish_reason == "stop"  # on a stop token
        kept = 0
        hit = False
        for i, token in enumerate(tokens):
            kept += 1
            if core_stopped and i == len(tokens) - 1:
                break  # the stop token's text is not output
            if detokenizer.append(token):
                hit = True
                break
        if kept < len(tokens):
            out.new_token_ids = tokens[:kept]
            if out.logprobs is not None:
                out.logprobs = out.logprobs[:kept]
        request.emitted += kept
        out.completion_tokens = request.emitted
        if hit:
            was_finished = out.finished
            out.finished, out.finish_reason = True, "stop"
            out.new_text = detokenizer.release(final=True)
            return not was_finished
        out.new_text = detokenizer.release(final=out.finished)
        return False

    def _on_exit(self, client: EngineCoreClient, reason: str) -> None:
        """A core died (receiver thread): fail over its requests, wake its supervisor."""
        replica = self._replicas[client.index]
        if self._closing.is_set():
            return
        logger.error("engine replica %d (pid %s) died: %s", replica.index, client.pid, reason)
        failed: list[_Request] = []
        passed: dict[int, list[_Request]] = {}
        with self._lock:
            if replica.client is not client:
                return
            replica.state = "restarting"
            replica.reason = reason
            replica.load = 0
            replica.stats = {}
            self._router.forget(replica.index)
            live = {r.index: r.load for r in self._replicas if r.state == "up"}
            for request in [r for r in self._requests.values() if r.replica is replica]:
                if request.started or request.retried or not live:
                    del self._requests[request.request_id]
                    failed.append(request)
                    continue
                index, _ = self._router.choose(request.prompt_token_ids, live)
                target = self._replicas[index]
                self._router.record(request.hashes, index)
                request.replica, request.retried = target, True
                request.stream.engine_index = str(index)
                target.load += 1
                target.adds_since_stats += 1
                live[index] += 1
                passed.setdefault(index, []).append(request)
            clients = {index: self._replicas[index].client for index in passed}
        for index, requests in passed.items():
            logger.warning("passing %d request(s) that had not started on to replica %d", len(requests), index)
            clients[index].send(AddRequests([self._new_request(r) for r in requests]))
        error = EngineDeadError(
            f"the engine replica serving this request failed ({reason}); retry the request")
        for request in failed:
            call_on_loop(request.stream.loop, request.stream.push, error)
        replica.died.set()
