"""`onecat bench serve` end to end on CPU: the real `onecat serve` (a subprocess) on a tiny
packed Qwen3.5, benchmarked through the command line; then the failures a user meets (an
oversized prompt answered 400, a wrong key, nothing listening)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from click.testing import CliRunner

from onecat.benchmarks.datasets import load_tokenizer, random_requests
from onecat.cli import main
from onecat.tiny import build_tiny_model

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytestmark = pytest.mark.timeout(300)

MAX_MODEL_LEN = 128
API_KEY = "bench-key"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A tiny Qwen3.5 quantized (RTN, g32) and packed: the artifact `onecat serve` takes."""
    from onecat.pack.writer import pack_checkpoint
    from onecat.quantize.pipeline import quantize_rtn

    root = tmp_path_factory.mktemp("bench-e2e")
    model = build_tiny_model("qwen3_5", root / "tiny")
    awq = quantize_rtn(model, root / "awq", group_size=32, show_progress=False)
    return pack_checkpoint(awq, root / "packed", show_progress=False)


@pytest.fixture(scope="module")
def server(packed):
    port = free_port()
    command = [
        sys.executable, "-m", "onecat.cli", "serve", str(packed), "--port", str(port),
        "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny",
        "--api-key", API_KEY, "--log-level", "warning",
    ]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "onecat serve did not come up"
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def bench(*args: str):
    return CliRunner().invoke(main, ["bench", "serve", "--no-progress", *args])


def max_overlap(starts: list[float], latencies: list[float]) -> int:
    """Most requests in flight at one moment (intervals [start, start + latency))."""
    events = sorted([(s, 1) for s in starts] + [(s + t, -1) for s, t in zip(starts, latencies, strict=True)],
                    key=lambda e: (e[0], e[1]))
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def test_bench_serve_measures_onecat_serve(server, packed, tmp_path):
    out = tmp_path / "result.json"
    run = bench("--base-url", server, "--api-key", API_KEY, "--tokenizer", str(packed),
                "--random-input-len", "24", "--random-output-len", "6", "--num-prompts", "6",
                "--max-concurrency", "2", "--seed", "1", "--result-json", str(out))
    assert run.exit_code == 0, run.output
    assert "Serving Benchmark Result" in run.output and "Median TTFT (ms)" in run.output
    result = json.loads(out.read_text())
    assert result["model_id"] == "tiny" and result["endpoint_type"] == "completions"
    assert result["completed"] == 6 and result["failed"] == 0 and result["max_concurrency"] == 2
    assert result["ignore_eos"] is True
    assert result["output_lens"] == [6] * 6 and result["total_output_tokens"] == 36  # exact
    assert result["input_lens"] == [24] * 6  # the server counted the prompts' intended lengths
    assert all(t > 0 for t in result["ttfts"]) and result["mean_ttft_ms"] > 0
    for itl, latency, ttft in zip(result["itls"], result["latencies"], result["ttfts"], strict=True):
        assert len(itl) <= 5 and all(gap > 0 for gap in itl)  # one gap per later text chunk
        assert latency >= ttft + sum(itl) - 1e-6
    assert sum(len(itl) for itl in result["itls"]) > 0
    assert max_overlap(result["start_times"], result["latencies"]) == 2  # the cap held
    for key in ("p99_ttft_ms", "median_tpot_ms", "p99_itl_ms", "output_throughput", "duration"):
        assert result[key] > 0, key
    assert result["output_throughput"] == pytest.approx(36 / result["duration"])


def test_bench_serve_chat_with_the_served_models_tokenizer(server, packed, tmp_path):
    out = tmp_path / "chat.json"
    run = bench("--base-url", server + "/v1", "--endpoint", "/v1/chat/completions", "--api-key", API_KEY,
                "--random-input-len", "12", "--random-output-len", "5", "--num-prompts", "3",
                "--request-rate", "50", "--result-json", str(out))
    assert run.exit_code == 0, run.output
    result = json.loads(out.read_text())
    assert result["backend"] == "openai-chat" and result["request_rate"] == 50
    assert result["tokenizer_id"] == str(packed)  # the root /v1/models reports, a local directory
    assert result["completed"] == 3 and result["output_lens"] == [5] * 3
    assert all(n > 12 for n in result["input_lens"])  # 12 tokens plus the chat template


def test_failed_requests_are_counted_and_shown(server, packed, tmp_path):
    args = ["--random-input-len", "100", "--random-range-ratio", "0.5", "--random-output-len", "6",
            "--num-prompts", "8", "--seed", "2"]
    requests = random_requests(8, 100, 6, 0.5, seed=2, tokenizer=load_tokenizer(str(packed)))
    too_long = sum(r.prompt_len + r.output_len > MAX_MODEL_LEN for r in requests)
    assert 0 < too_long < 8
    out = tmp_path / "failed.json"
    run = bench("--base-url", server, "--api-key", API_KEY, "--tokenizer", str(packed), *args,
                "--max-concurrency", "4", "--result-json", str(out))
    assert run.exit_code == 1
    assert f"{too_long} of 8 requests failed" in run.output
    assert f"HTTP 400 from {server}/v1/completions" in run.output and str(MAX_MODEL_LEN) in run.output
    result = json.loads(out.read_text())  # still written: the run completed
    assert result["failed"] == too_long and result["completed"] == 8 - too_long
    assert sum(bool(e) for e in result["errors"]) == too_long


def test_wrong_key_and_unreachable_server_are_clear(server):
    run = bench("--base-url", server, "--api-key", "wrong", "--num-prompts", "1")
    assert run.exit_code == 1
    assert f"{server}/v1/models answered 401" in run.output and "--api-key" in run.output
    run = bench("--base-url", server, "--result-json", "/nonexistent/dir/r.json")
    assert run.exit_code == 1 and "--result-json /nonexistent/dir/r.json" in run.output
    dead = f"http://127.0.0.1:{free_port()}"
    run = bench("--base-url", dead, "--num-prompts", "1")
    assert run.exit_code == 1
    assert f"cannot reach {dead}/v1/models" in run.output and "--base-url" in run.output
    run = bench("--base-url", server, "--api-key", API_KEY, "--model", "other", "--num-prompts", "1")
    assert run.exit_code == 1 and "--model other: not served" in run.output and "tiny" in run.output
