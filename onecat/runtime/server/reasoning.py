"""Reasoning parsers (vLLM's ``--reasoning-parser``): split ``<think>...</think>`` off the
answer into ``reasoning_content``.

``qwen3`` covers both Qwen chat-template styles. Qwen3.5's template opens the think block in
the prompt (the generation prompt ends ``<think>\\n``), so the output starts inside the
reasoning and only ``</think>`` appears in it; with ``enable_thinking: false`` the prompt
already holds an empty, closed block (``<think>\\n\\n</think>\\n\\n``) and the whole output
is the answer. Older Qwen3 templates leave the tags to the model, which opens with
``<think>``. The state at the first output token is therefore read from the prompt's end
(``initial_state``), as vLLM does. ``<tool_call>`` inside the reasoning ends it too (Qwen3.5
may call a tool without closing the block; vLLM treats it the same way). The newlines the
template puts around the tags are separators, not text: they are dropped.

Parsing is a pure function of the text so far (``parse(text, final)``): with ``final``
False it returns only what cannot change any more (a partial ``</think>`` or trailing
newlines are held back), so successive results extend each other and a stream can send
their differences (``onecat.runtime.server.chat_output``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"


class ReasoningState(Enum):
    """Where the output starts: inside a think block the prompt opened, after one the prompt
    closed, or with the tags left to the model."""

    IN_REASONING = "in_reasoning"
    ANSWER = "answer"
    MODEL_OPENS = "model_opens"


def initial_state(prompt_text: str) -> ReasoningState:
    """The reasoning state at the first output token of a chat whose rendered prompt is
    ``prompt_text`` (vLLM's ``prompt_is_reasoning_end``)."""
    tail = prompt_text.rstrip()
    if tail.endswith(THINK_START):
        return ReasoningState.IN_REASONING
    if tail.endswith(THINK_END):
        return ReasoningState.ANSWER
    return ReasoningState.MODEL_OPENS


@dataclass(frozen=True)
class ReasoningSplit:
    """The reasoning and the answer text known so far (``reasoning`` None: no think block)."""

    reasoning: str | None
    content: str


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``
    (it may still become the marker, so a stream must not send it yet)."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


class Qwen3ReasoningParser:
    """vLLM's ``qwen3`` reasoning parser (module docstring)."""

    name = "qwen3"

    def __init__(self, state: ReasoningState) -> None:
        self.state = state

    def parse(self, text: str, final: bool) -> ReasoningSplit:
        """Split ``text`` (the whole output so far); ``final``: the output is complete."""
        if self.state is ReasoningState.ANSWER:
            return ReasoningSplit(None, text)
        body = text
        if self.state is ReasoningState.MODEL_OPENS:
            stripped = text.lstrip()
            if not stripped.startswith(THINK_START):
                if not final and THINK_START.startswith(stripped):
                    return ReasoningSplit(None, "")  # may still open a think block
                return ReasoningSplit(None, text)
            body = stripped[len(THINK_START):]
        ends = [(body.find(m), m) for m in (THINK_END, TOOL_CALL_START)]
        ends = [(i, m) for i, m in ends if i >= 0]
        if ends:
            at, marker = min(ends)
            reasoning = body[:at].strip("\n")
            rest = body[at + len(THINK_END):] if marker == THINK_END else body[at:]
            content = rest.lstrip("\n")
            return ReasoningSplit(reasoning, content)
        if final:  # ended inside the reasoning (max_tokens): all of it is reasoning, as in vLLM
            return ReasoningSplit(body.lstrip("\n"), "")
        keep = len(body) - held_back(body, (THINK_END, TOOL_CALL_START))
        return ReasoningSplit(body[:keep].strip("\n"), "")


REASONING_PARSERS = {Qwen3ReasoningParser.name: Qwen3ReasoningParser}
