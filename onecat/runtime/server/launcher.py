"""Starting the server: ``serve`` (what ``onecat serve`` runs, blocking) and
``BackgroundServer`` (uvicorn in a thread on a free loopback port, for the demo and tests).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from onecat.errors import OnecatError
from onecat.runtime.server.async_engine import AsyncEngine

DEFAULT_MAX_QUEUE_LEN = 512


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free port chosen by the OS)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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


def _uvicorn_server(app: Any, log_level: str) -> Any:
    import uvicorn

    config = uvicorn.Config(
        app,
        log_level=log_level,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
    )
    return uvicorn.Server(config)


def serve(
    engine: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_queue_len: int = DEFAULT_MAX_QUEUE_LEN,
    log_level: str = "info",
) -> None:
    """Serve ``engine`` (an ``LLMEngine``) over HTTP until interrupted (Ctrl-C / SIGTERM)."""
    from onecat.runtime.server.app import create_app

    sock = _bind(host, port)
    async_engine = AsyncEngine(engine, max_queue_len=max_queue_len)
    async_engine.start()
    try:
        _uvicorn_server(create_app(async_engine, api_key=api_key), log_level).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled: a normal way to stop
        pass
    finally:
        async_engine.shutdown()
        sock.close()


class BackgroundServer:
    """uvicorn serving ``engine`` in a daemon thread on ``host`` and a free port.

    Use as a context manager: ``with BackgroundServer(engine) as server: server.url``.
    On exit the server stops (in-flight streams get 5 s) and the engine thread is joined.
    """

    def __init__(
        self,
        engine: Any,
        *,
        host: str = "127.0.0.1",
        api_key: str | None = None,
        max_queue_len: int = DEFAULT_MAX_QUEUE_LEN,
        log_level: str = "warning",
    ) -> None:
        from onecat.runtime.server.app import create_app

        self.async_engine = AsyncEngine(engine, max_queue_len=max_queue_len)
        self.app = create_app(self.async_engine, api_key=api_key)
        self._sock = _bind(host, 0)
        _, self.port = self._sock.getsockname()[:2]
        self.url = f"http://{host}:{self.port}"
        self._server = _uvicorn_server(self.app, log_level)
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
        """Stop uvicorn, then the engine thread."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(15)
        self.async_engine.shutdown()
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
