"""One HTTP request to an ASGI app in the same process and event loop, with no socket.

``onecat batch`` sends its lines through the very app ``onecat serve`` serves (validation,
error bodies, metrics: the same code), without HTTP framing or a client library. The
request's body is delivered at once; after that the app's ``receive`` waits until the
response has been sent and then reports a disconnect, so ``Request.is_disconnected`` is False
while the request runs (the client never leaves). Only whole (non-streamed) responses are
expected; the body parts are joined.
"""

from __future__ import annotations

import asyncio
from typing import Any

CLIENT = ("onecat-batch", 0)
SERVER = ("in-process", 0)


async def post_json(app: Any, path: str, body: bytes) -> tuple[int, bytes]:
    """POST ``body`` (JSON bytes) to ``path`` of the ASGI ``app``; the response's status and
    body bytes."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": CLIENT,
        "server": SERVER,
    }
    delivered = False
    finished = asyncio.Event()
    status = 500
    parts: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                finished.set()

    try:
        await app(scope, receive, send)
    finally:
        finished.set()
    return status, b"".join(parts)
