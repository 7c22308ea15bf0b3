"""JSON schemas are enforced or refused: the keywords xgrammar's grammar really enforces pass,
anything else is a 400 naming the keyword and where it is.

xgrammar 0.2.9 compiles many schemas it does not enforce: it ignores ``not``,
``uniqueItems``, ``contains``, ``if``/``then``/``else``, ``dependentRequired``, ``multipleOf``
on numbers, unknown ``format`` values, whatever sits beside ``$ref`` or ``enum`` / ``const``,
``allOf`` beyond one schema and overlapping ``oneOf`` branches (which it treats as
``anyOf``), and it leaves a remote ``$ref`` unconstrained; ``patternProperties`` it turns
into a grammar no object with such a property matches. The model's answer would then
violate the schema while ``finish_reason`` says "stop". So a schema is walked before it is
compiled: keywords in ``ENFORCED_KEYWORDS`` (with the conditions written beside them) and
``ANNOTATION_KEYWORDS`` (no effect on which values are valid) pass, every other keyword is
refused, and so are constraints that no value can satisfy where that is plain from the
schema (``minItems`` above ``maxItems``, a required property the schema forbids, an enum
none of whose values fits the keywords beside it, ...). Which keywords are enforced was
found by probes (``tests/test_schema_check.py`` repeats them against the installed
xgrammar); the README's list is this module's constants.

xgrammar is stricter than JSON Schema in two ways that never let invalid output through:
an object has only the properties its schema names unless ``additionalProperties`` says
otherwise, and ``pattern`` must match the whole string.
"""

from __future__ import annotations

import math
import re
from typing import Any

from onecat.runtime.errors import RequestError

ENFORCED_KEYWORDS: tuple[str, ...] = (
    "type", "enum", "const",
    "properties", "required", "additionalProperties", "unevaluatedProperties", "propertyNames",
    "minProperties", "maxProperties",
    "items", "prefixItems", "unevaluatedItems", "minItems", "maxItems",
    "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
)
"""Keywords the grammar enforces. Conditions: ``format`` one of ``ENFORCED_FORMATS``;
``multipleOf`` on ``"type": "integer"`` only; ``oneOf`` branches of distinct types;
``allOf`` of one schema; ``$ref`` local (``#`` or ``#/...``) with only annotations beside
it; ``enum`` / ``const`` beside other keywords only when every value satisfies them (type,
bounds, lengths, pattern, multipleOf); ``items`` a schema or a boolean (not a list)."""

ANNOTATION_KEYWORDS: tuple[str, ...] = (
    "title", "description", "default", "examples", "$comment", "$schema", "$id",
    "deprecated", "readOnly", "writeOnly", "strict", "nullable",
)
"""Keywords accepted and ignored: they do not change which values are valid (``strict`` is
OpenAI's flag, ``$id`` only at the root), or, for OpenAPI's ``nullable``, only widen them
(the grammar never writes the null it would allow). Keys starting with ``x-`` are
annotations too."""

ENFORCED_FORMATS: tuple[str, ...] = (
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
    "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
)

_SUBSCHEMA = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items", "unevaluatedItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_TYPES = {"string", "integer", "number", "boolean", "null", "object", "array"}
_PAIRS = (("minItems", "maxItems"), ("minLength", "maxLength"), ("minProperties", "maxProperties"))
_VALUE_CHECKED = {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                  "minLength", "maxLength", "pattern", "multipleOf", "format"}
"""Keywords beside ``enum`` / ``const`` whose effect on each value is checked here."""


def _pointer(path: list[str]) -> str:
    return "#" + "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in path)


class _Refusal(Exception):
    def __init__(self, path: list[str], message: str) -> None:
        super().__init__(message)
        self.path = path


def check_schema(schema: Any, where: str, param: str) -> None:
    """Raise RequestError (``param``) when ``schema`` uses a keyword the grammar does not
    enforce, a remote or anchor ``$ref``, or a constraint no value satisfies; the message
    names the keyword and its JSON pointer under ``where`` (e.g. ``response_format``)."""
    stack: list[tuple[Any, list[str]]] = [(schema, [])]
    try:
        while stack:
            node, path = stack.pop()
            stack.extend(_check_node(node, path))
    except _Refusal as refusal:
        raise RequestError(f"{where} at {_pointer(refusal.path)}: {refusal}", param=param) from None


def _check_node(node: Any, path: list[str]) -> list[tuple[Any, list[str]]]:
    """Check one schema object; return its subschemas with their paths."""
    if isinstance(node, bool):
        if node is False and not path:
            raise _Refusal(path, "the schema `false` accepts no value")
        return []
    if not isinstance(node, dict):
        raise _Refusal(path, f"a schema must be an object or a boolean, not {type(node).__name__}")
    for key in node:
        if key in ENFORCED_KEYWORDS or key.startswith("x-"):
            continue
        if key in ANNOTATION_KEYWORDS and (key != "$id" or not path):
            continue
        raise _Refusal([*path, key], f"the JSON-schema keyword `{key}` is not enforced by this "
                       "server's grammar engine, so the output could violate it; remove it "
                       f"(enforced keywords: {', '.join(ENFORCED_KEYWORDS)})")
    _check_conditions(node, path)
    _check_satisfiable(node, path)
    children: list[tuple[Any, list[str]]] = []
    for key in _SUBSCHEMA:
        if key in node:
            children.append((node[key], [*path, key]))
    for key in _SCHEMA_MAPS:
        value = node.get(key, {})
        if not isinstance(value, dict):
            raise _Refusal([*path, key], f"`{key}` must be an object of schemas")
        children.extend((sub, [*path, key, name]) for name, sub in value.items())
    for key in _SCHEMA_LISTS:
        value = node.get(key, [])
        if not isinstance(value, list):
            raise _Refusal([*path, key], f"`{key}` must be a list of schemas")
        children.extend((sub, [*path, key, str(i)]) for i, sub in enumerate(value))
    return children


def _types(node: dict[str, Any], path: list[str]) -> set[str] | None:
    """The schema's ``type`` as a set (None: any type)."""
    kind = node.get("type")
    if kind is None:
        return None
    kinds = [kind] if isinstance(kind, str) else kind
    if not isinstance(kinds, list) or not kinds or not all(isinstance(k, str) and k in _TYPES for k in kinds):
        raise _Refusal([*path, "type"], f"`type` must be one of {', '.join(sorted(_TYPES))} or a "
                       f"non-empty list of them, not {kind!r}")
    return set(kinds)


def _check_conditions(node: dict[str, Any], path: list[str]) -> None:
    """Keywords enforced only in some forms (``ENFORCED_KEYWORDS``' docstring)."""
    types = _types(node, path)
    fmt = node.get("format")
    if fmt is not None and fmt not in ENFORCED_FORMATS:
        raise _Refusal([*path, "format"], f"`format` {fmt!r} is not enforced by this server's grammar "
                       f"engine; enforced formats: {', '.join(ENFORCED_FORMATS)}")
    if "multipleOf" in node and types != {"integer"}:
        raise _Refusal([*path, "multipleOf"], '`multipleOf` is enforced on `"type": "integer"` only')
    if "allOf" in node and len(node["allOf"]) != 1:
        raise _Refusal([*path, "allOf"], "`allOf` is enforced with a single schema only (merge them)")
    if "oneOf" in node:
        _check_one_of(node["oneOf"], [*path, "oneOf"])
    if isinstance(node.get("items"), list):
        raise _Refusal([*path, "items"], "`items` as a list (draft-4 tuples) is not supported; use `prefixItems`")
    if "$ref" in node:
        ref = node["$ref"]
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise _Refusal([*path, "$ref"], f"`$ref` {ref!r} is refused: only references inside the schema "
                           "(`#` or `#/...`) are resolved; remote references are never fetched")
        beside = [k for k in node if k not in (*ANNOTATION_KEYWORDS, "$ref", "$defs", "definitions")
                  and not k.startswith("x-")]
        if beside:
            raise _Refusal([*path, beside[0]], f"`{beside[0]}` beside `$ref` is not enforced by this "
                           "server's grammar engine; move it into the referenced schema")
    if "enum" in node or "const" in node:
        _check_values(node, path, types)


def _check_one_of(branches: Any, path: list[str]) -> None:
    """``oneOf`` is enforced only where its branches cannot overlap: each names one type of
    its own (``integer`` and ``number`` overlap)."""
    if not isinstance(branches, list) or not branches:
        raise _Refusal(path, "`oneOf` must be a non-empty list of schemas")
    seen: set[str] = set()
    for branch in branches:
        kind = branch.get("type") if isinstance(branch, dict) else None
        kind = {"integer": "number"}.get(kind, kind) if isinstance(kind, str) else None
        if kind is None or kind in seen or (isinstance(branch, dict) and "$ref" in branch):
            raise _Refusal(path, "`oneOf` is enforced only when each branch has a `type` of its own "
                           "(overlapping branches would be treated as `anyOf`); use `anyOf`")
        seen.add(kind)


def _value_fits(value: Any, key: str, arg: Any, types: set[str] | None) -> bool:
    """Whether ``value`` (of an enum / const) satisfies ``key: arg``."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if key == "type":
        return types is None or _json_type(value) in types or (_json_type(value) == "integer" and "number" in types)
    if key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
        if not number or not isinstance(arg, (int, float)):
            return True  # numeric keywords say nothing about other values
        return {"minimum": value >= arg, "maximum": value <= arg, "exclusiveMinimum": value > arg,
                "exclusiveMaximum": value < arg,
                "multipleOf": arg > 0 and math.isclose(value / arg, round(value / arg))}[key]
    if not isinstance(value, str):
        return True
    if key == "minLength":
        return len(value) >= arg
    if key == "maxLength":
        return len(value) <= arg
    if key == "pattern":
        try:
            return re.fullmatch(arg, value) is not None  # the grammar matches the whole string
        except re.error:
            raise _Refusal([], f"`pattern` {arg!r} is not a regular expression this server reads") from None
    return True  # format: the grammar's own rule applies to the values too


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "unknown")


def _check_values(node: dict[str, Any], path: list[str], types: set[str] | None) -> None:
    """``enum`` / ``const`` with keywords beside them: the grammar enforces only the values,
    so each value must satisfy the others (else 400 naming the first it breaks)."""
    key = "const" if "const" in node else "enum"
    values = [node["const"]] if key == "const" else node["enum"]
    if "const" in node and "enum" in node and node["const"] not in node["enum"]:
        raise _Refusal([*path, "const"], "`const` is not one of the `enum` values: no value satisfies both")
    if not isinstance(values, list) or not values:
        raise _Refusal([*path, key], "`enum` must be a non-empty list: an empty one accepts no value")
    beside = [k for k in node if k not in (*ANNOTATION_KEYWORDS, "enum", "const") and not k.startswith("x-")]
    for other in beside:
        if other not in _VALUE_CHECKED:
            raise _Refusal([*path, other], f"`{other}` beside `{key}` is not enforced by this server's "
                           f"grammar engine (only the `{key}` values are); remove it")
        for value in values:
            try:
                fits = _value_fits(value, other, node[other], types)
            except _Refusal as refusal:
                raise _Refusal([*path, other], str(refusal)) from None
            if not fits:
                raise _Refusal([*path, other], f"the `{key}` value {value!r} does not satisfy `{other}`: "
                               f"{node[other]!r} (the grammar would produce it anyway); fix the schema")


def _number(node: dict[str, Any], key: str, path: list[str]) -> float | None:
    value = node.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _Refusal([*path, key], f"`{key}` must be a finite number, not {value!r}")
    return float(value)


def _check_satisfiable(node: dict[str, Any], path: list[str]) -> None:
    """Constraints no value can satisfy, where the schema shows it plainly."""
    for low, high in _PAIRS:
        lo, hi = _number(node, low, path), _number(node, high, path)
        if lo is not None and lo < 0:
            raise _Refusal([*path, low], f"`{low}` must not be negative")
        if lo is not None and hi is not None and lo > hi:
            raise _Refusal([*path, low], f"`{low}` {lo:g} is greater than `{high}` {hi:g}: no value satisfies both")
    lower = [(v, False) for v in [_number(node, "minimum", path)] if v is not None]
    lower += [(v, True) for v in [_number(node, "exclusiveMinimum", path)] if v is not None]
    upper = [(v, False) for v in [_number(node, "maximum", path)] if v is not None]
    upper += [(v, True) for v in [_number(node, "exclusiveMaximum", path)] if v is not None]
    if lower and upper:
        lo, lo_open = max(lower)
        hi, hi_open = min(upper)
        empty = lo > hi or (lo == hi and (lo_open or hi_open))
        if _types(node, path) == {"integer"} and not empty:
            first = math.floor(lo) + 1 if lo_open or not float(lo).is_integer() else lo
            last = math.ceil(hi) - 1 if hi_open or not float(hi).is_integer() else hi
            empty = first > last
        if empty:
            raise _Refusal([*path, "minimum" if any(not o for _, o in lower) else "exclusiveMinimum"],
                           "the lower bound is above the upper bound: no number satisfies both")
    for key in ("anyOf", "allOf"):
        if key in node and (not isinstance(node[key], list) or not node[key]):
            raise _Refusal([*path, key], f"`{key}` must be a non-empty list of schemas")
    _check_object(node, path)
    _check_array(node, path)


def _check_object(node: dict[str, Any], path: list[str]) -> None:
    """Required properties the schema forbids; more properties required than allowed. (The
    grammar allows only named properties unless ``additionalProperties`` is given.)"""
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise _Refusal([*path, "required"], "`required` must be a list of property names")
    extra = node.get("additionalProperties", node.get("unevaluatedProperties", False))
    for name in required:
        sub = properties.get(name, extra if name not in properties else None)
        if sub is False:
            raise _Refusal([*path, "required"], f"the required property {name!r} is not allowed by "
                           "`properties` / `additionalProperties`: no object satisfies the schema")
    if extra is False:
        most = node.get("maxProperties")
        least = node.get("minProperties")
        if isinstance(least, int) and least > len(properties):
            raise _Refusal([*path, "minProperties"], f"`minProperties` {least} is more than the "
                           f"{len(properties)} properties the schema allows")
        if isinstance(most, int) and len(set(required)) > most:
            raise _Refusal([*path, "maxProperties"], f"{len(set(required))} properties are required "
                           f"but `maxProperties` is {most}")


def _check_array(node: dict[str, Any], path: list[str]) -> None:
    """More items required than the schema allows."""
    least = node.get("minItems")
    prefix = node.get("prefixItems")
    if isinstance(least, int) and isinstance(prefix, list) and node.get("items", True) is False and least > len(prefix):
        raise _Refusal([*path, "minItems"], f"`minItems` {least} is more than the {len(prefix)} items "
                       "`prefixItems` allows with `items: false`")
    if isinstance(least, int) and least > 0 and node.get("items") is False and not prefix:
        raise _Refusal([*path, "minItems"], "`minItems` is positive but `items: false` allows no item")
