"""Grammar compilation as bounded work (issue 43, item 1), on the trained tiny Qwen3.5 served
over loopback: pathological schemas (a nested regex repetition that takes xgrammar 80 s, a
tool with 2000 optional parameters) get a 400 naming the field once the budget is spent,
plain chats keep answering within a second meanwhile, a compile is killed when its client
leaves, compiled grammars are cached, and refused schemas name their keyword."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

pytest.importorskip("xgrammar")
pytest.importorskip("fastapi")
pytestmark = pytest.mark.timeout(120)

from server_helpers import HELLO, make_engine  # noqa: E402

from onecat.runtime.server.chat_plan import ChatOptions  # noqa: E402
from onecat.runtime.server.launcher import BackgroundServer  # noqa: E402
from onecat.tiny_train import fixture_dir  # noqa: E402

TRAINED = fixture_dir("qwen3_5")
BUDGET = 4.0
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def pathological(n: int) -> dict:
    """A 216-byte response_format whose regex takes xgrammar minutes (``n`` varies the key)."""
    pattern = f"(((a{{0,{n}}}){{0,{n}}}){{0,{n}}}){{0,{n}}}"
    return {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "string", "pattern": pattern}}}


@pytest.fixture(scope="module")
def server():
    engine = make_engine(TRAINED, max_model_len=512, max_num_seqs=8)
    options = ChatOptions(tool_call_parser="qwen3_coder")
    with BackgroundServer(engine, chat_options=options, grammar_compile_timeout=BUDGET) as srv:
        yield srv


def pool(server):
    return server.app.state.serving._grammar[1]


def chat(url: str, timeout: float = 60, **body) -> httpx.Response:
    body = {"messages": HELLO, "max_tokens": 4, "temperature": 0, **NO_THINKING, **body}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)


def test_plain_chats_answer_while_pathological_grammars_compile(server):
    """Three pathological compiles (two in the workers, one queued) run while 20 plain chats
    each answer within 1 s; then each pathological request is a 400 naming response_format."""
    assert chat(server.url, response_format={"type": "json_object"}).status_code == 200  # workers up
    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda n=n: answers.append(chat(server.url, response_format=pathological(n))))
               for n in (12, 13, 14)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while not pool(server)._busy:  # the compiles have reached the workers
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for _ in range(20):
        started = time.monotonic()
        response = chat(server.url)
        assert response.status_code == 200, response.text
        assert time.monotonic() - started < 1.0, "a plain chat waited behind a grammar compile"
    assert pool(server)._busy, "the compiles ended before the plain chats did: nothing was shown"
    for thread in threads:
        thread.join(60)
    assert len(answers) == 3
    for response in answers:
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "response_format", response.text
        assert error["code"] == "schema_too_complex" and "too complex" in error["message"]
    started = time.monotonic()  # the same schema again: remembered, answered at once
    again = chat(server.url, response_format=pathological(12))
    assert again.status_code == 400 and time.monotonic() - started < 1.0


def test_tool_with_thousands_of_parameters_is_too_complex(server):
    props = {f"p{i}": {"type": "string"} for i in range(2000)}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": props}}}]
    started = time.monotonic()
    response = chat(server.url, tools=tools, tool_choice="required")
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tools"
    assert response.json()["error"]["code"] == "schema_too_complex"
    assert time.monotonic() - started < BUDGET + 10


def test_compiled_grammars_are_cached(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    first = chat(server.url, response_format=fmt, max_tokens=20)
    assert first.status_code == 200, first.text
    compiled = pool(server).cached(next(reversed(pool(server)._cache)))
    second = chat(server.url, response_format=fmt, max_tokens=20)
    assert second.status_code == 200
    assert pool(server).cached(next(reversed(pool(server)._cache))) is compiled


def test_a_compile_is_killed_when_its_client_leaves(server):
    """The client gives up after 1 s, long before the budget: its worker is killed then."""
    chat(server.url, response_format={"type": "json_object"})  # workers up
    before = {w.process.pid for w in pool(server)._idle}
    with pytest.raises(httpx.ReadTimeout):
        chat(server.url, timeout=1.0, response_format=pathological(11))
    deadline = time.monotonic() + BUDGET - 1.5
    while pool(server)._busy:
        assert time.monotonic() < deadline, "the compile outlived its client"
        time.sleep(0.05)
    pids = {w.process.pid for w in pool(server)._idle}
    assert pids != before  # the busy worker was replaced
    assert chat(server.url).status_code == 200


def test_refused_schemas_name_the_keyword(server):
    cases = [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "minItems": 3}, "#/uniqueItems"),
        ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}, "#/properties/a/$ref"),
        ({"type": "string", "const": "abc", "pattern": "^x$"}, "#/pattern"),
    ]
    for schema, pointer in cases:
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        response = chat(server.url, response_format=fmt)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "response_format" and pointer in error["message"], error


def test_shutdown_ends_a_running_compile():
    """A server stopping with a compile in flight (budget far away) answers it 503 at once,
    kills its worker and stops well within its shutdown timeout."""
    engine = make_engine(TRAINED, max_model_len=512)
    srv = BackgroundServer(engine, grammar_compile_timeout=600, shutdown_timeout=5).start()
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(chat(srv.url, response_format=pathological(10))))
    try:
        thread.start()
        deadline = time.monotonic() + 20
        while srv.app.state.serving._grammar is None or not pool(srv)._busy:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        workers = [w.process for w in pool(srv)._busy]
        started = time.monotonic()
    finally:
        srv.stop()
    assert time.monotonic() - started < 5
    thread.join(10)
    assert answers and answers[0].status_code == 503, answers
    assert all(process.poll() is not None for process in workers)
    assert pool(srv).live_workers == 0
