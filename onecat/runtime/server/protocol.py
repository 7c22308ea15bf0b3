"""Request models of the OpenAI API that onecat serves (pydantic, validated by FastAPI).

Fields OpenAI defines and the engine cannot honour (``n > 1``, logprobs, penalties, tools,
JSON mode, ...) are accepted only at their neutral value; anything else is refused with a
400 naming the field, never silently ignored. Unknown extra fields are ignored, as OpenAI
and vLLM do. vLLM's extensions ``top_k``, ``stop_token_ids``, ``ignore_eos``,
``chat_template_kwargs`` and ``chat_template`` are supported (a request's own template only
when the operator trusts them: ``--trust-request-chat-template``).

Every number must be one the engine can take (``onecat.runtime.sampling_params``' limits:
int32 counts and token ids, an int64 seed, finite floats) and every string valid Unicode;
anything else is a 400 naming the field before the request reaches the engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from onecat.runtime.errors import RequestError
from onecat.runtime.sampling_params import (
    MAX_INT32,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SEED_MAX,
    SEED_MIN,
    check_text,
)
from onecat.runtime.server.api_errors import bad_request

TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
Count = Annotated[int, Field(ge=1, le=MAX_INT32)]


_SCALARS = frozenset({int, float, bool, type(None)})


def refuse_invalid_unicode(data: Any) -> None:
    """Raise a 400 naming the field when any string (or key) in the raw request body is not
    valid Unicode, e.g. a lone surrogate from a ``\ud800`` JSON escape: such text cannot be
    tokenised, and an answer quoting it could not be encoded."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                check_text(value, path or "body")
            except RequestError as exc:
                raise bad_request(str(exc), param=path.split(".")[0] or None) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else str(key)
                if isinstance(key, str):
                    stack.append((key, where))
                stack.append((item, where))
        elif isinstance(value, list) and not _SCALARS.issuperset(map(type, value)):  # fast for token ids
            stack.extend((item, f"{path}.{i}") for i, item in enumerate(value) if isinstance(item, str | dict | list))


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with the token counts."""

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: Count | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_INT32)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    n: Count = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        refuse_invalid_unicode(data)
        return data

    def stop_strings(self) -> list[str]:
        """``stop`` as a list (OpenAI accepts one string or a list)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    def refuse_unsupported(self) -> None:
        """Raise a 400 for a field the engine cannot honour (set to a non-neutral value)."""
        if self.n != 1:
            raise bad_request("n > 1 is not supported; send one request per choice", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise bad_request(f"{name} is not supported by onecat's engine; leave it at 0", param=name)
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by onecat's engine", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")


class CompletionRequest(SamplingFields):
    """A /v1/completions request. ``prompt`` is text or token ids (one prompt per request)."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        """Also refuse several prompts in one request, echo, logprobs, best_of and suffix."""
        super().refuse_unsupported()
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str | list):
            if len(self.prompt) != 1:
                raise bad_request(
                    "a list of several prompts is not supported; send one request per prompt",
                    param="prompt",
                )
        if self.echo:
            raise bad_request("echo is not supported", param="echo")
        if self.logprobs is not None:
            raise bad_request("logprobs is not supported", param="logprobs")
        if self.best_of not in (None, 1):
            raise bad_request("best_of > 1 is not supported", param="best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", param="suffix")

    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return prompt[0]
        return prompt


class TextPart(BaseModel):
    """A text part of a message's content list."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message. Content is a string or a list of text parts (no images)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        """The message's content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(BaseModel):
    """``response_format``; only ``{"type": "text"}`` is supported."""

    model_config = ConfigDict(extra="allow")

    type: str = "text"


class ChatCompletionRequest(SamplingFields):
    """A /v1/chat/completions request."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # the request's own template (vLLM's extension)

    def refuse_unsupported(self) -> None:
        """Also refuse logprobs, tools and structured output."""
        super().refuse_unsupported()
        if self.logprobs or self.top_logprobs:
            raise bad_request("logprobs is not supported", param="logprobs")
        if self.tools:
            raise bad_request("tools (function calling) are not supported", param="tools")
        if self.response_format is not None and self.response_format.type != "text":
            raise bad_request(
                "response_format other than 'text' is not supported", param="response_format"
            )

    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens`` (the newer name) or ``max_tokens``; None: up to the context."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
