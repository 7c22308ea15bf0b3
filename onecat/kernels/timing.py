"""GPU timing for the tuner and the benchmark: CUDA graphs of repeated calls, CUDA events.

Decode-sized kernels run for a few microseconds, less than Python needs to launch them, so
timing eager calls would measure the CPU.  Calls are captured into a CUDA graph (as the
runtime's decode loop does) and each replay is timed with events; the result is the median
over replays divided by the calls per graph.  Callers rotate over several weight copies so
that small weights are not served from L2 (in a real model, each layer's weights are cold).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch


def copies_for(bytes_per_copy: int, target_bytes: int = 256 << 20, limit: int = 32) -> int:
    """How many copies of a weight to rotate over so that they exceed ``target_bytes``."""
    return max(1, min(limit, math.ceil(target_bytes / max(1, bytes_per_copy))))


def graph_time_us(
    calls: Sequence[Callable[[], object]],
    replays: int = 7,
    target_ms: float = 2.0,
) -> float:
    """Median microseconds per call of ``calls`` (run in rotation) on the current CUDA device.

    The calls are warmed up eagerly, then as many rounds of them as fill about ``target_ms``
    are captured in one CUDA graph, which is replayed ``replays`` times.
    """
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for fn in calls:
        fn()
    end.record()
    end.synchronize()
    per_call_ms = max(start.elapsed_time(end) / len(calls), 1e-3)
    rounds = max(1, min(64, round(target_ms / (per_call_ms * len(calls)))))
    if per_call_ms * len(calls) > 20.0:  # slow baselines: fewer replays keep the run short
        replays = min(replays, 3)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # on the capture stream: kernel workspaces exist before the capture
            fn()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(rounds):
            for fn in calls:
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    del graph
    return times[len(times) // 2] * 1000.0 / (rounds * len(calls))
