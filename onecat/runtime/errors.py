"""Errors of the runtime's request interface."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine cannot accept (prompt too long, max_tokens beyond the model
    length, bad sampling parameters); the server answers it with HTTP 400.

    ``param`` names the offending request field when one is to blame (the server puts it in
    the error body's ``param``).
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
