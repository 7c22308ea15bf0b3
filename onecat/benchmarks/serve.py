"""``onecat bench serve``: load a dataset, send its requests to an OpenAI-compatible server
at a request rate (Poisson arrivals, or all at once) under an optional concurrency cap,
time every streamed response, then report vLLM's serving figures.

Flags and result keys follow ``vllm bench serve``, so results from onecat's server, vLLM
and other OpenAI-compatible servers compare directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from onecat.benchmarks.client import (
    CONNECT_TIMEOUT_S,
    Endpoint,
    RequestResult,
    build_payload,
    endpoint_kind,
    list_models,
    send_request,
    split_base_url,
)
from onecat.benchmarks.datasets import (
    SampleRequest,
    dataset_name_for,
    load_tokenizer,
    sample_requests,
)
from onecat.benchmarks.metrics import (
    DEFAULT_PERCENTILE_METRICS,
    DEFAULT_PERCENTILES,
    arrival_times,
    compute_metrics,
    parse_percentile_metrics,
    parse_percentiles,
)
from onecat.benchmarks.report import print_summary, write_result_json
from onecat.errors import OnecatError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass
class BenchServeConfig:
    """The settings of one run (``vllm bench serve``'s flag names and defaults)."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    endpoint_type: str | None = None  # completions / chat; None: from the endpoint path
    model: str | None = None  # None: the first model of /v1/models
    api_key: str | None = None
    tokenizer: str | None = None  # None: the model's directory when it is local
    dataset_name: str | None = None  # None: random, or from --dataset-path's suffix
    dataset_path: str | None = None
    prompt_field: str = "prompt"
    num_prompts: int = 1000
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    random_prefix_share: float = 1.0  # onecat's: the share of requests that carry the prefix
    custom_output_len: int = 256
    sharegpt_output_len: int | None = None
    seed: int = 0
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    ignore_eos: bool | None = None  # None: on for the random dataset (exact output lengths)
    temperature: float | None = None  # sampling fields, sent only when given
    top_p: float | None = None
    top_k: int | None = None
    percentile_metrics: str = DEFAULT_PERCENTILE_METRICS
    metric_percentiles: str = DEFAULT_PERCENTILES
    result_json: str | None = None
    show_progress: bool = True


def default_tokenizer(root: str) -> str | None:
    """The served model's root (the path it was loaded from, in /v1/models) when it is a
    local directory with tokenizer files: the client then sits next to the server."""
    path = Path(root)
    if path.is_dir() and any((path / name).is_file() for name in TOKENIZER_FILES):
        return str(path)
    return None


def run_bench_serve(config: BenchServeConfig, console: Console | None = None) -> dict[str, Any]:
    """Run the benchmark; print the summary; write ``config.result_json``; return the result.

    Failed requests are counted and reported (the first error is shown), they do not stop
    the run; an unreachable server, a refused key, an unknown model or a bad dataset raise
    :class:`OnecatError` before anything is sent.
    """
    console = console or Console()
    percentile_metrics = parse_percentile_metrics(config.percentile_metrics)
    percentiles = parse_percentiles(config.metric_percentiles)
    if config.max_concurrency is not None and config.max_concurrency < 1:
        raise OnecatError(f"--max-concurrency must be >= 1; got {config.max_concurrency}")
    if config.num_warmups < 0:
        raise OnecatError(f"--num-warmups must be >= 0; got {config.num_warmups}")
    arrival_times(1, config.request_rate, config.burstiness)  # validates the rate flags
    if config.result_json and not Path(config.result_json).parent.is_dir():
        raise OnecatError(f"--result-json {config.result_json}: its directory does not exist")
    base, path = split_base_url(config.base_url, config.endpoint)
    kind = endpoint_kind(path, config.endpoint_type)
    models = list_models(base, config.api_key)
    model = config.model or next(iter(models), None)
    if model is None:
        raise OnecatError(f"{base}/v1/models lists no model; give --model")
    if model not in models:
        raise OnecatError(f"--model {model}: not served at {base} (it serves: {', '.join(models)})")
    dataset_name = dataset_name_for(config.dataset_name, config.dataset_path)
    tokenizer_id = config.tokenizer or default_tokenizer(models[model])
    tokenizer = load_tokenizer(tokenizer_id) if tokenizer_id else None
    requests = sample_requests(
        dataset_name, config.num_prompts, dataset_path=config.dataset_path,
        prompt_field=config.prompt_field, random_input_len=config.random_input_len,
        random_output_len=config.random_output_len, random_range_ratio=config.random_range_ratio,
        random_prefix_len=config.random_prefix_len, random_prefix_share=config.random_prefix_share,
        custom_output_len=config.custom_output_len, sharegpt_output_len=config.sharegpt_output_len,
        seed=config.seed, tokenizer=tokenizer,
    )
    ignore_eos = dataset_name == "random" if config.ignore_eos is None else config.ignore_eos
    endpoint = Endpoint(base, path, kind, model, config.api_key)
    rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g} req/s"
    console.print(
        f"benchmarking {model} at {endpoint.url}: {len(requests)} {dataset_name} prompts, "
        f"request rate {rate}, max concurrency {config.max_concurrency or 'none'}, "
        f"tokenizer {tokenizer_id or 'none (prompt lengths estimated)'}",
        highlight=False, soft_wrap=True,
    )
    results, duration = asyncio.run(_benchmark(endpoint, requests, config, ignore_eos, console))
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if kind == "chat" else "openai",
        "endpoint_type": kind,
        "base_url": base,
        "endpoint": path,
        "model_id": model,
        "tokenizer_id": tokenizer_id,
        "dataset_name": dataset_name,
        "num_prompts": len(requests),
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "ignore_eos": ignore_eos,
        "seed": config.seed,
        **compute_metrics(results, duration, percentile_metrics, percentiles),
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens if r.success else 0 for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "start_times": [r.start_time for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
    }
    print_summary(result, percentile_metrics, percentiles, console)
    if config.result_json:
        console.print(f"result written to {write_result_json(config.result_json, result)}", highlight=False)
    return result


async def _benchmark(endpoint: Endpoint, requests: list[SampleRequest], config: BenchServeConfig,
                     ignore_eos: bool, console: Console) -> tuple[list[RequestResult], float]:
    """Warm up, then send every request at its arrival time; the results (start times
    relative to the benchmark's start) and the benchmark's duration in seconds."""
    sampling = {k: v for k, v in (("temperature", config.temperature), ("top_p", config.top_p),
                                  ("top_k", config.top_k)) if v is not None}
    payloads = [build_payload(endpoint, r, ignore_eos, sampling) for r in requests]
    cap = config.max_concurrency
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
    semaphore = asyncio.Semaphore(cap) if cap else contextlib.nullcontext()

    async def limited(client: httpx.AsyncClient, i: int) -> RequestResult:
        async with semaphore:
            return await send_request(client, endpoint, payloads[i], requests[i].prompt_len)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        if config.num_warmups:
            console.print(f"warming up with {config.num_warmups} request(s)", highlight=False)
            warm = await asyncio.gather(*(limited(client, 0) for _ in range(config.num_warmups)))
            if not any(r.success for r in warm):
                raise OnecatError(f"every warm-up request failed; the first: {warm[0].error}")
        times = arrival_times(len(requests), config.request_rate, config.burstiness,
                              np.random.default_rng(config.seed))
        with _progress(config.show_progress) as progress:
            bar = progress.add_task("requests", total=len(requests), failed=0, tok_s=0.0)
            start = time.perf_counter()
            tokens = failed = 0

            async def arrive(i: int) -> RequestResult:
                nonlocal tokens, failed
                delay = start + times[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                result = await limited(client, i)
                tokens += result.output_tokens
                failed += not result.success
                elapsed = time.perf_counter() - start
                progress.update(bar, advance=1, failed=failed, tok_s=tokens / max(elapsed, 1e-9))
                return result

            results = await asyncio.gather(*(arrive(i) for i in range(len(requests))))
            duration = time.perf_counter() - start
    for r in results:
        r.start_time -= start
    return list(results), duration


def _progress(show: bool) -> Progress:
    """The run's progress bar (on stderr; hidden when ``show`` is False)."""
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[failed]} failed"), TextColumn("{task.fields[tok_s]:.0f} output tok/s"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not show, refresh_per_second=4, transient=False,
    )
