"""One streamed request to an OpenAI-compatible server, timed on the client.

Timings follow ``vllm bench serve``: the clock starts just before the request is sent;
TTFT is the arrival of the first chunk that carries output text; each later text chunk
adds one inter-token latency (ITL: the time since the previous one); the latency (E2EL)
ends at the last chunk with a choice. A chat stream's opening role chunk carries no text
and is not a token (onecat sends it before prefill, vLLM with the first token). The output
token count is the server's ``usage.completion_tokens`` (asked for with
``stream_options.include_usage``), else the number of text chunks; the prompt length is
``usage.prompt_tokens`` when the server reports it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from onecat.benchmarks.datasets import SampleRequest
from onecat.errors import OnecatError

EndpointKind = Literal["completions", "chat"]
CONNECT_TIMEOUT_S = 10.0


@dataclass
class RequestResult:
    """What one request gave: success, timings in seconds and token counts."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    generated_text: str = ""
    error: str = ""


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send requests."""

    base_url: str  # scheme://host:port, without /v1
    path: str  # e.g. /v1/completions
    kind: EndpointKind
    model: str
    api_key: str | None = None

    @property
    def url(self) -> str:
        """The request URL."""
        return self.base_url + self.path

    def headers(self) -> dict[str, str]:
        """The request headers (the API key as a bearer token)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def endpoint_kind(path: str, endpoint_type: str | None) -> EndpointKind:
    """``completions`` or ``chat``: given, or read from the path's ending."""
    if endpoint_type:
        if endpoint_type not in ("completions", "chat"):
            raise OnecatError(f"--endpoint-type {endpoint_type!r}: choose completions or chat")
        return endpoint_type  # type: ignore[return-value]
    if path.rstrip("/").endswith("chat/completions"):
        return "chat"
    if path.rstrip("/").endswith("completions"):
        return "completions"
    raise OnecatError(
        f"--endpoint {path}: cannot tell its API from the path; give --endpoint-type "
        "completions or chat"
    )


def split_base_url(base_url: str, path: str) -> tuple[str, str]:
    """``(server root, endpoint path)``; a base URL ending in ``/v1`` (OpenAI clients'
    habit) is accepted when the path starts with ``/v1/``."""
    base = base_url.rstrip("/")
    usage = f"--base-url {base_url}: give a URL such as http://127.0.0.1:8000"
    if not base.startswith(("http://", "https://")):
        raise OnecatError(usage)
    try:
        host = httpx.URL(base).host  # parses the authority: an unclosed [::1 or a bad port raises
    except (httpx.InvalidURL, ValueError) as exc:
        raise OnecatError(f"{usage} ({exc})") from None
    if not host:
        raise OnecatError(f"{usage} (no host)")
    path = "/" + path.lstrip("/")
    if base.endswith("/v1") and path.startswith("/v1/"):
        base = base[: -len("/v1")]
    return base, path


def error_message(response_body: bytes) -> str:
    """The ``error.message`` of an OpenAI-style error body, else the body's start."""
    text = response_body.decode("utf-8", "replace")
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:300] or "(empty body)"
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body))
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        return str(error)[:300]
    return text[:300]


def list_models(base_url: str, api_key: str | None) -> dict[str, str]:
    """``{model id: root}`` from ``GET /v1/models`` (root: the path or hub id the model was
    loaded from, as onecat and vLLM report it; else the id); raises a clear OnecatError
    when the server cannot be reached or refuses."""
    url = base_url + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url, headers=headers, timeout=CONNECT_TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise OnecatError(
            f"cannot reach {url} ({type(exc).__name__}: {exc}); is the server running? check --base-url"
        ) from None
    if response.status_code in (401, 403):
        raise OnecatError(
            f"{url} answered {response.status_code} ({error_message(response.content)}); "
            "give the server's key with --api-key or OPENAI_API_KEY"
        )
    if response.status_code != 200:
        raise OnecatError(f"{url} answered {response.status_code}: {error_message(response.content)}")
    try:
        return {m["id"]: m.get("root") or m["id"] for m in response.json()["data"]}
    except (ValueError, KeyError, TypeError):
        raise OnecatError(f"{url}: not an OpenAI model list: {response.text[:200]}") from None


def build_payload(
    endpoint: Endpoint, request: SampleRequest, ignore_eos: bool, extra_body: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The JSON body of one streamed request (vLLM's fields)."""
    payload: dict[str, Any] = {"model": endpoint.model, "stream": True,
                               "stream_options": {"include_usage": True}}
    if endpoint.kind == "chat":
        payload["messages"] = [{"role": "user", "content": request.prompt}]
        payload["max_completion_tokens"] = request.output_len
    else:
        payload["prompt"] = request.prompt
        payload["max_tokens"] = request.output_len
    if ignore_eos:
        payload["ignore_eos"] = True
    payload.update(extra_body or {})
    return payload


def chunk_text(chunk: dict[str, Any], kind: EndpointKind) -> tuple[bool, str]:
    """``(has a choice, its output text)`` of one streamed chunk."""
    choices = chunk.get("choices")
    if not choices:
        return False, ""
    choice = choices[0]
    if kind == "completions":
        return True, choice.get("text") or ""
    delta = choice.get("delta") or {}
    return True, (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def send_request(
    client: httpx.AsyncClient, endpoint: Endpoint, payload: dict[str, Any], prompt_len: int
) -> RequestResult:
    """Send one streamed request and time it; failures come back as ``success=False``
    with the reason in ``error`` (never raised)."""
    result = RequestResult(prompt_len=prompt_len)
    start = last = time.perf_counter()
    result.start_time = start
    text_chunks = 0
    finished = False
    pieces: list[str] = []
    try:
        async with client.stream("POST", endpoint.url, json=payload, headers=endpoint.headers()) as response:
            if response.status_code != 200:
                body = await response.aread()
                result.error = f"HTTP {response.status_code} from {endpoint.url}: {error_message(body)}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators and SSE comments
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk and not chunk.get("choices"):
                    result.error = f"error in the stream from {endpoint.url}: {error_message(data.encode())}"
                    return result
                has_choice, text = chunk_text(chunk, endpoint.kind)
                if text:
                    if text_chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    text_chunks += 1
                    pieces.append(text)
                    last = now
                if has_choice:
                    result.latency = now - start
                    if choice_finished(chunk):
                        finished = True
                        if not text_chunks:
                            result.ttft = now - start  # finished without any text
                usage = chunk.get("usage")
                if usage:
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                    result.prompt_len = int(usage.get("prompt_tokens") or prompt_len)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__} from {endpoint.url}: {exc}"
        return result
    except (json.JSONDecodeError, ValueError) as exc:
        result.error = f"bad stream from {endpoint.url}: {exc}"
        return result
    if not (text_chunks or finished):
        result.error = f"{endpoint.url}: the stream ended without output or a finish_reason"
        return result
    result.generated_text = "".join(pieces)
    if not result.output_tokens:
        result.output_tokens = text_chunks
    result.success = True
    return result


def choice_finished(chunk: dict[str, Any]) -> bool:
    """Whether the chunk's first choice carries a ``finish_reason``."""
    return bool(chunk["choices"][0].get("finish_reason"))
