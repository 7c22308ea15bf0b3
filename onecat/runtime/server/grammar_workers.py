"""Grammar compilation as bounded work: xgrammar compiles in spawned worker processes.

xgrammar's compiler is C++ that Python cannot interrupt, and some small schemas take minutes
and gigabytes (a nested regex repetition, an enum of 100k strings, a tool with thousands of
optional parameters). So nothing compiles in the server process: a compile is sent to one
of ``workers`` child processes (at low CPU priority, one compiler thread each, killed
with the server), which sends back the compiled grammar serialised
(``CompiledGrammar.serialize_json``); the server deserialises it against its own
``TokenizerInfo``. A compile that is not done within ``timeout`` seconds, whose client
leaves, or that is still running when the server starts shutting down, is ended by killing
its worker (which frees all its memory); a fresh worker is spawned in its place. Templating
and tokenisation keep their own thread pool, so plain requests never queue behind a compile.

Finished grammars are kept in a small LRU cache keyed by the constraint's JSON (the schema
in its key order, which is the order the grammar writes properties in); constraints that
ran past the budget are remembered too, so a repeated pathological request costs nothing.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_COMPILE_TIMEOUT = 10.0
"""Seconds a grammar may take to compile (``--structured-outputs-compile-timeout``): real
schemas and tool lists compile in well under a second, pathological ones in minutes."""
DEFAULT_WORKERS = 2
CACHE_ENTRIES = 256
POLL_SECONDS = 0.1
"""How often a waiting compile checks whether its client left or the server is draining."""
WORKER_NICENESS = 10


class CompileTimeout(Exception):
    """The grammar did not compile within the time budget."""


class CompileFailed(Exception):
    """xgrammar refused the grammar (its message says why)."""


class CompileAbandoned(Exception):
    """The compile was ended because its client left or the server is shutting down."""


def _die_with_parent() -> None:
    """Ask Linux to kill this process when the server's process goes (a compile in C++ would
    not notice its pipe closing); elsewhere the pipe's EOF ends an idle worker."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker_main(conn: Connection) -> None:
    """A worker process: read the tokenizer table, then compile each constraint received on
    ``conn`` (its structural tag is built here too: xgrammar takes a second for a tool with
    thousands of parameters) and send back ``("ok", serialized compiled grammar)`` or
    ``("error", message)``; exit at EOF."""
    _die_with_parent()
    try:
        os.nice(WORKER_NICENESS)  # plain requests' templating and the engine come first
    except OSError:
        pass
    import xgrammar

    from onecat.runtime.server.structured_output import structural_tag

    try:
        info = xgrammar.TokenizerInfo.deserialize_json(conn.recv())
    except (EOFError, OSError):
        return
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready", None))
    while True:
        try:
            constraint = conn.recv()
        except (EOFError, OSError):  # the server went away
            return
        try:
            compiled = compiler.compile_structural_tag(structural_tag(constraint))
            conn.send(("ok", compiled.serialize_json()))
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError / its own
            conn.send(("error", str(exc)))


class _Worker:
    """One compile process (``python -m`` this module, in a session of its own so that a
    terminal's Ctrl-C reaches only the server) and the server's end of its socket pair.
    A plain subprocess rather than ``multiprocessing``: spawn would re-run the server's
    ``__main__``."""

    def __init__(self, tokenizer_info_json: str) -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno())],
            pass_fds=[theirs.fileno()], env=env, start_new_session=True, stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(tokenizer_info_json)
        self.ready = False

    async def receive(self) -> tuple[str, Any]:
        """The worker's next message (EOFError when it died)."""
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        fd = self.conn.fileno()
        loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        try:
            await readable
        finally:
            loop.remove_reader(fd)
        return self.conn.recv()

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.process.poll() is None

    def kill(self) -> None:
        """End the process now (whatever it is compiling) and reap it."""
        self.process.kill()
        self.process.wait()
        self.conn.close()


class GrammarCompilePool:
    """Compiles structural tags in worker processes under a time budget (module docstring).

    ``tokenizer_info`` is the server's ``xgrammar.TokenizerInfo``; workers are spawned at
    the first compile, so a server that never constrains output runs none.
    """

    def __init__(self, tokenizer_info: Any, *, timeout: float = DEFAULT_COMPILE_TIMEOUT,
                 workers: int = DEFAULT_WORKERS, cache_entries: int = CACHE_ENTRIES) -> None:
        self.tokenizer_info = tokenizer_info
        self.timeout = timeout
        self.workers = workers
        self._info_json: str | None = None
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._slots: asyncio.Semaphore | None = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._too_complex: OrderedDict[str, None] = OrderedDict()
        self._cache_entries = cache_entries
        self._closed = False
        atexit.register(self.close)  # nothing outlives the server, however it exits

    @property
    def live_workers(self) -> int:
        """Worker processes alive now (idle or compiling)."""
        return sum(w.alive() for w in [*self._idle, *self._busy])

    def cached(self, key: str) -> Any | None:
        """The compiled grammar cached under ``key`` (None: not cached)."""
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
        return compiled

    async def compile(
        self,
        key: str,
        constraint: Any,
        *,
        is_disconnected: Callable[[], Awaitable[bool]] | None = None,
        is_draining: Callable[[], bool] | None = None,
    ) -> Any:
        """The ``xgrammar.CompiledGrammar`` of ``constraint`` (a ``JsonConstraint`` or
        ``ToolCallConstraint`` whose schemas were checked), cached under ``key`` (its JSON).

        Raises CompileTimeout past the budget, CompileFailed when xgrammar refuses the tag,
        CompileAbandoned when ``is_disconnected()`` turns true (polled while waiting) or
        ``is_draining()`` does; in each of these cases the worker is killed, not waited for.
        """
        compiled = self.cached(key)
        if compiled is not None:
            return compiled
        if key in self._too_complex:
            raise CompileTimeout(f"it did not compile within {self.timeout:g} s before")
        task = asyncio.ensure_future(self._compile_in_worker(key, constraint))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=POLL_SECONDS)
                if done:
                    compiled = task.result()
                    break
                if is_draining is not None and is_draining():
                    raise CompileAbandoned("the server is shutting down")
                if is_disconnected is not None and await is_disconnected():
                    raise CompileAbandoned("the client closed the request")
        finally:
            if not task.done():
                task.cancel()  # kills the worker (see _compile_in_worker)
                await asyncio.gather(task, return_exceptions=True)
        self._remember(self._cache, key, compiled)
        return compiled

    async def _compile_in_worker(self, key: str, constraint: Any) -> Any:
        """Run one compile on an idle worker; on a timeout, a cancellation or a dead worker,
        the worker is killed and replaced."""
        if self._closed:
            raise CompileAbandoned("the server is shutting down")
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        async with self._slots:
            worker = self._idle.pop() if self._idle else self._spawn()
            self._busy.add(worker)
            healthy = False
            try:
                try:
                    if not worker.ready:  # start-up (importing xgrammar) is not part of the budget
                        await worker.receive()
                        worker.ready = True
                    worker.conn.send(constraint)
                    kind, payload = await asyncio.wait_for(worker.receive(), self.timeout)
                except asyncio.TimeoutError:
                    self._remember(self._too_complex, key, None)
                    raise CompileTimeout(f"it did not compile within {self.timeout:g} s") from None
                except (EOFError, OSError):
                    if self._closed:
                        raise CompileAbandoned("the server is shutting down") from None
                    raise CompileFailed("the grammar compiler process died (out of memory?)") from None
                healthy = True
            finally:
                self._busy.discard(worker)
                if healthy and not self._closed:
                    self._idle.append(worker)
                else:
                    worker.kill()
                    if not self._closed:  # its successor starts up now, not at the next compile
                        self._idle.append(self._spawn())
        if kind == "error":
            raise CompileFailed(payload)
        import xgrammar

        return xgrammar.CompiledGrammar.deserialize_json(payload, self.tokenizer_info)

    def _spawn(self) -> _Worker:
        if self._info_json is None:
            self._info_json = self.tokenizer_info.serialize_json()
        return _Worker(self._info_json)

    def _remember(self, cache: OrderedDict[str, Any], key: str, value: Any) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > self._cache_entries:
            cache.popitem(last=False)

    def close(self) -> None:
        """Kill every worker, idle or compiling (server shutdown); later compiles are
        refused."""
        self._closed = True
        for worker in [*self._idle, *self._busy]:
            worker.kill()
        self._idle.clear()
        self._busy.clear()


if __name__ == "__main__":
    _worker_main(Connection(int(sys.argv[1])))
