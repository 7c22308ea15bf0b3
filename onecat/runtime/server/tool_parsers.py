"""Tool-call parsers (vLLM's ``--tool-call-parser``): the model's tool calls, in the format
its chat template taught it, become OpenAI ``tool_calls``.

- ``qwen3_coder`` (alias ``qwen3_xml``): Qwen3.5's and Qwen3-Coder's format, what Qwen3.5's
  chat template renders and asks for::

      <tool_call>
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>
      </tool_call>

  A value is raw text; it is converted by the type its tool's JSON schema gives the
  parameter (integer, number, boolean, object / array as JSON; a string stays as written),
  as vLLM's parser does, and the arguments become a JSON object in the parameters' order.
- ``hermes``: Qwen2.5's and Qwen3's format, ``<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>``.

Text before the first ``<tool_call>`` is the message content (the separating newlines
dropped); text after the calls is dropped, as in vLLM. A block that does not parse is not a
call; a finished answer in which no call parses is all content (the raw text, as vLLM
falls back to). Whatever the model writes (nesting too deep for ``json``, numbers beyond
float range, cut tags), ``parse`` never raises: a parse that fails is logged and the text
becomes content. Arguments are always valid JSON (no ``Infinity`` / ``NaN``).
Without a ``--tool-call-parser``, calls forced by ``tool_choice`` are JSON (vLLM's way,
``structured_output.ToolJsonConstraint``) and ``JsonToolCallParser`` reads them: a named
function's whole answer is its arguments; for ``"required"`` the answer is an array of
``{"name", "parameters"}`` objects, each object's ``parameters`` text its arguments.
``parse(text, final)`` is a pure function of the text so far; with ``final`` False it
returns only what later text cannot change (a ``qwen3_coder`` call's name once its
``<function=...>`` tag is complete, then its arguments parameter by parameter; a ``hermes``
call when its block closes), so a stream sends the differences of successive results
(``onecat.runtime.server.chat_output``).
"""

from __future__ import annotations

import ast
import json
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any

from onecat.runtime.server.reasoning import TOOL_CALL_START, held_back

logger = logging.getLogger(__name__)

TOOL_CALL_END = "</tool_call>"


@dataclass
class ToolCallDraft:
    """One call as far as it is known: ``name`` None until complete, ``arguments`` a prefix
    of the final JSON text (complete once the call is)."""

    name: str | None
    arguments: str = ""


@dataclass
class ToolSplit:
    """The content before the calls and the calls found so far."""

    content: str
    calls: list[ToolCallDraft] = field(default_factory=list)


def _tool_parameters(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Function name -> its parameters' JSON-schema ``properties``."""
    table = {}
    for tool in tools:
        function = tool.get("function") or {}
        parameters = function.get("parameters") or {}
        props = parameters.get("properties") if isinstance(parameters, dict) else None
        table[function.get("name")] = props if isinstance(props, dict) else {}
    return table


class ToolParser:
    """Splits an output into content and tool-call blocks; subclasses parse one block."""

    name = ""

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.parameters = _tool_parameters(tools)

    def parse(self, text: str, final: bool) -> ToolSplit:
        """Content and calls of ``text`` (the whole answer so far); ``final``: it is complete.
        Never raises (module docstring): a failed parse, or a finished answer without a call
        that parses, is content."""
        try:
            split = self._split(text, final)
        except Exception:  # noqa: BLE001 - model output must never fail the request
            logger.warning("the %s tool parser failed; the answer is sent as content", self.name, exc_info=True)
            split = ToolSplit(text[: text.find(TOOL_CALL_START)].rstrip())
        if final and not split.calls:
            return ToolSplit(text)
        return split

    def _split(self, text: str, final: bool) -> ToolSplit:
        start = text.find(TOOL_CALL_START)
        if start < 0:
            if final:
                return ToolSplit(text)
            keep = len(text) - held_back(text, (TOOL_CALL_START,))
            return ToolSplit(text[:keep].rstrip())  # newlines may separate a coming call
        calls = []
        while start >= 0:
            body_start = start + len(TOOL_CALL_START)
            end = text.find(TOOL_CALL_END, body_start)
            closed = end >= 0
            body = text[body_start:end] if closed else text[body_start:]
            call = self.parse_block(body, closed or final)
            if call is not None:
                calls.append(call)
            if not closed:
                break
            start = text.find(TOOL_CALL_START, end + len(TOOL_CALL_END))
        return ToolSplit(text[: text.find(TOOL_CALL_START)].rstrip(), calls)

    def parse_block(self, body: str, complete: bool) -> ToolCallDraft | None:
        """The call in one block's text (between the tags); ``complete``: no more text comes."""
        raise NotImplementedError


class Qwen3CoderToolParser(ToolParser):
    """Qwen3.5's XML-style calls (module docstring)."""

    name = "qwen3_coder"
    _function = re.compile(r"\s*<function=([^>\n]+)>")
    _parameter = re.compile(r"<parameter=([^>\n]+)>")

    def parse_block(self, body: str, complete: bool) -> ToolCallDraft | None:
        head = self._function.match(body)
        if head is None:
            if complete:
                logger.warning("a <tool_call> block without <function=NAME> is not a call: %.200r", body)
            return None
        name = head.group(1).strip()
        schema = self.parameters.get(name, {})
        rest = body[head.end():]
        function_end = rest.find("</function>")
        if function_end >= 0:
            rest, complete = rest[:function_end], True
        parts = []
        for match in self._parameter.finditer(rest):
            value_start = match.end()
            nxt = self._parameter.search(rest, value_start)  # a missing </parameter> ends here
            ends = [i for i in (rest.find("</parameter>", value_start), nxt.start() if nxt else -1) if i >= 0]
            if not ends and not complete:
                break
            close = min(ends) if ends else len(rest)
            key = match.group(1).strip()
            raw = _strip_newline(rest[value_start:close])
            parts.append(f"{json.dumps(key, ensure_ascii=False)}: {_json_value(_convert(raw, schema.get(key)), raw)}")
        arguments = "{" + ", ".join(parts) + ("}" if complete else "")
        return ToolCallDraft(name, arguments)


class HermesToolParser(ToolParser):
    """JSON calls: ``{"name": ..., "arguments": {...}}`` in each block."""

    name = "hermes"

    def parse_block(self, body: str, complete: bool) -> ToolCallDraft | None:
        if not complete:
            return None
        try:
            call = json.loads(body, parse_constant=_refuse_constant)
            name = call["name"]
            arguments = call.get("arguments", call.get("parameters", {}))
            text = arguments if isinstance(arguments, str) else _dumps(arguments)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            logger.warning("a <tool_call> block that is not a JSON call is not a call: %.200r", body)
            return None
        if not isinstance(name, str):
            return None
        return ToolCallDraft(name, text)


def _refuse_constant(name: str) -> Any:
    """``json.loads``' hook for ``NaN`` / ``Infinity``: not JSON, so not a value."""
    raise ValueError(f"{name} is not a JSON value")


def _dumps(value: Any) -> str:
    """``value`` as JSON text; ValueError for a non-finite float (no JSON for it)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def _json_value(value: Any, raw: str) -> str:
    """A converted parameter value as JSON text; the raw text as a JSON string when the value
    has no JSON form (a float beyond range inside an array, a Python set or complex number
    from ``literal_eval``) or is nested too deep to write."""
    try:
        return _dumps(value)
    except (ValueError, TypeError, RecursionError):
        return _dumps(raw)


def _strip_newline(value: str) -> str:
    """A parameter value without the one newline the template puts on each side."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _schema_type(schema: Any) -> str:
    if not isinstance(schema, dict):
        return "string"
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind is None and isinstance(schema.get("anyOf"), list):
        kind = next((o.get("type") for o in schema["anyOf"] if isinstance(o, dict) and o.get("type") != "null"), None)
    return str(kind or "string").lower()


def _convert(value: str, schema: Any) -> Any:
    """A raw parameter value as the type its schema names (vLLM's conversions); text that
    does not fit the type stays a string."""
    kind = _schema_type(schema)
    if isinstance(schema, dict) and ("enum" in schema or "const" in schema):
        value = value.strip()  # a choice among fixed values: the blanks around it are layout
    if kind == "string":
        return value
    if value.strip().lower() in ("null", "none"):
        return None
    try:
        if kind == "integer":
            return int(value)
        if kind == "number":
            number = float(value)
            if not math.isfinite(number):
                return value
            return int(number) if number.is_integer() else number
        if kind == "boolean":
            return value.strip().lower() == "true"
        return json.loads(value, parse_constant=_refuse_constant)
    except RecursionError:  # nested deeper than json reads: no value of the type, the text stays
        return value
    except ValueError:
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return value


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "qwen3_coder": Qwen3CoderToolParser,
    "qwen3_xml": Qwen3CoderToolParser,
    "hermes": HermesToolParser,
}


def _json_value_end(text: str, start: int) -> int | None:
    """The index just after the JSON value that starts at ``text[start]`` (a string, an
    object, an array or a scalar), or None when the text ends before the value does."""
    first = text[start] if start < len(text) else ""
    if not first:
        return None
    if first == '"':
        i = start + 1
        while i < len(text):
            if text[i] == "\\":
                i += 2
                continue
            if text[i] == '"':
                return i + 1
            i += 1
        return None
    if first in "[{":
        depth, i, in_string = 0, start, False
        while i < len(text):
            c = text[i]
            if in_string:
                if c == "\\":
                    i += 1
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "[{":
                depth += 1
            elif c in "]}":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    i = start
    while i < len(text) and text[i] not in ",]} \t\r\n":
        i += 1
    return i if i < len(text) else None  # a number at the end may go on


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


class JsonToolCallParser(ToolParser):
    """Calls forced as JSON without a tool-call parser (module docstring): ``function`` set,
    the whole answer is that function's arguments; else the answer is an array of
    ``{"name", "parameters"}`` objects. The arguments are the answer's own text of the
    object, so a streamed prefix is always a prefix of the final arguments."""

    name = "json"

    def __init__(self, tools: list[dict[str, Any]], function: str | None = None) -> None:
        super().__init__(tools)
        self.function = function

    def parse(self, text: str, final: bool) -> ToolSplit:
        """The calls in ``text`` (the answer so far); never raises: a finished answer in which
        no call parses is content."""
        if self.function is not None:
            return ToolSplit("", [ToolCallDraft(self.function, text.lstrip())])
        try:
            calls = self._array_calls(text)
        except Exception:  # noqa: BLE001 - model output must never fail the request
            logger.warning("the forced JSON tool calls did not parse; the answer is sent as content", exc_info=True)
            calls = []
        if final and not any(call.name is not None for call in calls):
            return ToolSplit(text)
        return ToolSplit("", calls)

    def _array_calls(self, text: str) -> list[ToolCallDraft]:
        i = _skip_space(text, 0)
        if i >= len(text) or text[i] != "[":
            return []
        calls: list[ToolCallDraft] = []
        i += 1
        while True:
            i = _skip_space(text, i)
            if i < len(text) and text[i] == ",":
                i = _skip_space(text, i + 1)
            if i >= len(text) or text[i] != "{":
                return calls
            call = ToolCallDraft(None)
            calls.append(call)
            i = self._object(text, i + 1, call)
            if i is None:
                return calls

    @staticmethod
    def _object(text: str, i: int, call: ToolCallDraft) -> int | None:
        """Fill ``call`` from the members of the object whose body starts at ``i``; the index
        after its closing brace, or None when the text ends first."""
        name = None
        while True:
            i = _skip_space(text, i)
            if i < len(text) and text[i] == ",":
                i = _skip_space(text, i + 1)
            if i >= len(text):
                return None
            if text[i] == "}":
                call.name = name
                return i + 1
            key_end = _json_value_end(text, i)
            if key_end is None:
                return None
            key = json.loads(text[i:key_end])
            i = _skip_space(text, key_end)
            if i >= len(text) or text[i] != ":":
                return None
            start = _skip_space(text, i + 1)
            end = _json_value_end(text, start)
            if key == "parameters":
                call.arguments = text[start:len(text) if end is None else end]
            elif key == "name" and end is not None:
                name = json.loads(text[start:end])
                call.name = name
            if end is None:
                return None
            i = end
