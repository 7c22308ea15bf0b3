"""The engine-core process: one ``LLMEngine`` that schedules, runs and samples, fed over ZMQ.

Started by ``client.EngineCoreClient`` as ``python -m onecat.runtime.core.process SPEC``
(SPEC: JSON with the ``EngineConfig`` fields, the two socket addresses, the replica index,
on CPU the torch thread count, and optionally ``factory``: ``"module:function"`` called as
``function(config, replica_index, **factory_args)`` to build the engine instead of
``LLMEngine(config)``, which benchmarks use for random models built on the GPU). It connects a PULL socket for requests and a PUSH
socket for outputs, builds the engine (``Failed(starting=True)`` and exit 1 when that
fails), sends ``Ready`` and loops:

- take every message waiting (blocking only while the engine has nothing to do, with a
  timeout, so that a core whose parent died notices and exits; it ignores Ctrl-C, which
  the API process handles by stopping it);
- run one engine step and send its outputs as one ``Outputs`` message, with a stats
  snapshot at most every ``STATS_INTERVAL`` seconds and when the engine goes idle.

The engine runs with ``detokenize`` off: the API process turns token ids into text and
finds stop strings (and aborts the request here when it finds one). An exception escaping
``engine.step()`` leaves the engine's state unknown: the core sends ``Failed`` with the
traceback and exits 1, and the API process fails over and restarts it.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections import OrderedDict
from typing import Any

import zmq

from onecat.runtime.core import messages
from onecat.runtime.core.messages import (
    AbortRequests,
    AddRequests,
    Failed,
    Outputs,
    Ready,
    Shutdown,
)
from onecat.runtime.server.launcher import log_to_stderr

logger = logging.getLogger("onecat.runtime.core")

IDLE_POLL_MS = 500
"""How long an idle core waits for a message before it checks that its parent lives."""
GRAMMAR_CACHE = 64


class EngineCore:
    """The loop of one engine-core process around ``engine`` (an ``LLMEngine``)."""

    def __init__(self, engine: Any, inputs: zmq.Socket, outputs: zmq.Socket, parent: int) -> None:
        self.engine = engine
        self.inputs = inputs
        self.outputs = outputs
        self.parent = parent
        self._pending: list[Any] = []  # outputs of refused adds, sent with the next message
        self._stats_at = 0.0
        self._grammar_backend: Any = None
        self._grammars: OrderedDict[str, Any] = OrderedDict()

    def run(self) -> None:
        """Serve until ``Shutdown``, the parent's death or an engine failure (raised)."""
        engine = self.engine
        while True:
            if os.getppid() != self.parent:
                logger.warning("the API process is gone; the engine core exits")
                return
            if not engine.has_unfinished_requests() and not self.inputs.poll(IDLE_POLL_MS):
                continue
            if not self._take_messages():
                return
            outputs = engine.step() if engine.has_unfinished_requests() else []
            self._send(outputs)

    def _take_messages(self) -> bool:
        """Handle every message waiting; False after ``Shutdown``."""
        while True:
            try:
                frame = self.inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            message = messages.to_core.decode(frame.buffer)
            if isinstance(message, AddRequests):
                for request in message.requests:
                    self._add(request)
            elif isinstance(message, AbortRequests):
                for request_id in message.request_ids:
                    self.engine.abort_request(request_id)
            elif isinstance(message, Shutdown):
                return False

    def _add(self, request: messages.NewRequest) -> None:
        from onecat.runtime.engine.llm_engine import RequestOutput

        try:
            params = messages.params_from_fields(request.params)
            if request.grammar is not None:
                params.logits_processors = [self._grammar_processor(request.grammar)]
            self.engine.add_request(request.request_id, request.prompt_token_ids, params)
        except Exception as exc:  # checked in the API process already: a mismatch or a bug
            logger.error("request %s refused by the engine core", request.request_id, exc_info=exc)
            self._pending.append(RequestOutput(
                request_id=request.request_id, new_token_ids=[], new_text="", finished=True,
                finish_reason="error", prompt_tokens=len(request.prompt_token_ids), completion_tokens=0,
                error=f"{type(exc).__name__}: {exc}",
            ))

    def _grammar_processor(self, payload: str) -> Any:
        """A fresh grammar mask over a serialised compiled grammar (deserialised once per
        distinct grammar, against the core's own tokenizer table)."""
        from onecat.runtime.server.structured_output import GrammarBackend

        if self._grammar_backend is None:
            engine = self.engine
            self._grammar_backend = GrammarBackend(
                engine.tokenizer, engine.runner.model_config.vocab_size, sorted(engine.eos_token_ids)
            )
        compiled = self._grammars.get(payload)
        if compiled is None:
            compiled = self._grammars[payload] = self._grammar_backend.deserialize(payload)
            while len(self._grammars) > GRAMMAR_CACHE:
                self._grammars.popitem(last=False)
        self._grammars.move_to_end(payload)
        return self._grammar_backend.logits_processor(compiled)

    def _send(self, outputs: list[Any]) -> None:
        if self._pending:
            outputs = self._pending + outputs
            self._pending = []
        now = time.monotonic()
        idle = not self.engine.has_unfinished_requests()
        stats = None
        if idle or now - self._stats_at >= messages.STATS_INTERVAL:
            stats = dict(self.engine.stats())
            self._stats_at = now
        if outputs or stats is not None:
            self.outputs.send(messages.encoder.encode(Outputs(outputs, stats)), copy=False)


def _ready(engine: Any) -> Ready:
    return Ready(
        pid=os.getpid(),
        model_name=engine.model_name,
        max_model_len=engine.max_model_len,
        vocab_size=engine.runner.model_config.vocab_size,
        eos_token_ids=sorted(engine.eos_token_ids),
        num_kv_blocks=engine.block_manager.num_blocks,
        kv_block_size=engine.config.kv_block_size,
    )


def exit_with_parent(parent: int, until: threading.Event) -> threading.Thread:
    """A daemon thread that ends this process (exit status 1) when ``parent`` is no longer its
    parent, checked every second until ``until`` is set: a core still building its engine
    (minutes for a 27B) must not outlive an API process killed with SIGKILL and hold its GPU.
    (Not ``PR_SET_PDEATHSIG``: that fires when the *thread* that spawned the core ends, and
    replicas are started from short-lived threads.)"""
    def watch() -> None:
        while not until.wait(1.0):
            if os.getppid() != parent:
                logger.warning("the API process is gone; the engine core exits while starting")
                os._exit(1)

    thread = threading.Thread(target=watch, name="onecat-parent-watch", daemon=True)
    thread.start()
    return thread


def main(argv: list[str]) -> int:
    """The process entry point; ``argv[0]`` is the JSON spec (module docstring)."""
    spec = json.loads(argv[0])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the API process's: it stops the cores
    log_to_stderr(spec.get("log_level", "info"), tag=f"[replica {spec['index']}] ")
    parent = spec.get("parent", os.getppid())
    started = threading.Event()
    exit_with_parent(parent, started)
    context = zmq.Context()
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 5000)
    outputs.connect(spec["outputs"])
    inputs = context.socket(zmq.PULL)
    inputs.setsockopt(zmq.LINGER, 0)
    inputs.connect(spec["inputs"])
    try:
        import torch

        from onecat.runtime.config import EngineConfig
        from onecat.runtime.engine.llm_engine import LLMEngine

        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
        config = EngineConfig(**spec["config"])
        if spec.get("factory"):  # "module:function" building the engine (benchmarks' random models)
            module, _, function = spec["factory"].partition(":")
            build = getattr(importlib.import_module(module), function)
            engine = build(config, spec["index"], **spec.get("factory_args", {}))
        else:
            engine = LLMEngine(config)
        engine.detokenize = False
    except BaseException as exc:  # noqa: BLE001 - the API process says why the replica is down
        logger.error("the engine could not be built", exc_info=exc)
        reason = str(exc) if exc.__class__.__module__.startswith("onecat") else f"{type(exc).__name__}: {exc}"
        outputs.send(messages.encoder.encode(Failed(reason, starting=True)))
        outputs.close()
        context.term()
        return 1
    started.set()  # the run loop checks the parent from here on
    outputs.send(messages.encoder.encode(_ready(engine)))
    try:
        EngineCore(engine, inputs, outputs, parent).run()
    except Exception as exc:  # the engine's state is unknown: this replica must restart
        logger.error("the engine failed; the engine core exits", exc_info=exc)
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        outputs.send(messages.encoder.encode(Failed(text)))
        return 1
    finally:
        engine.close()
        inputs.close()
        outputs.close()
        context.term()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
