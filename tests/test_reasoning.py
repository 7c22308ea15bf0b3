"""Reasoning (vLLM's --reasoning-parser qwen3): the think block split off into
reasoning_content, on known outputs (whole, and streamed split at every position) for both
Qwen template styles, then through the real server with the openai client on scripted
answers, with thinking on and with ``chat_template_kwargs: {"enable_thinking": false}``."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # the server modules below need it (the GPU machine may lack it)
from chat_output_helpers import ScriptedSampler, add_up, check_every_split, sse_deltas
from server_helpers import make_engine

from onecat.runtime.server.chat_output import ChatOutputParser, message_fields
from onecat.runtime.server.chat_plan import ChatOptions
from onecat.runtime.server.launcher import BackgroundServer
from onecat.runtime.server.reasoning import Qwen3ReasoningParser, ReasoningState, initial_state
from onecat.tiny import QWEN3_5_CHAT_TEMPLATE, build_tiny_model

IN, ANSWER, OPENS = ReasoningState.IN_REASONING, ReasoningState.ANSWER, ReasoningState.MODEL_OPENS


def parse(state: ReasoningState, text: str) -> dict:
    return message_fields(ChatOutputParser(Qwen3ReasoningParser(state), None).parse(text, final=True))


def test_initial_state_follows_the_prompt():
    from jinja2 import Environment

    template = Environment().from_string(QWEN3_5_CHAT_TEMPLATE)
    messages = [{"role": "user", "content": "hi"}]
    assert initial_state(template.render(messages=messages, add_generation_prompt=True)) is IN
    closed = template.render(messages=messages, add_generation_prompt=True, enable_thinking=False)
    assert closed.endswith("<think>\n\n</think>\n\n") and initial_state(closed) is ANSWER
    assert initial_state("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n") is OPENS


@pytest.mark.parametrize("state,text,reasoning,content", [
    # Qwen3.5: the prompt opened the block; the output closes it
    (IN, "Paris is in France.\n</think>\n\nIt is sunny.", "Paris is in France.", "It is sunny."),
    (IN, "still thinking when max_tokens hit", "still thinking when max_tokens hit", None),
    (IN, "\n</think>\n\nDirect.", None, "Direct."),  # an empty think block
    (IN, "<tool_call> ends it", None, "<tool_call> ends it"),
    # thinking disabled: the prompt closed the block
    (ANSWER, "All answer, even </think> here.", None, "All answer, even </think> here."),
    # older Qwen3 templates: the model opens the block itself, or does not
    (OPENS, "<think>\nhmm\n</think>\n\nyes", "hmm", "yes"),
    (OPENS, "no block at all", None, "no block at all"),
])
def test_split(state, text, reasoning, content):
    message = parse(state, text)
    assert message.get("reasoning_content") == reasoning
    assert message["content"] == content
    assert ("reasoning_content" in message) == (state is not ANSWER and (state is IN or text.startswith("<think>")))


@pytest.mark.parametrize("state,text", [
    (IN, "Let me think.\nStep two.\n</think>\n\nThe answer\nis 4."),
    (IN, "cut mid-thought </thi"),
    (OPENS, "<think>\nhmm\n</think>\n\nyes"),
    (OPENS, "<thin is not a tag"),
    (ANSWER, "plain\n</think>"),
])
def test_streamed_reasoning_adds_up_at_every_split(state, text):
    check_every_split(lambda: ChatOutputParser(Qwen3ReasoningParser(state), None), text)


# ----- through the server -------------------------------------------------------------------



def server_deps():
    """The openai client module; skips the test where the server's packages are missing."""
    for name in ("fastapi", "uvicorn"):
        pytest.importorskip(name)
    return pytest.importorskip("openai")



THOUGHT = "The user asks about Paris.\nCheck the forecast.\n</think>\n\nSunny, 24 degrees."
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    server_deps()
    return build_tiny_model("qwen3_5", tmp_path_factory.mktemp("reasoning") / "tiny-qwen3_5")


@pytest.mark.timeout(300)
def test_reasoning_content_through_the_server(tiny_model):
    engine = make_engine(tiny_model)
    engine.sampler = ScriptedSampler(engine, THOUGHT)
    with BackgroundServer(engine, chat_options=ChatOptions(reasoning_parser="qwen3")) as srv:
        client = server_deps().OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        response = client.chat.completions.create(model="tiny-qwen3_5", messages=ASK, max_tokens=100)
        message = response.choices[0].message
        assert message.reasoning_content == "The user asks about Paris.\nCheck the forecast."
        assert message.content == "Sunny, 24 degrees."
        assert response.choices[0].finish_reason == "stop"

        deltas, reasons = sse_deltas(client.chat.completions.create(
            model="tiny-qwen3_5", messages=ASK, max_tokens=100, stream=True))
        streamed = add_up(deltas)
        assert streamed["reasoning"] == message.reasoning_content and streamed["content"] == message.content
        assert reasons[-1] == "stop"
        assert sum("reasoning_content" in d for d in deltas) > 3, "reasoning is streamed as it comes"

        # enable_thinking false: the template closes the block, the whole answer is content
        off = client.chat.completions.create(model="tiny-qwen3_5", messages=ASK, max_tokens=100,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert off.choices[0].message.content == THOUGHT
        assert getattr(off.choices[0].message, "reasoning_content", None) is None
        assert off.usage.prompt_tokens > response.usage.prompt_tokens  # "<think>\n\n</think>\n\n"

    # without --reasoning-parser the think block stays in the content
    engine = make_engine(tiny_model)
    engine.sampler = ScriptedSampler(engine, THOUGHT)
    with BackgroundServer(engine) as srv:
        client = server_deps().OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        plain = client.chat.completions.create(model="tiny-qwen3_5", messages=ASK, max_tokens=100)
        assert plain.choices[0].message.content == THOUGHT
