"""Starting the server: ``serve`` (what ``onecat serve`` runs, blocking) and
``BackgroundServer`` (uvicorn in a thread on a free loopback port, for the demo and tests).

Shutting down (SIGTERM or Ctrl-C for ``serve``, ``stop()`` for ``BackgroundServer``) drains
first, with the listening socket still open: from the first moment new requests and /health
are answered 503 (so load balancers move away and clients get an answer, not a refused
connection), running requests may finish for ``shutdown_timeout`` seconds, then the ones
still running are ended: a stream gets an SSE error event and ``data: [DONE]``, a waiting
client a 503. Only then does uvicorn's graceful shutdown run (stop listening, let open
responses end, close connections). The drain lives in uvicorn's ``on_tick`` (the 0.1 s
loop that ends when a signal or ``stop()`` sets ``should_exit``), so whatever asked for the
exit, it drains the same way; a second Ctrl-C exits at once. ``onecat serve`` then exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from typing import Any

from onecat.errors import OnecatError
from onecat.runtime.server.async_engine import AsyncEngine, EngineClient, ShuttingDownError

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE_LEN = 512
DEFAULT_SHUTDOWN_TIMEOUT = 30.0  # seconds running requests get after SIGTERM (--shutdown-timeout)
_BACKSTOP = 5.0  # uvicorn cancels what is still open this long after the drain ended it


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free port chosen by the OS).

    Its protocol is named (``IPPROTO_TCP``, not 0) and it has ``TCP_NODELAY``: asyncio turns
    Nagle's algorithm off only on accepted sockets of a named TCP protocol, and with Nagle on
    a response's second write (the first SSE chunk after the headers, a body after its
    status line) waited for the client's delayed ACK, up to 40 ms per request."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OnecatError(
            f"cannot listen on {host}:{port}: {exc.strerror}; choose another --port or --host"
        ) from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def engine_client(engine: Any, max_queue_len: int) -> Any:
    """What request handlers talk to: ``engine`` itself when it is already a client of
    engine-core processes (``ReplicaSet``), else an ``AsyncEngine`` thread around the
    in-process ``LLMEngine``."""
    return engine if isinstance(engine, EngineClient) else AsyncEngine(engine, max_queue_len=max_queue_len)


def _uvicorn_server(app: Any, engine: AsyncEngine, log_level: str, shutdown_timeout: float) -> Any:
    """A uvicorn server whose graceful shutdown first drains ``engine`` (module docstring)."""
    import uvicorn

    def end_running_requests() -> None:
        stats = engine.stats()
        logger.warning(
            "shutdown timeout (%g s) reached: ending %d running and %d waiting request(s)",
            shutdown_timeout, stats.get("running", 0), stats.get("waiting", 0),
        )
        engine.abort_all(ShuttingDownError(
            f"the server shut down: the request was still running after the {shutdown_timeout:g} s "
            "drain (--shutdown-timeout); retry it on another instance"
        ))

    class DrainingServer(uvicorn.Server):
        drain_deadline: float | None = None
        ended_running = False

        async def on_tick(self, counter: int) -> bool:
            if not await super().on_tick(counter):
                return False
            if self.force_exit:
                return True
            now = asyncio.get_running_loop().time()
            if self.drain_deadline is None:
                engine.start_draining()
                logger.info("shutting down: new requests get 503; running ones get %g s", shutdown_timeout)
                self.drain_deadline = now + shutdown_timeout
            if engine.idle():
                return True
            if now >= self.drain_deadline:
                self.end_running()
                return True
            return False  # keep listening (and answering 503) until the engine is idle

        def end_running(self) -> None:
            if not self.ended_running:
                self.ended_running = True
                end_running_requests()

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            engine.start_draining()  # also when the loop ended otherwise (a forced exit)
            if not engine.idle():
                self.end_running()
            await super().shutdown(sockets)

    config = uvicorn.Config(
        app,
        log_level=log_level,
        timeout_graceful_shutdown=_BACKSTOP,  # the drain has run before uvicorn's shutdown
        timeout_keep_alive=5,
    )
    return DrainingServer(config)


class _Terminated(Exception):
    """SIGTERM after uvicorn's graceful shutdown (uvicorn raises the signal again once done)."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated


def log_to_stderr(log_level: str, tag: str = "") -> None:
    """Show onecat's own log records (engine failures with their tracebacks, the drain) at
    ``log_level``, next to uvicorn's; ``tag`` (e.g. ``"[replica 1] "``) starts each line
    after the level (an engine-core process names its replica)."""
    root = logging.getLogger("onecat")
    root.setLevel(log_level.upper())
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"%(levelname)s:     {tag}%(name)s: %(message)s"))
        root.addHandler(handler)


def serve(
    engine: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_queue_len: int = DEFAULT_MAX_QUEUE_LEN,
    log_level: str = "info",
    trust_request_chat_template: bool = False,
    max_request_body_bytes: int | None = None,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    chat_options: Any = None,
    grammar_compile_timeout: float | None = None,
) -> None:
    """Serve ``engine`` (a ``ReplicaSet`` of engine-core processes, or an in-process
    ``LLMEngine``) over HTTP until SIGTERM or Ctrl-C; both drain (module docstring), stop
    the engine and return normally."""
    from onecat.runtime.server.app import DEFAULT_MAX_REQUEST_BODY_BYTES, create_app

    log_to_stderr(log_level)
    sock = _bind(host, port)
    async_engine = engine_client(engine, max_queue_len)
    app = create_app(
        async_engine,
        api_key=api_key,
        trust_request_chat_template=trust_request_chat_template,
        max_request_body_bytes=max_request_body_bytes or DEFAULT_MAX_REQUEST_BODY_BYTES,
        chat_options=chat_options,
        grammar_compile_timeout=grammar_compile_timeout,
    )
    server = _uvicorn_server(app, async_engine, log_level, shutdown_timeout)
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main else None
    async_engine.start()
    try:
        server.run(sockets=[sock])
    except (KeyboardInterrupt, _Terminated):  # uvicorn re-raises the signal it handled
        pass
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        async_engine.shutdown()
        sock.close()


class BackgroundServer:
    """uvicorn serving ``engine`` (an ``LLMEngine`` or a ``ReplicaSet``) in a daemon thread
    on ``host`` and a free port.

    Use as a context manager: ``with BackgroundServer(engine) as server: server.url``.
    On exit the server drains (running requests get ``shutdown_timeout`` seconds) and the
    engine thread is joined.
    """

    def __init__(
        self,
        engine: Any,
        *,
        host: str = "127.0.0.1",
        api_key: str | None = None,
        max_queue_len: int = DEFAULT_MAX_QUEUE_LEN,
        log_level: str = "warning",
        trust_request_chat_template: bool = False,
        max_request_body_bytes: int | None = None,
        shutdown_timeout: float = 5.0,
        chat_options: Any = None,
        grammar_compile_timeout: float | None = None,
    ) -> None:
        from onecat.runtime.server.app import DEFAULT_MAX_REQUEST_BODY_BYTES, create_app

        self.async_engine = engine_client(engine, max_queue_len)
        self.app = create_app(
            self.async_engine,
            api_key=api_key,
            trust_request_chat_template=trust_request_chat_template,
            max_request_body_bytes=max_request_body_bytes or DEFAULT_MAX_REQUEST_BODY_BYTES,
            chat_options=chat_options,
            grammar_compile_timeout=grammar_compile_timeout,
        )
        self._sock = _bind(host, 0)
        _, self.port = self._sock.getsockname()[:2]
        self.url = f"http://{host}:{self.port}"
        self._shutdown_timeout = shutdown_timeout
        self._server = _uvicorn_server(self.app, self.async_engine, log_level, shutdown_timeout)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="onecat-http", daemon=True
        )

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        """Start the engine thread and uvicorn; return once the server accepts connections."""
        self.async_engine.start()
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise OnecatError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Drain and stop uvicorn, then the engine thread."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(self._shutdown_timeout + _BACKSTOP + 10)
        self.async_engine.shutdown()
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
