"""The three W4A16 kernel variants, their launch parameters and the default choice.

A variant is named by a short string, stored as is in the tuner's cache:

- ``gemv-m{R}-u{U}-p{P}``: CUDA-core GEMV (w4a16_gemv.cu) for up to R in {1, 2, 4} rows,
  U k tiles loaded ahead per warp step, P k tiles per warp (0: spread the weight evenly over
  one wave of resident warps);
- ``wmma-mt{T}-w{W}-c{C}-s{S}``: tensor-core kernel (w4a16_wmma.cu), row tiles of T in
  {8, 16, 32, 64}, W warps (32*W columns) per block, chunks of C k tiles, S splits of K
  (0: chosen by a wave model from the GPU's occupancy);
- ``wmmar-mt{T}-w{W}-c{C}-s{S}``: the same kernel dequantising on the B fragments (packed
  words through shared memory instead of fp16 weights; w4a16_wmma.cu's register-dequant
  variant), for group sizes that are multiples of 64;
- ``dequant``: dequantise to an fp16 workspace (w4a16_dequant.cu), then cuBLAS.

A GEMV plan made with ``silu_mul`` runs a SwiGLU layer's merged gate/up projection (gate rows
first, then as many up rows) and returns ``silu(gate) * up`` ``[M, N/2]``: the kernel forms it
in its epilogue (its ``act`` argument), so no activation launch follows. The tensor-core
kernels have no such epilogue: pairing gate and up tiles in one block made them slower than
the activation launch they saved (H200, 27B gate/up at 8 and 32 rows, BENCHMARKS.md).
"""

from __future__ import annotations

import ctypes
import functools
import math
import re
from dataclasses import dataclass

import torch

from onecat.errors import OnecatError
from onecat.kernels.driver import Kernel, PreparedLaunch
from onecat.kernels.loader import get_kernel
from onecat.kernels.workspace import stream_buffer

GEMV_BUILT = {1: (2, 4), 2: (2,), 4: (2,)}
"""GEMV rows -> unroll depths instantiated in w4a16_gemv.cu (4 warps per block)."""
WMMA_BUILT = {
    8: ((4, 2), (4, 4), (8, 2)),
    16: ((4, 2), (4, 4), (8, 2)),
    32: ((4, 2), (4, 4)),
    64: ((4, 2),),
}
"""wmma row tile -> (warps per block, k tiles per chunk) instantiated in w4a16_wmma.cu."""
WMMAR_BUILT = {
    8: ((4, 2), (4, 4), (8, 2)),
    16: ((4, 2), (8, 2)),
    32: ((4, 2), (8, 2)),
    64: ((4, 2),),
}
"""The same for the register-dequant kernels (``w4a16_wmmar_*``)."""
WMMAR_GROUP = 64
"""The register-dequant kernels need group sizes that are multiples of this (64 k per packed
fragment share one scale)."""
_TENSOR_CORE_BUILT = {"wmma": WMMA_BUILT, "wmmar": WMMAR_BUILT}
SPLIT_MAX_ARRIVALS = 255
"""Most contributors one 64-bit split word counts (``split_sum_add`` in w4a16_common.cuh):
GEMV warps covering one column tile."""

_GEMV_WARPS = 4
_DEQUANT_THREADS = 128


@dataclass(frozen=True)
class Variant:
    """One kernel variant with its launch parameters (see the module doc for the names)."""

    kind: str  # "gemv", "wmma", "wmmar" or "dequant"
    rows: int = 0  # GEMV: rows of the kernel; wmma: row tile
    width: int = 0  # GEMV: unroll depth; wmma: warps per block
    split: int = 0  # GEMV: k tiles per warp; wmma: splits of K; 0 = automatic
    chunk: int = 2  # wmma: k tiles per chunk

    @property
    def name(self) -> str:
        """The variant's name, e.g. ``gemv-m1-u4-p0``."""
        if self.kind == "gemv":
            return f"gemv-m{self.rows}-u{self.width}-p{self.split}"
        if self.kind in _TENSOR_CORE_BUILT:
            return f"{self.kind}-mt{self.rows}-w{self.width}-c{self.chunk}-s{self.split}"
        return "dequant"

    @staticmethod
    def parse(name: str) -> Variant:
        """Inverse of :attr:`name`; raises OnecatError on an unknown or unbuilt variant."""
        if name == "dequant":
            return Variant("dequant")
        if m := re.fullmatch(r"gemv-m(\d+)-u(\d+)-p(\d+)", name):
            variant = Variant("gemv", *map(int, m.groups()))
            built = variant.width in GEMV_BUILT.get(variant.rows, ())
        elif m := re.fullmatch(r"(wmmar?)-mt(\d+)-w(\d+)-c(\d+)-s(\d+)", name):
            kind = m.group(1)
            rows, width, chunk, split = map(int, m.groups()[1:])
            variant = Variant(kind, rows, width, split, chunk)
            built = (width, chunk) in _TENSOR_CORE_BUILT[kind].get(rows, ())
        else:
            raise OnecatError(f"unknown kernel variant {name!r}")
        if not built:
            raise OnecatError(f"kernel variant {name!r} is not built (see {__name__})")
        return variant

    def supports(self, m: int) -> bool:
        """Whether this variant can run ``m`` rows (the GEMV has a fixed row limit)."""
        return self.kind != "gemv" or m <= self.rows

    def supports_group(self, group_size: int) -> bool:
        """Whether this variant can run weights quantized with ``group_size``."""
        return self.kind != "wmmar" or group_size % WMMAR_GROUP == 0

    def fuses_silu_mul(self, n: int) -> bool:
        """Whether a ``silu_mul`` plan of this variant takes a merged gate/up weight of ``n`` rows:
        only the GEMV has the SwiGLU epilogue, and it pairs whole 32-row tiles (``n`` a multiple
        of 64)."""
        return self.kind == "gemv" and n % 64 == 0

    def kernel_name(self) -> str:
        """The ``extern "C"`` name of the kernel this variant launches."""
        if self.kind == "gemv":
            return f"w4a16_gemv_m{self.rows}_w{_GEMV_WARPS}_u{self.width}"
        if self.kind in _TENSOR_CORE_BUILT:
            return f"w4a16_{self.kind}_mt{self.rows}_w{self.width}_c{self.chunk}"
        return "w4a16_dequant"


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_variant(m: int) -> Variant:
    """The untuned choice for ``m`` rows: GEMV up to 2, wmma up to 64, dequant + cuBLAS above."""
    if m <= 2:
        return Variant("gemv", m, 2, 0)
    if m <= 64:
        return Variant("wmma", next(t for t in (8, 16, 32, 64) if t >= m), 4, 0)
    return Variant("dequant")


def gemv_tiles_per_warp(kernel: Kernel, n: int, k: int, device_index: int) -> int:
    """k tiles per warp that spread the weight over exactly one wave of resident warps."""
    warps = _sm_count(device_index) * kernel.max_active_blocks(32 * _GEMV_WARPS) * _GEMV_WARPS
    return max(4, math.ceil((n // 32) * (k // 32) / warps))


def wmma_splits(kernel: Kernel, variant: Variant, m: int, n: int, k: int, device_index: int) -> int:
    """Splits of K minimising a wave model: rounds of resident blocks x (k tiles per block +
    an epilogue worth about 2 k tiles), plus the last block's finish, which up to 32 rows
    reads every split's slice: about 1.5 k tiles a split at 32 rows (H200 sweep of
    ``bench/wmma_splits.py``, BENCHMARKS.md 2026-12-02), in proportion to the rows."""
    ktiles = k // 32
    units = math.ceil(n // 32 / variant.width) * math.ceil(m / variant.rows)
    slots = _sm_count(device_index) * kernel.max_active_blocks(32 * variant.width)
    finish = 1.5 * variant.rows / 32 if variant.rows < 64 else 0.0
    best, best_cost = 1, float("inf")
    for splits in range(1, max(1, ktiles // (2 * variant.chunk)) + 1):
        per = math.ceil(math.ceil(ktiles / splits) / variant.chunk) * variant.chunk
        actual = math.ceil(ktiles / per)
        cost = math.ceil(units * actual / slots) * (per + 2) + (0.5 + finish * actual if actual > 1 else 0)
        if cost < best_cost:
            best, best_cost = actual, cost
    return best


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a launch of one variant needs that does not change from call to call:
    resolved once per (variant, M, N, K, group, device) by :func:`launch_plan`."""

    variant: Variant
    per: int  # GEMV: k tiles per warp; wmma: k tiles per split; dequant: unused
    workspace_floats: int  # split-K partial sums (32-bit units) zero on entry and exit; 0: none
    counters: int  # 32-bit words after them: arrival counters, or the GEMV's SwiGLU pair words
    launch: PreparedLaunch  # the kernel with its grid, block and argument slots (built once)
    silu_mul: bool = False  # the output is silu(gate) * up [M, N/2] (see the module doc)
    slice_floats: int = 0  # 8-32-row wmma splits: fp32 partials per split, any content on entry


_plans: dict[tuple, LaunchPlan] = {}
_MAX_PLANS = 1 << 14  # prefill chunks of every length each make a plan: stay bounded


def launch_plan(
    variant: Variant, m: int, n: int, k: int, group_size: int, device_index: int, silu_mul: bool = False
) -> LaunchPlan:
    """The cached :class:`LaunchPlan` of ``variant`` for ``m`` rows of an ``[n, k]`` weight
    (``silu_mul``: a merged gate/up weight whose output is ``silu(gate) * up``)."""
    key = (variant, m, n, k, group_size, device_index, silu_mul)
    plan = _plans.get(key)
    if plan is not None:
        return plan
    if silu_mul and not variant.fuses_silu_mul(n):
        raise OnecatError(
            f"a SwiGLU epilogue needs a GEMV variant and N a multiple of 64 (two halves of whole tiles), "
            f"got {variant.name} and N={n}"
        )
    if not variant.supports(m):
        raise OnecatError(f"kernel variant {variant.name} cannot run {m} rows")
    if not variant.supports_group(group_size):
        raise OnecatError(f"kernel variant {variant.name} needs a group size that is a multiple of {WMMAR_GROUP}, got {group_size}")
    kernel = get_kernel(variant.kernel_name(), device_index)
    ktiles = k // 32
    workspace = counters = per = slices = 0
    if variant.kind == "dequant":
        items = (n // 32) * math.ceil(ktiles / 4)
        slots = _sm_count(device_index) * kernel.max_active_blocks(_DEQUANT_THREADS)
        grid, block = (min(math.ceil(items / (_DEQUANT_THREADS // 32)), 4 * slots), 1, 1), _DEQUANT_THREADS
    elif variant.kind == "gemv":
        # A range of `per` tiles meets at most ceil(ktiles / per) + 1 column-tile ranges.
        per = max(variant.split or gemv_tiles_per_warp(kernel, n, k, device_index),
                  math.ceil(ktiles / (SPLIT_MAX_ARRIVALS - 1)))  # fmt: skip
        warps = math.ceil((n // 32) * ktiles / per)
        grid, block = (math.ceil(warps / _GEMV_WARPS), 1, 1), 32 * _GEMV_WARPS
        if per % ktiles != 0:  # some warp ranges cut a column tile: one 64-bit split word per output
            workspace = 2 * m * n
        if silu_mul:  # then one 64-bit word per output column pair
            counters = m * n
    else:
        splits = variant.split or wmma_splits(kernel, variant, m, n, k, device_index)
        per = math.ceil(math.ceil(ktiles / splits) / variant.chunk) * variant.chunk
        splits = math.ceil(ktiles / per)
        grid = (math.ceil(n // 32 / variant.width), splits, math.ceil(m / variant.rows))
        block = 32 * variant.width
        if splits > 1 and variant.rows < 64:
            # a slice of fp32 partials per split; an arrival counter per (column group, row tile)
            slices, counters = splits * grid[2] * variant.rows * n, grid[0] * grid[2]
        elif splits > 1:  # fp32 atomics into zeroed sums
            workspace, counters = m * n, grid[0] * grid[2]
    if len(_plans) >= _MAX_PLANS:
        _plans.clear()
    p, i = ctypes.c_void_p, ctypes.c_int
    arg_types = {"dequant": [p, p, p, i, i, i], "gemv": [p] * 7 + [i] * 5 + [p]}.get(variant.kind, [p] * 7 + [i] * 5)
    launch = PreparedLaunch(kernel, grid, block, arg_types)
    plan = _plans[key] = LaunchPlan(variant, per, workspace, counters, launch, silu_mul, slices)
    return plan


def run_variant(
    variant: Variant,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """Run one variant on validated CUDA inputs: ``x [M, K]`` fp16 contiguous and 16-byte
    aligned, packed weights as in docs/FORMAT.md, optional fp16 ``bias [N]``.

    Returns ``y [M, N]`` fp16 (``silu_mul``: ``silu(y[:, :N/2]) * y[:, N/2:]`` ``[M, N/2]``),
    written into ``out`` when given (tests poison it first).
    """
    m, k = x.shape
    n = qweight.shape[0] * 32
    if out is None:
        out = torch.empty((m, n // 2 if silu_mul else n), dtype=torch.float16, device=x.device)
    if m == 0:
        return out
    device_index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    plan = launch_plan(variant, m, n, k, group_size, device_index, silu_mul)
    return run_plan(plan, x, qweight, scales_zeros, group_size, bias, out)


def run_plan(
    plan: LaunchPlan,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """Launch ``plan`` on torch's current stream (inputs as in :func:`run_variant`; ``out``
    is ``[M, N/2]`` for a ``silu_mul`` plan)."""
    m, k = x.shape
    n = qweight.shape[0] * 32
    stream = torch._C._cuda_getCurrentRawStream(x.device.index)
    if plan.variant.kind == "dequant":
        weight = torch.empty((n, k), dtype=torch.float16, device=x.device)
        plan.launch(stream, qweight.data_ptr(), scales_zeros.data_ptr(), weight.data_ptr(), n, k, group_size)
        if bias is not None:
            return torch.addmm(bias, x, weight.t(), out=out)
        return torch.mm(x, weight.t(), out=out)
    partials = counters = 0
    if plan.workspace_floats or plan.counters:  # what the kernels leave zero for the next launch
        scratch = stream_buffer("w4a16-split", x.device, stream, plan.workspace_floats + plan.counters, zeroed=True)
        partials = scratch.data_ptr()
        counters = partials + 4 * plan.workspace_floats
    if plan.slice_floats:  # kept apart: the slices are left holding partials
        partials = stream_buffer("w4a16-split-slices", x.device, stream, plan.slice_floats, zeroed=False).data_ptr()
    args = [x.data_ptr(), qweight.data_ptr(), scales_zeros.data_ptr(), 0 if bias is None else bias.data_ptr()]
    if plan.silu_mul:  # the GEMV pairs gate and up columns through its pair words and writes out only
        plan.launch(stream, *args, 0, partials, counters, m, n, k, group_size, plan.per, out.data_ptr())
    else:
        plan.launch(stream, *args, out.data_ptr(), partials, counters, m, n, k, group_size, plan.per,
                    *([0] if plan.variant.kind == "gemv" else []))  # fmt: skip
    return out


def all_variants() -> list[Variant]:
    """Every built variant with automatic parameters (what the doctor self-tests)."""
    found = [Variant("gemv", r, u, 0) for r, us in GEMV_BUILT.items() for u in us]
    found += [
        Variant(kind, t, w, 0, c) for kind, built in _TENSOR_CORE_BUILT.items() for t, wcs in built.items() for w, c in wcs
    ]
    return found + [Variant("dequant")]
