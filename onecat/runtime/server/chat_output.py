"""A chat answer's text as OpenAI message fields: ``reasoning_content`` (a reasoning parser),
``content`` and ``tool_calls`` (a tool-call parser), whole or as stream deltas.

The reasoning parser runs first and the tool parser reads only the answer after the
reasoning, as in vLLM. Both parse the whole text so far and return only what cannot change
any more, so ``ChatDeltaStream`` sends the differences of successive parses: the deltas of
a stream add up to exactly the non-streamed message, however the text is split.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from onecat.runtime.server.reasoning import Qwen3ReasoningParser
from onecat.runtime.server.tool_parsers import ToolCallDraft, ToolParser

logger = logging.getLogger(__name__)


@dataclass
class ChatMessageParts:
    """What the answer holds so far."""

    reasoning: str | None
    content: str
    calls: list[ToolCallDraft] = field(default_factory=list)


class ChatOutputParser:
    """Reasoning, then tool calls, over one request's output (either parser may be None;
    ``single_call``: only the first call counts, for ``parallel_tool_calls: false``)."""

    def __init__(
        self, reasoning: Qwen3ReasoningParser | None, tools: ToolParser | None, single_call: bool = False
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.single_call = single_call

    def parse(self, text: str, final: bool) -> ChatMessageParts:
        """The parts of ``text`` (the output so far); ``final``: the output is complete."""
        reasoning, answer = None, text
        if self.reasoning is not None:
            split = self.reasoning.parse(text, final)
            reasoning, answer = split.reasoning, split.content
        if self.tools is None:
            return ChatMessageParts(reasoning, answer)
        tools = self.tools.parse(answer, final)
        return ChatMessageParts(reasoning, tools.content, tools.calls[:1] if self.single_call else tools.calls)


def new_tool_call_id() -> str:
    """An OpenAI-style tool-call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


def message_fields(parts: ChatMessageParts, ids: list[str] | None = None) -> dict[str, Any]:
    """The assistant message of a finished answer (``ids``: the calls' ids, if already given)."""
    message: dict[str, Any] = {"role": "assistant", "content": parts.content or None}
    if parts.reasoning is not None:
        message["reasoning_content"] = parts.reasoning or None
    calls = [c for c in parts.calls if c.name is not None]
    if calls:
        ids = list(ids or []) + [new_tool_call_id() for _ in range(len(calls) - len(ids or []))]
        message["tool_calls"] = [
            {"id": ids[i], "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls)
        ]
    return message


class ChatDeltaStream:
    """Turns the growing output of one request into OpenAI ``delta`` objects."""

    def __init__(self, parser: ChatOutputParser) -> None:
        self.parser = parser
        self.text = ""
        self._reasoning = 0
        self._content = 0
        self._calls: list[tuple[str, int]] = []  # (id, arguments characters sent) per call

    @property
    def called_tools(self) -> bool:
        """True once a tool call has been sent."""
        return bool(self._calls)

    def feed(self, new_text: str, final: bool) -> dict[str, Any] | None:
        """Add ``new_text``; the delta to send now, or None when nothing is new."""
        self.text += new_text
        parts = self.parser.parse(self.text, final)
        delta: dict[str, Any] = {}
        reasoning = parts.reasoning or ""
        if len(reasoning) > self._reasoning:
            delta["reasoning_content"] = reasoning[self._reasoning:]
            self._reasoning = len(reasoning)
        if len(parts.content) > self._content:
            delta["content"] = parts.content[self._content:]
            self._content = len(parts.content)
        tool_deltas = []
        for index, call in enumerate(parts.calls):
            if call.name is None:
                break
            if index == len(self._calls):
                self._calls.append((new_tool_call_id(), 0))
                tool_deltas.append({
                    "index": index, "id": self._calls[index][0], "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                })
                self._calls[index] = (self._calls[index][0], len(call.arguments))
            elif len(call.arguments) > self._calls[index][1]:
                call_id, sent = self._calls[index]
                tool_deltas.append({"index": index, "function": {"arguments": call.arguments[sent:]}})
                self._calls[index] = (call_id, len(call.arguments))
        if tool_deltas:
            delta["tool_calls"] = tool_deltas
        return delta or None
