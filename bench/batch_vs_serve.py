"""`onecat batch` against `onecat serve` + `onecat bench serve` on the same requests at the same
concurrency (issue #41: batch throughput >= 95% of the server's).

Both sides run the trained tiny Qwen3.5 (``onecat/fixtures/trained-qwen3_5``, or --model) on
the same engine flags. The N prompts are slices of the held-out pydoc text; every request
generates exactly --output-len tokens (``ignore_eos``) at the server's default sampling. The
server side is `onecat serve` in a subprocess and `onecat bench serve --dataset-name custom`
(streamed /v1/completions, its output token throughput); the batch side is `onecat batch` on
a JSONL of the same /v1/completions bodies (its generated tokens over its wall time; neither
figure includes loading the model). The runs alternate, --rounds times each, so a noisy
machine hits both; the ratio is of the summed tokens over the summed seconds (each
round's own ratio and their median are printed too).

    python bench/batch_vs_serve.py --num-prompts 400 --concurrency 32 --output-len 16
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from onecat.tiny_train import fixture_dir, heldout_text

BATCH_LINE = re.compile(r"(\d+) tokens generated in ([\d.]+) s")


def prompts(count: int, words: int) -> list[str]:
    """``count`` prompts of ``words`` words each, consecutive slices of the held-out text."""
    text = heldout_text().split()
    return [" ".join(text[(i * words) % (len(text) - words):][:words]) for i in range(count)]


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags both sides use."""
    return ["--device", "cpu", "--max-model-len", str(args.max_model_len),
            "--max-num-seqs", str(max(args.concurrency, 1))]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_serve(args: argparse.Namespace, dataset: Path, work: Path) -> tuple[int, float]:
    """Generated tokens and seconds of `onecat bench serve` against `onecat serve`."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "onecat.cli", "serve", args.model, "--port", str(port),
         "--served-model-name", "tiny", "--log-level", "warning", *engine_flags(args)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if server.poll() is not None:
                raise SystemExit(f"onecat serve exited: {server.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("onecat serve did not come up in 120 s")
            time.sleep(0.2)
        result_path = work / "serve.json"
        subprocess.run(
            [sys.executable, "-m", "onecat.cli", "bench", "serve", "--base-url", url, "--no-progress",
             "--dataset-name", "custom", "--dataset-path", str(dataset), "--num-prompts", str(args.num_prompts),
             "--custom-output-len", str(args.output_len), "--ignore-eos", "--max-concurrency",
             str(args.concurrency), "--tokenizer", args.model, "--result-json", str(result_path)],
            check=True, stdout=subprocess.DEVNULL)
        result = json.loads(result_path.read_text())
        return result["total_output_tokens"], result["duration"]
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def run_batch(args: argparse.Namespace, requests: Path, work: Path, round_: int) -> tuple[int, float]:
    """Generated tokens and seconds of `onecat batch` (its own summary line)."""
    out = work / f"batch-{round_}.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "onecat.cli", "batch", str(requests), "-o", str(out), args.model,
         "--served-model-name", "tiny", "--no-progress", "--max-concurrency", str(args.concurrency),
         *engine_flags(args)],
        capture_output=True, text=True)
    match = BATCH_LINE.search(done.stderr)
    if done.returncode != 0 or match is None:
        raise SystemExit(f"onecat batch failed: {done.stderr[-2000:]}")
    return int(match.group(1)), float(match.group(2))


def main() -> None:
    """Run both sides --rounds times, alternating, and print the figures and their ratio."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(fixture_dir("qwen3_5")))
    parser.add_argument("--num-prompts", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-words", type=int, default=24)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="batch-vs-serve-") as tmp:
        work = Path(tmp)
        texts = prompts(args.num_prompts, args.input_words)
        dataset, requests = work / "prompts.jsonl", work / "requests.jsonl"
        dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in texts))
        body = {"model": "tiny", "max_tokens": args.output_len, "ignore_eos": True}
        requests.write_text("".join(
            json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                        "body": {**body, "prompt": p}}) + "\n" for i, p in enumerate(texts)))
        totals = {"serve": [0, 0.0], "batch": [0, 0.0]}
        ratios = []
        for round_ in range(args.rounds):
            rates = {}
            for side in ("serve", "batch"):
                if side == "serve":
                    tokens, seconds = run_serve(args, dataset, work)
                else:
                    tokens, seconds = run_batch(args, requests, work, round_)
                totals[side][0] += tokens
                totals[side][1] += seconds
                rates[side] = tokens / seconds
                print(f"round {round_ + 1} {side:5s}: {tokens} tokens in {seconds:.2f} s, "
                      f"{tokens / seconds:.1f} tok/s", flush=True)
            ratios.append(rates["batch"] / rates["serve"])
    rate = {side: tokens / seconds for side, (tokens, seconds) in totals.items()}
    print(f"{args.num_prompts} prompts x {args.output_len} tokens, concurrency {args.concurrency}: "
          f"serve {rate['serve']:.1f} tok/s, batch {rate['batch']:.1f} tok/s, "
          f"batch / serve = {rate['batch'] / rate['serve']:.3f} (rounds: "
          f"{', '.join(f'{r:.3f}' for r in ratios)}; median {statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
