"""The figures of a benchmark run, as ``vllm bench serve`` defines them (pure functions).

Per successful request: TTFT (time to first token), TPOT (time per output token after the
first: ``(latency - ttft) / (output_tokens - 1)``, only for requests with more than one
token), ITL (every gap between consecutive text chunks, pooled over requests) and E2EL
(end-to-end latency). Throughputs divide by the benchmark's wall time. Reported in ms:
``mean_X_ms``, ``median_X_ms``, ``std_X_ms`` and ``pP_X_ms`` per chosen percentile P
(numpy's linear interpolation), for the chosen metrics only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from onecat.benchmarks.client import RequestResult
from onecat.errors import OnecatError

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILE_METRICS = "ttft,tpot,itl"
DEFAULT_PERCENTILES = "99"


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0,
                  rng: np.random.Generator | None = None) -> list[float]:
    """When each request is sent, in seconds from the start.

    ``request_rate`` inf: all at once. Otherwise the gaps are gamma-distributed with shape
    ``burstiness`` and mean ``1 / request_rate`` (burstiness 1: a Poisson process), and the
    times are scaled so the last one falls at ``num_requests / request_rate`` (as vLLM
    does, so runs with different seeds offer the same average rate).
    """
    if request_rate <= 0 or burstiness <= 0:
        raise OnecatError(f"--request-rate and --burstiness must be > 0; got {request_rate}, {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = rng or np.random.default_rng(0)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    times = np.cumsum(gaps)
    times *= (num_requests / request_rate) / times[-1]
    return times.tolist()


def parse_percentile_metrics(text: str) -> list[str]:
    """``"ttft,tpot,itl"`` -> names, checked against :data:`METRICS`."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in METRICS]
    if unknown or not names:
        raise OnecatError(f"--percentile-metrics {text!r}: choose from {', '.join(METRICS)}")
    return names


def parse_percentiles(text: str) -> list[float]:
    """``"50,90,99"`` -> floats in (0, 100]."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 < v <= 100 for v in values):
        raise OnecatError(f"--metric-percentiles {text!r}: give numbers in (0, 100], e.g. 50,90,99")
    return values


def percentile_key(p: float) -> str:
    """``99`` -> ``"p99"``, ``99.9`` -> ``"p99.9"`` (vLLM's key spelling)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def tpot(result: RequestResult) -> float | None:
    """Time per output token after the first, or None for a one-token output."""
    if result.output_tokens <= 1:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def summarize(values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """``mean``, ``median``, ``std`` and each percentile of ``values`` (seconds) in ms;
    all 0 when there are none."""
    data = np.asarray(values if len(values) else [0.0], dtype=np.float64) * 1000.0
    stats = {"mean": float(data.mean()), "median": float(np.median(data)), "std": float(data.std())}
    for p in percentiles:
        stats[percentile_key(p)] = float(np.percentile(data, p))
    return stats


def metric_values(results: Sequence[RequestResult]) -> dict[str, list[float]]:
    """Each metric's samples (seconds) over the successful requests."""
    ok = [r for r in results if r.success]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := tpot(r)) is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }


def compute_metrics(
    results: Sequence[RequestResult],
    duration: float,
    percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl"),
    percentiles: Sequence[float] = (99.0,),
) -> dict[str, Any]:
    """The run's figures with vLLM's result keys (see the module docstring)."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    figures: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    samples = metric_values(results)
    for name in percentile_metrics:
        for stat, value in summarize(samples[name], percentiles).items():
            figures[f"{stat}_{name}_ms"] = value
    return figures
