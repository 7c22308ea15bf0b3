"""`onecat generate` and `onecat serve`'s command line on a tiny random Qwen3.5 (CPU)."""

from __future__ import annotations

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
        "--enforce-eager", "--device", "--max-queue-len",
    ):
        assert flag in help_text, flag
    assert "127.0.0.1" in help_text and "8000" in help_text and "0.92" in help_text
    missing = runner.invoke(main, ["serve", str(tmp_path / "nope")])
    assert missing.exit_code != 0 and "does not exist" in missing.output


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
