"""Request models of the OpenAI API that onecat serves (pydantic, validated by FastAPI).

Sampling fields have vLLM's names, ranges and meanings: ``n`` (up to ``MAX_N`` choices),
``seed``, ``presence_penalty`` / ``frequency_penalty`` in [-2, 2], ``repetition_penalty`` in
(0, 2], ``min_p`` in [0, 1], ``min_tokens``, logprobs (chat: ``logprobs`` + ``top_logprobs``
up to 20; completions: ``logprobs`` up to 20), ``logit_bias`` (token ids, biases clamped to
[-100, 100]), ``max_completion_tokens`` (chat). Fields OpenAI
defines and the engine cannot honour (``echo``, ``best_of`` > 1, ``suffix``, ...) are
accepted only at their neutral value; anything else is refused with a 400 naming the field,
never silently ignored. Chat requests take ``tools``, ``tool_choice``,
``parallel_tool_calls`` and ``response_format`` (``onecat.runtime.server.chat_plan`` checks
them against the server's flags), and messages carry ``tool_calls`` / ``tool_call_id``. Unknown extra fields are ignored, as
OpenAI and vLLM do. vLLM's extensions ``top_k``, ``min_p``, ``min_tokens``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``chat_template_kwargs`` and
``chat_template`` are supported (a request's own template only when the operator trusts
them: ``--trust-request-chat-template``).

Every number must be one the engine can take (``onecat.runtime.sampling_params``' limits:
int32 counts and token ids, an int64 seed, finite floats) and every string valid Unicode;
anything else is a 400 naming the field before the request reaches the engine. A boolean is
not a number (pydantic's lax mode would read ``true`` as 1): ``Int`` and ``Float`` refuse it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from onecat.runtime.errors import RequestError
from onecat.runtime.sampling_params import (
    LOGIT_BIAS_LIMIT,
    MAX_INT32,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SEED_MAX,
    SEED_MIN,
    check_text,
)
from onecat.runtime.server.api_errors import bad_request, clip


def _not_a_boolean(value: Any) -> Any:
    """Refuse ``true`` / ``false`` where a number is expected."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    return value


Int = Annotated[int, BeforeValidator(_not_a_boolean)]
Float = Annotated[float, BeforeValidator(_not_a_boolean)]
TokenId = Annotated[Int, Field(ge=0, le=MAX_INT32)]
Count = Annotated[Int, Field(ge=1, le=MAX_INT32)]
MAX_TOOLS = 128  # OpenAI's limit on the tools of one request
VLLM_STRUCTURED_OUTPUT_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
MAX_N = 128  # OpenAI's limit on n; each choice is a sequence of its own in the engine
Penalty = Annotated[Float, Field(ge=-2.0, le=2.0)]


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


class UnicodeChecked(BaseModel):
    """A request body whose raw strings are checked by :func:`refuse_invalid_unicode` first."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        refuse_invalid_unicode(data)
        return data


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with the token counts."""

    include_usage: bool = False


class SamplingFields(UnicodeChecked):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: Count | None = None
    temperature: Float | None = Field(default=None, ge=0.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Int | None = Field(default=None, ge=-1, le=MAX_INT32)
    seed: Int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    n: Annotated[Int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Float | None = Field(default=None, gt=0.0, le=2.0)
    min_p: Float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: Int = Field(default=0, ge=0, le=MAX_INT32)
    logit_bias: Annotated[dict[str, Float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    user: str | None = None

    def stop_strings(self) -> list[str]:
        """``stop`` as a list (OpenAI accepts one string or a list)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def token_biases(self) -> dict[int, float]:
        """``logit_bias`` with token-id keys and biases clamped to [-100, 100] (as vLLM); a 400
        naming the field when a key is not a token id."""
        biases = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {clip(repr(key))}", param="logit_bias") from None
            biases[token] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, bias))
        return biases

    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    def refuse_unsupported(self) -> None:
        """Raise a 400 for a field the engine cannot honour (set to a non-neutral value)."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")


class CompletionRequest(SamplingFields):
    """A /v1/completions request. ``prompt`` is text or token ids (one prompt per request)."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: bool = False
    logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: Int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        """Also refuse several prompts in one request, echo, best_of and suffix."""
        super().refuse_unsupported()
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str | list):
            if len(self.prompt) != 1:
                raise bad_request(
                    "a list of several prompts is not supported; send one request per prompt",
                    param="prompt",
                )
        if self.echo:
            raise bad_request("echo is not supported", param="echo")
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
    """One chat message. Content is a string or a list of text parts (no images). An
    assistant message may carry its ``tool_calls`` (and vLLM's ``reasoning_content``), a
    tool message the ``tool_call_id`` it answers; the chat template renders them."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        """The message's content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchemaSpec(BaseModel):
    """``response_format.json_schema``: the schema the answer must match."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: free ``text``, any JSON object (``json_object``) or a JSON
    schema (``json_schema``; always enforced strictly, as vLLM does)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format.json_schema is required when type is 'json_schema'")
        return self


class FunctionDefinition(BaseModel):
    """A function tool: its name, description and JSON-schema ``parameters``."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    """One entry of ``tools`` (only ``function`` tools exist in Chat Completions)."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    """The function a named ``tool_choice`` forces."""

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"] = "function"
    function: FunctionName


class MessageFunctionCall(BaseModel):
    """A call inside an assistant message: name and JSON-text arguments."""

    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(BaseModel):
    """An entry of an assistant message's ``tool_calls``."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class ChatCompletionRequest(SamplingFields):
    """A /v1/chat/completions request."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None
    logprobs: bool | None = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # vLLM's other structured-output extensions: refused (400), never silently ignored
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # the request's own template (vLLM's extension)

    def refuse_unsupported(self) -> None:
        """Also refuse top_logprobs without logprobs, and tool choices that name no given tool."""
        super().refuse_unsupported()
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
        for name in VLLM_STRUCTURED_OUTPUT_FIELDS:
            if getattr(self, name) is not None:
                raise bad_request(f"{name} is not supported by onecat; send response_format "
                                  "(json_object or json_schema) instead", param=name)
        choice = self.effective_tool_choice()
        if choice in ("required",) or isinstance(choice, NamedToolChoice):
            if not self.tools:
                raise bad_request("tool_choice requires tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in self.tool_names():
            raise bad_request(
                f"tool_choice names the function {clip(repr(choice.function.name))}, which is not among tools",
                param="tool_choice",
            )
        if self.tools and len(set(self.tool_names())) != len(self.tools):
            raise bad_request("tools has two functions of the same name", param="tools")

    def tool_names(self) -> list[str]:
        """The names of the given function tools."""
        return [t.function.name for t in self.tools or []]

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """``tool_choice`` with OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens`` (the newer name) or ``max_tokens``; None: up to the context."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        """How many top alternatives to report per token (None: no logprobs at all)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(UnicodeChecked):
    """A /tokenize request, vLLM's two bodies in one: ``prompt`` (text, tokenised with the
    tokenizer's special tokens unless ``add_special_tokens`` is false) or ``messages``
    (rendered by the chat template with ``add_generation_prompt`` / ``continue_final_message``,
    ``tools``, ``chat_template_kwargs``; no special tokens added unless asked). Exactly one
    of the two; ``return_token_strs`` adds the tokens' strings."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    tools: list[ChatTool] | None = Field(default=None, max_length=MAX_TOOLS)
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None

    def refuse_unsupported(self) -> None:
        """400 naming the field: neither or both of ``prompt`` and ``messages``, or both
        ``continue_final_message`` and ``add_generation_prompt`` (vLLM's rule)."""
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("send either prompt (text) or messages (a chat), not both or neither",
                              param="prompt" if self.prompt is None else "messages")
        if self.messages is not None and self.continue_final_message and self.add_generation_prompt:
            raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                              param="continue_final_message")


class DetokenizeRequest(BaseModel):
    """A /detokenize request: ``tokens`` (ids in the model's vocabulary) back to text."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[TokenId]
