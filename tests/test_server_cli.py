"""`onecat generate` and `onecat serve`'s command line on a tiny random Qwen3.5 (CPU)."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from onecat.cli import main
from onecat.runtime.config import EngineConfig
from onecat.runtime.engine import LLMEngine
from onecat.runtime.sampling_params import SamplingParams
from onecat.runtime.server.prompts import chat_token_ids
from onecat.tiny import build_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model("qwen3_5", tmp_path_factory.mktemp("cli") / "tiny-qwen3_5")


def test_generate_matches_the_engine(model):
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", max_model_len=128))
    params = SamplingParams(max_tokens=6, temperature=0.0)
    expected_plain = engine.generate(["def main():"], params)[0]
    messages = [{"role": "user", "content": "Hello"}]
    expected_chat = engine.generate([chat_token_ids(engine.tokenizer, messages)], params)[0]

    common = ["--max-tokens", "6", "--temperature", "0", "--device", "cpu", "--max-model-len", "128"]
    runner = CliRunner()
    plain = runner.invoke(main, ["generate", str(model), "--prompt", "def main():", *common])
    assert plain.exit_code == 0, plain.output
    assert plain.stdout == expected_plain + "\n"
    chat = runner.invoke(main, ["generate", str(model), "--prompt", "Hello", "--chat", *common])
    assert chat.exit_code == 0, chat.output
    assert chat.stdout == expected_chat + "\n"


def test_generate_rejects_a_bad_request(model):
    runner = CliRunner()
    result = runner.invoke(
        main,
        ["generate", str(model), "--prompt", "x " * 200, "--max-model-len", "64", "--device", "cpu"],
    )
    assert result.exit_code == 1
    assert "error:" in result.output and "64" in result.output


def test_serve_flags_follow_vllm(tmp_path):
    runner = CliRunner()
    help_text = runner.invoke(main, ["serve", "--help"]).output
    for flag in (
        "--host", "--port", "--api-key", "--max-model-len", "--max-num-seqs",
        "--max-num-batched-tokens", "--gpu-memory-utilization", "--served-model-name",
        "--enforce-eager", "--device", "--max-queue-len", "--trust-request-chat-template",
        "--max-request-body-bytes", "--shutdown-timeout", "--structured-outputs-compile-timeout",
    ):
        assert flag in help_text, flag
    assert "127.0.0.1" in help_text and "8000" in help_text and "0.92" in help_text
    missing = runner.invoke(main, ["serve", str(tmp_path / "nope")])
    assert missing.exit_code != 0 and "does not exist" in missing.output


def test_serve_names_a_broken_config_json(model, tmp_path):
    """A config.json that is not JSON is named, as `onecat pack` names it; the tokenizer (which
    reads config.json too) is not blamed."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    (broken / "config.json").write_text('{"model_type": "qwen3_5", oops')
    result = CliRunner().invoke(main, ["serve", str(broken), "--device", "cpu"])
    assert result.exit_code == 1, result.output
    assert f"{broken / 'config.json'} is not valid JSON" in result.output and "tokenizer" not in result.output


def test_server_flags_reach_vllm_or_are_refused(tmp_path, monkeypatch):
    """With --engine vllm the HTTP server flags are vLLM's own (forwarded when given), and
    one vLLM lacks is refused rather than dropped."""
    calls = []

    class Replaced(Exception):
        pass

    def fake_serve(artifact, **kwargs):
        calls.append(kwargs["vllm_args"])
        raise Replaced  # the real one replaces the process

    monkeypatch.setattr("onecat.vllm_plugin.launcher.serve_from_onecat_flags", fake_serve)
    runner = CliRunner()
    base = ["serve", str(tmp_path), "--engine", "vllm"]
    runner.invoke(main, base)
    runner.invoke(main, [*base, "--trust-request-chat-template", "--shutdown-timeout", "12",
                         "--vllm-arg=--x"])
    assert calls == [(), ("--trust-request-chat-template", "--shutdown-timeout", "12", "--x")]
    refused = runner.invoke(main, [*base, "--max-request-body-bytes", "1000"])
    assert refused.exit_code == 1 and "--max-request-body-bytes" in refused.output
    refused = runner.invoke(main, [*base, "--structured-outputs-compile-timeout", "3"])
    assert refused.exit_code == 1 and "--structured-outputs-compile-timeout" in refused.output


def test_serve_command_serves_and_stops_on_ctrl_c(model):
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable, "-m", "onecat.cli", "serve", str(model), "--port", str(port),
        "--device", "cpu", "--max-model-len", "128", "--served-model-name", "tiny",
        "--api-key", "k", "--log-level", "warning",
    ]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "onecat serve did not come up"
            time.sleep(0.2)
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "tiny", "prompt": "def", "max_tokens": 3},
            headers={"Authorization": "Bearer k"},
            timeout=30,
        )
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "serving tiny on http://127.0.0.1:" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


# `onecat serve` whose engine steps take 50 ms at least, so that requests run for seconds
SLOW_STEPS = """
import time
from onecat.runtime.engine.model_runner import ModelRunner
real_run = ModelRunner.run
def slow_run(self, scheduled, *args):
    time.sleep(0.05)
    return real_run(self, scheduled, *args)
ModelRunner.run = slow_run
"""
"""A ``sitecustomize`` that slows every engine step: it runs in the server's process and in
its engine-core process (which inherits ``PYTHONPATH``)."""


@pytest.mark.slow
def test_sigterm_drains_running_requests_then_exits_0(model, tmp_path):
    """SIGTERM: new requests and /health get 503 at once (the socket still listens), a request that finishes within
    --shutdown-timeout completes normally, one that does not gets an SSE error event and
    [DONE], and the process exits 0."""
    import json
    import signal
    import socket
    import subprocess
    import sys
    import threading
    import time

    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable, "-m", "onecat.cli", "serve", str(model), "--port", str(port), "--device", "cpu",
        "--max-model-len", "256", "--served-model-name", "tiny", "--shutdown-timeout", "2",
        "--log-level", "info",
    ]
    (tmp_path / "sitecustomize.py").write_text(SLOW_STEPS)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": path})
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "onecat serve did not come up"
            time.sleep(0.2)

        streams: dict[str, list[str]] = {"short": [], "long": []}
        first_chunk = {name: threading.Event() for name in streams}

        def stream(name: str, max_tokens: int) -> None:
            body = {"prompt": "def", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    streams[name].append(line)
                    first_chunk[name].set()

        threads = [threading.Thread(target=stream, args=("short", 10)),  # ~0.5 s of steps
                   threading.Thread(target=stream, args=("long", 100))]  # ~5 s of steps
        for thread in threads:
            thread.start()
        for event in first_chunk.values():
            assert event.wait(30), "the streams did not start"
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        for path, call in (("/health", httpx.get), ("/v1/completions", httpx.post)):
            # new connections are still accepted during the drain, and answered 503
            kwargs = {"json": {"prompt": "x", "max_tokens": 1}} if call is httpx.post else {}
            refused = call(url + path, timeout=5, **kwargs)
            assert refused.status_code == 503, (path, refused.text)
            assert refused.json()["error"]["code"] == "server_shutting_down", refused.text
        for thread in threads:
            thread.join(30)
        assert proc.wait(timeout=30) == 0
        elapsed = time.monotonic() - sent
        output = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()

    def payloads(lines: list[str]) -> list[str]:
        data = [line[len("data: "):] for line in lines if line]
        assert data and data[-1] == "[DONE]", lines[-3:]
        return data[:-1]

    short = [json.loads(p) for p in payloads(streams["short"])]
    assert short[-1]["choices"][0]["finish_reason"] == "length", short[-1]
    long = [json.loads(p) for p in payloads(streams["long"])]
    error = long[-1]["error"]
    assert error["code"] == "server_shutting_down" and "--shutdown-timeout" in error["message"]
    assert all("choices" in chunk for chunk in long[:-1]) and len(long) > 2
    assert 2 <= elapsed < 20, elapsed
    assert "shutdown timeout (2 s) reached" in output, output[-2000:]
