"""Engine cores in their own processes (``onecat.runtime.core``, issue #41 items 1-3):
routing and placement (pure), the API side's text and stop strings, the restart policy
(fake cores), and real CPU core processes: the same answers as the in-process engine on the
trained tiny model, and failover when a replica is killed under a 64-stream load."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import httpx
import pytest

from onecat.runtime.config import EngineConfig
from onecat.runtime.core import replicas as replicas_module
from onecat.runtime.core.client import EngineStartError, exit_reason
from onecat.runtime.core.messages import Ready
from onecat.runtime.core.placement import Placement, place_replicas
from onecat.runtime.core.routing import PrefixRouter, block_hashes
from onecat.runtime.engine.detokenizer import IncrementalDetokenizer
from onecat.runtime.engine.llm_engine import RequestOutput
from onecat.runtime.layers.sampler import TokenLogprobs
from onecat.runtime.sampling_params import SamplingParams
from onecat.tiny_train import fixture_dir

TRAINED = fixture_dir("qwen3_5")


# ----- routing and placement -------------------------------------------------------------------


def test_block_hashes_chain_full_blocks_only():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2  # the partial third block is not hashed
    b = block_hashes(list(range(32)) + [7, 7], 16)
    assert a == b
    c = block_hashes([99] + list(range(1, 40)), 16)
    assert c[0] != a[0] and c[1] != a[1], "a block's hash covers every token before it"
    assert block_hashes(list(range(10_000)), 16, limit=4) == block_hashes(list(range(64)), 16)


def test_router_keeps_a_prefix_on_its_replicas_within_the_slack():
    router = PrefixRouter(block_size=4, slack=2)
    shared = list(range(12))
    first, hashes = router.choose(shared + [50], {0: 0, 1: 0})
    assert first == 0
    router.record(hashes, 0)
    # the same prefix goes back to replica 0 while it is at most 2 requests busier
    assert router.choose(shared + [51], {0: 2, 1: 0})[0] == 0
    # beyond the slack the least loaded replica takes it, and holds the prefix from then on
    replica, hashes = router.choose(shared + [52], {0: 3, 1: 0})
    assert replica == 1
    router.record(hashes, 1)
    assert router.choose(shared + [53], {0: 3, 1: 1})[0] == 1
    assert router.choose(shared + [54], {0: 1, 1: 2})[0] == 0  # both hold it: the least loaded
    # a prompt without a known prefix: the least loaded; a dead replica is never chosen
    assert router.choose([9, 9, 9, 9, 9], {0: 4, 1: 1})[0] == 1
    assert router.choose(shared, {1: 5})[0] == 1
    router.forget(1)
    assert router.choose(shared, {0: 0, 1: 0})[0] == 0


def test_router_table_is_bounded():
    router = PrefixRouter(block_size=2, max_entries=8)
    for start in range(0, 100, 2):
        router.record(block_hashes([start, start + 1, 5, 5], 2), 0)
    assert len(router._holders) <= 8


def test_placement_of_replicas():
    one_gpu = place_replicas(2, 1, "auto", 1)
    assert [p.gpus for p in one_gpu] == [(0,), (0,)] and all(p.sharing == 2 for p in one_gpu)
    # the first replica on a shared GPU plans with its share; the second with the rest
    assert one_gpu[0].memory_utilization(0.9, 0) == pytest.approx(0.45)
    assert one_gpu[1].memory_utilization(0.9, 1) == pytest.approx(0.9)
    eight = place_replicas(4, 2, "auto", 8)
    assert [p.gpus for p in eight] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert all(p.sharing == 1 and p.memory_utilization(0.9, 3) == 0.9 for p in eight)
    assert [p.gpus for p in place_replicas(3, 1, "auto", 2)] == [(0,), (1,), (0,)]
    assert [p.sharing for p in place_replicas(3, 1, "auto", 2)] == [2, 1, 2]
    cpu = place_replicas(2, 1, "cpu", 8)
    assert [p.gpus for p in cpu] == [(), ()] and all(p.threads >= 1 for p in cpu)
    with pytest.raises(Exception, match="--device auto"):
        place_replicas(2, 1, "cuda:1", 4)
    with pytest.raises(Exception, match="-tp 4 needs 4 GPUs"):
        place_replicas(1, 4, "auto", 2)
    with pytest.raises(Exception, match="no CUDA GPU"):
        place_replicas(1, 1, "cuda", 0)


def test_replica_environment_maps_through_visible_devices():
    env = Placement(1, (1, 2), 1).environment({"CUDA_VISIBLE_DEVICES": "4,5,6", "X": "y"})
    assert env["CUDA_VISIBLE_DEVICES"] == "5,6" and env["X"] == "y"
    assert Placement(0, (0,), 1).environment({})["CUDA_VISIBLE_DEVICES"] == "0"
    assert "CUDA_VISIBLE_DEVICES" not in Placement(0, (), 1).environment({})


def test_exit_reasons_are_words():
    assert exit_reason(-9) == "killed by SIGKILL"
    assert exit_reason(1) == "exited with status 1"


# ----- the API side's text and stop strings ----------------------------------------------------


class _Tokens:
    """A tokenizer whose token i is the character chr(97 + i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i) for i in ids)


def _request(stop=(), min_tokens=0):
    detok = IncrementalDetokenizer(_Tokens(), list(stop), min_tokens=min_tokens)
    return replicas_module._Request("r", None, [1], SamplingParams(), None, detok, None, [])


def _out(tokens, finished=False, reason=None, logprobs=False):
    lps = [TokenLogprobs(t, -1.0, []) for t in tokens] if logprobs else None
    return RequestOutput("r", list(tokens), "", finished, reason, 1, 99, logprobs=lps)


def test_text_is_made_in_the_api_process():
    request = _request()
    out = _out([0, 1])
    assert replicas_module.ReplicaSet._text(request, out) is False
    assert (out.new_text, out.completion_tokens) == ("ab", 2)
    # the core stopped on a stop token (EOS): its text is not output, the count includes it
    out = _out([2, 3], finished=True, reason="stop")
    replicas_module.ReplicaSet._text(request, out)
    assert (out.new_text, out.new_token_ids, out.completion_tokens) == ("c", [2, 3], 4)


def test_stop_string_ends_the_request_in_the_api_process():
    request = _request(stop=["cd"])
    out = _out([0, 1])
    replicas_module.ReplicaSet._text(request, out)
    assert out.new_text == "a"  # "b" may start the stop string: held back
    # speculative steps bring several tokens: the ones after the stop string are dropped
    out = _out([2, 3, 4, 5], logprobs=True)
    assert replicas_module.ReplicaSet._text(request, out) is True, "the core must be told to abort"
    assert out.finished and out.finish_reason == "stop"
    assert (out.new_text, out.new_token_ids, len(out.logprobs), out.completion_tokens) == ("b", [2, 3], 2, 4)
    # a stop string in the core's last output (finished on length) needs no abort
    request = _request(stop=["b"])
    out = _out([0, 1], finished=True, reason="length")
    assert replicas_module.ReplicaSet._text(request, out) is False
    assert (out.finish_reason, out.new_text) == ("stop", "a")


def test_stop_strings_wait_for_min_tokens():
    request = _request(stop=["a"], min_tokens=2)
    out = _out([0, 1, 0])
    assert replicas_module.ReplicaSet._text(request, out) is True
    assert out.new_text == "ab" and out.new_token_ids == [0, 1, 0]


# ----- the wire to a core ------------------------------------------------------------------------


def _peer_code(address: str) -> str:
    return ("import sys, time, zmq\n"
            f"s = zmq.Context().socket(zmq.PULL); s.connect({address!r})\n"
            "print(repr(s.recv()), flush=True)\n"
            "time.sleep(600)\n")


def test_send_to_a_killed_core_returns_at_once(tmp_path):
    """A request routed to a core between its death and the receiver thread noticing must
    not block: a PUSH socket without a peer blocks a plain send for ever, which froze the
    server's event loop and (through the send lock) the failover (CI, 2 cores)."""
    import subprocess
    import sys

    import zmq

    from onecat.runtime.core.client import EngineCoreClient
    from onecat.runtime.core.messages import AbortRequests

    context = zmq.Context()
    client = EngineCoreClient(context, tmp_path, EngineConfig(model=str(TRAINED), device="cpu"),
                              place_replicas(1, 1, "cpu", 0)[0], on_message=lambda *a: None,
                              on_exit=lambda *a: None)
    client._inputs = context.socket(zmq.PUSH)
    client._inputs.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{tmp_path}/in"
    client._inputs.bind(address)
    client.process = subprocess.Popen([sys.executable, "-c", _peer_code(address)], stdout=subprocess.PIPE, text=True)
    try:
        client.send(AbortRequests(["first"]))  # waits for the peer to connect: it is alive
        assert "first" in client.process.stdout.readline()
        client.kill()
        client.process.wait()
        done = threading.Event()
        sender = threading.Thread(target=lambda: (client.send(AbortRequests(["late"])), done.set()), daemon=True)
        sender.start()
        assert done.wait(10), "send to a dead core blocked"
    finally:
        client.kill()
        client._close_sockets()
        context.term()


def test_a_message_the_api_process_cannot_handle_restarts_the_core(tmp_path, caplog):
    """A message the receiver thread cannot handle (a protocol bug) kills the core and reports
    why through ``on_exit`` (failover, restart), instead of ending the receiver thread and
    leaving the replica's requests waiting for ever."""
    import subprocess
    import sys

    import zmq

    from onecat.runtime.core.client import EngineCoreClient

    context = zmq.Context()
    exits = []
    client = EngineCoreClient(context, tmp_path, EngineConfig(model=str(TRAINED), device="cpu"),
                              place_replicas(1, 1, "cpu", 0)[0], on_message=lambda *a: None,
                              on_exit=lambda c, reason: exits.append(reason))
    client._outputs = context.socket(zmq.PULL)
    client._outputs.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{tmp_path}/out"
    client._outputs.bind(address)
    code = ("import time, zmq\n"
            f"s = zmq.Context().socket(zmq.PUSH); s.connect({address!r})\n"
            "s.send(b'not a message'); time.sleep(600)\n")
    client.process = subprocess.Popen([sys.executable, "-c", code])
    try:
        with caplog.at_level(logging.ERROR, logger="onecat.runtime.core.client"):
            client._receive()  # returns once the killed core's exit is reported
        assert client.process.returncode == -9
        assert len(exits) == 1 and "could not be handled" in exits[0]
        assert "killing it" in caplog.text
    finally:
        client.kill()
        client._close_sockets()
        context.term()


# ----- restarts (fake cores) ---------------------------------------------------------------------


class _FakeClient:
    """Stands in for EngineCoreClient: the first start succeeds, later ones as ``outcomes`` say."""

    outcomes: list[bool] = []
    started = 0
    initial = 1

    def __init__(self, context, socket_dir, config, placement, *, on_message, on_exit, log_level="info",
                 factory=None):
        self.index = placement.index
        self.on_exit = on_exit
        self.pid = 1000 + _FakeClient.started
        self.ready = Ready(self.pid, "m", 64, 100, [0], 10, 16)
        self.sent = []

    def start(self, timeout=None):
        _FakeClient.started += 1
        if _FakeClient.started > _FakeClient.initial and not _FakeClient.outcomes.pop(0):
            raise EngineStartError(f"engine replica {self.index} could not start: CUDA out of memory")
        return self.ready

    def send(self, message):
        self.sent.append(message)

    def stop(self, timeout=0):
        pass


def _fake_set(monkeypatch, outcomes, size=1):
    monkeypatch.setattr(replicas_module, "EngineCoreClient", _FakeClient)
    monkeypatch.setattr(replicas_module, "BACKOFF_BASE", 0.01)
    _FakeClient.outcomes = list(outcomes)
    _FakeClient.started = 0
    _FakeClient.initial = size
    rs = replicas_module.ReplicaSet(EngineConfig(model=str(TRAINED), device="cpu"), size)
    rs.start()
    return rs


def _wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_replica_that_keeps_failing_stays_down_and_says_why(monkeypatch, caplog):
    rs = _fake_set(monkeypatch, outcomes=[True, False, False, False, False])
    try:
        client = rs._replicas[0].client
        rs._on_exit(client, "killed by SIGKILL")  # the first death: restarted
        _wait(lambda: rs.health()["replicas"][0]["restarts"] == 1)
        assert rs.health()["status"] == "ok"
        with caplog.at_level(logging.ERROR, logger="onecat.runtime.core.replicas"):
            rs._on_exit(rs._replicas[0].client, "killed by SIGKILL")  # then every restart fails
            _wait(lambda: rs.health()["replicas"][0]["state"] == "down")
        assert "stays down" in caplog.text and "CUDA out of memory" in caplog.text
        assert rs.health()["status"] == "down"
        assert rs.error is not None and "every engine replica failed" in str(rs.error)
    finally:
        rs.shutdown()


def test_requests_of_a_dead_replica_fail_over(monkeypatch):
    rs = _fake_set(monkeypatch, outcomes=[True], size=2)
    try:
        async def add(i, prompt):
            return await rs.add_request(f"r{i}", prompt, SamplingParams(max_tokens=4))

        async def scenario():
            streams = [await add(i, [i + 1] * 3) for i in range(4)]
            on_zero = [s for s in streams if s.engine_index == "0"]
            assert len(on_zero) == 2, "least loaded: the replicas take turns"
            started = rs._requests[on_zero[0].request_id]
            started.started = True  # it has streamed output: it cannot move
            dead = rs._replicas[0].client
            rs._on_exit(dead, "killed by SIGKILL")
            await asyncio.sleep(0.05)
            with pytest.raises(replicas_module.EngineDeadError, match="SIGKILL"):
                async for _ in on_zero[0]:
                    pass
            moved = rs._requests[on_zero[1].request_id]
            assert moved.replica.index == 1 and moved.retried and on_zero[1].engine_index == "1"
            sent = [r.request_id for m in rs._replicas[1].client.sent for r in getattr(m, "requests", [])]
            assert sent.count(on_zero[1].request_id) == 1
            assert rs.health()["replicas"][0]["state"] in ("restarting", "up")
            _wait(lambda: rs.health()["replicas"][0]["state"] == "up")
            # the restarted replica takes new requests again
            again = [await add(10 + i, [7, 7, 7]) for i in range(4)]
            assert {s.engine_index for s in again} == {"0"}, "the least loaded: the fresh replica"

        asyncio.run(scenario())
    finally:
        rs.shutdown()


def test_a_request_whose_text_fails_ends_alone(monkeypatch, caplog):
    """An exception while turning one request's tokens into text (a bug) ends that request
    with an error and aborts it in its core; the other requests in the same message go on,
    and the receiver thread survives (before, it died and every request on the replica hung)."""
    from onecat.runtime.core.messages import AbortRequests, Outputs
    from onecat.runtime.server.async_engine import RequestFailedError

    rs = _fake_set(monkeypatch, outcomes=[])
    real_text = replicas_module.ReplicaSet._text

    def text(request, out):
        if request.request_id == "bad":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real_text(request, out)

    monkeypatch.setattr(replicas_module.ReplicaSet, "_text", staticmethod(text))
    try:
        async def scenario():
            good = await rs.add_request("good", [1, 2, 3], SamplingParams(max_tokens=4))
            bad = await rs.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=4))
            client = rs._replicas[0].client
            outs = [RequestOutput(rid, [5], "", False, None, 3, 1) for rid in ("good", "bad")]
            with caplog.at_level(logging.ERROR, logger="onecat.runtime.core.replicas"):
                rs._on_message(client, Outputs(outs), time.monotonic())
            with pytest.raises(RequestFailedError, match="UnicodeDecodeError"):
                await bad.__anext__()
            first = await good.__anext__()
            assert first.new_token_ids == [5] and not good.finished
            assert "bad" not in rs._requests and "good" in rs._requests
            assert rs._replicas[0].load == 1
            aborts = [m for m in client.sent if isinstance(m, AbortRequests)]
            assert aborts and aborts[-1].request_ids == ["bad"]
            assert "could not be turned into text" in caplog.text

        asyncio.run(scenario())
    finally:
        rs.shutdown()


# ----- real engine-core processes on CPU ---------------------------------------------------------


@pytest.fixture(scope="module")
def core_set():
    rs = replicas_module.ReplicaSet(EngineConfig(model=str(TRAINED), device="cpu", max_model_len=256), 1)
    rs.start()
    yield rs
    rs.shutdown()


async def _collect(stream):
    text, last, tokens = "", None, []
    async for out in stream:
        text += out.new_text
        tokens += out.new_token_ids
        last = out
    return text, tokens, last


@pytest.mark.timeout(300)
def test_core_process_answers_like_the_in_process_engine(core_set):
    """Greedy text, stop strings, stop tokens and ``n`` choices through a core process equal
    the in-process engine's on the trained tiny model."""
    from onecat.runtime.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(TRAINED), device="cpu", max_model_len=256))
    prompts = ["The quick brown fox", "def add(a, b):", "In Python, a list"]
    cases = [SamplingParams(max_tokens=24, temperature=0),
             SamplingParams(max_tokens=24, temperature=0, stop=[" the", "\n"]),
             SamplingParams(max_tokens=24, temperature=0, logprobs=2)]
    expected = [[engine.generate([p], params)[0] for p in prompts] for params in cases]
    tokenizer = core_set.tokenizer
    assert core_set.model_name == engine.model_name and core_set.max_model_len == engine.max_model_len

    async def run():
        results = []
        for params in cases:
            streams = [await core_set.add_request(f"c{len(results)}-{i}", tokenizer.encode(p), params)
                       for i, p in enumerate(prompts)]
            results.append(await asyncio.gather(*[_collect(s) for s in streams]))
        # two choices of one request share a replica and both finish
        pair = await core_set.add_requests(["n-0", "n-1"], tokenizer.encode(prompts[0]), [cases[0], cases[0]])
        both = await asyncio.gather(*[_collect(s) for s in pair])
        return results, both

    results, both = asyncio.run(run())
    for case, (params, want) in enumerate(zip(cases, expected, strict=True)):
        got = [text for text, _, _ in results[case]]
        assert got == want, (params, got, want)
        for _text, tokens, last in results[case]:
            assert last.finished and last.completion_tokens == len(tokens)
            if params.logprobs:
                assert last.logprobs is not None
    assert both[0][0] == both[1][0] == expected[0][0]
    _wait(core_set.idle)
    _wait(lambda: core_set.stats()["running"] == 0)
    stats = core_set.stats()
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]


@pytest.mark.timeout(300)
def test_abort_and_bad_requests_in_the_api_process(core_set):
    from onecat.runtime.errors import RequestError

    tokenizer = core_set.tokenizer

    async def run():
        with pytest.raises(RequestError, match="max_tokens"):
            await core_set.add_request("big", [1, 2, 3], SamplingParams(max_tokens=1000))
        with pytest.raises(RequestError, match="prompt token ids"):
            await core_set.add_request("oov", [10**7], SamplingParams())
        stream = await core_set.add_request("long", tokenizer.encode("Once"),
                                            SamplingParams(max_tokens=200, ignore_eos=True, temperature=0))
        first = await stream.__anext__()
        assert first.new_token_ids
        core_set.abort("long")
        rest = [out async for out in stream]
        assert rest == [] or not rest[-1].finished

    asyncio.run(run())
    _wait(core_set.idle)
    _wait(lambda: core_set.stats().get("running", 1) == 0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_failover_under_64_streams(caplog):
    """Two CPU replicas behind the HTTP server; replica 0 is killed (SIGKILL) while 64
    streams run: no request hangs, the ones running on it end with an error event and
    [DONE], every other one (those not started yet among them) is served in full, and the
    restarted replica takes traffic again."""
    pytest.importorskip("fastapi")
    from onecat.runtime.server.launcher import BackgroundServer

    rs = replicas_module.ReplicaSet(
        EngineConfig(model=str(TRAINED), device="cpu", max_model_len=256, max_num_seqs=4), 2)
    rs.start()
    max_tokens = 40
    results: dict[int, tuple[str, int, int]] = {}  # i -> (outcome, tokens before the end, completion tokens)
    first_token = threading.Event()

    async def one(client, i):
        body = {"prompt": f"Item {i}: the", "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        seen, usage, error = 0, 0, None
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if "error" in payload:
                    error = payload["error"]
                elif payload.get("usage"):
                    usage = payload["usage"]["completion_tokens"]
                elif payload["choices"][0]["text"]:
                    seen += 1
                    first_token.set()
        results[i] = ("error" if error else "ok", seen, usage)
        if error:
            assert error["code"] == "engine_unavailable" and "SIGKILL" in error["message"]

    async def load(url):
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            await asyncio.wait_for(asyncio.gather(*[one(client, i) for i in range(64)]), 300)

    try:
        with caplog.at_level(logging.WARNING, logger="onecat.runtime.core.replicas"), BackgroundServer(rs) as srv:
            killer = threading.Thread(target=lambda: (first_token.wait(60), rs.kill_replica(0)))
            killer.start()
            asyncio.run(load(srv.url))
            killer.join()
            assert len(results) == 64, "every request ended"
            failed = [i for i, (outcome, _, _) in results.items() if outcome == "error"]
            served = [i for i, (outcome, _, usage) in results.items() if outcome == "ok" and usage == max_tokens]
            assert len(failed) + len(served) == 64
            assert len(failed) <= 4, "only the requests running on the killed replica (max_num_seqs 4) fail"
            assert "passing" in caplog.text, "requests waiting on the killed replica went to the live one"
            _wait(lambda: rs.health()["replicas"][0]["state"] == "up", timeout=120)
            health = httpx.get(srv.url + "/health").json()
            assert health["status"] == "ok" and health["replicas"][0]["restarts"] == 1
            before = dict(rs.replica_stats()).get("0", {}).get("prompt_tokens_total", 0)
            asyncio.run(_more(srv.url))
            _wait(lambda: dict(rs.replica_stats()).get("0", {}).get("prompt_tokens_total", 0) > before)
            text = httpx.get(srv.url + "/metrics").text
            assert 'vllm:num_requests_running{engine="0"' in text and 'vllm:num_requests_running{engine="1"' in text
    finally:
        rs.shutdown()


async def _more(url):
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        replies = await asyncio.gather(*[
            client.post("/v1/completions", json={"prompt": f"Again {i}", "max_tokens": 4}) for i in range(8)])
    assert all(r.status_code == 200 for r in replies)


def factory_engine(config, replica, model):
    """An ``engine_factory`` for the test below: the engine over ``model``, built in the core."""
    from dataclasses import replace

    from onecat.runtime.engine import LLMEngine

    return LLMEngine(replace(config, model=model, served_model_name=f"built-by-factory-{replica}"))


@pytest.mark.timeout(300)
def test_engine_factory_builds_the_core_engine(monkeypatch):
    """Benchmarks build random models inside the core process (``engine_factory``)."""
    import os
    from pathlib import Path

    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    rs = replicas_module.ReplicaSet(
        EngineConfig(model=str(TRAINED), device="cpu", max_model_len=128), 1,
        engine_factory=("test_engine_core:factory_engine", {"model": str(TRAINED)}))
    try:
        rs.start()
        assert rs._replicas[0].client.ready.model_name == "built-by-factory-0"

        async def run():
            stream = await rs.add_request("f", rs.tokenizer.encode("Hello"), SamplingParams(max_tokens=3))
            return await _collect(stream)

        _, tokens, last = asyncio.run(run())
        assert last.finished and len(tokens) == last.completion_tokens
    finally:
        rs.shutdown()


@pytest.mark.timeout(300)
def test_grammar_mask_crosses_to_the_core(core_set):
    """A response_format grammar compiled in the API process constrains sampling in the
    core (it travels serialised): the answer parses and matches the schema."""
    pytest.importorskip("xgrammar")
    from onecat.runtime.server.structured_output import GrammarBackend, JsonConstraint

    tokenizer = core_set.tokenizer
    backend = GrammarBackend(tokenizer, core_set.vocab_size, core_set.eos_token_ids)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    compiled = backend.compile(JsonConstraint(schema))

    async def run():
        results = []
        for i in range(2):  # the second one reuses the serialised grammar (cached on both sides)
            params = SamplingParams(max_tokens=40, temperature=0,
                                    logits_processors=[backend.logits_processor(compiled)])
            stream = await core_set.add_request(f"g{i}", tokenizer.encode("A JSON object:"), params)
            results.append(await _collect(stream))
        return results

    for text, _, last in asyncio.run(run()):
        assert last.finish_reason == "stop", (text, last)
        value = json.loads(text)
        assert set(value) == {"n"} and isinstance(value["n"], int)


def sleeping_engine(config, replica, seconds):
    """An ``engine_factory`` that never finishes building in time (a model still loading)."""
    time.sleep(seconds)
    raise RuntimeError("not reached in the test")


@pytest.mark.timeout(120)
def test_a_core_still_building_exits_when_its_api_process_dies(tmp_path):
    """A core whose API process is SIGKILLed while the core builds its engine exits within
    seconds instead of loading on and holding its GPU."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    spec = {"config": {"model": str(TRAINED), "device": "cpu"}, "index": 0,
            "inputs": f"ipc://{tmp_path}/in", "outputs": f"ipc://{tmp_path}/out",
            "factory": "test_engine_core:sleeping_engine", "factory_args": {"seconds": 600}}
    parent_code = (  # the spec names its parent, as EngineCoreClient's does: a core still importing
        # when the parent dies would otherwise take its new parent for the API process
        "import json, os, subprocess, sys, time\n"
        f"spec = json.dumps({{**json.loads({json.dumps(spec)!r}), 'parent': os.getpid()}})\n"
        "core = subprocess.Popen([sys.executable, '-m', 'onecat.runtime.core.process', spec])\n"
        "print(core.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                        os.environ.get("PYTHONPATH")]))}
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True, env=env)
    core = int(parent.stdout.readline())
    time.sleep(3)  # the core is importing or building by now
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(core, 0)  # the orphan is reparented (not our child): probe it with signal 0
        except ProcessLookupError:
            return
        with open(f"/proc/{core}/stat") as stat:
            if stat.read().split(")")[-1].split()[0] == "Z":  # exited, not yet reaped by init
                return
        time.sleep(0.2)
    os.kill(core, signal.SIGKILL)
    pytest.fail("the engine core outlived its API process by 30 s")
