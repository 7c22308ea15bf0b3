"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

A value the client sent is quoted in a message only through ``clip`` (a few hundred
characters at most: a 1 MB ``model`` field must not come back whole), and ``error_body``
cuts any message longer than ``MAX_MESSAGE_CHARS`` as a last resort.
"""

from __future__ import annotations

from typing import Any

MAX_ECHO_CHARS = 200
MAX_MESSAGE_CHARS = 2000


def clip(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """``value`` (its ``str``) for quoting in an error message: the first ``limit`` characters
    and how long it was, when longer."""
    text = str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


class APIError(Exception):
    """An error answered to the client as an OpenAI-style error body with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI's API answers for this error."""
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` as OpenAI's API writes it (the
    message cut to ``MAX_MESSAGE_CHARS``)."""
    return {"error": {"message": clip(message, MAX_MESSAGE_CHARS), "type": type, "param": param, "code": code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param, code=code)


def internal_error(request_id: str) -> APIError:
    """A 500 that tells the client only that something failed and under which id the server's
    log has the details (never the exception itself)."""
    return APIError(
        500, f"internal error (request id {request_id})", type="server_error", code="internal_error"
    )
