"""CUDA graph capture that leaves kernel workspaces out of the graphs' memory pool.

onecat's kernels keep persistent scratch per (device, stream) (``kernels/workspace.py``),
some of which must stay zeroed between launches (split-K arrival counters and sums). A
buffer allocated while a graph is being captured comes from that graph's private memory pool,
and the engine's graphs share one pool: a later capture may take memory that an earlier
graph uses for its own temporaries, so replaying that earlier graph overwrote the "zeroed"
counters of kernels in the later graphs, which then summed garbage (NaN logits in prompt
passes after prefix-cache hits, issue 40). Warming up and capturing on the same stream
makes the warm-up allocate every workspace (in ordinary memory, zero-filled at once) under
the key the capture looks up, so a capture allocates none; ``workspace.stream_buffer``
refuses to allocate during a capture, so a missed warm-up fails the capture loudly (the
engine then runs that pass eagerly) instead of corrupting memory.

Every capture of a device uses the same side stream (``capture_stream``). A fresh
``torch.cuda.Stream()`` per capture comes from torch's pool of 32 streams, and the caching
allocator keeps what each stream's warm-ups freed for that stream alone: up to 32 copies of
a prompt pass's activations (the 27B ran out of memory capturing its prompt graphs), and 32
sets of kernel workspaces. On one stream the warm-ups reuse one cache and the graphs share
one set of workspaces, which is safe because graphs replay one after another on the
engine's stream and the kernels leave the zeroed ones zeroed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

_streams: dict[int, torch.cuda.Stream] = {}


def capture_stream() -> torch.cuda.Stream:
    """The side stream every capture on the current device runs on (created at the first)."""
    index = getattr(torch.cuda.current_stream(), "device_index", None)
    if index is None:  # no real CUDA stream (the CPU tests' stand-ins): nothing to share
        return torch.cuda.Stream()
    stream = _streams.get(index)
    if stream is None:
        stream = _streams[index] = torch.cuda.Stream(device=index)
    return stream


def capture(graph: torch.cuda.CUDAGraph, pool: object | None, run: Callable[[], T], warmups: int = 1) -> T:
    """Run ``run`` ``warmups`` times, then capture it into ``graph`` (memory from ``pool``),
    all on the device's capture stream; returns what the captured call returned (its outputs
    live in the graph's pool and are rewritten by each replay)."""
    current = torch.cuda.current_stream()
    side = capture_stream()
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(warmups):
            run()
    with torch.cuda.graph(graph, pool=pool, stream=side):
        result = run()
    current.wait_stream(side)
    return result
