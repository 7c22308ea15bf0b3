"""`onecat serve` end to end on CPU: a real uvicorn server on a free loopback port serving the
real engine on a tiny random Qwen3.5 (full-attention KV blocks and GDN state slots), driven
by httpx and the official openai client. Covers the OpenAI endpoints, SSE framing, bad
input, the API key, a full queue, client disconnects and 64 concurrent streaming clients.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytestmark = pytest.mark.timeout(180)  # a hung server must fail the test, not CI

from server_helpers import (  # noqa: E402
    API_KEY,
    AUTH,
    HELLO,
    MAX_MODEL_LEN,
    MODEL,
    assert_all_free,
    assert_metrics_idle,
    make_engine,
    scrape,
    sse_payloads,
    stream_lines,
    wait_idle,
)

from onecat.runtime.server.launcher import BackgroundServer  # noqa: E402
from onecat.runtime.server.prompts import chat_token_ids  # noqa: E402
from onecat.tiny import build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model("qwen3_5", tmp_path_factory.mktemp("server") / "tiny-qwen3_5")


@pytest.fixture(scope="module")
def server(tiny_model):
    with BackgroundServer(make_engine(tiny_model, max_num_seqs=64), api_key=API_KEY) as srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


# ----- endpoints --------------------------------------------------------------------------


def test_models_health_version_metrics(client, server):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert client.get("/health").status_code == 200
    assert client.get("/version").json()["version"]
    metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    stats = server.async_engine.stats()
    text = metrics.text
    assert f'onecat:kv_blocks_total{{engine="0"}} {float(stats["total_kv_blocks"])}' in text
    for name in (
        "onecat:kv_blocks_free",
        "onecat:state_slots_free",
        "onecat:engine_steps_total",
        "onecat:engine_steps_with_prompt_tokens_total",
    ):
        assert f'\n{name}{{engine="0"}} ' in text, name
    labels = f'{{engine="0",model_name="{MODEL}"}}'
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
    ):
        assert f"\n{name}{labels} " in text, name


def test_metrics_have_vllm_names_and_request_histograms_move(client, server):
    """vLLM's series (names, types, labels, buckets) are exposed, and one plain and one
    streamed request move the request histograms: TTFT, inter-token latency (one per step
    after the first token), end-to-end and queue time, token counts, successes by reason."""
    wait_idle(server)
    before = scrape(server.url)
    plain = client.post("/v1/completions", json={
        "model": MODEL, "prompt": "Hello", "max_tokens": 5, "ignore_eos": True, "temperature": 0}).json()
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 4, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks = [json.loads(p) for p in sse_payloads(stream_lines(client, "/v1/chat/completions", body)) if p != "[DONE]"]
    streamed = chunks[-1]
    wait_idle(server)
    after = scrape(server.url)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    usages = [plain["usage"], streamed["usage"]]
    assert [u["completion_tokens"] for u in usages] == [5, 4]
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_inference_time",
                 "request_prefill_time", "request_decode_time"):
        assert delta(f"vllm:{name}_seconds_count") == 2, name
    assert delta("vllm:inter_token_latency_seconds_count") == (5 - 1) + (4 - 1)
    assert delta("vllm:time_to_first_token_seconds_sum") > 0
    assert delta("vllm:e2e_request_latency_seconds_sum") > delta("vllm:time_to_first_token_seconds_sum")
    assert delta("vllm:e2e_request_latency_seconds_sum") >= delta("vllm:request_queue_time_seconds_sum") >= 0
    assert delta('vllm:request_success_total{finished_reason="length"}') == 2
    assert delta("vllm:request_prompt_tokens_sum") == sum(u["prompt_tokens"] for u in usages)
    assert delta("vllm:request_generation_tokens_sum") == 9
    assert delta("vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("vllm:generation_tokens_total") == 9
    assert after["vllm:kv_cache_usage_perc"] == 0.0  # idle: every block free

    text = client.get("/metrics").text
    for name, kind in (("vllm:time_to_first_token_seconds", "histogram"), ("vllm:inter_token_latency_seconds", "histogram"),
                       ("vllm:e2e_request_latency_seconds", "histogram"), ("vllm:request_queue_time_seconds", "histogram"),
                       ("vllm:request_success_total", "counter"), ("vllm:kv_cache_usage_perc", "gauge")):
        assert f"# TYPE {name} {kind}\n" in text, name
    for name, last in (("time_to_first_token", "2560.0"), ("inter_token_latency", "80.0"),
                       ("e2e_request_latency", "7680.0"), ("request_queue_time", "7680.0")):
        bucket = f'vllm:{name}_seconds_bucket{{engine="0",le="{last}",model_name="{MODEL}"}} '
        assert bucket in text, bucket
    assert "onecat:num_requests_running" not in text and "onecat:prompt_tokens" not in text  # renamed


def test_tokenize_and_detokenize_round_trip(client, server):
    """vLLM's /tokenize (a prompt, or messages rendered as chat completions renders them) and
    /detokenize bodies, and the text back."""
    tokenizer = server.async_engine.tokenizer
    prompt = "Hello, who are you? Ünïcode too."
    body = client.post("/tokenize", json={"model": MODEL, "prompt": prompt}).json()
    assert body == {"count": len(body["tokens"]), "max_model_len": MAX_MODEL_LEN,
                    "tokens": tokenizer.encode(prompt), "token_strs": None}
    assert client.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]}).json() == {"prompt": prompt}

    strs = client.post("/tokenize", json={"prompt": prompt, "return_token_strs": True}).json()
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])

    chat = client.post("/tokenize", json={"model": MODEL, "messages": HELLO}).json()
    assert chat["tokens"] == chat_token_ids(tokenizer, HELLO)  # what a chat request's usage counts
    reply = client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 1}).json()
    assert reply["usage"]["prompt_tokens"] == chat["count"]
    bare = client.post("/tokenize", json={"messages": HELLO, "add_generation_prompt": False}).json()
    assert bare["count"] < chat["count"] and chat["tokens"][:bare["count"]] == bare["tokens"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": HELLO}, "messages"),
    ("/tokenize", {"messages": HELLO, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {"model": "other", "prompt": "a"}, "model"),
    ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_tokenize_errors_name_the_field(client, path, body, param):
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_tokenize_needs_the_api_key(server):
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        assert httpx.post(server.url + path, json=body, timeout=10).status_code == 401


def test_chat_completion_with_openai_client(server, tiny_model):
    openai = pytest.importorskip("openai")
    oc = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    reply = oc.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0)
    assert reply.object == "chat.completion"
    assert reply.model == MODEL
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    tokenizer = server.async_engine.tokenizer
    assert reply.usage.prompt_tokens == len(chat_token_ids(tokenizer, HELLO))
    assert 1 <= reply.usage.completion_tokens <= 6
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    if choice.finish_reason == "length":
        assert reply.usage.completion_tokens == 6

    chunks = list(
        oc.chat.completions.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content, "greedy: streamed text equals the full response"
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_chat_stream_framing(client):
    body = {
        "model": MODEL,
        "messages": HELLO,
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = [json.loads(p) for p in sse_payloads(stream_lines(client, "/v1/chat/completions", body))]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    *content, usage_chunk = chunks
    finishes = [c["choices"][0]["finish_reason"] for c in content if c["choices"][0]["finish_reason"]]
    assert len(finishes) == 1 and content[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 1 <= usage["completion_tokens"] <= 8

    full = client.post("/v1/chat/completions", json={**body, "stream": False, "stream_options": None})
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    assert full.json()["choices"][0]["message"]["content"] == text


def test_completions_text_and_token_prompt(client, server):
    body = {"model": MODEL, "prompt": "def main():", "max_tokens": 5, "temperature": 0}
    reply = client.post("/v1/completions", json=body).json()
    assert reply["object"] == "text_completion"
    assert reply["choices"][0]["finish_reason"] in ("stop", "length")
    token_ids = server.async_engine.tokenizer.encode("def main():")
    by_ids = client.post("/v1/completions", json={**body, "prompt": token_ids}).json()
    assert by_ids["choices"][0]["text"] == reply["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == len(token_ids)

    events = sse_payloads(stream_lines(client, "/v1/completions", {**body, "stream": True}))
    chunks = [json.loads(p) for p in events]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == reply["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == reply["choices"][0]["finish_reason"]


# ----- bad input ----------------------------------------------------------------------------

LONG = "word " * (MAX_MODEL_LEN * 2)
BAD_REQUESTS = {
    "malformed json": (b'{"model": "tiny-qwen3_5", "messages": [', None),
    "not an object": (b"[1, 2, 3]", None),
    "messages not a list": (json.dumps({"messages": "hello"}), "messages"),
    "max_tokens not an int": (json.dumps({"messages": HELLO, "max_tokens": "many"}), "max_tokens"),
    "temperature negative": (json.dumps({"messages": HELLO, "temperature": -1}), "temperature"),
    "unknown role": (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), "messages"),
    "unknown model": (json.dumps({"model": "gpt-9", "messages": HELLO}), "model"),
    "prompt too long": (json.dumps({"messages": [{"role": "user", "content": LONG}]}), None),
    "max_tokens beyond the limit": (json.dumps({"messages": HELLO, "max_tokens": MAX_MODEL_LEN}), None),
    "n beyond 128": (json.dumps({"messages": HELLO, "n": 129}), "n"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_400_and_server_keeps_serving(client, server, case):
    content, param = BAD_REQUESTS[case]
    response = client.post(
        "/v1/chat/completions", content=content, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param
    if case == "unknown model":
        assert error["code"] == "model_not_found"
    ok = client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert_all_free(wait_idle(server))


def test_completion_prompt_too_long_and_bad_token_ids(client):
    for prompt in (LONG, [10**9], list(range(5)) * MAX_MODEL_LEN):
        response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_api_key_is_required(server):
    path, body = "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(server.url + path, json=body, headers=headers)
        assert response.status_code == 401, headers
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key
    assert httpx.post(server.url + path, json=body, headers=AUTH).status_code == 200


# ----- faults -------------------------------------------------------------------------------


def test_client_disconnect_mid_stream_frees_blocks_and_slots(client, server):
    wait_idle(server)
    before = server.async_engine.stats()["generation_tokens_total"]
    max_tokens = MAX_MODEL_LEN - 64
    body = {"messages": HELLO, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data: ")
            if seen == 4:
                assert server.async_engine.stats()["running"] == 1
                break  # leaving the block closes the connection mid-stream
    stats = wait_idle(server)
    assert_all_free(stats)
    generated = stats["generation_tokens_total"] - before
    assert generated < max_tokens, "the request ran to the end instead of being aborted"


def test_full_queue_answers_429(tiny_model):
    engine = make_engine(tiny_model, max_num_seqs=1)
    with BackgroundServer(engine, max_queue_len=1) as srv:

        async def one(client: httpx.AsyncClient) -> httpx.Response:
            body = {"messages": HELLO, "max_tokens": 32, "ignore_eos": True}
            return await client.post("/v1/chat/completions", json=body)

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
                return await asyncio.gather(*(one(client) for _ in range(8)))

        responses = asyncio.run(burst())
        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {200, 429}, statuses
        assert statuses.count(200) >= 1 and statuses.count(429) >= 1, statuses
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.json()["error"]["code"] == "queue_full"
        assert refused.headers["retry-after"]
        after = httpx.post(srv.url + "/v1/chat/completions", json={"messages": HELLO, "max_tokens": 1})
        assert after.status_code == 200, "the server serves again once the queue drains"
        assert_all_free(wait_idle(srv))


def test_64_concurrent_streaming_clients(server):
    num_clients, max_tokens = 64, 16

    async def one(client: httpx.AsyncClient, i: int) -> dict:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Client {i}: tell me about lists."}],
            "max_tokens": max_tokens,
            "temperature": 0.8,
            "seed": i,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines()]
        chunks = [json.loads(p) for p in sse_payloads(lines)]
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        return {"finish": [f for f in finish if f], "usage": chunks[-1]["usage"]}

    async def run_all() -> list[dict]:
        limits = httpx.Limits(max_connections=num_clients)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(num_clients)))

    wait_idle(server)
    before = server.async_engine.stats()
    results = asyncio.run(run_all())
    assert len(results) == num_clients
    for result in results:
        assert len(result["finish"]) == 1 and result["finish"][0] in ("stop", "length")
        assert 1 <= result["usage"]["completion_tokens"] <= max_tokens
        if result["finish"][0] == "length":
            assert result["usage"]["completion_tokens"] == max_tokens
    stats = wait_idle(server)
    assert_all_free(stats)
    generated = stats["generation_tokens_total"] - before["generation_tokens_total"]
    assert generated == sum(r["usage"]["completion_tokens"] for r in results)
    idle = assert_metrics_idle(server.url)  # what an operator's dashboard sees
    assert idle["vllm:generation_tokens_total"] == stats["generation_tokens_total"]


def test_engine_failure_is_reported_not_hung(tiny_model):
    engine = make_engine(tiny_model)
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("injected engine fault")
        return real_step()

    engine.step = failing_step
    with BackgroundServer(engine) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        body = {"messages": HELLO, "max_tokens": 32, "ignore_eos": True, "stream": True}
        payloads = sse_payloads(stream_lines(client, "/v1/chat/completions", body))
        error = json.loads(payloads[-1])["error"]
        assert error["type"] == "server_error" and error["code"] == "engine_unavailable"
        assert "injected" not in error["message"], "internals stay in the log, out of the body"
        assert client.get("/health").status_code == 503
        refused = client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "engine_unavailable"
