"""Shared helpers of the tool-call, reasoning and structured-output tests: streamed deltas
added up, every-split stream checks, a scripted sampler (the server path with a known model
output) and the tools the tests call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from onecat.runtime.server.chat_output import ChatDeltaStream, ChatOutputParser, message_fields

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                      "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}},
]


def check_weather_arguments(arguments: dict[str, Any]) -> None:
    """``arguments`` satisfy WEATHER_PARAMETERS (no jsonschema package needed)."""
    assert set(arguments) == {"city", "days"}, arguments
    assert arguments["city"] in ("Paris", "Rome", "Oslo"), arguments
    assert isinstance(arguments["days"], int) and 1 <= arguments["days"] <= 9, arguments


def add_up(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """The message that a list of OpenAI ``delta`` dicts adds up to (content and reasoning
    concatenated, tool calls merged by index; an id and a name arrive once per call)."""
    reasoning, content, calls = "", "", {}
    for delta in deltas:
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            entry = calls.setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
            if call.get("id"):
                assert entry["id"] is None, "a call's id is sent once"
                entry["id"] = call["id"]
            function = call.get("function") or {}
            if function.get("name"):
                assert entry["name"] is None, "a call's name is sent once"
                entry["name"] = function["name"]
            entry["arguments"] += function.get("arguments") or ""
    assert sorted(calls) == list(range(len(calls))), "tool call indexes count up from 0"
    return {"reasoning": reasoning, "content": content,
            "calls": [(calls[i]["name"], calls[i]["arguments"]) for i in range(len(calls))],
            "ids": [calls[i]["id"] for i in range(len(calls))]}


def whole(message: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed message in ``add_up``'s form."""
    return {
        "reasoning": message.get("reasoning_content") or "",
        "content": message.get("content") or "",
        "calls": [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []],
    }


def stream(parser: ChatOutputParser, chunks: list[str]) -> list[dict[str, Any]]:
    """The deltas of ``chunks`` fed one by one (the last one final)."""
    deltas = ChatDeltaStream(parser)
    out = []
    for i, chunk in enumerate(chunks):
        delta = deltas.feed(chunk, final=i == len(chunks) - 1)
        if delta is not None:
            out.append(delta)
    return out


def check_every_split(make_parser: Callable[[], ChatOutputParser], text: str) -> dict[str, Any]:
    """Streaming ``text`` split in two at every position, and one character at a time, adds
    up to the non-streamed message; returns that message."""
    expected = whole(message_fields(make_parser().parse(text, final=True)))
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text) or [""]]
    for chunks in splits:
        got = add_up(stream(make_parser(), chunks))
        got.pop("ids")
        assert got == expected, (chunks[:2], got, expected)
    return expected


class ScriptedSampler:
    """Wraps the engine's sampler so that every request generates ``text`` first: the logits
    of each row allow only the script's next token; after it, EOS (or, ``then_free``, the
    model's own logits). The real sampler (logits processors included), detokenizer, server
    and parsers run as usual; only the model's choice is scripted."""

    def __init__(self, engine: Any, text: str, then_free: bool = False) -> None:
        self.sampler = engine.sampler
        self.script = list(engine.tokenizer.encode(text, add_special_tokens=False))
        self.eos = engine.tokenizer.eos_token_id
        self.then_free = then_free

    def runs_on_device(self, row: Any) -> bool:
        return self.sampler.runs_on_device(row)

    def _script(self, logits: torch.Tensor, rows: Any) -> torch.Tensor:
        scripted = logits.clone() if self.then_free else torch.full(logits.shape, float("-inf"), device=logits.device)
        for i, row in enumerate(rows):
            n = len(row.token_ids) - row.num_prompt_tokens
            if n < len(self.script) or not self.then_free:
                scripted[i] = float("-inf")
                scripted[i, self.script[n] if n < len(self.script) else self.eos] = 0.0
        return scripted

    def __call__(self, logits: torch.Tensor, rows: Any) -> Any:
        return self.sampler(self._script(logits, rows), rows)

    def sample_on_device(self, logits: torch.Tensor, rows: Any) -> torch.Tensor:  # overlapped decode steps
        return self.sampler.sample_on_device(self._script(logits, rows), rows)


def sse_deltas(chunks: list[Any]) -> tuple[list[dict[str, Any]], list[str | None]]:
    """The deltas and finish reasons of an openai-client chat stream (one choice)."""
    deltas, reasons = [], []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        deltas.append(choice.delta.model_dump(exclude_none=True))
        reasons.append(choice.finish_reason)
    return deltas, reasons
