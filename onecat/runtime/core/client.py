"""One engine-core process, seen from the API process: start it, send to it, hear from it.

``EngineCoreClient.start`` binds two IPC sockets (a PUSH for requests, a PULL for outputs),
spawns ``python -m onecat.runtime.core.process`` with the replica's environment
(``placement.Placement``) and waits for ``Ready``; a core that sends ``Failed`` or exits
first raises ``EngineStartError`` with its reason. Then a receiver thread hands every
message to ``on_message(client, message, received_at)`` and, once the process has exited
and every message it sent is read, calls ``on_exit(client, reason)`` once: the reason is
the engine's own error when it sent one, else how the process ended (a signal such as
SIGKILL, an exit status). Each start uses fresh sockets, so nothing sent to a dead core
reaches its successor.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import zmq

from onecat.errors import OnecatError
from onecat.runtime.config import EngineConfig
from onecat.runtime.core import messages
from onecat.runtime.core.messages import Failed, Ready, Shutdown
from onecat.runtime.core.placement import Placement

logger = logging.getLogger(__name__)

RECEIVE_POLL_MS = 200
"""How often the receiver thread checks whether the process has exited while it is silent."""
STOP_TIMEOUT = 15.0
SEND_RETRY_MS = 10
"""How long a send waits for the core's socket to take a message before it checks again
that the process still runs."""


class EngineStartError(OnecatError):
    """An engine-core process failed before it was ready; the message says why."""


def exit_reason(returncode: int) -> str:
    """How a process ended, in words (``-9`` -> "killed by SIGKILL")."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


class EngineCoreClient:
    """One engine-core process (module docstring)."""

    def __init__(
        self,
        context: zmq.Context,
        socket_dir: Path,
        config: EngineConfig,
        placement: Placement,
        *,
        on_message: Callable[[EngineCoreClient, Any, float], None],
        on_exit: Callable[[EngineCoreClient, str], None],
        log_level: str = "info",
        factory: tuple[str, dict[str, Any]] | None = None,
    ) -> None:
        self.index = placement.index
        self._factory = factory
        self.placement = placement
        self.config = config
        self.ready: Ready | None = None
        self.process: subprocess.Popen | None = None
        self._context = context
        self._socket_dir = socket_dir
        self._on_message = on_message
        self._on_exit = on_exit
        self._log_level = log_level
        self._send_lock = threading.Lock()
        self._inputs: zmq.Socket | None = None
        self._outputs: zmq.Socket | None = None
        self._failure: str | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """The core process's id (None before it started)."""
        return None if self.process is None else self.process.pid

    def start(self, timeout: float | None = None) -> Ready:
        """Spawn the core and wait until its engine is ready; EngineStartError when it
        fails first (or does not become ready within ``timeout`` seconds)."""
        tag = f"{self.index}-{uuid.uuid4().hex[:8]}"
        self._inputs = self._context.socket(zmq.PUSH)
        self._inputs.setsockopt(zmq.LINGER, 0)
        self._inputs.setsockopt(zmq.SNDHWM, 0)
        inputs = f"ipc://{self._socket_dir}/in-{tag}"
        self._inputs.bind(inputs)
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.LINGER, 0)
        self._outputs.setsockopt(zmq.RCVHWM, 0)
        outputs = f"ipc://{self._socket_dir}/out-{tag}"
        self._outputs.bind(outputs)
        spec = {
            "config": asdict(self.config),
            "inputs": inputs,
            "outputs": outputs,
            "index": self.index,
            "parent": os.getpid(),
            "threads": self.placement.threads,
            "log_level": self._log_level,
        }
        if self._factory is not None:
            spec["factory"], spec["factory_args"] = self._factory
        self.process = subprocess.Popen(
            [sys.executable, "-m", "onecat.runtime.core.process", json.dumps(spec)],
            env=self.placement.environment(dict(os.environ)),
        )
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._outputs.poll(RECEIVE_POLL_MS):
                message = messages.from_core.decode(self._outputs.recv())
                if isinstance(message, Ready):
                    self.ready = message
                    break
                if isinstance(message, Failed):
                    self._kill()
                    raise EngineStartError(f"engine replica {self.index} could not start: {message.error}")
            elif self.process.poll() is not None:
                self._close_sockets()
                raise EngineStartError(
                    f"engine replica {self.index} could not start: its process "
                    f"{exit_reason(self.process.returncode)} (see the log above)"
                )
            elif deadline is not None and time.monotonic() > deadline:
                self._kill()
                raise EngineStartError(f"engine replica {self.index} was not ready within {timeout:g} s")
        self._thread = threading.Thread(target=self._receive, name=f"onecat-core-{self.index}", daemon=True)
        self._thread.start()
        return self.ready

    def send(self, message: Any) -> None:
        """Send a message to the core (any thread); dropped once the core has gone.

        Never blocks on a dead core: a PUSH socket whose only peer has gone blocks a plain
        send for ever, and a request routed here between the core's death and the receiver
        thread noticing it (up to ``RECEIVE_POLL_MS``) would then freeze the caller (the
        server's event loop) and, through the lock, the receiver thread's failover. So the
        send does not wait; while the peer is missing it retries only as long as the process
        lives (``on_exit`` then fails the request over or ends it)."""
        data = messages.encoder.encode(message)
        with self._send_lock:
            while self._inputs is not None and not self._inputs.closed:
                try:
                    self._inputs.send(data, flags=zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:
                    if not self.alive():
                        return
                    self._inputs.poll(SEND_RETRY_MS, zmq.POLLOUT)

    def alive(self) -> bool:
        """True while the core process runs."""
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Ask the core to exit, wait ``timeout`` seconds, then kill it; no ``on_exit`` call."""
        self._stopping = True
        if self.alive():
            self.send(Shutdown())
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._kill()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._close_sockets()

    def kill(self) -> None:
        """SIGKILL the core (tests and the failover bench use it)."""
        if self.process is not None:
            self.process.kill()

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._close_sockets()

    def _close_sockets(self) -> None:
        with self._send_lock:
            for sock in (self._inputs, self._outputs):
                if sock is not None and not sock.closed:
                    sock.close(linger=0)

    def _receive(self) -> None:
        """The receiver thread (module docstring)."""
        sock = self._outputs
        while not self._stopping:
            if sock.poll(RECEIVE_POLL_MS):
                self._guarded_handle(sock.recv(copy=False))
                continue
            if self.process.poll() is None:
                continue
            while sock.poll(0):  # what it sent before it died
                self._guarded_handle(sock.recv(copy=False))
            if self._stopping:
                return
            reason = self._failure or exit_reason(self.process.returncode)
            self._close_sockets()
            self._on_exit(self, reason)
            return

    def _guarded_handle(self, frame: Any) -> None:
        """``_handle``; a message that cannot be handled (a bug: requests fail one by one in
        ``on_message``) kills the core rather than the receiver thread, so its requests fail
        over and the replica restarts instead of hanging for ever."""
        try:
            self._handle(frame)
        except Exception as exc:  # noqa: BLE001 - logged; the core's exit is handled next
            logger.error("engine replica %d: a message from its core could not be handled; killing it",
                         self.index, exc_info=exc)
            self._failure = f"a message from the engine core could not be handled ({type(exc).__name__}: {exc})"
            self.kill()

    def _handle(self, frame: Any) -> None:
        message = messages.from_core.decode(frame.buffer)
        if isinstance(message, Failed):
            self._failure = f"the engine failed: {message.error}"
            return
        self._on_message(self, message, time.monotonic())
