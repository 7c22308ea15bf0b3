"""The three W4A16 kernel variants, their launch parameters and default choice.

A variant is named by a short string, stored as is in the tuner's cache:

- ``gemv-m{R}-w{W}-s{S}``: CUDA-core GEMV (w4a16_gemv.cu) for up to R in {1, 2, 4} rows,
  W warps per block, S splits of K (S = 0: chosen from the shape and the GPU);
- ``wmma-mt{T}-w{W}-s{S}``: tensor-core kernel (w4a16_wmma.cu), row tiles of T in
  {8, 16, 32, 64}, W warps (32*W columns) per block, S splits of K (0: automatic);
- ``dequant``: dequantise to an fp16 workspace (w4a16_dequant.cu), then cuBLAS.
"""

from __future__ import annotations

import ctypes
import functools
import math
import re
from dataclasses import dataclass

import torch

from onecat.errors import OnecatError
from onecat.kernels.loader import get_kernel

GEMV_ROWS = (1, 2, 4)
GEMV_WARPS = {1: (4, 8), 2: (4, 8), 4: (4,)}
WMMA_TILES = {8: (4, 8), 16: (4, 8), 32: (4,), 64: (4,)}
"""Instantiated kernels: rows -> warps (keep in sync with the ONECAT_* lines of the sources)."""

_UNROLL = 4  # k tiles per warp step in the GEMV (w4a16_gemv.cu)
_CHUNK = 2  # k tiles per chunk in the wmma kernel (w4a16_wmma.cu)


@dataclass(frozen=True)
class Variant:
    """One kernel variant with its launch parameters (see the module doc for the names)."""

    kind: str  # "gemv", "wmma" or "dequant"
    rows: int = 0  # GEMV: rows of the kernel; wmma: row tile
    warps: int = 0
    splits: int = 0  # 0: automatic

    @property
    def name(self) -> str:
        """The variant's name, e.g. ``gemv-m1-w4-s0``."""
        if self.kind == "dequant":
            return "dequant"
        tag = "m" if self.kind == "gemv" else "mt"
        return f"{self.kind}-{tag}{self.rows}-w{self.warps}-s{self.splits}"

    @staticmethod
    def parse(name: str) -> Variant:
        """Inverse of :attr:`name`; raises OnecatError on an unknown name."""
        if name == "dequant":
            return Variant("dequant")
        m = re.fullmatch(r"(gemv)-m(\d+)-w(\d+)-s(\d+)|(wmma)-mt(\d+)-w(\d+)-s(\d+)", name)
        if not m:
            raise OnecatError(f"unknown kernel variant {name!r}")
        kind, rows, warps, splits = m.groups()[:4] if m.group(1) else m.groups()[4:]
        variant = Variant(kind, int(rows), int(warps), int(splits))
        table = GEMV_WARPS if kind == "gemv" else WMMA_TILES
        if variant.warps not in table.get(variant.rows, ()):
            raise OnecatError(f"kernel variant {name!r} is not built (see {__name__})")
        return variant

    def supports(self, m: int) -> bool:
        """Whether this variant can run ``m`` rows (the GEMV has a fixed row limit)."""
        return self.kind != "gemv" or m <= self.rows


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_variant(m: int) -> Variant:
    """The untuned choice for ``m`` rows: GEMV up to 2, wmma up to 64, dequant + cuBLAS above."""
    if m <= 2:
        return Variant("gemv", 1 if m == 1 else 2, 4, 0)
    if m <= 64:
        tile = next(t for t in (8, 16, 32, 64) if t >= m)
        return Variant("wmma", tile, 4, 0)
    return Variant("dequant")


def auto_splits(variant: Variant, m: int, n: int, k: int, device_index: int) -> int:
    """Splits of K that fill the GPU: enough blocks for about one full wave, at least one
    warp step (GEMV) or two chunks (wmma) of k tiles per split."""
    ktiles = k // 32
    sms = _sm_count(device_index)
    if variant.kind == "gemv":
        blocks = n // 32
        target = sms * (32 // variant.warps)  # 32 resident warps per SM
        limit = max(1, ktiles // (variant.warps * _UNROLL))
    else:
        blocks = math.ceil(n // 32 / variant.warps) * math.ceil(m / variant.rows)
        target = sms * 4
        limit = max(1, ktiles // (2 * _CHUNK))
    return max(1, min(limit, round(target / blocks)))


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else 0)


def run_variant(
    variant: Variant,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run one variant on validated CUDA inputs: ``x [M, K]`` fp16 contiguous and 16-byte
    aligned, packed weights as in docs/FORMAT.md, optional fp16 ``bias [N]``.

    Returns ``y [M, N]`` fp16, written into ``out`` when given (tests poison it first).
    """
    m, k = x.shape
    n = qweight.shape[0] * 32
    device_index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if out is None:
        out = torch.empty((m, n), dtype=torch.float16, device=x.device)
    if m == 0:
        return out
    stream = torch.cuda.current_stream(x.device).cuda_stream
    if variant.kind == "dequant":
        weight = torch.empty((n, k), dtype=torch.float16, device=x.device)
        kernel = get_kernel("w4a16_dequant", device_index)
        pairs = (n // 32) * (k // 32)
        kernel.launch(
            (math.ceil(pairs / 8), 1, 1),
            256,
            stream,
            [
                _ptr(qweight),
                _ptr(scales_zeros),
                _ptr(weight),
                ctypes.c_int(n),
                ctypes.c_int(k),
                ctypes.c_int(group_size),
            ],
        )
        if bias is not None:
            return torch.addmm(bias, x, weight.t(), out=out)
        return torch.mm(x, weight.t(), out=out)
    if not variant.supports(m):
        raise OnecatError(f"kernel variant {variant.name} cannot run {m} rows")
    ktiles = k // 32
    splits = variant.splits or auto_splits(variant, m, n, k, device_index)
    step = _CHUNK if variant.kind == "wmma" else 1
    per_split = math.ceil(math.ceil(ktiles / splits) / step) * step
    splits = math.ceil(ktiles / per_split)
    if variant.kind == "gemv":
        grid = (n // 32, splits, 1)
        counters_count = n // 32
    else:
        grid = (math.ceil(n // 32 / variant.warps), splits, math.ceil(m / variant.rows))
        counters_count = grid[0] * grid[2]
    workspace = counters = None
    if splits > 1:
        # fp32 partial sums [M, N] followed by one int counter per output tile, all zero.
        scratch = torch.zeros(m * n + counters_count, dtype=torch.float32, device=x.device)
        workspace, counters = scratch, scratch[m * n :]
    name = (
        f"w4a16_gemv_m{variant.rows}_w{variant.warps}"
        if variant.kind == "gemv"
        else f"w4a16_wmma_mt{variant.rows}_w{variant.warps}"
    )
    kernel = get_kernel(name, device_index)
    dims = [ctypes.c_int(v) for v in (m, n, k, group_size, per_split)]
    kernel.launch(
        grid,
        32 * variant.warps,
        stream,
        [
            _ptr(x),
            _ptr(qweight),
            _ptr(scales_zeros),
            _ptr(bias),
            _ptr(out),
            _ptr(workspace),
            _ptr(counters),
            *dims,
        ],
    )
    return out


def all_variants() -> list[Variant]:
    """Every built variant with automatic splits (what the doctor self-tests)."""
    found = [Variant("gemv", r, w, 0) for r, ws in GEMV_WARPS.items() for w in ws]
    found += [Variant("wmma", t, w, 0) for t, ws in WMMA_TILES.items() for w in ws]
    return found + [Variant("dequant")]
