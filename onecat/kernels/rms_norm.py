"""Qwen3.5's ``(1 + w)`` RMSNorm, optionally after the residual add, in one sm_70 launch
(``rms_norm.cu``): the decode step's norms on one GPU, for rows as wide as the runtime takes it
(``onecat.runtime.layers.norm.KERNEL_MIN_HIDDEN``). The torch functions in
``onecat.runtime.layers.norm`` stay the reference and the path for CPUs, other dtypes, rows
the kernel does not take and torch.compile tracing.
"""

from __future__ import annotations

import ctypes

import torch

from onecat.kernels.loader import get_kernel

MAX_HIDDEN = 16384
"""The widest row the kernel takes (kept in registers: 512 threads of up to 4 vectors of 8 halves)."""
_MAX_THREADS = 512
VECTORS_PER_THREAD = 1
"""16-byte vectors of the row per thread the launch aims at (the block has ``hidden / 8 /
VECTORS_PER_THREAD`` threads, rounded up to whole warps, at most 512). H200, compute_70 PTX
(``bench/norm.py``, 2026-12-01): 1 was fastest or within 0.3 us of 2 at 2048 and 5120 features
and 1-32 rows; 4 was 0.4-0.7 us slower."""


def supports(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """True when :func:`add_rms_norm` takes these tensors: CUDA fp16 ``x`` (and ``residual``
    of the same shape) contiguous and 16-byte aligned, rows of a multiple of 8 up to
    :data:`MAX_HIDDEN` features, an fp32 contiguous weight of that length, not while
    torch.compile traces."""
    hidden = x.shape[-1] if x.dim() else 0
    tensors = [x] if residual is None else [x, residual]
    return (
        x.is_cuda
        and not torch.compiler.is_compiling()
        and 0 < hidden <= MAX_HIDDEN
        and hidden % 8 == 0
        and all(t.dtype == torch.float16 and t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)
        and (residual is None or residual.shape == x.shape)
        and weight.dtype == torch.float32
        and weight.is_contiguous()
        and weight.numel() == hidden
        and weight.device == x.device
    )


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    out: torch.Tensor | None = None, vectors_per_thread: int = VECTORS_PER_THREAD,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) * (1 + weight), x + residual)`` with the roundings of
    ``onecat.runtime.layers.norm.add_rms_norm`` (the sum rounded to fp16, the norm in fp32);
    with ``residual`` None, ``(rms_norm(x) * (1 + weight), x)``. Inputs as :func:`supports`
    says; one block per row on torch's current stream. ``out`` (tests poison it) receives
    the normed rows when given."""
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    out = torch.empty_like(x) if out is None else out
    summed = x if residual is None else torch.empty_like(x)
    if rows == 0:
        return out, summed
    device_index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    vectors = hidden // 8
    threads = min(_MAX_THREADS, -(-vectors // vectors_per_thread // 32) * 32)
    args = [
        ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(0 if residual is None else residual.data_ptr()),
        ctypes.c_void_p(weight.data_ptr()), ctypes.c_void_p(out.data_ptr()),
        ctypes.c_void_p(0 if residual is None else summed.data_ptr()), ctypes.c_int(hidden), ctypes.c_float(eps),
    ]  # fmt: skip
    stream = torch.cuda.current_stream(x.device).cuda_stream
    get_kernel("rms_norm_rows", device_index).launch((rows, 1, 1), threads, stream, args)
    return out, summed
