"""Errors of the runtime's request interface."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine cannot accept (prompt too long, max_tokens beyond the model
    length, bad sampling parameters); the server answers it with HTTP 400."""
