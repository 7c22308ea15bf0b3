"""`onecat bench serve` pieces without a server: the metrics on known timings, the datasets
(random prompts with the tiny models' tokenizer, JSONL, ShareGPT) and the streamed-request
client against a scripted HTTP transport."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import numpy as np
import pytest

from onecat.benchmarks import client as bench_client
from onecat.benchmarks.client import Endpoint, RequestResult, build_payload, send_request
from onecat.benchmarks.datasets import (
    SampleRequest,
    custom_requests,
    dataset_name_for,
    load_tokenizer,
    prefix_carriers,
    random_requests,
    sample_requests,
    sharegpt_requests,
)
from onecat.benchmarks.metrics import (
    arrival_times,
    compute_metrics,
    parse_percentile_metrics,
    parse_percentiles,
    percentile_key,
)
from onecat.benchmarks.report import write_result_json
from onecat.errors import OnecatError
from onecat.tiny import build_tokenizer

# ----- metrics ----------------------------------------------------------------------------


def ok(ttft: float, itl: list[float], latency: float, tokens: int, prompt: int = 10) -> RequestResult:
    return RequestResult(success=True, prompt_len=prompt, output_tokens=tokens, ttft=ttft, itl=itl,
                         latency=latency)


def test_metrics_on_known_timings():
    results = [
        ok(0.100, [0.020, 0.020, 0.030, 0.030], 0.200, tokens=5, prompt=10),
        ok(0.300, [0.050], 0.400, tokens=3, prompt=20),  # TPOT (0.4 - 0.3) / 2 = 50 ms
        ok(0.500, [], 0.500, tokens=1, prompt=30),  # one token: no TPOT, no ITL
        RequestResult(success=False, prompt_len=40, error="HTTP 400"),
    ]
    m = compute_metrics(results, duration=2.0, percentile_metrics=["ttft", "tpot", "itl", "e2el"],
                        percentiles=[50, 99])
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 60 and m["total_output_tokens"] == 9
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(34.5)
    # TTFT 100, 300, 500 ms
    assert m["mean_ttft_ms"] == pytest.approx(300) and m["median_ttft_ms"] == pytest.approx(300)
    assert m["p99_ttft_ms"] == pytest.approx(300 + 0.98 * 200)  # numpy's linear interpolation
    assert m["std_ttft_ms"] == pytest.approx(np.std([100, 300, 500]))
    # TPOT: (200 - 100) / 4 = 25 ms and 50 ms
    assert m["mean_tpot_ms"] == pytest.approx(37.5) and m["p50_tpot_ms"] == pytest.approx(37.5)
    # ITL pooled: 20, 20, 30, 30, 50 ms
    assert m["mean_itl_ms"] == pytest.approx(30) and m["median_itl_ms"] == pytest.approx(30)
    assert m["p99_itl_ms"] == pytest.approx(30 + 0.96 * 20)
    assert m["mean_e2el_ms"] == pytest.approx((200 + 400 + 500) / 3)


def test_metrics_report_only_the_chosen_metrics_and_survive_all_failures():
    m = compute_metrics([RequestResult(error="boom")], 1.0, ["ttft"], [90, 99.9])
    assert m["completed"] == 0 and m["failed"] == 1 and m["output_throughput"] == 0
    assert set(k for k in m if k.endswith("_ms")) == {
        "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p90_ttft_ms", "p99.9_ttft_ms"}
    assert m["p99.9_ttft_ms"] == 0.0
    assert percentile_key(99) == "p99" and percentile_key(99.9) == "p99.9"


def test_metric_flags_are_checked():
    assert parse_percentile_metrics("ttft, itl") == ["ttft", "itl"]
    assert parse_percentiles("50,90,99") == [50.0, 90.0, 99.0]
    with pytest.raises(OnecatError, match="--percentile-metrics"):
        parse_percentile_metrics("ttft,latency")
    for bad in ("", "0", "101", "p99"):
        with pytest.raises(OnecatError, match="--metric-percentiles"):
            parse_percentiles(bad)


def test_poisson_arrivals():
    assert arrival_times(5, math.inf) == [0.0] * 5
    times = arrival_times(4000, 10.0, rng=np.random.default_rng(1))
    assert times == arrival_times(4000, 10.0, rng=np.random.default_rng(1))
    gaps = np.diff([0.0, *times])
    assert (gaps > 0).all() and times[-1] == pytest.approx(400.0)  # n / rate, as vLLM scales
    assert gaps.mean() == pytest.approx(0.1, rel=1e-9)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.06)  # exponential: CV 1
    steady = np.diff(arrival_times(4000, 10.0, burstiness=100.0, rng=np.random.default_rng(1)))
    assert steady.std() / steady.mean() < 0.15  # gamma shape 100: CV 0.1
    with pytest.raises(OnecatError, match="--request-rate"):
        arrival_times(3, 0.0)


def test_result_json_is_written_atomically(tmp_path):
    target = tmp_path / "result.json"
    write_result_json(target, {"completed": 3, "request_rate": "inf"})
    assert json.loads(target.read_text()) == {"completed": 3, "request_rate": "inf"}
    with pytest.raises(TypeError):
        write_result_json(target, {"bad": object()})
    assert json.loads(target.read_text())["completed"] == 3  # the old file is intact
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # no temporary left
    with pytest.raises(OnecatError, match="does not exist"):
        write_result_json(tmp_path / "missing" / "r.json", {})


# ----- datasets ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-tokenizer")
    build_tokenizer(path)  # the tiny models' tokenizer (onecat.tiny.build_tiny_model)
    return load_tokenizer(str(path))


def test_random_prompts_have_the_drawn_token_lengths(tokenizer):
    requests = random_requests(64, 48, 16, range_ratio=0.5, seed=3, tokenizer=tokenizer)
    assert requests == random_requests(64, 48, 16, range_ratio=0.5, seed=3, tokenizer=tokenizer)
    assert requests != random_requests(64, 48, 16, range_ratio=0.5, seed=4, tokenizer=tokenizer)
    for r in requests:
        assert len(tokenizer.encode(r.prompt, add_special_tokens=False)) == r.prompt_len
        assert 24 <= r.prompt_len <= 72 and 8 <= r.output_len <= 24
    assert len({r.prompt_len for r in requests}) > 10  # the range is used
    exact = random_requests(16, 40, 7, seed=0, tokenizer=tokenizer)
    assert [r.prompt_len for r in exact] == [40] * 16 and [r.output_len for r in exact] == [7] * 16
    assert len({r.prompt for r in exact}) == 16


def test_random_prompts_without_a_tokenizer_are_words():
    requests = random_requests(8, 30, 5, range_ratio=0.2, seed=1)
    for r in requests:
        assert len(r.prompt.split()) == r.prompt_len and 24 <= r.prompt_len <= 36
        assert r.prompt.replace(" ", "").isalpha()
    with pytest.raises(OnecatError, match="range-ratio"):
        random_requests(2, 30, 5, range_ratio=1.0)
    with pytest.raises(OnecatError, match="input-len"):
        random_requests(2, 0, 5)


def test_prefix_carriers_spread_the_share_evenly():
    assert prefix_carriers(6, 0.5) == [False, True] * 3
    assert prefix_carriers(4, 1.0) == [True] * 4 and prefix_carriers(4, 0.0) == [False] * 4
    spread = prefix_carriers(100, 0.3)
    assert sum(spread) == 30 and all(sum(spread[i : i + 10]) == 3 for i in range(0, 100, 10))


def test_random_prefix_is_shared_by_the_share_of_requests(tokenizer):
    """vLLM's --random-prefix-len: one prefix per run before each random part (prompt = prefix
    + drawn length); onecat's --random-prefix-share: half the requests carry it, the others as
    many fresh random tokens instead (same lengths)."""
    prefix_len, input_len = 24, 40
    requests = random_requests(16, input_len, 8, seed=5, tokenizer=tokenizer, prefix_len=prefix_len,
                               prefix_share=0.5)
    assert requests == random_requests(16, input_len, 8, seed=5, tokenizer=tokenizer, prefix_len=prefix_len,
                                       prefix_share=0.5)
    ids = [tokenizer.encode(r.prompt, add_special_tokens=False) for r in requests]
    assert [r.prompt_len for r in requests] == [len(i) for i in ids] == [prefix_len + input_len] * 16
    carriers, others = ids[1::2], ids[0::2]
    head = carriers[0][: prefix_len - 1]  # the last prefix token may merge with the next one
    assert all(i[: prefix_len - 1] == head for i in carriers)
    assert all(i[: prefix_len - 1] != head for i in others)
    assert len({tuple(i[:prefix_len - 1]) for i in others}) == len(others)  # fresh per request
    assert len({r.prompt for r in requests}) == 16
    everyone = random_requests(8, input_len, 8, seed=5, tokenizer=tokenizer, prefix_len=prefix_len)
    assert len({tuple(tokenizer.encode(r.prompt, add_special_tokens=False)[: prefix_len - 1])
                for r in everyone}) == 1  # share 1.0 (vLLM): every request
    # no prefix: the prompts drawn before the option existed
    assert random_requests(8, input_len, 8, seed=5, tokenizer=tokenizer, prefix_len=0, prefix_share=0.5) == \
        random_requests(8, input_len, 8, seed=5, tokenizer=tokenizer)


def test_random_prefix_without_a_tokenizer_and_its_errors():
    requests = sample_requests("random", 4, random_input_len=10, random_output_len=3, random_prefix_len=6,
                               random_prefix_share=0.5, seed=2)
    words = [r.prompt.split() for r in requests]
    assert [r.prompt_len for r in requests] == [len(w) for w in words] == [16] * 4
    assert words[1][:6] == words[3][:6] and words[0][:6] != words[1][:6] and words[2][:6] != words[1][:6]
    with pytest.raises(OnecatError, match="random-prefix-len"):
        random_requests(2, 10, 3, prefix_len=-1)
    with pytest.raises(OnecatError, match="random-prefix-share"):
        random_requests(2, 10, 3, prefix_len=4, prefix_share=1.5)


def test_jsonl_prompts(tmp_path, tokenizer):
    path = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"id": i, "text": f"question number {i} about the world"}) for i in range(5)]
    path.write_text("\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:]) + "\n")
    requests = custom_requests(path, 5, output_len=32, field="text", seed=0, tokenizer=tokenizer)
    assert sorted(r.prompt for r in requests) == sorted(json.loads(line)["text"] for line in lines)
    assert all(r.output_len == 32 for r in requests)
    assert all(r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False)) for r in requests)
    more = custom_requests(path, 12, output_len=32, field="text", seed=0)
    assert len(more) == 12 and more[:5] == [SampleRequest(r.prompt, more[i].prompt_len, 32)
                                            for i, r in enumerate(requests)]
    assert {r.prompt for r in more} == {r.prompt for r in requests}  # topped up from the file
    with pytest.raises(OnecatError, match=r"prompts.jsonl:1: no string field 'prompt'.*--prompt-field"):
        custom_requests(path, 2, output_len=8)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "fine"}\n{"prompt": oops}\n')
    with pytest.raises(OnecatError, match=r"broken.jsonl:2: not valid JSON"):
        custom_requests(broken, 2, output_len=8)
    with pytest.raises(OnecatError, match=r"missing.jsonl: no such file"):
        custom_requests(tmp_path / "missing.jsonl", 2, output_len=8)


def sharegpt_entry(*turns: tuple[str, str]) -> dict:
    return {"id": "x", "conversations": [{"from": who, "value": text} for who, text in turns]}


def test_sharegpt_prompts(tmp_path, tokenizer):
    reply = "the answer is " + "quite long and detailed " * 4
    data = [
        sharegpt_entry(("human", "what is the meaning of everything here"), ("gpt", reply)),
        sharegpt_entry(("gpt", "welcome"), ("human", "tell me a story about a dragon"), ("gpt", reply),
                       ("human", "again")),
        sharegpt_entry(("human", "hi")),  # one turn: skipped
        sharegpt_entry(("human", "ok"), ("gpt", reply)),  # prompt under 4 tokens: filtered
        {"no": "conversations"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    requests = sharegpt_requests(path, 2, seed=0, tokenizer=tokenizer)
    assert sorted(r.prompt for r in requests) == [
        "tell me a story about a dragon", "what is the meaning of everything here"]
    reply_len = len(tokenizer.encode(reply, add_special_tokens=False))
    assert all(r.output_len == reply_len for r in requests)
    assert all(r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False)) for r in requests)
    fixed = sharegpt_requests(path, 4, output_len=7, seed=0, tokenizer=tokenizer)
    assert len(fixed) == 4 and all(r.output_len == 7 for r in fixed)
    path.write_text("[1, 2")
    with pytest.raises(OnecatError, match="sharegpt.json: not valid JSON"):
        sharegpt_requests(path, 2)
    path.write_text(json.dumps({"conversations": []}))
    with pytest.raises(OnecatError, match="expected a JSON list"):
        sharegpt_requests(path, 2)
    path.write_text(json.dumps([sharegpt_entry(("human", "x"))]))
    with pytest.raises(OnecatError, match="human turn followed by a reply"):
        sharegpt_requests(path, 2)


def test_dataset_name_follows_the_file():
    assert dataset_name_for(None, None) == "random"
    assert dataset_name_for(None, "a/b.jsonl") == "custom"
    assert dataset_name_for(None, "ShareGPT_V3.json") == "sharegpt"
    assert dataset_name_for("custom", "x.txt") == "custom"
    with pytest.raises(OnecatError, match="--dataset-name"):
        dataset_name_for(None, "prompts.txt")


# ----- client -----------------------------------------------------------------------------


def test_urls_and_endpoint_kinds():
    assert bench_client.split_base_url("http://h:8000/v1/", "/v1/completions") == ("http://h:8000", "/v1/completions")
    assert bench_client.split_base_url("https://h", "v1/chat/completions") == ("https://h", "/v1/chat/completions")
    with pytest.raises(OnecatError, match="--base-url"):
        bench_client.split_base_url("h:8000", "/v1/completions")
    assert bench_client.split_base_url("http://[::1]:8000", "/v1/completions")[0] == "http://[::1]:8000"


@pytest.mark.parametrize("url", ["http://[::1", "http://h:port", "http://[::1]:80a", "http://\x00h", "http://:80"])
def test_malformed_base_url_is_a_clean_error(url):
    """`onecat bench serve --base-url 'http://[::1'` ended in httpx's InvalidURL traceback."""
    from click.testing import CliRunner

    from onecat.cli import main

    result = CliRunner().invoke(main, ["bench", "serve", "--base-url", url])
    assert result.exit_code == 1 and "--base-url" in result.output, result.output
    assert not isinstance(result.exception, httpx.InvalidURL) and "Traceback" not in result.output
    assert bench_client.endpoint_kind("/v1/chat/completions", None) == "chat"
    assert bench_client.endpoint_kind("/v1/completions", None) == "completions"
    assert bench_client.endpoint_kind("/generate", "chat") == "chat"
    with pytest.raises(OnecatError, match="--endpoint-type"):
        bench_client.endpoint_kind("/generate", None)


def test_payloads_follow_vllm():
    request = SampleRequest("hello", 1, 16)
    comp = build_payload(Endpoint("http://h", "/v1/completions", "completions", "m"), request, True)
    assert comp == {"model": "m", "prompt": "hello", "max_tokens": 16, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
    chat = build_payload(Endpoint("http://h", "/v1/chat/completions", "chat", "m"), request, False)
    assert chat["messages"] == [{"role": "user", "content": "hello"}]
    assert chat["max_completion_tokens"] == 16 and "ignore_eos" not in chat
    greedy = build_payload(Endpoint("http://h", "/v1/completions", "completions", "m"), request, True,
                           {"temperature": 0.0, "top_k": 1})
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == 1 and greedy["max_tokens"] == 16


def sse(*events: object) -> bytes:
    return b"".join(
        b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n" for e in events
    )


def run_request(body: bytes, kind: str = "completions", status: int = 200, delay: float = 0.0):
    """send_request against a transport answering ``body`` in one piece per SSE event."""

    class Stream(httpx.AsyncByteStream):
        async def __aiter__(self):
            for part in body.split(b"\n\n"):
                if part:
                    await asyncio.sleep(delay)
                    yield part + b"\n\n"

    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["url"], seen["auth"] = str(request.url), request.headers.get("authorization")
        seen["json"] = json.loads(request.content)
        return httpx.Response(status, stream=Stream())

    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    endpoint = Endpoint("http://server", path, kind, "m", api_key="k")

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            return await send_request(c, endpoint, build_payload(endpoint, SampleRequest("p", 3, 4), True), 3)

    return asyncio.run(go()), seen


def test_streamed_chat_request_is_timed_from_text_chunks():
    def delta(d, finish=None):
        return {"choices": [{"index": 0, "delta": d, "finish_reason": finish}], "usage": None}

    body = sse(delta({"role": "assistant", "content": ""}), delta({"content": "Hel"}), delta({"content": "lo"}),
               delta({"content": " world"}), delta({}, "length"),
               {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}},
               "[DONE]")
    result, seen = run_request(body, "chat", delay=0.01)
    assert seen["url"] == "http://server/v1/chat/completions" and seen["auth"] == "Bearer k"
    assert seen["json"]["stream_options"] == {"include_usage": True}
    assert result.success and result.error == ""
    assert result.generated_text == "Hello world"
    assert result.output_tokens == 4 and result.prompt_len == 9  # the server's usage
    assert len(result.itl) == 2  # three text chunks; the role chunk is not a token
    assert result.ttft >= 0.015  # role chunk (10 ms) does not end the wait for the first token
    assert all(gap >= 0.008 for gap in result.itl)
    assert result.latency >= result.ttft + sum(result.itl) - 1e-9


def test_streamed_completion_without_usage_counts_chunks():
    def piece(text, finish=None):
        return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}

    result, _ = run_request(sse(piece("a"), piece("b"), piece("c", "length"), "[DONE]"))
    assert result.success and result.output_tokens == 3 and len(result.itl) == 2
    assert result.prompt_len == 3 and result.generated_text == "abc"


def test_failed_requests_carry_the_reason():
    result, _ = run_request(json.dumps({"error": {"message": "prompt too long", "code": 400}}).encode(),
                            status=400)
    assert not result.success
    assert result.error == "HTTP 400 from http://server/v1/completions: prompt too long"
    result, _ = run_request(sse({"choices": [{"text": "a"}]},
                                {"error": {"message": "engine died", "type": "server_error"}}, "[DONE]"))
    assert not result.success and "engine died" in result.error
    result, _ = run_request(sse("[DONE]"))
    assert not result.success and "without output" in result.error


def test_the_client_imports_no_engine():
    import subprocess
    import sys

    code = ("import sys, onecat.benchmarks.serve; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('onecat.runtime')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
