"""Shared helpers of the server tests: the tiny engine, waiting for the engine to go idle,
/metrics parsing and SSE framing checks."""

from __future__ import annotations

import re
import time

import httpx

from onecat.runtime.config import EngineConfig
from onecat.runtime.engine import LLMEngine

API_KEY = "test-key"
MODEL = "tiny-qwen3_5"
MAX_MODEL_LEN = 256
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HELLO = [{"role": "user", "content": "Hello, who are you?"}]


def make_engine(model_dir, **overrides) -> LLMEngine:
    """The real engine on CPU over the tiny model."""
    config = dict(
        model=str(model_dir), device="cpu", max_model_len=MAX_MODEL_LEN, served_model_name=MODEL
    )
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


def wait_idle(server, timeout: float = 15.0) -> dict[str, int]:
    """The engine stats once nothing runs or waits (fails the test after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.async_engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
        assert time.monotonic() < deadline, f"engine still busy: {stats}"
        time.sleep(0.02)


def assert_all_free(stats: dict[str, int]) -> None:
    """Every KV block and state slot is back in its pool."""
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"] > 0, stats
    assert stats["free_state_slots"] == stats["total_state_slots"] > 0, stats


def metric_samples(text: str) -> dict[str, float]:
    """The ``onecat:`` and ``vllm:`` samples of an exposition text, keyed by name and any
    labels beside vLLM's ``model_name`` / ``engine`` (``vllm:prompt_tokens_total``,
    ``vllm:time_to_first_token_seconds_bucket{le="0.1"}``, ``onecat:kv_blocks_free``)."""
    samples = {}
    for line in text.splitlines():
        if line.startswith(("onecat:", "vllm:")):
            name, value = line.rsplit(" ", 1)
            base, _, labels = name.partition("{")
            kept = [p for p in re.findall(r'[a-z_]+="[^"]*"', labels) if not p.startswith(("engine=", "model_name="))]
            samples[base + ("{" + ",".join(kept) + "}" if kept else "")] = float(value)
    return samples


def scrape(url: str) -> dict[str, float]:
    """/metrics' samples (``metric_samples``)."""
    return metric_samples(httpx.get(url + "/metrics", timeout=10).text)


def assert_metrics_idle(url: str, timeout: float = 15.0) -> dict[str, float]:
    """/metrics reports nothing running or waiting and every block and slot free (polls: the
    engine publishes its stats after each iteration)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        idle = (
            m["vllm:num_requests_running"] == 0
            and m["vllm:num_requests_waiting"] == 0
            and m["onecat:kv_blocks_free"] == m["onecat:kv_blocks_total"] > 0
            and m["onecat:state_slots_free"] == m["onecat:state_slots_total"] > 0
        )
        if idle:
            return m
        assert time.monotonic() < deadline, f"/metrics never returned to idle: {m}"
        time.sleep(0.05)


def sse_payloads(lines: list[str]) -> list[str]:
    """The ``data:`` payloads of an SSE body, checking OpenAI's framing on the way."""
    payloads = []
    for i, line in enumerate(lines):
        if not line:
            continue
        assert line.startswith("data: "), f"line {i} is not an SSE data line: {line!r}"
        assert i + 1 < len(lines) and lines[i + 1] == "", "events must be separated by a blank line"
        payloads.append(line[len("data: ") :])
    assert payloads and payloads[-1] == "[DONE]", "the stream must end with data: [DONE]"
    assert "[DONE]" not in payloads[:-1]
    return payloads[:-1]


def stream_lines(client: httpx.Client, path: str, body: dict) -> list[str]:
    """The lines of a 200 SSE response."""
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(response.iter_lines())


class LaunchStopped(Exception):
    """Raised by :func:`capture_launches`' stand-ins: the command stops where it would start."""


def capture_launches(monkeypatch) -> tuple[list, list[dict]]:
    """Make ``onecat serve`` / ``generate`` stop where they would start an engine (an
    ``LLMEngine`` or ``serve``'s ``ReplicaSet``): returns the lists that receive each
    embedded engine's ``EngineConfig`` and each vLLM launch's keyword
    arguments (``serve_from_onecat_flags``)."""
    configs: list = []
    vllm_calls: list[dict] = []

    def fake_engine(config):
        configs.append(config)
        raise LaunchStopped

    def fake_replicas(config, data_parallel_size=1, **kwargs):
        configs.append(config)
        raise LaunchStopped

    def fake_vllm(artifact, **kwargs):
        vllm_calls.append(kwargs)
        raise LaunchStopped

    monkeypatch.setattr("onecat.runtime.engine.LLMEngine", fake_engine)
    monkeypatch.setattr("onecat.runtime.core.replicas.ReplicaSet", fake_replicas)
    monkeypatch.setattr("onecat.vllm_plugin.launcher.serve_from_onecat_flags", fake_vllm)
    return configs, vllm_calls
