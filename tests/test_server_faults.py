"""Fault tests of `onecat serve` (issue 10) on CPU: a real uvicorn server over the real engine
on a tiny random Qwen3.5. One request must not take the server down or stall it: numbers the
engine cannot take and invalid Unicode are 400s naming the field, an exception inside one
request's engine step fails that request only, a request's own chat template is refused
unless trusted, an oversized body is a 413, tokenisation runs off the event loop, a client
that leaves during prefill frees everything. After each, the server keeps serving and every
KV block and state slot is back in its pool.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytestmark = pytest.mark.timeout(180)

from server_helpers import (  # noqa: E402
    HELLO,
    assert_all_free,
    assert_metrics_idle,
    make_engine,
    sse_payloads,
    stream_lines,
    wait_idle,
)

from onecat.runtime.server.launcher import BackgroundServer  # noqa: E402
from onecat.tiny import build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model("qwen3_5", tmp_path_factory.mktemp("faults") / "tiny-qwen3_5")


@pytest.fixture(scope="module")
def server(tiny_model):
    with BackgroundServer(make_engine(tiny_model, max_num_seqs=16)) as srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def post_raw(client: httpx.Client, path: str, raw: str | bytes) -> httpx.Response:
    return client.post(path, content=raw, headers={"Content-Type": "application/json"})


def assert_still_serving(client: httpx.Client, server) -> None:
    """A normal sampled request succeeds, /health is ok and everything is free again."""
    ok = client.post(
        "/v1/chat/completions", json={"messages": HELLO, "max_tokens": 3, "top_k": 5, "seed": 1}
    )
    assert ok.status_code == 200, ok.text
    assert client.get("/health").status_code == 200
    assert_all_free(wait_idle(server))


# ----- numbers the engine cannot take ------------------------------------------------------

CHAT = "/v1/chat/completions"
OUT_OF_RANGE = {
    "top_k 2**70": (CHAT, {"top_k": 2**70}, "top_k"),
    "top_k -2": (CHAT, {"top_k": -2}, "top_k"),
    "seed 2**64": (CHAT, {"seed": 2**64}, "seed"),
    "seed below int64": (CHAT, {"seed": -(2**63) - 1}, "seed"),
    "max_tokens 2**40": (CHAT, {"max_tokens": 2**40}, "max_tokens"),
    "max_completion_tokens 2**70": (CHAT, {"max_completion_tokens": 2**70}, "max_completion_tokens"),
    "n 2**70": (CHAT, {"n": 2**70}, "n"),
    "stop_token_ids 2**40": (CHAT, {"stop_token_ids": [5, 2**40]}, "stop_token_ids"),
    "stop_token_ids negative": (CHAT, {"stop_token_ids": [-1]}, "stop_token_ids"),
    "too many stop_token_ids": (CHAT, {"stop_token_ids": list(range(5000))}, "stop_token_ids"),
    "too many stop strings": (CHAT, {"stop": [f"s{i}" for i in range(1000)]}, "stop"),
    "prompt token 2**70": ("/v1/completions", {"prompt": [1, 2**70]}, "prompt"),
    "prompt token beyond the vocabulary": ("/v1/completions", {"prompt": [1, 10**9]}, "prompt"),
}


@pytest.mark.parametrize("case", list(OUT_OF_RANGE))
def test_out_of_range_number_is_400_naming_the_field(client, server, case):
    path, fields, param = OUT_OF_RANGE[case]
    body = {"prompt": "def"} if path.endswith("/completions") and "chat" not in path else {"messages": HELLO}
    response = client.post(path, json={**body, "max_tokens": 2, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert_still_serving(client, server)


@pytest.mark.parametrize("literal", ["Infinity", "-Infinity", "NaN"])
def test_non_finite_float_is_400(client, server, literal):
    raw = '{"messages": [{"role": "user", "content": "hi"}], "temperature": ' + literal + "}"
    response = post_raw(client, CHAT, raw)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "temperature"
    assert_still_serving(client, server)


SURROGATES = {
    "chat content": (CHAT, '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
    "chat content part": (
        CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}', "messages"),
    "completion prompt": ("/v1/completions", '{"prompt": "x\\udc00y"}', "prompt"),
    "stop string": (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud83d"]}', "stop"),
    "model name": (CHAT, '{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "model"),
    "template kwarg": (
        CHAT, '{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": "\\ud800"}}',
        "chat_template_kwargs"),
}


@pytest.mark.parametrize("case", list(SURROGATES))
def test_lone_surrogate_is_400(client, server, case):
    path, raw, param = SURROGATES[case]
    response = post_raw(client, path, raw)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "Unicode" in error["message"], error
    assert_still_serving(client, server)


def test_500_says_internal_error_with_a_request_id_in_the_log(client, server, monkeypatch, caplog):
    serving_text_ids = "onecat.runtime.server.openai_serving.text_token_ids"

    def broken(tokenizer, prompt):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(serving_text_ids, broken)
    with caplog.at_level(logging.ERROR, logger="onecat"):
        response = client.post("/v1/completions", json={"prompt": "def", "max_tokens": 2})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert "secret" not in error["message"] and "RuntimeError" not in error["message"]
    request_id = error["message"].split("request id ")[1].rstrip(")")
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and logged[0].exc_info and "secret internals" in str(logged[0].exc_info[1])
    monkeypatch.undo()
    assert_still_serving(client, server)


# ----- an exception inside one request's engine step ---------------------------------------

POISON_DETOKENIZER = 13  # max_tokens that marks a request whose detokenizer raises
POISON_SAMPLER = 0.123  # top_p that marks a request whose sampling raises


@pytest.fixture(scope="module")
def faulty_server(tiny_model):
    """A server whose engine fails marked requests inside its step: the detokenizer of a
    request with max_tokens 13 raises at its third token, the batched sampler raises on a
    batch holding a request with top_p 0.123 (and so does that row sampled alone)."""
    engine = make_engine(tiny_model, max_num_seqs=16)
    real_add, real_sampler = engine.add_request, engine.sampler

    def add_request(request_id, prompt_token_ids, params):
        real_add(request_id, prompt_token_ids, params)
        if params.max_tokens == POISON_DETOKENIZER:
            detok = engine._sequences[request_id].detokenizer
            real_append = detok.append

            def append(token_id):
                if len(detok.token_ids) >= 2:
                    raise RuntimeError(f"injected detokenizer fault in {request_id}")
                return real_append(token_id)

            detok.append = append

    class FaultySampler:
        runs_on_device = staticmethod(real_sampler.runs_on_device)

        @staticmethod
        def check(rows):
            if any(row.params.top_p == POISON_SAMPLER for row in rows):
                raise RuntimeError("injected sampler fault")

        def __call__(self, logits, rows):
            self.check(rows)
            return real_sampler(logits, rows)

        def sample_on_device(self, logits, rows):  # overlapped decode steps sample here
            self.check(rows)
            return real_sampler.sample_on_device(logits, rows)

    engine.add_request = add_request
    engine.sampler = FaultySampler()
    with BackgroundServer(engine) as srv:
        yield srv


def test_exception_in_one_requests_step_fails_that_request_only(faulty_server, caplog):
    server = faulty_server

    async def one(client: httpx.AsyncClient, i: int, **fields) -> tuple[int, list[str] | dict]:
        body = {"messages": [{"role": "user", "content": f"client {i}"}], "max_tokens": 12,
                "ignore_eos": True, "temperature": 0.7, "seed": i, **fields}
        if body.get("stream"):
            async with client.stream("POST", CHAT, json=body) as response:
                return response.status_code, [line async for line in response.aiter_lines()]
        response = await client.post(CHAT, json=body)
        return response.status_code, response.json()

    async def run_all():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(
                *(one(client, i, stream=i % 2 == 0) for i in range(6)),
                one(client, 6, stream=True, max_tokens=POISON_DETOKENIZER),
                one(client, 7, stream=False, max_tokens=POISON_DETOKENIZER),
                one(client, 8, stream=True, top_p=POISON_SAMPLER),
                one(client, 9, stream=False, top_p=POISON_SAMPLER),
            )

    with caplog.at_level(logging.ERROR, logger="onecat"):
        results = asyncio.run(run_all())
    for i, (status, result) in enumerate(results[:6]):  # the healthy ones finish normally
        assert status == 200, result
        if isinstance(result, dict):
            assert result["usage"]["completion_tokens"] == 12, result
        else:
            chunks = [json.loads(p) for p in sse_payloads(result)]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length", (i, chunks[-1])
    victims = []
    for status, result in results[6:]:
        if isinstance(result, dict):  # not streamed: a 500 naming the request id only
            assert status == 500, result
            error = result["error"]
        else:  # streamed: the 200 has been sent; an error event, then [DONE]
            assert status == 200
            error = json.loads(sse_payloads(result)[-1])["error"]
        assert error["type"] == "server_error" and error["code"] == "internal_error", error
        assert "injected" not in error["message"]
        victims.append(error["message"].split("request id ")[1].rstrip(")"))
    log = "\n".join(r.getMessage() for r in caplog.records)
    for request_id in victims:  # the log has each failed request's id, with the traceback
        record = next(r for r in caplog.records if request_id in r.getMessage())
        assert record.exc_info is not None and "injected" in str(record.exc_info[1]), log
    assert_all_free(wait_idle(server))
    assert_metrics_idle(server.url)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert_still_serving(client, server)


def test_forward_failure_fails_its_batch_and_the_engine_carries_on(tiny_model):
    engine = make_engine(tiny_model)
    real_run, failures = engine.runner.run, []

    def run(scheduled, *args):
        if any(seq.params.max_tokens == POISON_DETOKENIZER for seq, _ in scheduled) and not failures:
            failures.append(1)
            raise RuntimeError("injected forward fault")
        return real_run(scheduled, *args)

    engine.runner.run = run
    with BackgroundServer(engine) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        body = {"messages": HELLO, "max_tokens": POISON_DETOKENIZER, "stream": True}
        error = json.loads(sse_payloads(stream_lines(client, CHAT, body))[-1])["error"]
        assert error["code"] == "internal_error" and "injected" not in error["message"]
        assert failures == [1]
        assert_still_serving(client, srv)
        assert_metrics_idle(srv.url)


# ----- client disconnect during prefill -----------------------------------------------------


@pytest.fixture(scope="module")
def slow_prefill_server(tiny_model):
    """Prompts prefilled 16 tokens a step, each step slowed to 50 ms: a 200-token prompt
    stays in prefill for over half a second."""
    engine = make_engine(tiny_model, max_num_batched_tokens=16)
    real_run = engine.runner.run

    def slow_run(scheduled, *args):
        time.sleep(0.05)
        return real_run(scheduled, *args)

    engine.runner.run = slow_run
    with BackgroundServer(engine) as srv:
        yield srv


def long_prompt_ids(server) -> list[int]:
    ids = server.async_engine.tokenizer.encode("a long prompt about lists " * 60)[:200]
    assert len(ids) == 200
    return ids


def wait_prefilling(server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while server.async_engine.stats()["running"] != 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.005)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_during_prefill_frees_everything(slow_prefill_server, stream):
    server = slow_prefill_server
    before = wait_idle(server)["generation_tokens_total"]
    body = {"prompt": long_prompt_ids(server), "max_tokens": 20, "stream": stream}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        if stream:
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                wait_prefilling(server)
                # leaving the block closes the connection while the prompt is being prefilled
        else:  # the client gives up waiting (read timeout) while the prompt is prefilled
            outcome = []

            def waiter():
                try:
                    client.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
                except httpx.ReadTimeout as exc:
                    outcome.append(exc)

            thread = threading.Thread(target=waiter)
            thread.start()
            wait_prefilling(server)
            thread.join()
            assert outcome, "the request finished before the client left"
    stats = wait_idle(server)
    assert_all_free(stats)
    assert stats["generation_tokens_total"] == before, "a token was sampled: the abort came too late"
    assert_metrics_idle(server.url)


# ----- request chat templates ---------------------------------------------------------------

PLAIN_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"chat_template": PLAIN_TEMPLATE}, "chat_template"),
        ({"chat_template_kwargs": {"chat_template": PLAIN_TEMPLATE}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"return_dict": True}}, "chat_template_kwargs"),
    ],
)
def test_request_template_is_refused_without_the_flag(client, server, fields, param):
    response = client.post(CHAT, json={"messages": HELLO, "max_tokens": 2, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    if "chat_template" in {**fields, **fields.get("chat_template_kwargs", {})}:
        assert error["code"] == "chat_template_not_allowed"
        assert "--trust-request-chat-template" in error["message"]
    assert_still_serving(client, server)


def test_template_variables_are_still_accepted(client, server):
    response = client.post(
        CHAT, json={"messages": HELLO, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert response.status_code == 200, response.text


def test_request_template_is_used_with_the_flag(tiny_model):
    engine = make_engine(tiny_model)
    with BackgroundServer(engine, trust_request_chat_template=True) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as client:
        tokenizer = srv.async_engine.tokenizer
        rendered = "<user>Hello, who are you?<assistant>"
        expected = len(tokenizer.encode(rendered, add_special_tokens=False))
        default = client.post(CHAT, json={"messages": HELLO, "max_tokens": 1}).json()
        assert default["usage"]["prompt_tokens"] != expected, "pick a template unlike the model's"
        for fields in ({"chat_template": PLAIN_TEMPLATE},
                       {"chat_template_kwargs": {"chat_template": PLAIN_TEMPLATE}}):
            reply = client.post(CHAT, json={"messages": HELLO, "max_tokens": 1, **fields})
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["prompt_tokens"] == expected
        broken = client.post(CHAT, json={"messages": HELLO, "chat_template": "{% for %}"})
        assert broken.status_code == 400 and broken.json()["error"]["param"] == "messages"


# ----- body size and tokenisation off the event loop ----------------------------------------


def health_latencies(url: str, busy: threading.Thread, min_probes: int = 3) -> list[float]:
    """Probe /health every 50 ms while ``busy`` runs; the latencies of the probes answered
    while it was still running (at least ``min_probes`` of them)."""
    latencies = []
    with httpx.Client(base_url=url, timeout=30) as probe:
        while busy.is_alive() or len(latencies) < min_probes:
            start = time.monotonic()
            assert probe.get("/health").status_code == 200
            if busy.is_alive():
                latencies.append(time.monotonic() - start)
            elif len(latencies) < min_probes:
                break
            time.sleep(0.05)
    return latencies


def in_background(fn) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    return thread, result


def test_oversized_body_is_413_and_health_keeps_answering(tiny_model):
    limit = 1024 * 1024
    with BackgroundServer(make_engine(tiny_model), max_request_body_bytes=limit) as srv:
        big = json.dumps({"messages": [{"role": "user", "content": "x" * (50 * limit)}]}).encode()

        def send_big() -> httpx.Response:
            return httpx.post(srv.url + CHAT, content=big, headers={"Content-Type": "application/json"},
                              timeout=60)

        thread, result = in_background(send_big)
        latencies = health_latencies(srv.url, thread, min_probes=0)
        thread.join()
        response = result[0]
        assert response.status_code == 413, response.text[:200]
        error = response.json()["error"]
        assert error["code"] == "request_too_large" and "--max-request-body-bytes" in error["message"]
        assert all(t < 2.0 for t in latencies), latencies

        def chunks():  # no Content-Length: counted as it arrives
            for _ in range(3):
                yield b" " * limit

        chunked = httpx.post(srv.url + CHAT, content=chunks(), headers={"Content-Type": "application/json"})
        assert chunked.status_code == 413 and "so far" in chunked.json()["error"]["message"]
        small = json.dumps({"messages": HELLO, "max_tokens": 2}).encode()
        ok = httpx.post(srv.url + CHAT, content=iter([small[:10], small[10:]]),
                        headers={"Content-Type": "application/json"}, timeout=60)
        assert ok.status_code == 200, ok.text
        assert_all_free(wait_idle(srv))


def test_large_prompt_is_tokenised_while_health_answers(server):
    """A 1.5 MB prompt (under the 4 MiB default limit) takes seconds to tokenise: the event
    loop keeps answering /health meanwhile, then the prompt is refused as too long."""
    prompt = "lists and tuples are sequences; " * (1_500_000 // 32)

    def send() -> httpx.Response:
        return httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                          timeout=120)

    thread, result = in_background(send)
    latencies = health_latencies(server.url, thread, min_probes=5)
    thread.join()
    assert result[0].status_code == 400 and "tokens" in result[0].json()["error"]["message"]
    # on the event loop, tokenising would hold every probe until it ended: at most the one
    # probe sent before it began and the one it held would be answered while in flight
    assert len(latencies) >= 5, f"/health was not answered while the prompt was tokenised: {latencies}"
    assert max(latencies) < 2.0, latencies
