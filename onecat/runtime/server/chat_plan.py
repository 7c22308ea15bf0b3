"""What a chat request asks of its answer beyond sampling: tools, ``tool_choice``,
``response_format`` and reasoning, checked against the server's flags (vLLM's
``--enable-auto-tool-choice``, ``--tool-call-parser``, ``--reasoning-parser``).

vLLM's semantics: tools are rendered by the chat template (passed to
``apply_chat_template``) whatever the ``tool_choice``; ``auto`` (the default when tools are
given) needs ``--enable-auto-tool-choice`` and a tool-call parser, which then reads the calls
out of the answer; ``none`` leaves the answer as text; ``required`` and a named function
constrain generation (structured output) so that the answer is a call. With a
``--tool-call-parser`` onecat constrains it to the model's own call format (xgrammar's
structural tags), so the parser reads it back and the model writes what its template taught
it; without one, as vLLM does, the answer is JSON: a named function's arguments under its
parameters schema, or for ``required`` an array of ``{"name", "parameters"}`` objects,
returned as ``tool_calls`` all the same. ``response_format`` ``json_object`` /
``json_schema`` constrain the answer to JSON. A reasoning parser splits the think block off;
constrained answers then start after the reasoning. Combinations that cannot be honoured
are 400s naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from onecat.errors import OnecatError
from onecat.runtime.server.api_errors import bad_request
from onecat.runtime.server.chat_output import ChatDeltaStream, ChatOutputParser, message_fields
from onecat.runtime.server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice
from onecat.runtime.server.reasoning import REASONING_PARSERS, ReasoningState, initial_state
from onecat.runtime.server.structured_output import (
    JSON_OBJECT_SCHEMA,
    XGRAMMAR_TOOL_FORMATS,
    Constraint,
    JsonConstraint,
    ToolCallConstraint,
    ToolJsonConstraint,
)
from onecat.runtime.server.tool_parsers import TOOL_PARSERS, JsonToolCallParser, ToolParser


@dataclass(frozen=True)
class ChatOptions:
    """The server's tool and reasoning flags (vLLM's names)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def check(self) -> None:
        """Raise OnecatError for an unknown parser name or auto tool choice without a parser."""
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise OnecatError(f"--tool-call-parser {self.tool_call_parser!r} is not known to the "
                              f"embedded engine; choose one of {', '.join(sorted(TOOL_PARSERS))}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise OnecatError(f"--reasoning-parser {self.reasoning_parser!r} is not known to the "
                              f"embedded engine; choose one of {', '.join(sorted(REASONING_PARSERS))}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise OnecatError("--enable-auto-tool-choice needs --tool-call-parser (which format the "
                              "model writes its calls in, e.g. qwen3_coder for Qwen3.5)")


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A request message as the chat template reads it (a call's JSON arguments as a mapping,
    as Qwen's templates iterate over them)."""
    out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                           "content": message.text()}
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            arguments: Any = call.function.arguments
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    pass
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        out["tool_calls"] = calls
    for key in ("name", "tool_call_id", "reasoning_content"):
        if getattr(message, key) is not None:
            out[key] = getattr(message, key)
    return out


class ChatPlan:
    """One chat request's template inputs, output parsing and generation constraint."""

    def __init__(self, req: ChatCompletionRequest, options: ChatOptions) -> None:
        self.options = options
        self.messages = [template_message(m) for m in req.messages]
        self.tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        self.tool_choice = req.effective_tool_choice()
        self.parallel_tool_calls = req.parallel_tool_calls is not False
        self.response_format = req.response_format
        self.state = ReasoningState.MODEL_OPENS
        self._check(req)

    def _check(self, req: ChatCompletionRequest) -> None:
        forced = self.forces_tool_call
        if self.tool_choice == "auto" and self.tools and not self.options.enable_auto_tool_choice:
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                'set on the server; send tool_choice "none", "required" or a named function instead',
                param="tool_choice",
            )
        if forced and self.json_schema is not None:
            raise bad_request("response_format cannot be combined with tool_choice \"required\" or a "
                              "named function (both constrain the answer)", param="response_format")

    @property
    def forces_tool_call(self) -> bool:
        """True for tool_choice "required" or a named function."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def json_schema(self) -> dict[str, Any] | None:
        """The schema ``response_format`` asks for (None: free text)."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return JSON_OBJECT_SCHEMA
        return fmt.json_schema.json_schema if fmt.json_schema is not None else None

    @property
    def constrained_field(self) -> str:
        """The request field a grammar constraint comes from (for error messages)."""
        return "tool_choice" if self.forces_tool_call else "response_format"

    def template_kwargs(self) -> dict[str, Any]:
        """``apply_chat_template`` arguments beyond the messages (the tools)."""
        return {"tools": self.tools} if self.tools else {}

    def start(self, prompt_tail: str) -> None:
        """Record how the rendered prompt ends (whether it opened or closed a think block)."""
        self.state = initial_state(prompt_tail)

    @property
    def after_reasoning(self) -> bool:
        """True when a reasoning parser is on and the output starts inside a think block: a
        constraint then applies after ``</think>`` only."""
        return self.options.reasoning_parser is not None and self.state is ReasoningState.IN_REASONING

    def constraint(self) -> Constraint | None:
        """What generation must match, or None."""
        if self.forces_tool_call:
            parser = self.options.tool_call_parser
            choice: Any = self.tool_choice
            if isinstance(choice, NamedToolChoice):
                choice = choice.model_dump()
            if parser is None:  # vLLM's way: JSON
                return ToolJsonConstraint(self.tools, choice, self.after_reasoning, self.parallel_tool_calls)
            assert parser in XGRAMMAR_TOOL_FORMATS
            return ToolCallConstraint(parser, self.tools, choice, self.after_reasoning, self.parallel_tool_calls)
        schema = self.json_schema
        if schema is not None:
            return JsonConstraint(schema, self.after_reasoning)
        return None

    def output_parser(self) -> ChatOutputParser | None:
        """How the answer's text becomes message fields (None: it is the content as is)."""
        reasoning = None
        if self.options.reasoning_parser is not None:
            reasoning = REASONING_PARSERS[self.options.reasoning_parser](self.state)
        tools: ToolParser | None = None
        if self.tools and self.tool_choice != "none" and self.options.tool_call_parser is not None:
            tools = TOOL_PARSERS[self.options.tool_call_parser](self.tools)
        elif self.forces_tool_call:
            choice = self.tool_choice
            tools = JsonToolCallParser(self.tools, choice.function.name if isinstance(choice, NamedToolChoice) else None)
        if reasoning is None and tools is None:
            return None
        return ChatOutputParser(reasoning, tools, single_call=not self.parallel_tool_calls)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a finished answer and its finish reason ("tool_calls"
        when it stopped on calls)."""
        parser = self.output_parser()
        if parser is None:
            return {"role": "assistant", "content": text}, finish_reason
        message = message_fields(parser.parse(text, final=True))
        if message.get("tool_calls") and finish_reason == "stop":
            finish_reason = "tool_calls"
        return message, finish_reason

    def delta_stream(self) -> ChatDeltaStream | None:
        """A stream of message deltas (None: send the text as content deltas)."""
        parser = self.output_parser()
        return ChatDeltaStream(parser) if parser is not None else None
