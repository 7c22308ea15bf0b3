"""Structured output (response_format json_object / json_schema) through xgrammar's token
mask: the logits processor on its own, then the real server on the random tiny Qwen3.5 with
the official openai client, where only the mask makes the answers JSON."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

pytest.importorskip("xgrammar")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from chat_output_helpers import (  # noqa: E402
    WEATHER_PARAMETERS,
    ScriptedSampler,
    add_up,
    check_weather_arguments,
    sse_deltas,
)
from server_helpers import make_engine  # noqa: E402

from onecat.runtime.errors import RequestError  # noqa: E402
from onecat.runtime.server.chat_plan import ChatOptions  # noqa: E402
from onecat.runtime.server.launcher import BackgroundServer  # noqa: E402
from onecat.runtime.server.structured_output import (  # noqa: E402
    JSON_OBJECT_SCHEMA,
    GrammarBackend,
    JsonConstraint,
    StructuredOutputUnavailable,
)
from onecat.tiny import build_tiny_model  # noqa: E402

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
ASK = [{"role": "user", "content": "The weather in Paris as JSON, please."}]
WEATHER_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "strict": True,
                                                          "schema": WEATHER_PARAMETERS}}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model("qwen3_5", tmp_path_factory.mktemp("structured") / "tiny-qwen3_5")


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def server(tiny_model):
    engine = make_engine(tiny_model, max_model_len=1024)
    with BackgroundServer(engine, chat_options=ChatOptions(reasoning_parser="qwen3")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


# ----- the logits processor -----------------------------------------------------------------


def test_mask_allows_exactly_the_grammar(tokenizer):
    width = len(tokenizer) + 40  # a model's padded vocabulary: the extra rows are never allowed
    backend = GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    compiled = backend.compile(JsonConstraint(WEATHER_PARAMETERS))
    answer = tokenizer.encode('{"city": "Oslo", "days": 4}', add_special_tokens=False)
    processor = backend.logits_processor(compiled)
    for step, token in enumerate([*answer, tokenizer.eos_token_id]):
        logits = processor(answer[:step], torch.zeros(width))
        allowed = torch.isfinite(logits)
        assert allowed[token], f"step {step}: the answer's next token is masked"
        assert not allowed[len(tokenizer):].any()
        assert 0 < int(allowed.sum()) < len(tokenizer)
        assert (logits[allowed] == 0).all(), "allowed logits keep their values"
    # after the object only EOS may follow
    fresh = backend.logits_processor(compiled)
    done = fresh(answer, torch.zeros(width))
    assert torch.isfinite(done).nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    # an output taken back (shorter than what the mask has seen) starts the grammar over
    assert torch.equal(torch.isfinite(fresh(answer[:2], torch.zeros(width))),
                       torch.isfinite(backend.logits_processor(compiled)(answer[:2], torch.zeros(width))))
    with pytest.raises(RequestError, match="does not fit"):
        backend.logits_processor(compiled)(tokenizer.encode("[", add_special_tokens=False), torch.zeros(width))


def test_bad_schema_is_a_request_error(tokenizer):
    backend = GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    with pytest.raises(RequestError) as info:
        backend.compile(JsonConstraint({"type": "object", "properties": {"a": {"type": "no-such-type"}}}))
    assert info.value.param == "response_format"
    backend.compile(JsonConstraint(JSON_OBJECT_SCHEMA))


# ----- through the server -------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_json_object_answers_parse(client):
    """The random model writes whatever the mask lets through; every finished answer is a
    JSON object, and an answer cut by max_tokens is still the beginning of one."""
    stopped = 0
    for seed in range(4):
        response = client.chat.completions.create(
            model="tiny-qwen3_5", messages=ASK, response_format={"type": "json_object"},
            max_tokens=400, seed=seed, extra_body=NO_THINKING)
        choice = response.choices[0]
        if choice.finish_reason == "stop":
            stopped += 1
            assert isinstance(json.loads(choice.message.content), dict), choice.message.content
        else:
            assert choice.finish_reason == "length"
            assert choice.message.content.lstrip().startswith("{")
    assert stopped, "no seed finished its object within 400 tokens"


@pytest.mark.timeout(300)
def test_json_schema_answers_validate(client):
    """A bounded schema (enum, integer range, no other keys, whitespace runs capped) always
    finishes within the budget and validates."""
    for seed in (0, 1, 2):
        response = client.chat.completions.create(
            model="tiny-qwen3_5", messages=ASK, response_format=WEATHER_FORMAT, max_tokens=400,
            seed=seed, extra_body=NO_THINKING)
        assert response.choices[0].finish_reason == "stop"
        check_weather_arguments(json.loads(response.choices[0].message.content))
    several = client.chat.completions.create(  # each choice has its own grammar state
        model="tiny-qwen3_5", messages=ASK, response_format=WEATHER_FORMAT, max_tokens=400, seed=5,
        n=3, extra_body=NO_THINKING)
    assert len(several.choices) == 3
    for choice in several.choices:
        assert choice.finish_reason == "stop"
        check_weather_arguments(json.loads(choice.message.content))
    chunks = list(client.chat.completions.create(
        model="tiny-qwen3_5", messages=ASK, response_format=WEATHER_FORMAT, max_tokens=400, seed=7,
        stream=True, extra_body=NO_THINKING))
    deltas, reasons = sse_deltas(chunks)
    assert reasons[-1] == "stop"
    check_weather_arguments(json.loads(add_up(deltas)["content"]))


@pytest.mark.timeout(300)
def test_schema_applies_after_the_reasoning(tiny_model):
    """With a reasoning parser and thinking on, the think block is free and the JSON follows
    it: a scripted thought, then the masked random model."""
    engine = make_engine(tiny_model, max_model_len=1024)
    engine.sampler = ScriptedSampler(engine, "Paris, probably sunny.\n</think>\n\n", then_free=True)
    with BackgroundServer(engine, chat_options=ChatOptions(reasoning_parser="qwen3")) as srv:
        scripted = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        response = scripted.chat.completions.create(
            model="tiny-qwen3_5", messages=ASK, response_format=WEATHER_FORMAT, max_tokens=400, seed=0)
        message = response.choices[0].message
        assert message.reasoning_content == "Paris, probably sunny."
        check_weather_arguments(json.loads(message.content))


def test_refusals_name_the_field(server, monkeypatch):
    def post(**body):
        body = {"model": "tiny-qwen3_5", "messages": ASK, "max_tokens": 4, **body}
        return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)

    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    cases = [({"response_format": bad_schema}, "response_format"),
             ({"response_format": {"type": "json_schema"}}, "response_format"),
             ({"response_format": {"type": "yaml"}}, "response_format"),
             ({"guided_json": {"type": "object"}}, "guided_json"),  # vLLM's extensions: not ignored
             ({"structured_outputs": {"regex": "a+"}}, "structured_outputs")]
    for body, param in cases:
        response = post(**body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert post(response_format={"type": "text"}).status_code == 200

    def missing():
        raise StructuredOutputUnavailable("structured output needs the xgrammar package")

    monkeypatch.setattr("onecat.runtime.server.structured_output.import_xgrammar", missing)
    response = post(response_format={"type": "json_object"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "response_format"
    assert "xgrammar" in response.json()["error"]["message"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mask_on_cuda_matches_cpu(tokenizer):
    """The mask is applied on the logits' device: CUDA logits get the same allowed set."""
    backend = GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    compiled = backend.compile(JsonConstraint(WEATHER_PARAMETERS))
    answer = tokenizer.encode('{"city": "Rome", "days": 9}', add_special_tokens=False)
    on_cpu, on_gpu = backend.logits_processor(compiled), backend.logits_processor(compiled)
    for step in range(len(answer) + 1):
        logits = torch.randn(len(tokenizer) + 64)
        want = on_cpu(answer[:step], logits.clone())
        got = on_gpu(answer[:step], logits.cuda()).cpu()
        assert torch.equal(torch.isfinite(got), torch.isfinite(want)), step
        assert torch.equal(got[torch.isfinite(got)], want[torch.isfinite(want)])
