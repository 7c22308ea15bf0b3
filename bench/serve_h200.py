"""onecat's HTTP server under `onecat bench serve` on Qwen3.5-27B- and 35B-A3B-shaped random
packed models (GPU), next to the engine's own speed in the engine-core process.

For each model a server process (the API process) starts ``--data-parallel-size``
engine-core processes (``ReplicaSet``, as ``onecat serve`` does) whose ``engine_factory``
(``random_engine``) builds the model at full depth with random packed 4-bit weights
directly on the GPU (``bench/e2e.py``'s shapes and weights, the real 248,320-token
vocabulary). Replica 0 first times the engine alone: decode with each benchmarked
concurrency as the batch size (``e2e.timed_decode``: 128-token prompts, greedy), the
driver's closed-loop workload, and the time to first token of a 128-token prompt. Then the
server serves the replicas (the code path of ``onecat serve`` after loading).
``--ttft-run`` adds a run of 128-token prompts one at a time (the API process's added time
to first token); ``--kill-replica-at S`` SIGKILLs replica 0 S seconds after the last run's warm-ups and
reports what completed, what failed and the replicas' states after the restart. The driver runs
``onecat bench serve`` against it for each workload (``--workloads``; default random prompts
of 128-512 tokens and 25-103 output tokens with ``ignore_eos``: the range ratio applies to both
lengths, as in vLLM's random dataset; ``128:0:256`` is the decode-bound one) at each
concurrency (greedy like the engine figures, ``prompts_per_run`` prompts after ``concurrency``
warm-up requests) and prints one table. The TTFT run also splits the server's time to first
token by the stamps behind vLLM's histograms (``ttft_split``).

Long documents (issue 42, item 4): ``--workloads longdoc`` (= ``6144:0:256:2048:0.5``:
8k-token prompts, a shared 2048-token prefix on every second request, fresh tokens in its place
on the others, 256 out; ``IN:RATIO:OUT:PREFIX:SHARE``) with ``LONG_PROMPTS_PER_SLOT`` requests a
slot and at most ``LONG_WARMUPS`` warm-ups, the engine alone on the same mix
(``e2e.workload_requests``); ``--max-model-len`` is raised to the longest request;
``--kv-cache-dtype auto,int8,fp8_e5m2`` starts a server per dtype and model.

Why build in the server process instead of ``onecat serve ARTIFACT``: a packed 27B written
to disk is ~14 GB (minutes to write and to load, disk the GPU machine may not spare), while
random weights generated on the GPU take seconds; what is measured, the server and the
engine, is the same code either way.

The tokenizer is synthetic and word-level over the same vocabulary (``w123`` is token 123):
every token decodes to text on its own, so each generated token is one streamed chunk and
prompts re-encode to exactly their drawn length. (The real tokenizer is not downloaded.)

    ONECAT_KERNEL_ARCH=70 python bench/serve_h200.py --out serve_h200.json
    python bench/serve_h200.py --models 27b --layers 8 --concurrency 1,8   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

VOCAB = int(os.environ.get("ONECAT_BENCH_VOCAB", 248320))  # smaller only for CPU smoke runs
PROMPTS_PER_SLOT = 8
"""Requests per concurrency slot in a run. With mixed output lengths a closed loop ends in a
tail where the batch drains; at 2 a slot that tail dominated (engine alone on the trained tiny
model, CPU, concurrency 32: 20.4 output tokens a step with 64 requests, 29.3 with 256)."""
SPECIAL = ("<|endoftext|>", "<|im_end|>")


def build_word_tokenizer(out_dir: Path, vocab_size: int = VOCAB) -> Path:
    """A word-level tokenizer of ``vocab_size`` ids (special tokens first, then ``w{id}``)
    saved as a transformers fast tokenizer in ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL[1], pad_token=SPECIAL[0])
    fast.save_pretrained(out_dir)
    return out_dir


# ----- the server process ------------------------------------------------------------------


def random_engine(config, replica: int, model: str, layers: int | None, tokenizer: str, engine_json: str,
                  engine_batches: list[int], workloads: list[str]) -> object:
    """The engine of one engine-core process (``ReplicaSet``'s ``engine_factory``): the random
    model built on the GPU, and, in replica 0, the engine's own figures written to
    ``engine_json`` before it serves (decode at each batch size, each closed-loop workload the
    driver sends over HTTP (``workloads``: ``parse_workload`` strings), and the time to first
    token of a 128-token prompt alone)."""
    import e2e  # bench/e2e.py: model shapes, random packed weights, decode timing
    import torch
    from transformers import AutoTokenizer

    from onecat.runtime.engine import LLMEngine
    from onecat.runtime.models.config import ModelConfig
    from onecat.runtime.models.qwen3_5 import Qwen3_5ForCausalLM
    from onecat.runtime.quant_plan import QuantPlan

    raw = e2e.text_config(model, layers)
    raw["vocab_size"] = VOCAB
    dtype = torch.float16 if config.device == "cuda" else torch.float32
    t0 = time.perf_counter()
    with torch.device(config.device):
        net = Qwen3_5ForCausalLM(ModelConfig.from_dict(raw), QuantPlan(default=e2e.GROUP), dtype)
    e2e.fill_random(net)
    engine = LLMEngine.from_model(config, net, AutoTokenizer.from_pretrained(tokenizer))
    if replica != 0:
        return engine
    figures = {"model": model, "layers": raw["num_hidden_layers"], "setup_s": time.perf_counter() - t0,
               "kv_cache_dtype": config.kv_cache_dtype, "max_model_len": engine.max_model_len,
               "kv_cache_tokens": engine.runner.num_blocks * engine.runner.block_size,
               "engine_decode_tok_s": {}, "engine_workload_tok_s": {}, "engine_workload": {},
               "engine_ttft_128_ms": engine_ttft_ms(engine, 128)}
    print(f"  engine TTFT, 128-token prompt alone: {figures['engine_ttft_128_ms']:.2f} ms", flush=True)
    for batch in engine_batches:
        figures["engine_decode_tok_s"][batch] = e2e.timed_decode(engine, batch, 128, 24, 1000 * batch)
        print(f"  engine batch {batch}: {figures['engine_decode_tok_s'][batch]:.1f} tok/s", flush=True)
        for workload in workloads:  # the closed-loop workloads the driver sends over HTTP, on the engine alone
            input_len, range_ratio, output_len, prefix_len, share = parse_workload(workload)
            count = prompts_per_run(batch, range_ratio, prompt_tokens(workload))
            requests = e2e.workload_requests(count, input_len, output_len, range_ratio, VOCAB, 7 * batch,
                                             prefix_len, share)
            result = e2e.timed_workload(engine, requests, batch)
            figures["engine_workload_tok_s"][f"{workload}@{batch}"] = result["output_tok_s"]
            figures["engine_workload"][f"{workload}@{batch}"] = result
            print(f"  engine workload {workload} at concurrency {batch}: {result['output_tok_s']:.1f} tok/s",
                  flush=True)
    Path(engine_json).write_text(json.dumps(figures))
    return engine


def engine_ttft_ms(engine, prompt_len: int, runs: int = 9) -> float:
    """Median milliseconds to the first token of one ``prompt_len``-token prompt, the engine
    alone (``e2e.time_to_first_token``, a fresh prompt each run, the first one a warm-up):
    the baseline of the server's added time to first token."""
    import statistics

    import e2e

    times = [e2e.time_to_first_token(engine, prompt_len, seed=100 + run) for run in range(runs + 1)]
    return 1000 * statistics.median(times[1:])


NAMED_WORKLOADS = {"longdoc": "6144:0:256:2048:0.5"}
"""``--workloads`` names: ``longdoc`` is issue 42's long-document workload, 8k-token prompts
(6144 random tokens after 2048 more: the shared prefix on every second request, fresh tokens
on the others), 256 out."""
LONG_PROMPT_TOKENS = 4096
"""Workloads with prompts of at least this many tokens run ``LONG_PROMPTS_PER_SLOT`` requests a
slot and at most ``LONG_WARMUPS`` warm-ups (a long run's prefill would not fit a device call)."""
LONG_PROMPTS_PER_SLOT = 2
LONG_WARMUPS = 4


def parse_workload(text: str) -> tuple[int, float, int, int, float]:
    """``"IN:RATIO:OUT[:PREFIX[:SHARE]]"`` (e.g. ``320:0.6:64``: prompts of 320 tokens +-60%, 64
    +-60% out; ``6144:0:256:2048:0.5``: 6144 tokens after a shared 2048-token prefix on half the
    requests, ``onecat bench serve --random-prefix-len / --random-prefix-share``), or a name of
    ``NAMED_WORKLOADS``, as (input_len, range_ratio, output_len, prefix_len, prefix_share);
    SystemExit naming the flag when malformed."""
    fields = NAMED_WORKLOADS.get(text, text).split(":")
    try:
        if not 3 <= len(fields) <= 5:
            raise ValueError
        prefix_len = int(fields[3]) if len(fields) > 3 else 0
        share = float(fields[4]) if len(fields) > 4 else 1.0
        if prefix_len < 0 or not 0 <= share <= 1:
            raise ValueError
        return int(fields[0]), float(fields[1]), int(fields[2]), prefix_len, share
    except ValueError:
        raise SystemExit(f"--workloads: {text!r} is not IN:RATIO:OUT[:PREFIX[:SHARE]] (e.g. 320:0.6:64, "
                         f"6144:0:256:2048:0.5) nor one of {', '.join(NAMED_WORKLOADS)}") from None


def prompt_tokens(workload: str) -> int:
    """The longest prompt of a workload, in tokens."""
    from onecat.benchmarks.datasets import length_range

    input_len, ratio, _, prefix_len, _ = parse_workload(workload)
    return prefix_len + length_range(input_len, ratio, minimum=1)[1]


def longest_sequence(workloads: list[str]) -> int:
    """Tokens of the longest request of any workload (prompt + output)."""
    from onecat.benchmarks.datasets import length_range

    return max(prompt_tokens(w) + length_range(parse_workload(w)[2], parse_workload(w)[1], minimum=1)[1]
               for w in workloads)


def prompts_per_run(concurrency: int, range_ratio: float, prompt_len: int = 0) -> int:
    """Requests in one run: ``PROMPTS_PER_SLOT`` per slot, half that when every request has the
    same lengths (the batch then drains all at once: no tail to amortise), and
    ``LONG_PROMPTS_PER_SLOT`` for prompts of ``LONG_PROMPT_TOKENS`` or more."""
    per_slot = PROMPTS_PER_SLOT if range_ratio else PROMPTS_PER_SLOT // 2
    if prompt_len >= LONG_PROMPT_TOKENS:
        per_slot = LONG_PROMPTS_PER_SLOT
    return max(8, per_slot * concurrency)


def serve_random_model(args: argparse.Namespace) -> None:
    """The API process: ``data_parallel_size`` engine-core processes build the random model
    (``random_engine``), then onecat's OpenAI server serves them until killed (the code path
    of ``onecat serve`` after loading)."""
    from onecat.runtime.config import EngineConfig
    from onecat.runtime.core.replicas import ReplicaSet
    from onecat.runtime.server.launcher import log_to_stderr, serve

    name = f"random-{args.serve_model}"
    config = EngineConfig(model=args.tokenizer, served_model_name=name, device=args.device,
                          max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                          kv_cache_dtype=args.kv_cache_dtype)
    factory = {"model": args.serve_model, "layers": args.layers, "tokenizer": args.tokenizer,
               "engine_json": args.engine_json, "engine_batches": args.engine_batches,
               "workloads": args.workloads}
    log_to_stderr("warning")
    replicas = ReplicaSet(config, args.data_parallel_size, log_level="warning",
                          engine_factory=("serve_h200:random_engine", factory))
    replicas.start()
    serve(replicas, host="127.0.0.1", port=args.port, log_level="warning")


# ----- the driver --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"the server was not up after {timeout:.0f} s:\n{log.read_text()[-4000:]}")
        time.sleep(1)


STEP_COUNTERS = ("onecat:engine_steps_total", "onecat:engine_steps_with_prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:num_preemptions_total")
TTFT_PARTS = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
              "vllm:request_prefill_time_seconds")
"""Histograms whose sums split the served time to first token (``ttft_split``)."""


def step_counters(url: str) -> dict[str, float]:
    """The server's step counters and the TTFT histograms' sums and counts from /metrics
    (summed over the replicas' ``engine`` labels)."""
    import httpx

    wanted = set(STEP_COUNTERS) | {f"{h}_{part}" for h in TTFT_PARTS for part in ("sum", "count")}
    samples: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.rpartition(" ")
        name = name.partition("{")[0]  # vLLM's series carry model_name and engine labels
        if name in wanted:
            samples[name] = samples.get(name, 0.0) + float(value)
    return samples


def step_mix(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the engine did between two scrapes: steps, the share with prompt tokens, output
    tokens per step (warm-up requests included), preemptions."""
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in STEP_COUNTERS}
    steps = delta["onecat:engine_steps_total"]
    return {
        "steps": int(steps),
        "steps_with_prompts": int(delta["onecat:engine_steps_with_prompt_tokens_total"]),
        "prompt_step_share": delta["onecat:engine_steps_with_prompt_tokens_total"] / steps if steps else None,
        "tokens_per_step": delta["vllm:generation_tokens_total"] / steps if steps else None,
        "preemptions": int(delta["vllm:num_preemptions_total"]),
    }


def ttft_split(before: dict[str, float], after: dict[str, float]) -> dict[str, float] | None:
    """Where the server's time to first token went between two scrapes, mean ms per request
    (warm-ups included), from the stamps behind vLLM's histograms (``time.monotonic``, one clock
    for every process): ``server`` = the handler's start -> the API process holding the first
    token; ``to_core`` = the handler's start -> queued in the engine core (parsing, tokenising,
    checks, routing, the IPC hop in); ``queue`` = queued -> first scheduled; ``prefill`` =
    scheduled -> the API process holding the first token (the step, the IPC hop out)."""
    def mean(name: str) -> float | None:
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        return None if not count else 1000 * (after[f"{name}_sum"] - before.get(f"{name}_sum", 0.0)) / count

    server, queue, prefill = (mean(name) for name in TTFT_PARTS)
    if server is None or queue is None or prefill is None:
        return None
    return {"server_ms": server, "to_core_ms": server - queue - prefill, "queue_ms": queue, "prefill_ms": prefill}


def raw_ttft_ms(url: str, model: str, prompts: list[str], max_tokens: int = 16) -> list[float]:
    """Milliseconds to the first streamed text chunk of each prompt, one at a time, over a
    kept-alive ``http.client`` connection (blocking sockets, no event loop: the client's own
    share is tens of microseconds, so this is the server's time to first token as a client
    sees it). Each stream is read to its end before the next request."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    times = []
    try:
        for prompt in prompts:
            body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                               "temperature": 0, "ignore_eos": True}).encode()
            start = time.perf_counter()
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise SystemExit(f"TTFT probe: HTTP {response.status}: {response.read()[:300]!r}")
            first = None
            for line in response:
                if line.strip() == b"data: [DONE]":
                    break
                if first is None and line.startswith(b"data:"):
                    choices = json.loads(line[5:]).get("choices")
                    if choices and choices[0].get("text"):
                        first = time.perf_counter() - start
            response.read()
            if first is None:
                raise SystemExit("TTFT probe: the stream carried no text")
            times.append(1000 * first)
    finally:
        conn.close()
    return times


def raw_probe(url: str, model: str, engine_ttft_ms: float, count: int = 24) -> dict:
    """``raw_ttft_ms`` over ``count`` fresh 128-token prompts (after 4 warm-ups) with the
    server's TTFT split, next to the engine alone's time to first token."""
    import random

    rng = random.Random(11)
    prompts = [" ".join(f"w{rng.randrange(len(SPECIAL), VOCAB)}" for _ in range(128)) for _ in range(count + 4)]
    raw_ttft_ms(url, model, prompts[:4])
    before = step_counters(url)
    times = raw_ttft_ms(url, model, prompts[4:])
    split = ttft_split(before, step_counters(url))
    median = statistics.median(times)
    print(f"  raw-client TTFT: median {median:.2f} ms, engine alone {engine_ttft_ms:.2f} ms: the API process adds "
          f"{median - engine_ttft_ms:+.2f} ms; split (mean ms) "
          + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in (split or {}).items()), flush=True)
    return {"median_ttft_ms": median, "ttfts_ms": times, "engine_ttft_ms": engine_ttft_ms,
            "added_ms": median - engine_ttft_ms, "split": split}


def finished_requests(url: str) -> float:
    """Requests the server has finished (``vllm:request_success_total``, every reason and replica)."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def kill_replica_later(url: str, delay: float, warmups: int, record: dict) -> threading.Thread:
    """A thread that SIGKILLs replica 0's engine-core process (its pid from /health) ``delay``
    seconds after the driver's ``warmups`` warm-up requests have finished (so that the kill
    lands among the measured requests, with requests running on replica 0), and notes how
    many were in flight there; the failover test of issue #41 on real replicas."""
    import httpx

    def kill() -> None:
        start = finished_requests(url)
        while finished_requests(url) < start + warmups:
            time.sleep(0.2)
        time.sleep(delay)
        replica = httpx.get(url + "/health", timeout=10).json()["replicas"][0]
        os.kill(replica["pid"], signal.SIGKILL)
        record.update(killed_pid=replica["pid"], killed_after_warmups_s=delay, in_flight_at_kill=replica["in_flight"])
        print(f"  killed replica 0 (pid {replica['pid']}, {replica['in_flight']} requests in flight) {delay:g} s "
              "after the warm-ups", flush=True)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def wait_replicas_up(url: str, timeout: float) -> dict:
    """/health once every replica is up again (or the last answer after ``timeout``)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(url + "/health", timeout=10).json()
        if health["status"] == "ok" or time.monotonic() > deadline:
            return health
        time.sleep(1)


def serve_run(name: str, url: str, tokenizer: Path, work: Path, c: int, workload: str, *,
              prompts: int | None = None, label: str = "", kill_at: float | None = None) -> dict:
    """One ``onecat bench serve`` run at concurrency ``c`` of ``workload`` (``parse_workload``)."""
    input_len, range_ratio, output_len, prefix_len, share = parse_workload(workload)
    long = prompt_tokens(workload) >= LONG_PROMPT_TOKENS
    prompts = prompts or prompts_per_run(c, range_ratio, prompt_tokens(workload))
    tag = f"{name}-c{c}-{workload.replace(':', '_')}{label}"
    result_json = work / f"{tag}.json"
    bench = [sys.executable, "-m", "onecat.cli", "bench", "serve", "--base-url", url,
             "--tokenizer", str(tokenizer), "--dataset-name", "random",
             "--random-input-len", str(input_len), "--random-range-ratio", str(range_ratio),
             "--random-output-len", str(output_len), "--num-prompts", str(prompts),
             "--random-prefix-len", str(prefix_len), "--random-prefix-share", str(share),
             *(["--seed", str(c)] if prefix_len or long else []),  # no run hits another run's prompts
             "--max-concurrency", str(c), "--num-warmups", str(min(c, LONG_WARMUPS) if long else c),
             "--temperature", "0",
             "--metric-percentiles", "50,99", "--result-json", str(result_json), "--no-progress"]
    before = step_counters(url)
    failover: dict = {}
    killer = kill_replica_later(url, kill_at, c, failover) if kill_at is not None else None
    done = subprocess.run(bench, capture_output=True, text=True)
    if killer is not None:
        killer.join()
        failover["health_after"] = wait_replicas_up(url, 300)
    after = step_counters(url)
    mix, split = step_mix(before, after), ttft_split(before, after)
    (work / f"{tag}.log").write_text(done.stdout + done.stderr)
    if not result_json.exists():
        raise SystemExit(f"onecat bench serve failed at concurrency {c}:\n{done.stdout}{done.stderr}")
    result = json.loads(result_json.read_text())
    result = {k: v for k, v in result.items() if not isinstance(v, list)}  # no per-request lists
    share = "-" if mix["prompt_step_share"] is None else f"{mix['prompt_step_share']:.0%}"
    print(f"  {workload} c{c}{label}: {result['completed']}/{prompts} ok, {result['output_throughput']:.1f} output "
          f"tok/s, TTFT median {result['median_ttft_ms']:.1f} ms; {mix['steps']} engine steps, {share} with "
          f"prompt tokens, {mix['tokens_per_step'] or 0:.1f} output tokens a step", flush=True)
    if split and label == "ttft":
        print("  TTFT split (mean ms): " + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in split.items())
              + f"; client mean {result['mean_ttft_ms']:.2f}", flush=True)
    if failover:
        print(f"  failover: {result['completed']} completed, {result['failed']} failed; replicas after: "
              + ", ".join(f"{r['index']}={r['state']} (restarts {r['restarts']})"
                          for r in failover["health_after"]["replicas"]), flush=True)
    return {"concurrency": c, "workload": workload, "label": label, **result, "step_mix": mix, "ttft_split": split,
            "failover": failover or None}


def bench_model(name: str, args: argparse.Namespace, tokenizer: Path, work: Path, kv_cache_dtype: str = "auto") -> dict:
    """Start the server for ``name`` (its KV cache in ``kv_cache_dtype``), run ``onecat bench
    serve`` for each workload at each concurrency, stop."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tag = name if kv_cache_dtype == "auto" else f"{name}-{kv_cache_dtype}"
    engine_json, log = work / f"{tag}-engine.json", work / f"{tag}-server.log"
    max_model_len = max(args.max_model_len, longest_sequence(args.workloads) + 16)
    command = [sys.executable, str(Path(__file__).resolve()), "--serve-model", name, "--port", str(port),
               "--tokenizer", str(tokenizer), "--engine-json", str(engine_json), "--kv-cache-dtype", kv_cache_dtype,
               "--max-num-seqs", str(max(args.concurrency, default=1)), "--max-model-len", str(max_model_len),
               "--engine-batches", ",".join(map(str, args.concurrency)), "--workloads", ",".join(args.workloads),
               "--data-parallel-size", str(args.data_parallel_size), "--device", args.device]
    if args.layers:
        command += ["--layers", str(args.layers)]
    t0 = time.perf_counter()
    with open(log, "w") as log_file:
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, cwd=Path(__file__).parent,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_ready(proc, url, log, args.server_timeout)
        engine = json.loads(engine_json.read_text())
        print(f"{tag}: server up in {time.perf_counter() - t0:.0f} s ({kv_cache_dtype} KV cache, "
              f"{engine['kv_cache_tokens']} tokens, max model len {engine['max_model_len']}); engine "
              + ", ".join(f"b{b} {v:.0f}" for b, v in engine["engine_decode_tok_s"].items()) + " tok/s",
              flush=True)
        runs = []
        if args.ttft_run:  # the API process's added time to first token: 128-token prompts, one at a time
            runs.append(serve_run(name, url, tokenizer, work, 1, "128:0:16", prompts=24, label="ttft"))
            runs[-1]["raw_probe"] = raw_probe(url, f"random-{name}", engine["engine_ttft_128_ms"])
        plan = [(w, c) for w in args.workloads for c in args.concurrency]
        for i, (workload, c) in enumerate(plan):
            kill = args.kill_replica_at if i == len(plan) - 1 else None
            runs.append(serve_run(tag, url, tokenizer, work, c, workload, kill_at=kill,
                                  label="kill" if kill is not None else ""))
        return {"engine": engine, "runs": runs, "kv_cache_dtype": kv_cache_dtype, "wall_s": time.perf_counter() - t0}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="onecat serve under onecat bench serve (output tokens/s; latencies ms, median / p99)")
    for column in ("model", "workload", "conc.", "ok/fail", "req/s", "output tok/s", "engine decode", "server/decode",
                   "engine workload", "server/workload", "TTFT", "TPOT", "ITL"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for name, entry in report["models"].items():
        engine = entry["engine"]["engine_decode_tok_s"]
        for r in entry["runs"]:
            c, label = r["concurrency"], r.get("label", "")
            eng = None if label else engine.get(str(c))
            work = None if label else entry["engine"]["engine_workload_tok_s"].get(f"{r['workload']}@{c}")
            ttft = f"{r['median_ttft_ms']:.1f} / {r['p99_ttft_ms']:.1f}"
            if label == "ttft":
                ttft += f" (engine {entry['engine']['engine_ttft_128_ms']:.1f})"
            table.add_row(
                name, r["workload"], f"{c} {label}".strip(), f"{r['completed']}/{r['failed']}", f"{r['request_throughput']:.2f}",
                f"{r['output_throughput']:.1f}", f"{eng:.1f}" if eng else "-",
                f"{r['output_throughput'] / eng:.0%}" if eng else "-",
                f"{work:.1f}" if work else "-", f"{r['output_throughput'] / work:.0%}" if work else "-",
                ttft,
                f"{r['median_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f}",
                f"{r['median_itl_ms']:.1f} / {r['p99_itl_ms']:.1f}",
            )
    Console(width=160).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="27b,35b-a3b")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (smoke runs)")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--workloads", default="320:0.6:64",
                        help="IN:RATIO:OUT[:PREFIX[:SHARE]],...: prompt tokens, their +- range ratio (also applied "
                        "to the output), output tokens, a shared prefix's tokens before the prompt and the share of "
                        "requests carrying it (the others: fresh tokens); 320:0.6:64 = prompts of 128-512 tokens, "
                        "25-103 out; 128:0:256 decode-bound; longdoc = 6144:0:256:2048:0.5 (8k-token prompts)")
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="at least; raised to the longest request of --workloads")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="comma-separated KV cache dtypes (auto, fp8_e5m2, int8): a server each, per model")
    parser.add_argument("--server-timeout", type=float, default=600.0)
    parser.add_argument("--out", default=None, help="write every figure to this JSON file")
    parser.add_argument("--work", default=None, help="keep the server logs and per-run JSON here")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the plumbing (use --layers, "
                        "ONECAT_BENCH_VOCAB)")
    parser.add_argument("--data-parallel-size", type=int, default=1, help="engine replicas (they share the GPU)")
    parser.add_argument("--ttft-run", action="store_true",
                        help="also one run of 128-token prompts at concurrency 1 (the server's added TTFT)")
    parser.add_argument("--kill-replica-at", type=float, default=None, metavar="SECONDS",
                        help="SIGKILL replica 0 this long after the last run's warm-ups (failover)")
    # the server process (started by the driver)
    parser.add_argument("--serve-model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--engine-json", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--engine-batches", default="1,8,32,64", help=argparse.SUPPRESS)
    parser.add_argument("--max-num-seqs", type=int, default=64, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.workloads = [w for w in args.workloads.split(",") if w]
    for workload in args.workloads:
        parse_workload(workload)
    from onecat.runtime.capacity import KV_CACHE_DTYPES

    args.kv_cache_dtypes = [d for d in args.kv_cache_dtype.split(",") if d]
    for kv_dtype in args.kv_cache_dtypes:
        if kv_dtype not in KV_CACHE_DTYPES:
            raise SystemExit(f"--kv-cache-dtype {kv_dtype}: choose from {', '.join(KV_CACHE_DTYPES)}")
    if args.serve_model:
        args.kv_cache_dtype = args.kv_cache_dtypes[0]
    args.engine_batches = [int(b) for b in args.engine_batches.split(",") if b]
    if args.serve_model:
        serve_random_model(args)
        return
    import torch

    from onecat.benchmarks.report import write_result_json

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/serve_h200.py needs a CUDA GPU (--device cpu: a smoke run of the plumbing)")
    report = {"gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "data_parallel_size": args.data_parallel_size,
              "kernel_arch": os.environ.get("ONECAT_KERNEL_ARCH"), "workloads": args.workloads,
              "kv_cache_dtypes": args.kv_cache_dtypes, "models": {}}
    with tempfile.TemporaryDirectory(prefix="onecat-serve-bench-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        tokenizer = build_word_tokenizer(work / "tokenizer")
        for name in args.models.split(","):
            for kv_dtype in args.kv_cache_dtypes:
                key = name if kv_dtype == "auto" else f"{name}/{kv_dtype}"
                report["models"][key] = bench_model(name, args, tokenizer, work, kv_dtype)
                if args.out:
                    write_result_json(args.out, report)
    print_table(report)


if __name__ == "__main__":
    main()
