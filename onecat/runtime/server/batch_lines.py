"""The lines of a batch job (``onecat batch``): OpenAI's Batch input format in, its output
format out.

An input line is one JSON object: ``{"custom_id": str, "method": "POST", "url":
"/v1/chat/completions" or "/v1/completions", "body": {...}}``. ``parse_line`` checks what the
batch runner itself must know (the id, the method, the url, that the body is an object and
does not stream) and leaves the body's fields to the server's own validation. A line it
refuses carries a ``LineError`` and becomes an error line in the output; the job goes on.

An output line is ``{"id": "batch_req_...", "custom_id": ..., "response": {"status_code",
"request_id", "body"} or null, "error": {"code", "message", "line"} or null}``: a request the
server answered (any status) has a ``response``; a line refused before reaching the server
has an ``error``, which also names its input line number (``line``), since such a line may
have no usable ``custom_id`` (``onecat batch --resume`` skips it by that number).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from onecat.runtime.server.api_errors import clip

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
DUPLICATE_CODE = "duplicate_custom_id"


@dataclass(frozen=True)
class LineError:
    """Why the runner refused an input line (OpenAI's batch ``error`` object)."""

    code: str
    message: str


@dataclass(frozen=True)
class BatchLine:
    """One non-blank input line. ``number``: 1-based line number in the input file;
    ``custom_id`` None when the line has no usable one; ``error`` set when the runner refused
    the line (then ``url`` and ``body`` may be None)."""

    number: int
    custom_id: str | None
    url: str | None = None
    body: dict[str, Any] | None = None
    error: LineError | None = None


def parse_line(number: int, raw: bytes, seen_ids: set[str]) -> BatchLine:
    """Parse input line ``number`` (its bytes, without the newline). ``seen_ids`` holds the
    custom_ids of the lines before it and receives this line's: a repeated id is refused
    (the first line with an id is the one that runs)."""
    try:
        item = json.loads(raw)
    except UnicodeDecodeError:
        return BatchLine(number, None, error=LineError("invalid_json", "the line is not valid UTF-8"))
    except json.JSONDecodeError as exc:
        return BatchLine(number, None, error=LineError("invalid_json", f"the line is not valid JSON: {exc}"))
    if not isinstance(item, dict):
        return BatchLine(number, None, error=LineError(
            "invalid_request", "the line must be a JSON object with custom_id, method, url and body"))
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BatchLine(number, None, error=LineError(
            "missing_custom_id", f"custom_id must be a non-empty string, got {clip(json.dumps(custom_id))}"))
    if custom_id in seen_ids:
        return BatchLine(number, custom_id, error=LineError(
            DUPLICATE_CODE, f"custom_id {clip(custom_id)!r} is used by an earlier line; custom_ids must be unique"))
    seen_ids.add(custom_id)
    method, url, body = item.get("method"), item.get("url"), item.get("body")
    if method != "POST":
        return BatchLine(number, custom_id, error=LineError(
            "invalid_method", f"method must be \"POST\", got {clip(json.dumps(method))}"))
    if url not in ENDPOINTS:
        return BatchLine(number, custom_id, error=LineError(
            "invalid_url", f"url must be one of {', '.join(ENDPOINTS)}; got {clip(json.dumps(url))}"))
    if not isinstance(body, dict):
        return BatchLine(number, custom_id, error=LineError(
            "invalid_request", "body must be a JSON object (the request the url takes)"))
    if body.get("stream") not in (None, False):
        return BatchLine(number, custom_id, error=LineError(
            "stream_not_supported", "a batch line cannot stream: drop \"stream\" or set it to false "
            "(the output holds each response whole)"))
    return BatchLine(number, custom_id, url, body)


def _line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def encode_line(record: dict[str, Any]) -> bytes:
    """One output line: compact JSON (newlines inside strings are escaped) and ``\\n``."""
    return (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


def response_line(line: BatchLine, status: int, body: Any) -> bytes:
    """The output line of a request the server answered with ``status`` and ``body`` (a
    response or an OpenAI error body). ``request_id``: the response's id, else a new one."""
    request_id = body.get("id") if isinstance(body, dict) and isinstance(body.get("id"), str) else None
    response = {"status_code": status, "request_id": request_id or f"req_{uuid.uuid4().hex}", "body": body}
    return encode_line({"id": _line_id(), "custom_id": line.custom_id, "response": response, "error": None})


def error_line(line: BatchLine, error: LineError) -> bytes:
    """The output line of an input line the runner refused (no response)."""
    record = {"code": error.code, "message": error.message, "line": line.number}
    return encode_line({"id": _line_id(), "custom_id": line.custom_id, "response": None, "error": record})
