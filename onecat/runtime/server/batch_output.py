"""The output file of a batch job: only ever appended with whole lines, resumable.

``open_output`` opens OUTPUT for appending under an exclusive lock (a second job writing the
same file is refused). Without ``resume`` an existing non-empty OUTPUT is refused. With
``resume`` the lines already there say which input lines are done (``Done``: custom_ids,
and line numbers for refused lines, so resume with the same INPUT); a trailing
partial line (a job killed in the middle of a write) is cut off first: the bytes after the
last newline were never a whole line, so nothing complete is lost. Any whole line that is not
a batch output line is refused: the file was not written by ``onecat batch``.

``OutputFile.append`` writes each line with one ``write`` on the O_APPEND descriptor (no
Python buffering): a killed job leaves whole lines and at most one partial last line. Lines
are not fsynced one by one (the page cache survives a killed process); ``close`` fsyncs.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from onecat.errors import OnecatError
from onecat.runtime.server.batch_lines import DUPLICATE_CODE, BatchLine

logger = logging.getLogger(__name__)

READ_CHUNK = 1 << 20


@dataclass
class Done:
    """What an earlier run of the job wrote: the custom_ids it answered or refused, and the
    input line numbers of lines it refused before they reached the server."""

    custom_ids: set[str] = field(default_factory=set)
    line_numbers: set[int] = field(default_factory=set)
    lines: int = 0  # output lines read

    def add(self, record: object) -> bool:
        """Take one output line's record; False when it is not a batch output line."""
        if not isinstance(record, dict) or "custom_id" not in record:
            return False
        response, error = record.get("response"), record.get("error")
        if not isinstance(response, dict) and not isinstance(error, dict):
            return False
        custom_id = record["custom_id"]
        if isinstance(error, dict) and isinstance(error.get("line"), int):
            self.line_numbers.add(error["line"])
            if error.get("code") == DUPLICATE_CODE:  # the id belongs to its first line
                custom_id = None
        if isinstance(custom_id, str):
            self.custom_ids.add(custom_id)
        self.lines += 1
        return True

    def covers(self, line: BatchLine) -> bool:
        """True when ``line`` has its output line already (the job skips it). A duplicate's
        id is its first line's, so a duplicate is matched by its line number only."""
        if line.number in self.line_numbers:
            return True
        duplicate = line.error is not None and line.error.code == DUPLICATE_CODE
        return not duplicate and line.custom_id is not None and line.custom_id in self.custom_ids


class OutputFile:
    """OUTPUT opened for appending whole lines (module docstring)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    def append(self, line: bytes) -> None:
        """Append one whole line (ending in a newline) with a single write."""
        written = os.write(self._fd, line)
        if written != len(line):  # a full disk: the partial line is cut off on --resume
            raise OnecatError(f"{self.path}: only {written} of {len(line)} bytes of a line were written "
                              "(disk full?); free space and rerun with --resume")

    def close(self) -> None:
        """Flush to disk and release the file (and its lock)."""
        if self._fd >= 0:
            try:
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = -1


def open_output(path: str | Path, resume: bool) -> tuple[OutputFile, Done]:
    """Open OUTPUT for the job (module docstring): the file and what is done already."""
    path = Path(path)
    if path.is_dir():
        raise OnecatError(f"the output {path} is a directory; give a file path with -o")
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        raise OnecatError(f"cannot open the output {path}: {exc.strerror}") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OnecatError(f"another onecat batch is writing {path}; wait for it or choose another -o") from None
        size = os.fstat(fd).st_size
        if size and not resume:
            raise OnecatError(f"the output {path} exists and is not empty: add --resume to skip the "
                              "requests it holds and append the rest, or choose another -o path")
        done = _read_done(fd, path, size) if size else Done()
    except BaseException:
        os.close(fd)
        raise
    return OutputFile(path, fd), done


def _read_done(fd: int, path: Path, size: int) -> Done:
    """Read the whole lines of OUTPUT into a ``Done``; cut off a trailing partial line."""
    done = Done()
    pending = b""
    offset = 0
    number = 0
    while offset < size:
        chunk = os.pread(fd, min(READ_CHUNK, size - offset), offset)
        if not chunk:
            break
        offset += len(chunk)
        *whole, pending = (pending + chunk).split(b"\n")
        for raw in whole:
            number += 1
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError:
                record = None
            if not done.add(record):
                raise OnecatError(
                    f"{path}:{number} is not an onecat batch output line; the file was not written "
                    "by onecat batch: choose another -o path")
    if pending:
        os.ftruncate(fd, size - len(pending))
        logger.warning("%s: cut off a partial last line of %d bytes (an interrupted run); "
                       "its request runs again", path, len(pending))
    return done
