"""Unit tests of the server's protocol layer: SSE framing, request validation and refusal of
OpenAI features the engine cannot honour, error bodies. No engine, no HTTP."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pydantic")

from pydantic import ValidationError  # noqa: E402

from onecat.runtime.server.api_errors import APIError  # noqa: E402
from onecat.runtime.server.openai_serving import DONE_EVENT, sse_event, usage_dict  # noqa: E402
from onecat.runtime.server.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402

HELLO = [{"role": "user", "content": "hi"}]


def test_sse_event_framing():
    event = sse_event({"text": "naïve\nline", "n": 1})
    assert event.startswith("data: ") and event.endswith("\n\n")
    body = event[len("data: ") : -2]
    assert "\n" not in body, "a newline inside the JSON would end the SSE event"
    assert json.loads(body) == {"text": "naïve\nline", "n": 1}
    assert DONE_EVENT == "data: [DONE]\n\n"
    assert usage_dict(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_chat_request_fields():
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "stop": "END",
            "max_completion_tokens": 5,
            "max_tokens": 9,
            "some_future_field": True,
        }
    )
    assert req.messages[0].text() == "ab"
    assert req.stop_strings() == ["END"]
    assert req.max_new_tokens() == 5, "max_completion_tokens wins over max_tokens"
    assert not req.include_usage()


@pytest.mark.parametrize(
    "fields",
    [
        {"messages": []},
        {"messages": [{"role": "user"}], "max_tokens": 0},
        {"messages": HELLO, "top_p": 0},
        {"messages": HELLO, "stream_options": {"include_usage": "maybe"}},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        {"messages": HELLO, "tools": [{"type": "function"}]},
        {"messages": HELLO, "response_format": {"type": "json_schema"}},
    ],
)
def test_chat_request_rejects_invalid_fields(fields):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(fields)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"tool_choice": "required"}, "tool_choice"),  # no tools to choose from
        ({"tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_unsupported_chat_features_are_refused(fields, param):
    req = ChatCompletionRequest.model_validate({"messages": HELLO, **fields})
    with pytest.raises(APIError) as info:
        req.refuse_unsupported()
    assert info.value.status == 400 and info.value.param == param
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}


def test_completion_prompt_shapes():
    assert CompletionRequest.model_validate({"prompt": "x"}).single_prompt() == "x"
    assert CompletionRequest.model_validate({"prompt": [1, 2]}).single_prompt() == [1, 2]
    assert CompletionRequest.model_validate({"prompt": [[1, 2]]}).single_prompt() == [1, 2]
    several = CompletionRequest.model_validate({"prompt": ["a", "b"]})
    with pytest.raises(APIError, match="one request per prompt"):
        several.refuse_unsupported()
    for field in ({"echo": True}, {"best_of": 2}, {"suffix": "x"}):
        with pytest.raises(APIError):
            CompletionRequest.model_validate({"prompt": "x", **field}).refuse_unsupported()


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_k": 2**70}, "top_k"),
        ({"top_k": -1}, "top_k"),
        ({"seed": 2**63}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"stop": ["a"] * 65}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["\ud800"]}, "stop"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids"),
        ({"stop_token_ids": [1] * 1025}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_sampling_params_refuse_what_the_engine_cannot_take(fields, param):
    """The engine's own check (for callers other than the server): a RequestError naming the
    field, never an exception inside the engine loop."""
    from onecat.runtime.errors import RequestError
    from onecat.runtime.sampling_params import SamplingParams

    with pytest.raises(RequestError) as info:
        SamplingParams(**fields).validate()
    assert info.value.param == param
    SamplingParams(top_k=2**31 - 1, seed=-(2**63), stop=["a"] * 64, stop_token_ids=[0] * 1024).validate()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "a\ud800"}]}, "messages"),
        ({"messages": HELLO, "user": "\udfff"}, "user"),
        ({"messages": HELLO, "chat_template_kwargs": {"\ud800": 1}}, "chat_template_kwargs"),
    ],
)
def test_lone_surrogates_are_refused_naming_the_field(body, param):
    with pytest.raises(APIError) as info:
        ChatCompletionRequest.model_validate(body)
    assert info.value.status == 400 and info.value.param == param
    assert "Unicode" in info.value.message


@pytest.mark.parametrize(
    "fields",
    [{"top_k": 2**70}, {"seed": 2**64}, {"n": 2**70}, {"max_completion_tokens": 2**40},
     {"stop_token_ids": [-1]}, {"temperature": float("inf")}],
)
def test_chat_request_bounds(fields):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": HELLO, **fields})
