"""Tool-call parsers on hostile model output (issue #43): deep nesting, cut tags, broken
UTF-8, numbers beyond float range, random mixes of call fragments. Whatever the text, every
parser returns calls whose arguments are strict JSON, or the raw text as content; it never
raises, whole or streamed."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("pydantic")
from chat_output_helpers import add_up, check_every_split, stream, whole

from onecat.runtime.server.chat_output import ChatOutputParser, message_fields
from onecat.runtime.server.reasoning import Qwen3ReasoningParser, ReasoningState
from onecat.runtime.server.tool_parsers import TOOL_PARSERS

TYPES = ("string", "integer", "number", "boolean", "array", "object")
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {kind[0]: {"type": kind} for kind in TYPES}}}}]
DEEP = "[" * 50_000 + "]" * 50_000
DEEP_OBJECT = '{"a":' * 5_000 + "1" + "}" * 5_000


def qwen_call(value: str, key: str = "a") -> str:
    return f"<tool_call>\n<function=f>\n<parameter={key}>\n{value}\n</parameter>\n</function>\n</tool_call>"


def hermes_call(arguments: str) -> str:
    return f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'


HOSTILE = {
    "qwen deep array": qwen_call(DEEP),
    "qwen deep object": qwen_call(DEEP_OBJECT, "o"),
    "qwen deep string param": qwen_call(DEEP, "s"),
    "qwen deep unclosed": "<tool_call>\n<function=f>\n<parameter=a>\n" + "[" * 100_000,
    "qwen huge float in array": qwen_call("[1e999, -1e999]"),
    "qwen huge number": qwen_call("1e999", "n") + qwen_call("9" * 5000, "i"),
    "qwen NaN literal": qwen_call("[NaN, Infinity]"),
    "qwen python set and complex": qwen_call("{1, 2}") + qwen_call("1j", "o") + qwen_call("{(1, 2): 3}", "o"),
    "qwen surrogate and replacement": qwen_call("\ud800\ufffd\x00", "s") + qwen_call("[\"\ud83d\"]"),
    "qwen truncated tags": "<tool_call>\n<function=f\n<parameter=<parameter=>\n</parameter",
    "qwen empty name": "<tool_call>\n<function=>\n</function>\n</tool_call>",
    "qwen cut at every tag": "<tool_call><tool_call><function=f><parameter=a><parameter=a></function>",
    "hermes deep": hermes_call(DEEP),
    "hermes deep object": hermes_call(DEEP_OBJECT),
    "hermes huge float": hermes_call('{"x": 1e999}'),
    "hermes NaN": hermes_call('{"x": NaN}'),
    "hermes name not a string": '<tool_call>\n{"name": [1], "arguments": {}}\n</tool_call>',
    "hermes list body": "<tool_call>\n[1, 2]\n</tool_call>",
    "hermes arguments not a dict": hermes_call("[1, 2]"),
    "hermes invalid utf8": "<tool_call>\n{\"name\": \"f\ufffd\ud800\", \"arguments\": {}}\n</tool_call>",
    "hermes truncated": '<tool_call>\n{"name": "f", "argum',
    "only tags": "</tool_call><tool_call></tool_call>" * 50,
}

FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<function=f>", "</function>", "<parameter=a>", "<parameter=o>",
    "</parameter>", "<think>", "</think>", "\n", "[", "]", "{", "}", '"', "1e999", "NaN", "-",
    '{"name": "f", "arguments": ', "\ufffd", "\ud800", "x", "<tool", "_call>", "<function=", "9" * 50,
]


def random_texts(count: int, seed: int = 0) -> list[str]:
    """``count`` seeded random concatenations of call fragments."""
    rng = random.Random(seed)
    return ["".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 30))) for _ in range(count)]


def strict_json(text: str) -> object:
    """``text`` parsed as JSON that has no NaN / Infinity."""
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in arguments: {text[:200]!r}")

    return json.loads(text, parse_constant=refuse)


def check_final(parser: ChatOutputParser, text: str) -> None:
    """The finished answer: calls with strict-JSON arguments, or the whole text as content."""
    message = message_fields(parser.parse(text, final=True))
    calls = message.get("tool_calls") or []
    for call in calls:
        assert isinstance(call["function"]["name"], str)
        strict_json(call["function"]["arguments"])
    if not calls and parser.reasoning is None:
        assert message["content"] == (text or None)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_output_never_raises(name, case):
    text = HOSTILE[case]
    check_final(ChatOutputParser(None, TOOL_PARSERS[name](TOOLS)), text)
    for cut in (len(text) // 3, len(text) // 2, len(text) - 1):  # streamed: partial parses
        ChatOutputParser(None, TOOL_PARSERS[name](TOOLS)).parse(text[:cut], final=False)
    halves = [text[: len(text) // 2], text[len(text) // 2 :]]
    streamed = add_up(stream(ChatOutputParser(None, TOOL_PARSERS[name](TOOLS)), halves))
    streamed.pop("ids")
    assert streamed == whole(message_fields(ChatOutputParser(None, TOOL_PARSERS[name](TOOLS)).parse(text, True)))


def test_deep_array_argument_falls_back_to_text_not_an_error():
    """The probe's case: a qwen3_coder array parameter nested past json's recursion limit is
    kept as its text; a hermes block nested that deep is no call, so the answer is content."""
    parser = ChatOutputParser(None, TOOL_PARSERS["qwen3_coder"](TOOLS))
    (call,) = message_fields(parser.parse(HOSTILE["qwen deep array"], final=True))["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"a": DEEP}
    hermes = message_fields(ChatOutputParser(None, TOOL_PARSERS["hermes"](TOOLS)).parse(HOSTILE["hermes deep"], True))
    assert "tool_calls" not in hermes and hermes["content"] == HOSTILE["hermes deep"]
    (call,) = message_fields(parser.parse(HOSTILE["qwen huge float in array"], final=True))["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"a": "[1e999, -1e999]"}


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("reasoning", [False, True])
def test_random_fragment_mixes(name, reasoning):
    """Seeded random mixes of tags and values, with and without the reasoning parser: the
    finished parse holds, and streams split at every position add up to it."""
    for text in random_texts(150, seed=len(name) + reasoning):
        def make() -> ChatOutputParser:
            think = Qwen3ReasoningParser(ReasoningState.MODEL_OPENS) if reasoning else None
            return ChatOutputParser(think, TOOL_PARSERS[name](TOOLS))

        check_final(make(), text)
    for text in random_texts(6, seed=99):
        check_every_split(lambda: ChatOutputParser(None, TOOL_PARSERS[name](TOOLS)), text)
