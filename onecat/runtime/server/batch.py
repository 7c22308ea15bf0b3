"""``onecat batch``: an OpenAI Batch file (JSONL) run through the engine, as vLLM's
``run_batch`` does.

The lines go through the server's own app (``app.create_app`` over an ``AsyncEngine``,
called in-process by ``asgi_call.post_json``), so a line gets exactly the answer ``onecat
serve`` would give its body: the same validation, defaults and error bodies. Up to
``max_concurrency`` requests are in flight at once (default: the engine's ``max_num_seqs``, so
the engine's batch stays full); the engine's queue is not bounded, so no line is answered 429.

Every non-blank input line gets one output line (``batch_lines``), written as soon as its
answer is complete (so in completion order, not input order): a line the runner refuses
(invalid JSON, no custom_id, a repeated custom_id, another method or url, a streaming body)
and a body the server answers with an error (4xx, or a 500 for a request that failed in the
engine) get error lines, and the job goes on. A 503 (the engine stopped) ends the job instead:
those lines get no output line, so ``--resume`` runs them later. The output file is only ever
appended with whole lines and ``--resume`` skips what it holds (``batch_output``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from onecat.errors import OnecatError
from onecat.runtime.server.asgi_call import post_json
from onecat.runtime.server.batch_lines import BatchLine, error_line, parse_line, response_line
from onecat.runtime.server.batch_output import Done, OutputFile, open_output

UNBOUNDED_QUEUE = 1 << 30  # the concurrency limit bounds the requests in flight instead


@dataclass
class BatchSummary:
    """What a run did. ``stopped``: why the job ended early (None: it ran every line)."""

    lines: int = 0  # non-blank input lines
    skipped: int = 0  # done by an earlier run (--resume)
    ok: int = 0
    failed: int = 0  # error lines written (refused lines and error responses)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_time: float = 0.0
    max_concurrency: int = 0
    stopped: str | None = None

    @property
    def written(self) -> int:
        """Output lines this run wrote."""
        return self.ok + self.failed

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of wall time."""
        return self.completion_tokens / self.wall_time if self.wall_time > 0 else 0.0


def input_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(line number, bytes)`` of the non-blank lines of ``path`` (split at ``\\n`` only: a
    JSON string may hold U+2028, which ``str.splitlines`` would split at)."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            raw = raw.rstrip(b"\r\n")
            if raw.strip():
                yield number, raw


def _count_lines(path: Path) -> int:
    return sum(1 for _ in input_lines(path))


class BatchJob:
    """An input file and its output, opened and checked before the model loads
    (``prepare_batch``); ``run`` runs it once on an engine."""

    def __init__(self, input_path: Path, output: OutputFile, done: Done, lines: int) -> None:
        self.input_path = input_path
        self.output = output
        self.done = done
        self.lines = lines

    def run(
        self,
        engine: Any,
        *,
        max_concurrency: int | None = None,
        show_progress: bool = True,
        console: Console | None = None,
        **app_options: Any,
    ) -> BatchSummary:
        """Run every line not done yet through ``engine`` (a started ``ReplicaSet`` or an
        ``LLMEngine``; the caller closes it) and close the output. ``app_options`` go to ``create_app`` (chat options, request
        templates, body limit, grammar budget). Ctrl-C ends the job with whole lines written
        (``stopped`` says so)."""
        from onecat.runtime.server.app import create_app
        from onecat.runtime.server.launcher import engine_client

        try:
            limit = max_concurrency or engine.config.max_num_seqs * getattr(engine, "data_parallel_size", 1)
            if limit < 1:
                raise OnecatError(f"--max-concurrency must be >= 1; got {limit}")
            summary = BatchSummary(lines=self.lines, max_concurrency=limit)
            async_engine = engine_client(engine, UNBOUNDED_QUEUE)
            app = create_app(async_engine, **app_options)
        except BaseException:
            self.output.close()
            raise
        progress = _progress(show_progress, console)
        async_engine.start()
        start = time.perf_counter()
        try:
            with progress:
                runner = _Runner(app, self.output, summary, progress, self.lines, start)
                asyncio.run(runner.run(self._lines(summary, runner), limit))
        except KeyboardInterrupt:
            summary.stopped = "interrupted (Ctrl-C)"
        finally:
            summary.wall_time = time.perf_counter() - start
            try:
                app.state.serving.close()
                async_engine.shutdown()
            finally:
                self.output.close()
        return summary

    def close(self) -> None:
        """Release the output without running (``run`` closes it itself)."""
        self.output.close()

    def _lines(self, summary: BatchSummary, runner: _Runner) -> Iterator[BatchLine]:
        """The lines to run; lines done already are counted as skipped, lines the runner
        refuses are answered here."""
        seen: set[str] = set()
        for number, raw in input_lines(self.input_path):
            line = parse_line(number, raw, seen)
            if self.done.covers(line):
                summary.skipped += 1
                runner.advance()
            elif line.error is not None:
                runner.write(error_line(line, line.error), ok=False)
            else:
                yield line


def prepare_batch(input_path: str | Path, output_path: str | Path, *, resume: bool = False) -> BatchJob:
    """Check INPUT, open OUTPUT (refused when it exists and is not empty, unless ``resume``;
    ``batch_output``) and read what an earlier run did."""
    input_path = Path(input_path)
    if not input_path.is_file():
        raise OnecatError(f"the batch input {input_path} is not a file: give a JSONL file of requests")
    output_path = Path(output_path)
    if output_path.exists() and output_path.resolve() == input_path.resolve():
        raise OnecatError(f"the output {output_path} is the input file; choose another -o path")
    lines = _count_lines(input_path)
    output, done = open_output(output_path, resume)
    return BatchJob(input_path, output, done, lines)


class _Runner:
    """The asynchronous part of a run: requests in flight, output lines, progress."""

    def __init__(self, app: Any, output: OutputFile, summary: BatchSummary, progress: Progress,
                 total: int, start: float) -> None:
        self.app = app
        self.output = output
        self.summary = summary
        self.progress = progress
        self.start = start
        self.bar = progress.add_task("batch", total=total, failed=0, skipped=0, tok_s=0.0)

    def advance(self) -> None:
        """Move the bar by one line and refresh its figures."""
        s = self.summary
        tok_s = s.completion_tokens / max(time.perf_counter() - self.start, 1e-9)
        self.progress.update(self.bar, advance=1, failed=s.failed, skipped=s.skipped, tok_s=tok_s)

    def write(self, line: bytes, ok: bool) -> None:
        """Append one output line and count it."""
        self.output.append(line)
        if ok:
            self.summary.ok += 1
        else:
            self.summary.failed += 1
        self.advance()

    async def run(self, lines: Iterator[BatchLine], limit: int) -> None:
        """Send ``lines`` with at most ``limit`` in flight; stop sending once one is answered
        503, or once one failed (an output write: its exception is raised here)."""
        slots = asyncio.Semaphore(limit)
        tasks: set[asyncio.Task] = set()
        failures: list[BaseException] = []

        def finished(task: asyncio.Task) -> None:
            tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:
                failures.append(task.exception())

        try:
            for line in lines:
                await slots.acquire()
                if self.summary.stopped or failures:
                    break
                task = asyncio.ensure_future(self._one(line, slots))
                tasks.add(task)
                task.add_done_callback(finished)
            if tasks:
                await asyncio.wait(set(tasks))
        finally:
            for task in tasks:
                task.cancel()
        if failures:
            raise failures[0]

    async def _one(self, line: BatchLine, slots: asyncio.Semaphore) -> None:
        """Run one line and write its output line (none for a 503: the engine stopped)."""
        try:
            status, payload = await post_json(self.app, line.url or "", json.dumps(line.body).encode())
            try:
                body: Any = json.loads(payload)
            except ValueError:
                body = payload.decode(errors="replace")
            if status == 503:
                self.summary.stopped = _error_message(body) or "the engine stopped (503)"
                return
            if status == 200:
                usage = body.get("usage") or {}
                self.summary.prompt_tokens += usage.get("prompt_tokens", 0)
                self.summary.completion_tokens += usage.get("completion_tokens", 0)
            self.write(response_line(line, status, body), ok=status == 200)
        finally:
            slots.release()


def _error_message(body: Any) -> str | None:
    """The message of an OpenAI error body, if it is one."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = body["error"].get("message")
        return message if isinstance(message, str) else None
    return None


def _progress(show: bool, console: Console | None) -> Progress:
    """The job's progress bar (on stderr; hidden when ``show`` is False)."""
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[failed]} failed"), TextColumn("{task.fields[skipped]} skipped"),
        TextColumn("{task.fields[tok_s]:.0f} tok/s"), TimeElapsedColumn(),
        console=console or Console(stderr=True), disable=not show, refresh_per_second=4,
    )


def summary_table(summary: BatchSummary) -> Table:
    """The run's figures as a two-column table."""
    table = Table(title="Batch Result", show_header=False, title_style="bold")
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        ("Input lines", f"{summary.lines}"),
        ("Skipped (done before, --resume)", f"{summary.skipped}"),
        ("Requests ok", f"{summary.ok}"),
        ("Requests failed (error lines)", f"{summary.failed}"),
        ("Maximum concurrency", f"{summary.max_concurrency}"),
        ("Prompt tokens", f"{summary.prompt_tokens}"),
        ("Generated tokens", f"{summary.completion_tokens}"),
        ("Wall time (s)", f"{summary.wall_time:.2f}"),
        ("Generated tokens/s", f"{summary.tokens_per_second:.2f}"),
        ("Requests/s", f"{summary.written / summary.wall_time if summary.wall_time > 0 else 0.0:.2f}"),
    ]
    for label, value in rows:
        table.add_row(label, value)
    return table
