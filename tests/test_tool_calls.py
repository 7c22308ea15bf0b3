"""Tool calls (vLLM's --enable-auto-tool-choice / --tool-call-parser): the qwen3_coder
(Qwen3.5) and hermes parsers on known outputs, whole and streamed split at every position;
then through the real server with the official openai client: calls forced by tool_choice
(a named function, "required") under the grammar mask on the random tiny Qwen3.5, calls the
model chose (tool_choice "auto") on a scripted output, and the 400s."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("pydantic")  # the server modules below need it (the GPU machine may lack it)
from chat_output_helpers import (
    TOOLS,
    ScriptedSampler,
    add_up,
    check_every_split,
    check_weather_arguments,
    sse_deltas,
    stream,
)
from click.testing import CliRunner
from server_helpers import make_engine

from onecat.runtime.server.chat_output import ChatOutputParser, message_fields
from onecat.runtime.server.chat_plan import ChatOptions
from onecat.runtime.server.launcher import BackgroundServer
from onecat.runtime.server.reasoning import Qwen3ReasoningParser, ReasoningState
from onecat.runtime.server.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    JsonToolCallParser,
    Qwen3CoderToolParser,
)
from onecat.tiny import QWEN3_5_CHAT_TEMPLATE, build_tiny_model

QWEN_CALLS = (
    "I will check both.\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>"
)
HERMES_CALLS = (
    "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\", \"days\": 2}}\n</tool_call>"
)


def qwen(parallel: bool = True) -> ChatOutputParser:
    return ChatOutputParser(None, Qwen3CoderToolParser(TOOLS), single_call=not parallel)


# ----- parsers ----------------------------------------------------------------------------


def test_qwen3_coder_parses_calls_and_content():
    message = message_fields(qwen().parse(QWEN_CALLS, final=True))
    assert message["content"] == "I will check both."
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert calls == [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"])
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    only_first = message_fields(qwen(parallel=False).parse(QWEN_CALLS, final=True))
    assert [c["function"]["name"] for c in only_first["tool_calls"]] == ["get_weather"]


def test_qwen3_coder_reads_what_the_qwen3_5_template_writes():
    """A call rendered by Qwen3.5's template (the tiny model's copy of its structure) parses
    back to the same name and arguments, values typed by the tool's schema."""
    from jinja2 import Environment

    tools = [{"type": "function", "function": {"name": "plan", "parameters": {"type": "object", "properties": {
        "title": {"type": "string"}, "n": {"type": "integer"}, "ratio": {"type": "number"},
        "ok": {"type": "boolean"}, "tags": {"type": "array"}, "meta": {"type": "object"},
        "maybe": {"type": ["integer", "null"]}}}}}]
    arguments = {"title": "multi\nline  text", "n": 12, "ratio": 0.25, "ok": False, "tags": ["a", "b"],
                 "meta": {"k": [1, {"x": None}]}, "maybe": None}
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": "plan", "arguments": arguments}}]}]
    env = Environment()
    env.filters["tojson"] = lambda v: json.dumps(v)
    env.filters["items"] = lambda v: list(v.items())
    rendered = env.from_string(QWEN3_5_CHAT_TEMPLATE).render(messages=messages, tools=tools)
    answer = rendered.split("<|im_start|>assistant\n", 1)[1].split("<|im_end|>")[0]
    parsed = message_fields(ChatOutputParser(None, Qwen3CoderToolParser(tools)).parse(answer, final=True))
    assert parsed["content"] is None
    (call,) = parsed["tool_calls"]
    assert call["function"]["name"] == "plan"
    assert json.loads(call["function"]["arguments"]) == arguments


def test_qwen3_coder_value_conversions_follow_the_schema():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "i": {"type": "integer"}, "x": {"type": "number"}, "b": {"type": "boolean"},
        "e": {"type": "string", "enum": ["A", "B"]}, "s": {"type": "string"}, "bad": {"type": "integer"}}}}}]
    text = ("<tool_call>\n<function=f>\n<parameter=i>\n-4\n</parameter>\n<parameter=x>\n2.0\n</parameter>\n"
            "<parameter=b>\nTrue\n</parameter>\n<parameter=e>\n  B \n</parameter>\n<parameter=s>\n 42 \n</parameter>\n"
            "<parameter=bad>\nmany\n</parameter>\n<parameter=extra>\n[1]\n</parameter>\n</function>\n</tool_call>")
    message = message_fields(ChatOutputParser(None, Qwen3CoderToolParser(tools)).parse(text, final=True))
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {
        "i": -4, "x": 2, "b": True, "e": "B", "s": " 42 ", "bad": "many", "extra": "[1]"}


def test_malformed_and_truncated_calls():
    parser = qwen()
    # a missing </parameter>: the next parameter tag ends the value
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n5\n"
            "</parameter>\n</function>\n</tool_call>")
    (call,) = message_fields(parser.parse(text, final=True))["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "days": 5}
    # cut by max_tokens inside a value: what was written is kept, the JSON is closed
    (call,) = message_fields(parser.parse("<tool_call>\n<function=get_weather>\n<parameter=city>\nRo", True))["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Ro"}
    # no <function=...>: not a call; no call at all: plain content
    assert "tool_calls" not in message_fields(parser.parse("<tool_call>\noops\n</tool_call>", True))
    assert message_fields(parser.parse("plain answer\n\n", True)) == {"role": "assistant", "content": "plain answer\n\n"}
    # a hermes block that is not JSON is not a call
    hermes = ChatOutputParser(None, HermesToolParser(TOOLS))
    assert "tool_calls" not in message_fields(hermes.parse("<tool_call>\n{\"name\": \n</tool_call>", True))


def test_hermes_parses_json_calls():
    message = message_fields(ChatOutputParser(None, HermesToolParser(TOOLS)).parse(HERMES_CALLS, True))
    assert message["content"] == "Checking."
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome", "days": 2}


@pytest.mark.parametrize("name,text", [("qwen3_coder", QWEN_CALLS), ("hermes", HERMES_CALLS),
                                       ("qwen3_coder", "no call, just <tool text\n"),
                                       ("qwen3_coder", QWEN_CALLS[:150])])
def test_streamed_calls_add_up_at_every_split(name, text):
    expected = check_every_split(lambda: ChatOutputParser(None, TOOL_PARSERS[name](TOOLS)), text)
    if text in (QWEN_CALLS, HERMES_CALLS):
        assert expected["calls"], expected


def test_streamed_qwen3_coder_sends_name_first_then_arguments_by_parameter():
    deltas = stream(qwen(), list(QWEN_CALLS))
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": "{"} and calls[0]["id"].startswith("call_")
    assert [c["function"]["arguments"] for c in calls[1:4]] == ['"city": "Paris"', ', "days": 3', "}"]
    assert add_up(deltas)["content"] == "I will check both."


def test_reasoning_then_calls():
    """A tool call inside the think block ends the reasoning (Qwen3.5 may skip </think>)."""
    def make():
        return ChatOutputParser(Qwen3ReasoningParser(ReasoningState.IN_REASONING), Qwen3CoderToolParser(TOOLS))

    text = "Need the weather.\n" + QWEN_CALLS[QWEN_CALLS.index("<tool_call>"):]
    expected = check_every_split(make, text)
    assert expected["reasoning"] == "Need the weather."
    assert [n for n, _ in expected["calls"]] == ["get_weather", "get_time"]


# ----- through the server -------------------------------------------------------------------



JSON_CALLS = ('[ {"name": "get_weather", "parameters": {"city": "Paris", "days": 3}},\n'
              '{"name":"get_time","parameters":{ "zone" : "C\\"ET" }} ]')


def test_json_calls_without_a_parser_parse_and_stream_at_every_split():
    """Forced calls without --tool-call-parser (vLLM's JSON): an array of {name, parameters}
    (arguments: each object's own parameters text) and a named function's arguments; the
    streamed deltas add up to the whole message at every split."""
    message = check_every_split(lambda: ChatOutputParser(None, JsonToolCallParser(TOOLS)), JSON_CALLS)
    assert message["content"] == ""
    assert [(n, json.loads(a)) for n, a in message["calls"]] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": 'C"ET'})]
    named = check_every_split(lambda: ChatOutputParser(None, JsonToolCallParser(TOOLS, "get_weather")),
                              '{"city": "Rome", "days": 2}')
    assert named["calls"] == [("get_weather", '{"city": "Rome", "days": 2}')]
    cut = JsonToolCallParser(TOOLS).parse('[{"name": "get_weather", "parameters": {"city": "Pa', final=False)
    assert cut.calls[0].name == "get_weather" and cut.calls[0].arguments == '{"city": "Pa'
    assert JsonToolCallParser(TOOLS).parse("not json", final=True).content == "not json"  # never raises


def test_json_tool_schemas_are_vllms():
    from onecat.runtime.server.structured_output import ToolJsonConstraint

    named = ToolJsonConstraint(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert named.schema == TOOLS[0]["function"]["parameters"]
    required = ToolJsonConstraint(TOOLS, "required", parallel_tool_calls=False).schema
    assert required["type"] == "array" and required["minItems"] == 1 and required["maxItems"] == 1
    first = required["items"]["anyOf"][0]
    assert first["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert first["required"] == ["name", "parameters"]


def server_deps():
    """The openai client module; skips the test where the server's packages are missing."""
    for name in ("fastapi", "uvicorn", "xgrammar"):
        pytest.importorskip(name)
    return pytest.importorskip("openai")



NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
PARSERS = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="qwen3_coder", reasoning_parser="qwen3")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    server_deps()
    return build_tiny_model("qwen3_5", tmp_path_factory.mktemp("tools") / "tiny-qwen3_5")


@pytest.fixture(scope="module")
def server(tiny_model):
    engine = make_engine(tiny_model, max_model_len=1024)
    with BackgroundServer(engine, chat_options=PARSERS) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server_deps().OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.timeout(300)
def test_named_tool_choice_is_a_call_of_that_function(client):
    for seed in (0, 1):
        response = client.chat.completions.create(
            model="tiny-qwen3_5", messages=ASK, tools=TOOLS, max_tokens=400, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, extra_body=NO_THINKING,
        )
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        check_weather_arguments(json.loads(call.function.arguments))
        assert not choice.message.content


@pytest.mark.timeout(300)
def test_required_tool_choice_streams_call_deltas(client):
    chunks = list(client.chat.completions.create(
        model="tiny-qwen3_5", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=400, seed=3, stream=True, extra_body=NO_THINKING,
    ))
    deltas, reasons = sse_deltas(chunks)
    assert reasons[-1] == "tool_calls" and all(r is None for r in reasons[:-1])
    message = add_up(deltas)
    assert len(message["calls"]) == 1 and message["content"] == ""
    name, arguments = message["calls"][0]
    assert name in ("get_weather", "get_time")
    parsed = json.loads(arguments)
    if name == "get_weather":
        check_weather_arguments(parsed)
    else:
        assert parsed in ({"zone": "UTC"}, {"zone": "CET"})
    assert sum("tool_calls" in d for d in deltas) >= 2, "the name comes first, then the arguments"


@pytest.mark.timeout(300)
def test_auto_tool_choice_parses_the_model_calls(tiny_model):
    """tool_choice auto (the default with tools): a scripted answer with two calls comes back
    as tool_calls, whole and as stream deltas; the template got the tools."""
    engine = make_engine(tiny_model, max_model_len=1024)
    engine.sampler = ScriptedSampler(engine, QWEN_CALLS)
    with BackgroundServer(engine, chat_options=PARSERS) as srv:
        scripted = server_deps().OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        response = scripted.chat.completions.create(
            model="tiny-qwen3_5", messages=ASK, tools=TOOLS, max_tokens=200, extra_body=NO_THINKING)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "I will check both."
        got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
        assert got == [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})]
        assert response.usage.prompt_tokens > 60, "the tools were rendered into the prompt"

        deltas, reasons = sse_deltas(scripted.chat.completions.create(
            model="tiny-qwen3_5", messages=ASK, tools=TOOLS, max_tokens=200, stream=True, extra_body=NO_THINKING))
        streamed = add_up(deltas)
        assert reasons[-1] == "tool_calls"
        assert streamed["content"] == "I will check both."
        assert [(n, json.loads(a)) for n, a in streamed["calls"]] == got

        # tool_choice none: the same answer is plain content
        plain = scripted.chat.completions.create(
            model="tiny-qwen3_5", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=200,
            extra_body=NO_THINKING)
        assert plain.choices[0].message.content == QWEN_CALLS and not plain.choices[0].message.tool_calls

        # a conversation with the calls and their results renders and runs
        follow_up = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": "{\"city\": \"Paris\", \"days\": 3}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
        again = scripted.chat.completions.create(model="tiny-qwen3_5", messages=follow_up, tools=TOOLS,
                                                 max_tokens=200, extra_body=NO_THINKING)
        assert again.choices[0].message.tool_calls


def test_unsupported_combinations_are_400s_naming_the_field(server, tiny_model):
    def post(srv_url: str, **body):
        body = {"model": "tiny-qwen3_5", "messages": ASK, "max_tokens": 4, **body}
        return httpx.post(srv_url + "/v1/chat/completions", json=body, timeout=60)

    named = {"type": "function", "function": {"name": "get_weather"}}
    cases = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": named, "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ]
    for body, param in cases:
        response = post(server.url, **body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param, (body, response.text)

    plain = make_engine(tiny_model, max_model_len=1024)  # a server without the flags
    with BackgroundServer(plain) as srv:
        for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
            response = post(srv.url, **body)
            assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice", response.text
            assert "--tool-call-parser" in response.json()["error"]["message"]
        assert post(srv.url, tools=TOOLS, tool_choice="none").status_code == 200


def test_cli_flags_are_checked_and_reach_vllm(tmp_path, monkeypatch):
    from onecat.cli import main

    calls = []

    class Replaced(Exception):
        pass

    def fake_serve(artifact, **kwargs):
        calls.append(kwargs["vllm_args"])
        raise Replaced

    monkeypatch.setattr("onecat.vllm_plugin.launcher.serve_from_onecat_flags", fake_serve)
    runner = CliRunner()
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3"]
    runner.invoke(main, ["serve", str(tmp_path), "--engine", "vllm", *flags])
    assert calls == [tuple(flags)]
    unknown = runner.invoke(main, ["serve", str(tmp_path), "--tool-call-parser", "mistral"])
    assert unknown.exit_code == 1 and "qwen3_coder" in unknown.output
    lonely = runner.invoke(main, ["serve", str(tmp_path), "--enable-auto-tool-choice"])
    assert lonely.exit_code == 1 and "--tool-call-parser" in lonely.output


@pytest.mark.parametrize("parser", ["qwen3_coder", "hermes"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_in_each_format_parse_back(tiny_model, parser, choice):
    """The grammar that forces a call writes it in the parser's own format: random logits
    under the mask always end in a call the parser reads (every format, every forcing)."""
    import torch
    from transformers import AutoTokenizer

    from onecat.runtime.server.structured_output import GrammarBackend, ToolCallConstraint

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    backend = GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    compiled = backend.compile(ToolCallConstraint(parser, TOOLS, choice, parallel_tool_calls=False))
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        processor, out = backend.logits_processor(compiled), []
        while not out or out[-1] != tokenizer.eos_token_id:
            assert len(out) < 600, "the forced call did not end"
            logits = processor(out, torch.randn(len(tokenizer), generator=generator) * 4)
            out.append(int(torch.multinomial(logits.softmax(-1), 1, generator=generator)))
        text = tokenizer.decode(out[:-1])
        message = message_fields(ChatOutputParser(None, TOOL_PARSERS[parser](TOOLS)).parse(text, final=True))
        (call,) = message["tool_calls"]
        arguments = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "get_weather":
            check_weather_arguments(arguments)
        else:
            assert choice == "required" and arguments in ({"zone": "UTC"}, {"zone": "CET"})


@pytest.fixture(scope="module")
def plain_client(tiny_model):
    """A server without --tool-call-parser (forced calls are JSON, as in vLLM)."""
    with BackgroundServer(make_engine(tiny_model, max_model_len=1024)) as srv:
        yield server_deps().OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.timeout(300)
def test_named_tool_choice_without_a_parser_is_json_arguments(plain_client):
    """The random model's answer is constrained to the function's parameters schema, so the
    arguments are always valid; whole and streamed."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = plain_client.chat.completions.create(
        model="tiny-qwen3_5", messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=200, seed=0,
        extra_body=NO_THINKING)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_") and not choice.message.content
    check_weather_arguments(json.loads(call.function.arguments))

    deltas, reasons = sse_deltas(plain_client.chat.completions.create(
        model="tiny-qwen3_5", messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=200, seed=1, stream=True,
        extra_body=NO_THINKING))
    message = add_up(deltas)
    assert reasons[-1] == "tool_calls" and message["content"] == "" and message["ids"][0].startswith("call_")
    ((name, arguments),) = message["calls"]
    assert name == "get_weather"
    check_weather_arguments(json.loads(arguments))


@pytest.mark.timeout(300)
def test_required_tool_choice_without_a_parser_is_a_json_array_of_calls(plain_client):
    for stream_it, parallel in ((False, True), (True, False)):
        kwargs = dict(model="tiny-qwen3_5", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=300,
                      seed=2, parallel_tool_calls=parallel, extra_body=NO_THINKING)
        if stream_it:
            deltas, reasons = sse_deltas(plain_client.chat.completions.create(stream=True, **kwargs))
            message, reason = add_up(deltas), reasons[-1]
            calls = message["calls"]
            assert len(calls) == 1 and len(set(message["ids"])) == 1
        else:
            choice = plain_client.chat.completions.create(**kwargs).choices[0]
            reason = choice.finish_reason
            calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
            assert len({c.id for c in choice.message.tool_calls}) == len(calls) >= 1
        assert reason == "tool_calls"
        for name, arguments in calls:
            parsed = json.loads(arguments)
            if name == "get_weather":
                check_weather_arguments(parsed)
            else:
                assert name == "get_time" and parsed in ({"zone": "UTC"}, {"zone": "CET"})
