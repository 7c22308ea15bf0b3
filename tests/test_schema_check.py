"""JSON schemas are enforced or refused (issue 43, item 4): keywords xgrammar would ignore,
remote references and unsatisfiable constraints are RequestErrors naming the keyword and its
JSON pointer; every keyword the server lets through is shown, against the installed
xgrammar, to reject a value that breaks it; the README lists exactly the code's keywords."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

xgr = pytest.importorskip("xgrammar")

from chat_output_helpers import WEATHER_PARAMETERS  # noqa: E402
from xgrammar import structural_tag as st  # noqa: E402
from xgrammar.testing import _is_grammar_accept_string as accepts  # noqa: E402

from onecat.runtime.errors import RequestError  # noqa: E402
from onecat.runtime.server.schema_check import (  # noqa: E402
    ANNOTATION_KEYWORDS,
    ENFORCED_FORMATS,
    ENFORCED_KEYWORDS,
    check_schema,
)

README = Path(__file__).resolve().parents[1] / "README.md"


def refusal(schema) -> str:
    with pytest.raises(RequestError) as info:
        check_schema(schema, "response_format", "response_format")
    assert info.value.param == "response_format"
    return str(info.value)


INTS = {"type": "array", "items": {"type": "integer"}}
UNENFORCED = {  # keyword -> a schema using it where xgrammar would ignore it, the pointer
    "not": ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "#/properties/a/not"),
    "uniqueItems": ({**INTS, "uniqueItems": True, "minItems": 3}, "#/uniqueItems"),
    "contains": ({**INTS, "contains": {"const": 5}, "maxItems": 0}, "#/contains"),
    "minContains": ({**INTS, "minContains": 2}, "#/minContains"),
    "if": ({"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 5}}, "#/if"),
    "dependentRequired": ({"type": "object", "dependentRequired": {"a": ["b"]}}, "#/dependentRequired"),
    "patternProperties": ({"type": "object", "patternProperties": {"^a": {}}}, "#/patternProperties"),
    "additionalItems": ({"type": "array", "additionalItems": False}, "#/additionalItems"),
    "$anchor": ({"$defs": {"x": {"$anchor": "x"}}}, "#/$defs/x/$anchor"),
    "contentEncoding": ({"type": "string", "contentEncoding": "base64"}, "#/contentEncoding"),
    "unknown": ({"type": "string", "maxLenght": 3}, "#/maxLenght"),
    "format": ({"type": "string", "format": "regex"}, "#/format"),
    "multipleOf": ({"type": "number", "multipleOf": 0.5}, "#/multipleOf"),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "#/allOf"),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "#/oneOf"),
    "$ref sibling": ({"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x", "minimum": 5}, "#/minimum"),
    "enum sibling": ({"enum": [{"a": 1}], "properties": {"a": {"type": "string"}}}, "#/properties"),
    "items list": ({"type": "array", "items": [{"type": "integer"}]}, "#/items"),
}


@pytest.mark.parametrize("case", sorted(UNENFORCED))
def test_unenforced_keywords_are_refused(case):
    schema, pointer = UNENFORCED[case]
    message = refusal(schema)
    assert f"at {pointer}:" in message, message
    assert pointer.rsplit("/", 1)[-1] in message


@pytest.mark.parametrize("ref", ["https://example.com/schema.json", "other.json#/x", "#anchor", "//host/x"])
def test_remote_and_anchor_refs_are_refused(ref):
    message = refusal({"type": "object", "properties": {"a": {"$ref": ref}}})
    assert "#/properties/a/$ref" in message and "remote" in message


UNSATISFIABLE = {
    "minItems > maxItems": ({**INTS, "minItems": 3, "maxItems": 1}, "#/minItems"),
    "minLength > maxLength": ({"type": "string", "minLength": 3, "maxLength": 1}, "#/minLength"),
    "minProperties > maxProperties": ({"type": "object", "minProperties": 2, "maxProperties": 1}, "#/minProperties"),
    "minimum > maximum": ({"type": "number", "minimum": 5, "maximum": 1}, "#/minimum"),
    "empty exclusive range": ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "#/exclusiveMinimum"),
    "no integer in range": ({"type": "integer", "minimum": 1.2, "maximum": 1.8}, "#/minimum"),
    "const and pattern": ({"type": "string", "const": "abc", "pattern": "^x$"}, "#/pattern"),
    "const and type": ({"type": "string", "const": 1}, "#/type"),
    "enum and minimum": ({"type": "integer", "enum": [1, 7], "minimum": 5}, "#/minimum"),
    "enum and maxLength": ({"enum": ["ab", "abc"], "maxLength": 2}, "#/maxLength"),
    "const not in enum": ({"enum": [1, 2], "const": 3}, "#/const"),
    "empty enum": ({"enum": []}, "#/enum"),
    "required but forbidden": ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "#/required"),
    "required but false": ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "#/required"),
    "more properties than allowed": ({"type": "object", "properties": {"a": {}}, "minProperties": 2}, "#/minProperties"),
    "minItems beyond prefixItems": ({"type": "array", "prefixItems": [{}], "items": False, "minItems": 2}, "#/minItems"),
    "false root": (False, "#"),
    "empty anyOf": ({"anyOf": []}, "#/anyOf"),
}


@pytest.mark.parametrize("case", sorted(UNSATISFIABLE))
def test_unsatisfiable_constraints_are_refused(case):
    schema, pointer = UNSATISFIABLE[case]
    message = refusal(schema)
    assert f"at {pointer}:" in message, message


def test_tool_parameters_name_the_tool():
    from onecat.runtime.server.structured_output import ToolCallConstraint, structural_tag

    tools = [{"type": "function", "function": {"name": "f", "parameters": WEATHER_PARAMETERS}},
             {"type": "function", "function": {"name": "g", "parameters": {
                 "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}]
    with pytest.raises(RequestError) as info:
        structural_tag(ToolCallConstraint("qwen3_coder", tools))
    assert info.value.param == "tools"
    assert "tools[1].function.parameters at #/properties/x/uniqueItems" in str(info.value)


def test_real_schemas_pass():
    """What clients send: a pydantic model's schema (nested model, Optional, Literal, list,
    enum, defaults, titles), OpenAI's strict weather tool, JSON mode's object."""
    pydantic = pytest.importorskip("pydantic")
    from enum import Enum
    from typing import Literal

    class Unit(str, Enum):
        C = "celsius"
        F = "fahrenheit"

    class Place(pydantic.BaseModel):
        city: str = pydantic.Field(description="the city", max_length=40)
        country: str | None = None

    class Forecast(pydantic.BaseModel):
        place: Place
        days: int = pydantic.Field(ge=1, le=14)
        unit: Unit = Unit.C
        kind: Literal["daily", "hourly"] = "daily"
        hours: list[int] = []

    for schema in (Forecast.model_json_schema(), WEATHER_PARAMETERS,
                   {"type": "object", "additionalProperties": True}, True, {}):
        check_schema(schema, "response_format", "response_format")


# ----- what the server lets through, xgrammar enforces ------------------------------------------

ENFORCEMENT = {  # keyword -> (schema, values it must accept, values it must reject)
    "type": ({"type": ["integer", "null"]}, ["1", "null"], ['"s"', "1.5"]),
    "enum": ({"enum": [1, "a"]}, ["1", '"a"'], ["2", '"b"']),
    "const": ({"const": {"a": [1]}}, ['{"a":[1]}'], ['{"a":[2]}']),  # written compactly
    "properties": ({"type": "object", "properties": {"a": {"type": "integer"}}}, ['{"a": 1}'], ['{"a": "s"}']),
    "required": ({"type": "object", "properties": {"a": {}}, "required": ["a"]}, ['{"a": 1}'], ["{}"]),
    "additionalProperties": ({"type": "object", "additionalProperties": {"type": "integer"}},
                             ['{"x": 1}'], ['{"x": "s"}']),
    "unevaluatedProperties": ({"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False},
                              ['{"a": 1}'], ['{"b": 1}']),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^a+$"}}, ['{"aa": 1}'], ['{"b": 1}']),
    "minProperties": ({"type": "object", "properties": {"a": {}, "b": {}}, "minProperties": 1},
                      ['{"a": 1}'], ["{}"]),
    "maxProperties": ({"type": "object", "properties": {"a": {}, "b": {}}, "maxProperties": 1},
                      ['{"a": 1}'], ['{"a": 1, "b": 2}']),
    "items": ({"type": "array", "items": {"type": "integer"}}, ["[1, 2]"], ['["s"]']),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, ["[1]"], ['["a"]', "[1, 2]"]),
    "unevaluatedItems": ({"type": "array", "prefixItems": [{}], "unevaluatedItems": False}, ["[1]"], ["[1, 2]"]),
    "minItems": ({**INTS, "minItems": 2}, ["[1, 2]"], ["[1]"]),
    "maxItems": ({**INTS, "maxItems": 1}, ["[1]"], ["[1, 2]"]),
    "minLength": ({"type": "string", "minLength": 2}, ['"ab"'], ['"a"']),
    "maxLength": ({"type": "string", "maxLength": 1}, ['"a"'], ['"ab"']),
    "pattern": ({"type": "string", "pattern": "^a+$"}, ['"aa"'], ['"b"']),
    "format": ({"type": "string", "format": "date"}, ['"2026-01-31"'], ['"soon"']),
    "minimum": ({"type": "number", "minimum": 1.5}, ["1.5"], ["1.4"]),
    "maximum": ({"type": "integer", "maximum": 3}, ["3"], ["4"]),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 3}, ["4"], ["3"]),
    "exclusiveMaximum": ({"type": "number", "exclusiveMaximum": 3}, ["2.5"], ["3"]),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, ["6"], ["4"]),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, ["1", '"s"'], ["true"]),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, ["1", '"s"'], ["true"]),
    "allOf": ({"allOf": [{"type": "integer", "minimum": 2}]}, ["2"], ["1"]),
    "$ref": ({"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x"}, ["1"], ['"s"']),
    "$defs": ({"$defs": {"x": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}},
              ['{"a": 1}'], ['{"a": "s"}']),
    "definitions": ({"definitions": {"x": {"type": "integer"}}, "$ref": "#/definitions/x"}, ["1"], ['"s"']),
}
FORMAT_SAMPLES = {  # format -> (a valid string, an invalid one)
    "email": ("a@b.co", "a"), "date": ("2026-01-31", "x"), "time": ("03:04:05Z", "x"),
    "date-time": ("2026-01-31T03:04:05Z", "x"), "duration": ("P1D", "x"), "ipv4": ("1.2.3.4", "x"),
    "ipv6": ("::1", "x"), "hostname": ("a.b", "a b"), "uuid": ("123e4567-e89b-12d3-a456-426614174000", "x"),
    "uri": ("http://a.b", "x y"), "uri-reference": ("/a", "x y"), "uri-template": ("/a{b}", "{"),
    "json-pointer": ("/a", "a"), "relative-json-pointer": ("0/a", "a"),
}


def grammar(schema):
    return xgr.Grammar.from_structural_tag(st.StructuralTag(format=st.JSONSchemaFormat(json_schema=schema)))


def test_every_enforced_keyword_is_enforced_by_xgrammar():
    """The probe behind ``ENFORCED_KEYWORDS``: each keyword, through the server's own
    structural-tag path, accepts what satisfies it and rejects what breaks it."""
    assert set(ENFORCEMENT) == set(ENFORCED_KEYWORDS)
    for keyword, (schema, good, bad) in ENFORCEMENT.items():
        check_schema(schema, "response_format", "response_format")
        compiled = grammar(schema)
        for value in good:
            assert accepts(compiled, value), f"{keyword}: {value} is valid but rejected"
        for value in bad:
            assert not accepts(compiled, value), f"{keyword}: {value} breaks it but is accepted"
    assert set(FORMAT_SAMPLES) == set(ENFORCED_FORMATS)
    for fmt, (good, bad) in FORMAT_SAMPLES.items():
        compiled = grammar({"type": "string", "format": fmt})
        assert accepts(compiled, json.dumps(good)) and not accepts(compiled, json.dumps(bad)), fmt


def test_readme_lists_the_code_keywords():
    """The README's lists are ``schema_check``'s constants, in their order."""
    text = README.read_text()

    def listed(label: str) -> list[str]:
        line = re.search(rf"^{label}: (.*)$", text, re.MULTILINE)
        assert line, f"README has no line starting with {label!r}"
        return re.findall(r"`([^`]+)`", line.group(1).rstrip("."))

    assert listed("Enforced JSON-schema keywords") == list(ENFORCED_KEYWORDS)
    assert listed("Enforced formats") == list(ENFORCED_FORMATS)
    assert listed("Accepted annotations") == list(ANNOTATION_KEYWORDS)
