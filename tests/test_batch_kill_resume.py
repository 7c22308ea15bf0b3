"""`onecat batch` killed (SIGKILL) halfway through 2000 lines and resumed with --resume: every
custom_id ends up in the output exactly once, every line whole and valid JSON (issue #41's
target, on the trained tiny Qwen3.5 on CPU)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from onecat.tiny_train import fixture_dir

pytest.importorskip("fastapi")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LINES = 2000


def batch_command(source, out, *extra: str) -> list[str]:
    return [sys.executable, "-m", "onecat.cli", "batch", str(source), "-o", str(out),
            str(fixture_dir("qwen3_5")), "--device", "cpu", "--max-model-len", "128", "--no-progress",
            *extra]


def test_a_killed_job_resumes_with_every_custom_id_once(tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    with source.open("w") as f:
        for i in range(LINES):
            if i % 2:
                url, body = "/v1/completions", {"prompt": f"Item {i} is", "max_tokens": 4}
            else:
                url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Tell me {i}"}],
                                                     "max_tokens": 4}
            f.write(json.dumps({"custom_id": f"id-{i}", "method": "POST", "url": url, "body": body}) + "\n")

    proc = subprocess.Popen(batch_command(source, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 200
    while proc.poll() is None and time.monotonic() < deadline:
        if out.exists() and out.read_bytes().count(b"\n") >= LINES // 2:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL, f"not killed halfway: {proc.stderr.read().decode()[-2000:]}"
    written = out.read_bytes().count(b"\n")
    assert LINES // 2 <= written < LINES

    done = subprocess.run(batch_command(source, out, "--resume"), capture_output=True, timeout=200)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    data = out.read_bytes()
    assert data.endswith(b"\n")
    records = [json.loads(line) for line in data.splitlines()]  # every line whole JSON
    ids = [r["custom_id"] for r in records]
    assert sorted(ids) == sorted(f"id-{i}" for i in range(LINES)), "some custom_id is missing or repeated"
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in records)
