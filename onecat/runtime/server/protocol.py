"""Request models of the OpenAI API that onecat serves (pydantic, validated by FastAPI).

Fields OpenAI defines and the engine cannot honour (``n > 1``, logprobs, penalties, tools,
JSON mode, ...) are accepted only at their neutral value; anything else is refused with a
400 naming the field, never silently ignored. Unknown extra fields are ignored, as OpenAI
and vLLM do. vLLM's extensions ``top_k``, ``stop_token_ids``, ``ignore_eos`` and
``chat_template_kwargs`` are supported.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from onecat.runtime.server.api_errors import bad_request


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with the token counts."""

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

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

    prompt: str | list[int] | list[str] | list[list[int]]
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
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None

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
