"""Scratch buffers that kernels reuse across launches: one per (purpose, device, stream).

A buffer is allocated once and grown when a launch needs more; a grown buffer replaces the
old one, which stays allocated because captured CUDA graphs may hold its address. Buffers are
never allocated during a CUDA graph capture (that raises): memory taken there belongs to the
graph's pool, where other graphs' temporaries may reuse it, so the capture's warm-up must run
on the capture stream (``runtime/engine/graph_capture.py``). Reuse is
safe because launches on one stream run in order. ``zeroed`` buffers start as zeros and the
kernels that use them leave them zeroed (split reductions); the others hold garbage between
launches (partials written and read within one call).
"""

from __future__ import annotations

import torch

_buffers: dict[tuple[str, int | None, int], torch.Tensor] = {}
_retired: list[torch.Tensor] = []
_MIN_FLOATS = 1 << 16


def stream_buffer(purpose: str, device: torch.device, stream: int, floats: int, *, zeroed: bool) -> torch.Tensor:
    """An fp32 buffer of at least ``floats`` elements for ``purpose`` on ``stream`` (a raw
    CUDA stream handle) of ``device``; zero-filled when first allocated if ``zeroed``."""
    key = (purpose, device.index, stream)
    buf = _buffers.get(key)
    if buf is None or buf.numel() < floats:
        if torch.cuda.is_current_stream_capturing():
            # it would come from the graph's pool, which later captures share: another
            # graph's temporaries could overwrite it, and a zero fill would only run on replay
            raise RuntimeError(
                f"kernel workspace {purpose!r} ({floats} floats) would be allocated inside a CUDA "
                "graph capture; run the captured calls once on the capture stream first "
                "(onecat.runtime.engine.graph_capture.capture)"
            )
        if buf is not None:
            _retired.append(buf)
        make = torch.zeros if zeroed else torch.empty
        buf = _buffers[key] = make(max(floats, _MIN_FLOATS), dtype=torch.float32, device=device)
    return buf


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values)`` on ``device`` without stalling the host: on CUDA the values
    go through pinned memory with an asynchronous copy (a copy from pageable memory waits
    for the stream, i.e. for every kernel queued before it)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
