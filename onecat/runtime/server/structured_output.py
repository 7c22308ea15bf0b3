"""Structured output: the tokens a request may sample are masked to a grammar (xgrammar).

``response_format`` ``json_object`` (any JSON object) and ``json_schema`` (the schema, strictly:
no properties or items it does not name), and tool calls forced by ``tool_choice``
``required`` or a named function: with a ``--tool-call-parser``, the calls in the model's own
format, so that the parser reads them back (xgrammar's structural tags for Qwen3.5 / Qwen3);
without one, as vLLM does, JSON (``ToolJsonConstraint``: a named function's arguments object
under its parameters schema, or for ``required`` an array of ``{"name", "parameters"}``
objects, ``tool_parsers.JsonToolCallParser`` reading them back). When
the output opens inside a think block (a reasoning parser is on and the chat template opened
it), the reasoning is left free and the grammar applies after ``</think>``, as in vLLM.

The mask is a per-request logits processor (``SamplingParams.logits_processors``): it feeds
the tokens sampled since its last call to an xgrammar ``GrammarMatcher``, asks it for the
allowed next tokens (a bitmask over the vocabulary, filled on the CPU) and sets every other
logit to -inf on the logits' device. Once the grammar is complete only the stop tokens (the
model's EOS) remain allowed.

Schemas are checked before they compile (``schema_check``: a keyword the grammar does not
enforce is refused, not ignored); the server compiles in worker processes under a time
budget (``grammar_workers``).

xgrammar is optional (the ``serve`` extra): it is imported at the first request that needs
it, and a server without it answers such requests with a 400 naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from onecat.runtime.errors import RequestError
from onecat.runtime.server.schema_check import check_schema

THINK_END = "</think>"
XGRAMMAR_TOOL_FORMATS = {"qwen3_coder": "qwen_3_5", "qwen3_xml": "qwen_3_5", "hermes": "qwen_3"}
"""--tool-call-parser name -> xgrammar's structural-tag model key of the same format."""


class StructuredOutputUnavailable(Exception):
    """The grammar library is not installed on this server."""


def import_xgrammar() -> Any:
    """The xgrammar module; StructuredOutputUnavailable when it is not installed."""
    try:
        import xgrammar
    except ImportError as exc:
        raise StructuredOutputUnavailable(
            "structured output needs the xgrammar package, which this server lacks "
            "(pip install 'onecat[serve]')"
        ) from exc
    return xgrammar


@dataclass(frozen=True)
class JsonConstraint:
    """The answer is one JSON value matching ``schema`` (``{"type": "object", ...}`` for JSON
    mode)."""

    schema: dict[str, Any]
    after_reasoning: bool = False


@dataclass(frozen=True)
class ToolCallConstraint:
    """The answer is one or more tool calls in ``parser``'s format: ``tool_choice``
    ``"required"`` (any of ``tools``; with ``parallel_tool_calls`` text may follow the first
    call, as further calls may) or a function name (that one, then the end)."""

    parser: str
    tools: list[dict[str, Any]] = field(hash=False)
    tool_choice: str | dict[str, Any] = field(hash=False, default="required")
    after_reasoning: bool = False
    parallel_tool_calls: bool = True


@dataclass(frozen=True)
class ToolJsonConstraint:
    """Tool calls forced without a tool-call parser, as vLLM forces them: the answer is the
    named function's arguments (a JSON object under its parameters schema) or, for
    ``"required"``, a JSON array of ``{"name", "parameters"}`` objects (at most one with
    ``parallel_tool_calls`` false). ``schema`` is the JSON schema of the answer."""

    tools: list[dict[str, Any]] = field(hash=False)
    tool_choice: str | dict[str, Any] = field(hash=False, default="required")
    after_reasoning: bool = False
    parallel_tool_calls: bool = True

    @property
    def schema(self) -> dict[str, Any]:
        """The answer's JSON schema (RequestError naming ``tools`` when two tools define one
        ``$defs`` name differently)."""
        if isinstance(self.tool_choice, dict):
            name = self.tool_choice["function"]["name"]
            return next(_parameters(t) for t in self.tools if t.get("function", {}).get("name") == name)
        items, defs = [], {}
        for tool in self.tools:
            parameters = dict(_parameters(tool))
            for key in ("$defs", "definitions"):  # a local $ref resolves from the root: hoist them
                for def_name, definition in (parameters.pop(key, None) or {}).items():
                    if defs.setdefault(key, {}).setdefault(def_name, definition) != definition:
                        raise RequestError(f"tools define {key}/{def_name} twice, differently; give the "
                                           "definitions distinct names", param="tools")
            items.append({"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                         "parameters": parameters},
                          "required": ["name", "parameters"]})
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        return {**schema, **defs}


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema (an object with no properties when it has none)."""
    parameters = tool.get("function", {}).get("parameters")
    return parameters if parameters is not None else {"type": "object", "properties": {}}


JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object", "additionalProperties": True}
MAX_WHITESPACE = 16
"""Longest run of whitespace a grammar allows between JSON tokens (and around a tool call's
parameter values): enough for an indented nested object, and a sampled model cannot spend
its whole budget on blank space."""


Constraint = JsonConstraint | ToolCallConstraint | ToolJsonConstraint


def check_constraint(constraint: Constraint) -> None:
    """RequestError naming the request field, the keyword and where it is when a schema of
    ``constraint`` uses a keyword the grammar would not enforce or cannot be satisfied
    (``schema_check``)."""
    if isinstance(constraint, JsonConstraint):
        check_schema(constraint.schema, "response_format.json_schema.schema", "response_format")
        return
    for i, tool in enumerate(constraint.tools):
        parameters = tool.get("function", {}).get("parameters")
        if parameters is not None:
            check_schema(parameters, f"tools[{i}].function.parameters", "tools")
    if isinstance(constraint, ToolJsonConstraint):
        check_schema(constraint.schema, "tools", "tools")  # the array around them


def constraint_key(constraint: Constraint) -> str:
    """The constraint as JSON, in its schemas' key order (the grammar cache's key)."""
    return json.dumps([type(constraint).__name__, dataclasses.asdict(constraint)], separators=(",", ":"))


def structural_tag(constraint: Constraint) -> Any:
    """xgrammar's structural tag for ``constraint``, its schemas checked first."""
    xgr = import_xgrammar()
    from xgrammar import structural_tag as st

    check_constraint(constraint)
    if isinstance(constraint, JsonConstraint | ToolJsonConstraint):
        body: Any = st.JSONSchemaFormat(json_schema=constraint.schema, max_whitespace_cnt=MAX_WHITESPACE)
        if constraint.after_reasoning:
            body = st.SequenceFormat(elements=[_reasoning_prefix(st), body])
        return st.StructuralTag(format=body)
    try:
        return xgr.get_model_structural_tag(
            XGRAMMAR_TOOL_FORMATS[constraint.parser],
            tools=constraint.tools,
            tool_choice=constraint.tool_choice,
            reasoning="enabled" if constraint.after_reasoning else "disabled",
            max_whitespace_cnt=MAX_WHITESPACE,
            parallel_tool_calls=constraint.parallel_tool_calls,
        )
    except Exception as exc:  # xgrammar raises ValueError / its own types
        raise RequestError(f"tools cannot be compiled into a grammar: {exc}", param="tools") from exc


def constraint_param(constraint: Constraint) -> str:
    """The request field a constraint comes from (for error bodies)."""
    return "response_format" if isinstance(constraint, JsonConstraint) else "tools"


class GrammarBackend:
    """One model's tokenizer as xgrammar sees it (built lazily: xgrammar's token table takes
    a second or so for a large vocabulary), an in-process ``compile`` (the server compiles
    in worker processes instead: ``grammar_workers``) and the logits processors of compiled
    grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._info: Any = None
        self._compiler: Any = None
        self._lock = threading.RLock()

    def tokenizer_info(self) -> Any:
        """xgrammar's ``TokenizerInfo`` of the model (thread-safe)."""
        xgr = import_xgrammar()
        with self._lock:
            if self._info is None:
                self._info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
        return self._info

    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar of ``constraint``, in this process and without a time limit;
        RequestError (naming the request field) when the schema or the tools are refused or
        cannot be compiled."""
        tag = structural_tag(constraint)
        xgr = import_xgrammar()
        with self._lock:
            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(self.tokenizer_info(), max_threads=2)
        try:
            return self._compiler.compile_structural_tag(tag)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own types
            param = constraint_param(constraint)
            raise RequestError(f"{param} cannot be compiled into a grammar: {exc}", param=param) from exc

    def logits_processor(self, compiled: Any) -> GrammarLogitsProcessor:
        """A fresh per-request mask over ``compiled``."""
        xgr = import_xgrammar()
        return GrammarLogitsProcessor(xgr.GrammarMatcher(compiled), self.vocab_size, compiled)

    def deserialize(self, payload: str) -> Any:
        """A compiled grammar from ``CompiledGrammar.serialize_json`` (another process's
        compile), against this backend's tokenizer table."""
        return import_xgrammar().CompiledGrammar.deserialize_json(payload, self.tokenizer_info())


def _reasoning_prefix(st: Any) -> Any:
    """Free text up to ``</think>`` and the template's blank line after it."""
    return st.SequenceFormat(elements=[
        st.TagFormat(begin="", content=st.AnyTextFormat(excludes=["<think>", THINK_END]), end=THINK_END),
        st.ConstStringFormat(value="\n\n"),
    ])


class GrammarLogitsProcessor:
    """``(output_token_ids, logits_row) -> logits_row`` with every token the grammar does not
    allow next set to -inf (the engine calls it once per generated token). ``compiled`` is
    the grammar the matcher runs (an engine-core process gets it serialised)."""

    def __init__(self, matcher: Any, vocab_size: int, compiled: Any = None) -> None:
        xgr = import_xgrammar()
        self.matcher = matcher
        self.compiled = compiled
        self.vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._shifts: dict[torch.device, torch.Tensor] = {}
        self._accepted = 0

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output_token_ids) < self._accepted:  # the output was taken back: start over
            self.matcher.reset()
            self._accepted = 0
        for token in output_token_ids[self._accepted:]:
            if not self.matcher.accept_token(token):
                raise RequestError(f"token {token} does not fit the request's grammar")
        self._accepted = len(output_token_ids)
        self.matcher.fill_next_token_bitmask(self._bitmask)
        return logits.masked_fill_(~self.allowed(logits.device, logits.shape[-1]), float("-inf"))

    def allowed(self, device: torch.device, width: int) -> torch.Tensor:
        """The current bitmask as booleans over ``width`` logits (tokens past the grammar's
        vocabulary are never allowed)."""
        shifts = self._shifts.get(device)
        if shifts is None:
            shifts = self._shifts[device] = torch.arange(32, device=device, dtype=torch.int32)
        words = self._bitmask[0].to(device, non_blocking=True)
        bits = ((words[:, None] >> shifts) & 1).reshape(-1).bool()
        if bits.numel() < width:
            bits = torch.cat([bits, bits.new_zeros(width - bits.numel())])
        return bits[:width]
