"""The routed experts of a mixture-of-experts block and its router, as torch custom ops.

``torch.ops.onecat.w4a16_moe(x, expert_ids, weights, w13_qweight, w13_scales_zeros,
w2_qweight, w2_scales_zeros, group_size)`` computes, for every token ``t``,
``out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))`` with
``e = expert_ids[t, j]``, all experts' weights stacked in the Volta layout (docs/FORMAT.md,
"Stacked experts") and read in place. Ids outside ``[0, E)`` (other ranks' experts under
expert parallelism, vLLM's ``-1``) contribute nothing.

- CUDA, up to :data:`GATHER_MAX_PAIRS` (token, expert) pairs (decode): two CUDA-core
  gather-GEMV launches (``w4a16_moe_gemv.cu``): gate+up with SiLU-and-multiply per pair,
  then the down projection per token over its experts with the routing weights applied.
  From :data:`GROUPED_GEMV_MIN_TOKENS` tokens on, the pairs are first sorted by expert on
  the GPU and each block serves a few pairs of one expert (:data:`GROUPED_GEMV_SHAPE`), so a
  chosen expert's weights are read once per step however many tokens chose it; a last
  launch adds each token's pairs in a fixed order.
- CUDA, more pairs (prefill): the pairs are sorted by expert on the GPU by one small kernel,
  then two grouped wmma GEMMs over row tiles of one expert each (``w4a16_moe_wmma.cu``):
  16-row tiles while the experts average at most :data:`SMALL_TILE_PAIRS_PER_EXPERT` pairs
  (a short prompt: ~10 rows per expert would leave a 64-row tile mostly padding), else 64;
  16-row tiles dequantise on packed wmma fragments (:data:`PACKED_FRAGMENTS`).
- CPU: the reference (:func:`reference_moe`): the dequant contract, fp32 matmuls, the hidden
  activations rounded to ``x.dtype`` as the kernels round them to fp16.
- Meta / fake tensors: ``x``'s shape and dtype.

Neither CUDA path reads anything back to the host or loops over experts in Python, so the
op can be captured in a CUDA graph.

``torch.ops.onecat.moe_route(logits, top_k) -> (weights fp32 [T, k], ids int32 [T, k])``:
Qwen3.5's router (softmax over the experts, top k, renormalised) in one kernel
(``w4a16_moe_route.cu``), ties taken lowest expert index first; CPU: :func:`reference_route`.

``torch.ops.onecat.moe_router(x, router_weight, shared_gate_weight, top_k)``: for decode
batches, the router's fp16 projection, the same selection and the shared expert's gate logit
in ONE launch (it replaces a cuBLAS GEMM, the routing kernel and cuBLAS's two-kernel GEMV of
the one-row shared gate); CPU: :func:`reference_router`.
"""

from __future__ import annotations

import ctypes
import math
import re

import torch
import torch.nn.functional as F

from onecat.errors import OnecatError
from onecat.kernels import rms_norm
from onecat.kernels.loader import get_kernel
from onecat.kernels.variants import WMMAR_GROUP
from onecat.kernels.workspace import stream_buffer
from onecat.pack.volta_layout import TILE, dequantize_volta

_MOE_SCHEMA = (
    "w4a16_moe(Tensor x, Tensor expert_ids, Tensor weights, Tensor w13_qweight, "
    "Tensor w13_scales_zeros, Tensor w2_qweight, Tensor w2_scales_zeros, int group_size) -> Tensor"
)
_ROUTE_SCHEMA = "moe_route(Tensor logits, int top_k, int shared_expert=-1) -> (Tensor, Tensor)"
_ROUTER_SCHEMA = (
    "moe_router(Tensor x, Tensor router_weight, Tensor? shared_gate_weight, int top_k, int shared_expert=-1) "
    "-> (Tensor, Tensor, Tensor)"
)

_ROUTER_NORM_SCHEMA = (
    "moe_router_norm(Tensor x, Tensor residual, Tensor norm_weight, float eps, Tensor router_weight, "
    "Tensor? shared_gate_weight, int top_k, int shared_expert=-1) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)

_LIB = torch.library.Library("onecat", "FRAGMENT")  # module scope: keeps the registration alive
_LIB.define(_MOE_SCHEMA)
_LIB.define(_ROUTE_SCHEMA)
_LIB.define(_ROUTER_SCHEMA)
_LIB.define(_ROUTER_NORM_SCHEMA)

GATHER_MAX_PAIRS = 288
"""Largest ``T * top_k`` run by the gather-GEMV kernels; more pairs take the grouped path
(288: a 32-sequence decode step of Qwen3.5-35B-A3B, top-8 plus its folded shared expert)."""
MAX_EXPERTS = 1024
"""Most experts the align and routing kernels take (one thread / register slot per expert)."""

GATHER_SHAPES: tuple[tuple[int, tuple[int, int], tuple[int, int]], ...] = (
    (2, (8, 4), (16, 4)),
    (8, (4, 4), (16, 4)),
    (1 << 30, (4, 4), (8, 4)),
)
"""Gather-path kernel shapes by token count: ``(up to T tokens, gate_up (warps per block, k
tiles per warp step), down (warps, k tiles))``, from ``bench/kernels.py --moe-shapes`` on the
H200 (35B-A3B layer, 2026-12-01 12:40): smaller blocks win from 4 tokens on (more resident
blocks hide the loads' latency): at 32 tokens 161.4 us against 180.2 for the 8- and 16-warp
blocks used before, at 8 tokens 47.4 against 50.9; at 1-2 tokens the larger blocks stay."""


def gather_shapes(tokens: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The ``(gate_up, down)`` kernel shapes the gather path runs for ``tokens`` tokens."""
    return next((gate, down) for limit, gate, down in GATHER_SHAPES if tokens <= limit)


GROUPED_GEMV_MIN_TOKENS = 16
"""From this many tokens the decode path groups the pairs by expert first (one align launch),
so that each chosen expert's weights are read and dequantised once for all its tokens
(``w4a16_moe_gemv_grouped_*``), and a last launch adds each token's pairs; below it, one
block per pair (``w4a16_moe_gemv_gate_up`` / ``_down``)."""
GROUPED_GEMV_SHAPE = (4, 4, 2)
"""``(warps per block, k tiles per warp step, pairs of one expert per block)`` of the grouped
decode kernels (:func:`built_grouped_gemv_shapes` lists the others that
``bench/kernels.py --moe-shapes`` compares)."""


def built_grouped_gemv_shapes() -> list[tuple[int, int, int]]:
    """Every ``(warps, batch, rows)`` the grouped decode kernels are built in
    (``ONECAT_MOE_GROUPED`` in ``w4a16_moe_gemv.cu``), sorted."""
    from onecat.kernels import build

    pattern = re.compile(r"w4a16_moe_gemv_grouped_gate_up_w(\d+)_b(\d+)_r(\d+)")
    return sorted({tuple(int(v) for v in m.groups()) for name in build.kernel_names("w4a16_moe_gemv")
                   if (m := pattern.fullmatch(name))})  # fmt: skip


MAX_DOWN_SPLITS = 4
"""Most blocks one (column tile, token) of the gather path's down projection is split over."""
SMALL_TILE_PAIRS_PER_EXPERT = 18  # H200, 35B layer (bench/kernels.py --moe-only): r16 faster up to 16 pairs/expert (426 vs 561 us), r64 from 20 (521 vs 575)
"""Up to this many (token, expert) pairs per expert on average the grouped path uses 16-row tiles."""
PACKED_FRAGMENTS = True
"""Grouped path, 16-row tiles: dequantise on packed wmma fragments (``_r16_pk`` kernels, group
sizes that are multiples of 64) instead of staging fp16 weights through shared memory. H200,
35B-A3B layer (``bench/kernels.py --moe-only``, 2026-12-01): 191 / 227 / 276 / 378 us at
40 / 64 / 320 / 512 tokens against 218 / 256 / 309 / 426. (With 64-row tiles the packed
kernel needs 255 registers and lost: 660 against 616 us at 1024 tokens; not built.)"""
_GROUP_ROWS = {False: 64, True: 16}  # w4a16_moe_wmma.cu tile rows: 64, and the _r16 kernels
_GROUP_WARPS = 4  # kMoeWarps
_ALIGN_THREADS = 1024  # kAlignThreads
_ROUTE_WARPS = 4  # w4a16_moe_route.cu kRouteWarps
_ROUTER_WARPS = 8
"""Router rows per block of ``w4a16_moe_route_decode`` (any 1..16, kRouterMaxWarps). H200, 35B-A3B
router (``bench/router.py --warps``, 2026-12-01 07:15): 16 / 8 / 4 rows a block took 6.71 / 6.30 /
6.13 us at 1 token and 10.35 / 10.18 / 12.5 us at 8."""
_ROUTER_STAGE_HALFS = 16384  # kRouterStageHalfs: the widest hidden size the kernel stages
ROUTER_MAX_TOKENS = 8
"""Most tokens :func:`moe_router` takes on the GPU; more run the fp16 projections (cuBLAS) and
:func:`moe_route`. Measured on the H200 (``bench/router.py``, 35B-A3B router, 2026-12-01 07:15):
the one launch takes 6.7 / 7.1 / 8.1 / 10.4 us at 1 / 2 / 4 / 8 tokens against 14.1 / 13.3 /
13.5 / 15.3 us for the two linears and the routing kernel (at 32 tokens, before the key
selection, it took 49 us against 15)."""
_MAX_TOP_K = 32  # one lane per choice
_GRID_Y_MAX = 65535


def check_moe_inputs(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w13_qweight: torch.Tensor,
    w13_scales_zeros: torch.Tensor,
    w2_qweight: torch.Tensor,
    w2_scales_zeros: torch.Tensor,
    group_size: int,
) -> tuple[int, int, int, int, int]:
    """Validate the op's inputs; returns ``(T, H, I, E, top_k)``. Raises OnecatError naming
    the bad argument and the shape it should have."""
    where = "onecat.kernels.moe.w4a16_moe"
    if w13_qweight.dtype != torch.int32 or w13_qweight.dim() != 5 or tuple(w13_qweight.shape[3:]) != (TILE, 4):
        raise OnecatError(
            f"{where}: w13_qweight must be int32 [E, 2I/32, H/32, 32, 4] (stacked Volta layout), "
            f"got {w13_qweight.dtype} {tuple(w13_qweight.shape)}"
        )
    e, h = w13_qweight.shape[0], w13_qweight.shape[2] * TILE
    if w13_qweight.shape[1] % 2:
        raise OnecatError(f"{where}: w13_qweight holds gate then up rows: 2I/32 must be even, got {w13_qweight.shape[1]}")
    i = w13_qweight.shape[1] * TILE // 2
    g = group_size
    if g <= 0 or g % TILE or h % g or i % g:
        raise OnecatError(f"{where}: group_size {g} must be a positive multiple of 32 dividing H={h} and I={i}")
    expected = {
        "w13_scales_zeros": ((e, 2 * i // TILE, h // g, TILE, 2), torch.float16, w13_scales_zeros),
        "w2_qweight": ((e, h // TILE, i // TILE, TILE, 4), torch.int32, w2_qweight),
        "w2_scales_zeros": ((e, h // TILE, i // g, TILE, 2), torch.float16, w2_scales_zeros),
    }
    for name, (shape, dtype, t) in expected.items():
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise OnecatError(
                f"{where}: {name} must be {dtype} {list(shape)} for E={e}, H={h}, I={i}, "
                f"group size {g}; got {t.dtype} {tuple(t.shape)}"
            )
    if x.dim() != 2 or x.shape[1] != h:
        raise OnecatError(f"{where}: x must be [T, {h}], got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise OnecatError(f"{where}: x must be floating point, got {x.dtype}")
    t = x.shape[0]
    if expert_ids.dim() != 2 or expert_ids.shape[0] != t or expert_ids.shape[1] < 1:
        raise OnecatError(f"{where}: expert_ids must be [T={t}, top_k], got {tuple(expert_ids.shape)}")
    if expert_ids.dtype not in (torch.int32, torch.int64):
        raise OnecatError(f"{where}: expert_ids must be int32 or int64, got {expert_ids.dtype}")
    if tuple(weights.shape) != tuple(expert_ids.shape) or not weights.is_floating_point():
        raise OnecatError(
            f"{where}: weights must be floating point {list(expert_ids.shape)} like expert_ids, "
            f"got {weights.dtype} {tuple(weights.shape)}"
        )
    tensors = {"expert_ids": expert_ids, "weights": weights, **{k: v[2] for k, v in expected.items()},
               "w13_qweight": w13_qweight}
    for name, tensor in tensors.items():
        if tensor.device != x.device:
            raise OnecatError(f"{where}: {name} is on {tensor.device}, x on {x.device}")
    if x.device.type == "cuda":
        if x.dtype != torch.float16:
            raise OnecatError(f"{where}: x must be float16 on the GPU (V100 has no bf16), got {x.dtype}")
        if weights.dtype not in (torch.float32, torch.float16):
            raise OnecatError(f"{where}: weights must be float32 or float16 on the GPU, got {weights.dtype}")
        for name in ("w13_qweight", "w13_scales_zeros", "w2_qweight", "w2_scales_zeros"):
            tensor = tensors[name]
            if not tensor.is_contiguous() or tensor.data_ptr() % 16:
                raise OnecatError(
                    f"{where}: {name} must be contiguous and 16-byte aligned on the GPU "
                    f"(call .contiguous() once when loading the weights)"
                )
        if e > MAX_EXPERTS:
            raise OnecatError(f"{where}: at most {MAX_EXPERTS} experts per rank, got {e}")
    return t, h, i, e, expert_ids.shape[1]


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else 0)


def _ints(*values: int) -> list[ctypes.c_int]:
    return [ctypes.c_int(v) for v in values]


def down_splits(tokens: int, column_tiles: int, device_index: int) -> int:
    """Splits of the gather path's down projection over its virtual K (``w4a16_moe_gemv.cu``):
    enough that the ``column_tiles x tokens`` blocks, two a SM, fill the GPU once, at most
    :data:`MAX_DOWN_SPLITS`; 1 from a few tokens on (a 35B-A3B layer: 4 at one token, 2 at
    two, 1 from three on an H200 or a V100)."""
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return max(1, min(MAX_DOWN_SPLITS, round(2 * sms / max(tokens * column_tiles, 1))))


def _device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def _launch_grouped_gemv(
    x: torch.Tensor, ids: torch.Tensor, flags: list, weights: torch.Tensor, weights32: list,
    w13_qweight: torch.Tensor, w13_scales_zeros: torch.Tensor, w2_qweight: torch.Tensor,
    w2_scales_zeros: torch.Tensor, hidden: torch.Tensor, out: torch.Tensor, top_k: int, e: int,
    group_size: int, device: int, stream: int,
) -> None:
    """The grouped decode path: align the pairs by expert, then gate_up and down per (column
    tile, row tile of one expert), then each token's sum over its pairs."""
    t, h = x.shape
    i, pairs = hidden.shape[1], hidden.shape[0]
    warps, batch, rows = GROUPED_GEMV_SHAPE
    shape = f"w{warps}_b{batch}_r{rows}"
    meta = torch.empty(2 * (e + 1) + pairs, dtype=torch.int32, device=x.device)
    row_tiles = math.ceil(pairs / rows) + min(e, pairs)
    pair_out = stream_buffer("moe_pair_out", x.device, stream, pairs * h, zeroed=False)
    get_kernel("w4a16_moe_wmma_align", device).launch(
        (1, 1, 1), _ALIGN_THREADS, stream, [_ptr(ids), *flags, *_ints(pairs, e, rows), _ptr(meta)]
    )
    get_kernel(f"w4a16_moe_gemv_grouped_gate_up_{shape}", device).launch(
        (i // TILE, row_tiles, 1), 32 * warps, stream,
        [_ptr(x), _ptr(meta), *_ints(e), _ptr(w13_qweight), _ptr(w13_scales_zeros), _ptr(hidden),
         *_ints(top_k, h, i, group_size, math.ceil(h // TILE / warps))],
    )  # fmt: skip
    get_kernel(f"w4a16_moe_gemv_grouped_down_{shape}", device).launch(
        (math.ceil(h // TILE / warps), row_tiles, 1), 32 * warps, stream,
        [_ptr(hidden), _ptr(meta), *_ints(e), _ptr(weights), *weights32, _ptr(w2_qweight),
         _ptr(w2_scales_zeros), _ptr(pair_out), *_ints(h, i, group_size)],
    )  # fmt: skip
    get_kernel("w4a16_moe_gemv_pair_sum", device).launch(
        (math.ceil(h / 1024), t, 1), 256, stream,
        [_ptr(pair_out), _ptr(ids), *flags, *_ints(e), _ptr(out), *_ints(top_k, h)],
    )


def _cuda_moe(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w13_qweight: torch.Tensor,
    w13_scales_zeros: torch.Tensor,
    w2_qweight: torch.Tensor,
    w2_scales_zeros: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    t, h, i, e, top_k = check_moe_inputs(
        x, expert_ids, weights, w13_qweight, w13_scales_zeros, w2_qweight, w2_scales_zeros, group_size
    )
    out = torch.empty((t, h), dtype=torch.float16, device=x.device)
    if t == 0:
        return out
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.contiguous() if not x.is_contiguous() else x.clone()
    ids, weights = expert_ids.contiguous(), weights.contiguous()
    flags = _ints(int(ids.dtype == torch.int64))
    weights32 = _ints(int(weights.dtype == torch.float32))
    device = _device_index(x)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    pairs = t * top_k
    hidden = torch.empty((pairs, i), dtype=torch.float16, device=x.device)
    if pairs <= GATHER_MAX_PAIRS and t >= GROUPED_GEMV_MIN_TOKENS:
        _launch_grouped_gemv(x, ids, flags, weights, weights32, w13_qweight, w13_scales_zeros,
                             w2_qweight, w2_scales_zeros, hidden, out, top_k, e, group_size,
                             device, stream)  # fmt: skip
        return out
    if pairs <= GATHER_MAX_PAIRS:
        (gate_warps, gate_batch), (down_warps, down_batch) = gather_shapes(t)
        get_kernel(f"w4a16_moe_gemv_gate_up_w{gate_warps}_b{gate_batch}", device).launch(
            (i // TILE, pairs, 1), 32 * gate_warps, stream,
            [_ptr(x), _ptr(ids), *flags, _ptr(w13_qweight), _ptr(w13_scales_zeros), _ptr(hidden),
             *_ints(top_k, e, h, i, group_size, math.ceil(h // TILE / gate_warps))],
        )  # fmt: skip
        splits = down_splits(t, h // TILE, device)
        split_words = stream_buffer("moe_down_split_words", x.device, stream, 2 * t * h, zeroed=True)  # u64 [T, H]
        get_kernel(f"w4a16_moe_gemv_down_w{down_warps}_b{down_batch}", device).launch(
            (h // TILE, t, splits), 32 * down_warps, stream,
            [_ptr(hidden), _ptr(ids), *flags, _ptr(weights), *weights32, _ptr(w2_qweight),
             _ptr(w2_scales_zeros), _ptr(out),
             *_ints(top_k, e, h, i, group_size, math.ceil(math.ceil(top_k * (i // TILE) / splits) / down_warps)),
             _ptr(split_words)],
        )  # fmt: skip
        return out
    # Grouped path: row tiles of one expert each; the grid covers the most tiles P pairs
    # can need (each expert with pairs adds at most one partial tile), blocks beyond exit.
    small = pairs <= SMALL_TILE_PAIRS_PER_EXPERT * e
    rows, suffix = _GROUP_ROWS[small], "_r16" if small else ""
    if small and PACKED_FRAGMENTS and group_size % WMMAR_GROUP == 0:
        suffix += "_pk"
    row_tiles = math.ceil(pairs / rows) + min(e, pairs)
    if row_tiles > _GRID_Y_MAX:
        raise OnecatError(
            f"onecat.kernels.moe.w4a16_moe: {t} tokens x top-{top_k} is too many pairs for one "
            f"call; split the batch (at most {(_GRID_Y_MAX - e) * rows} pairs)"
        )
    meta = torch.empty(2 * (e + 1) + pairs, dtype=torch.int32, device=x.device)
    # A token's top_k rows lie in different blocks: they are summed with fp32 atomics into
    # a zeroed workspace (one memset and one conversion per prefill call).
    summed = torch.zeros((t, h), dtype=torch.float32, device=x.device)
    get_kernel("w4a16_moe_wmma_align", device).launch(
        (1, 1, 1), _ALIGN_THREADS, stream, [_ptr(ids), *flags, *_ints(pairs, e, rows), _ptr(meta)]
    )
    get_kernel(f"w4a16_moe_wmma_gate_up{suffix}", device).launch(
        (math.ceil(i // TILE / (_GROUP_WARPS // 2)), row_tiles, 1), 32 * _GROUP_WARPS, stream,
        [_ptr(x), _ptr(meta), *_ints(e), _ptr(w13_qweight), _ptr(w13_scales_zeros), _ptr(hidden),
         *_ints(top_k, h, i, group_size)],
    )  # fmt: skip
    get_kernel(f"w4a16_moe_wmma_down{suffix}", device).launch(
        (math.ceil(h // TILE / _GROUP_WARPS), row_tiles, 1), 32 * _GROUP_WARPS, stream,
        [_ptr(hidden), _ptr(meta), *_ints(e), _ptr(weights), *weights32, _ptr(w2_qweight),
         _ptr(w2_scales_zeros), _ptr(summed), *_ints(top_k, h, i, group_size)],
    )  # fmt: skip
    return out.copy_(summed)


def reference_moe(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w13_qweight: torch.Tensor,
    w13_scales_zeros: torch.Tensor,
    w2_qweight: torch.Tensor,
    w2_scales_zeros: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """The op on the CPU: per expert that received pairs, its contract weights
    (``dequantize_volta``) in fp32, ``silu(gate) * up`` rounded to ``x.dtype`` (the kernels
    keep it in fp16), the down projection, the routing-weighted sum in fp32, one rounding to
    ``x.dtype``. Ids outside ``[0, E)`` are skipped. Runs on any device (loops on the host)."""
    _, hidden, inter, experts, _ = check_moe_inputs(
        x, expert_ids, weights, w13_qweight, w13_scales_zeros, w2_qweight, w2_scales_zeros, group_size
    )
    out = torch.zeros(x.shape[0], hidden, dtype=torch.float32, device=x.device)
    ids = expert_ids.long()
    valid = (ids >= 0) & (ids < experts)
    for e in torch.unique(ids[valid]).tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        w13 = dequantize_volta(w13_qweight[e], w13_scales_zeros[e], group_size, torch.float32)
        gate_up = x[tokens].float() @ w13.t()
        act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype).float()
        w2 = dequantize_volta(w2_qweight[e], w2_scales_zeros[e], group_size, torch.float32)
        out.index_add_(0, tokens, (act @ w2.t()) * weights[tokens, slots].float()[:, None])
    return out.to(x.dtype)


def _cpu_moe(*args) -> torch.Tensor:
    return reference_moe(*args)


_LIB.impl("w4a16_moe", _cuda_moe, "CUDA")
_LIB.impl("w4a16_moe", _cpu_moe, "CPU")


@torch.library.register_fake("onecat::w4a16_moe")
def _fake_moe(x, expert_ids, weights, w13_qweight, w13_scales_zeros, w2_qweight, w2_scales_zeros, group_size):
    return x.new_empty(x.shape)


def w4a16_moe(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w13_qweight: torch.Tensor,
    w13_scales_zeros: torch.Tensor,
    w2_qweight: torch.Tensor,
    w2_scales_zeros: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """Routed experts: ``out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))``.

    Args:
        x: activations ``[T, H]``, float16 on the GPU (any float dtype on the CPU).
        expert_ids: int32 or int64 ``[T, top_k]``; ids outside ``[0, E)`` contribute nothing.
        weights: routing weights ``[T, top_k]``, float32 or float16.
        w13_qweight: int32 ``[E, 2I/32, H/32, 32, 4]``: per expert the gate rows then the up
            rows, in the Volta layout; contiguous.
        w13_scales_zeros: float16 ``[E, 2I/32, H/g, 32, 2]``.
        w2_qweight: int32 ``[E, H/32, I/32, 32, 4]`` (down projection).
        w2_scales_zeros: float16 ``[E, H/32, I/g, 32, 2]``.
        group_size: quantization group ``g`` of both projections.

    Returns:
        ``[T, H]`` in ``x.dtype``: fp32 sums, ``silu(gate) * up`` rounded to fp16 between the
        projections (the decode kernels form fp16 partial sums of 16 products per k tile).

    Raises:
        OnecatError: on a wrong dtype, shape or device, or non-contiguous weights on the GPU.
    """
    return torch.ops.onecat.w4a16_moe(
        x, expert_ids, weights, w13_qweight, w13_scales_zeros, w2_qweight, w2_scales_zeros, group_size
    )


# --- router ------------------------------------------------------------------------------


def _check_route(logits: torch.Tensor, top_k: int, shared_expert: int = -1) -> int:
    """Raise on bad router inputs; returns the number of routed experts E."""
    where = "onecat.kernels.moe.moe_route"
    if logits.dim() != 2 or not logits.is_floating_point():
        raise OnecatError(f"{where}: logits must be floating point [T, E], got {logits.dtype} {tuple(logits.shape)}")
    experts = logits.shape[1] - (1 if shared_expert >= 0 else 0)
    if not 1 <= top_k <= min(experts, _MAX_TOP_K):
        raise OnecatError(f"{where}: top_k {top_k} must be in 1..{min(experts, _MAX_TOP_K)} for {experts} experts")
    if logits.device.type == "cuda" and experts > MAX_EXPERTS:
        raise OnecatError(f"{where}: at most {MAX_EXPERTS} experts on the GPU, got {experts}")
    return experts


def reference_route(logits: torch.Tensor, top_k: int, shared_expert: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """The router on any device: the ``top_k`` largest logits (equal logits: lowest expert
    index first) and a softmax over them, in fp32 (equal to softmax, top-k, renormalise).
    Returns ``(weights fp32 [T, k], ids int32 [T, k])``, experts in decreasing weight order;
    with ``shared_expert >= 0`` the last logit column is the shared expert's gate and that
    expert is appended (:func:`append_shared_expert`)."""
    experts = _check_route(logits, top_k, shared_expert)
    values, ids = torch.sort(logits[:, :experts].float(), dim=-1, descending=True, stable=True)
    weights, ids = torch.softmax(values[:, :top_k], dim=-1), ids[:, :top_k].to(torch.int32)
    if shared_expert >= 0:
        return append_shared_expert(weights, ids, logits[:, experts], shared_expert)
    return weights, ids


def _cuda_route(logits: torch.Tensor, top_k: int, shared_expert: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    experts = _check_route(logits, top_k, shared_expert)
    tokens = logits.shape[0]
    choices = top_k + (1 if shared_expert >= 0 else 0)
    weights = torch.empty((tokens, choices), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, choices), dtype=torch.int32, device=logits.device)
    if tokens == 0:
        return weights, ids
    if logits.dtype not in (torch.float16, torch.float32):
        logits = logits.float()
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    get_kernel("w4a16_moe_route_topk", _device_index(logits)).launch(
        (math.ceil(tokens / _ROUTE_WARPS), 1, 1), 32 * _ROUTE_WARPS,
        torch.cuda.current_stream(logits.device).cuda_stream,
        [_ptr(logits), *_ints(int(logits.dtype == torch.float32), logits.stride(0), tokens, experts, top_k,
                              shared_expert), _ptr(weights), _ptr(ids)],
    )  # fmt: skip
    return weights, ids


_LIB.impl("moe_route", _cuda_route, "CUDA")
_LIB.impl("moe_route", reference_route, "CPU")


@torch.library.register_fake("onecat::moe_route")
def _fake_route(logits, top_k, shared_expert=-1):
    shape = (logits.shape[0], top_k + (1 if shared_expert >= 0 else 0))
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int32)


def moe_route(logits: torch.Tensor, top_k: int, shared_expert: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3.5's router: softmax over the experts, the ``top_k`` best, renormalised to sum 1.

    ``logits [T, E]`` (fp16 or fp32; on the GPU E <= 1024, top_k <= 32) -> ``(weights fp32
    [T, top_k], expert ids int32 [T, top_k])``, in decreasing weight order; equal logits
    are taken lowest expert index first. Computed as a softmax over the selected logits
    (the same numbers: the full softmax's denominator cancels in the renormalisation).
    With ``shared_expert >= 0``, ``logits [T, E+1]`` end with the shared expert's gate logit
    and the result is ``[T, top_k + 1]``, choice ``top_k`` of every token being
    ``(shared_expert, sigmoid(gate logit))`` (as :func:`append_shared_expert`), in the same
    launch.
    """
    return torch.ops.onecat.moe_route(logits, top_k, shared_expert)


# --- router with its projection (decode) -------------------------------------------------


def _check_router(
    x: torch.Tensor, router_weight: torch.Tensor, shared_gate_weight: torch.Tensor | None, top_k: int, shared_expert: int
) -> None:
    where = "onecat.kernels.moe.moe_router"
    if shared_expert >= 0 and shared_gate_weight is None:
        raise OnecatError(f"{where}: shared_expert {shared_expert} needs the shared expert's gate weight")
    if x.dim() != 2 or router_weight.dim() != 2 or router_weight.shape[1] != x.shape[1]:
        raise OnecatError(
            f"{where}: x must be [T, H] and router_weight [E, H], got {tuple(x.shape)} and {tuple(router_weight.shape)}"
        )
    if shared_gate_weight is not None and shared_gate_weight.numel() != x.shape[1]:
        raise OnecatError(f"{where}: shared_gate_weight must hold H = {x.shape[1]} values, got {tuple(shared_gate_weight.shape)}")
    experts = router_weight.shape[0]
    if not 1 <= top_k <= min(experts, _MAX_TOP_K):
        raise OnecatError(f"{where}: top_k {top_k} must be in 1..{min(experts, _MAX_TOP_K)} for {experts} experts")


def router_fits(x: torch.Tensor, router_weight: torch.Tensor, shared_gate_weight: torch.Tensor | None) -> bool:
    """True when :func:`moe_router` runs its one-launch GPU kernel on these inputs: CUDA fp16,
    at most :data:`ROUTER_MAX_TOKENS` tokens, ``H % 8 == 0`` and ``H <= 16384``, at most
    :data:`MAX_EXPERTS` experts."""
    weights = [router_weight] if shared_gate_weight is None else [router_weight, shared_gate_weight]
    return (
        x.is_cuda and x.dtype == torch.float16 and x.dim() == 2 and x.shape[0] <= ROUTER_MAX_TOKENS
        and x.shape[1] % 8 == 0 and x.shape[1] <= _ROUTER_STAGE_HALFS and router_weight.shape[0] <= MAX_EXPERTS
        and all(w.dtype == torch.float16 and w.is_contiguous() and w.device == x.device for w in weights)
    )  # fmt: skip


def reference_router(
    x: torch.Tensor, router_weight: torch.Tensor, shared_gate_weight: torch.Tensor | None, top_k: int,
    shared_expert: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router with its projection on any device: fp32 logits ``x @ router_weight^T``
    rounded to ``x.dtype`` (as the linear layer rounds them), :func:`reference_route` over
    them, and the shared expert's gate logit ``[T, 1]`` (``[T, 0]`` without one); with
    ``shared_expert >= 0`` that expert is appended to every token's choices instead (see
    :func:`moe_router`)."""
    _check_router(x, router_weight, shared_gate_weight, top_k, shared_expert)
    logits = F.linear(x.float(), router_weight.float()).to(x.dtype)
    weights, ids = reference_route(logits, top_k)
    if shared_gate_weight is None:
        return weights, ids, x.new_empty((x.shape[0], 0))
    gate = F.linear(x.float(), shared_gate_weight.reshape(1, -1).float()).to(x.dtype)
    if shared_expert < 0:
        return weights, ids, gate
    weights, ids = append_shared_expert(weights, ids, gate, shared_expert)
    return weights, ids, x.new_empty((x.shape[0], 0))


def append_shared_expert(
    weights: torch.Tensor, ids: torch.Tensor, gate_logit: torch.Tensor, shared_expert: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing ``[T, k]`` plus the shared expert as choice ``k`` of every token, weighted
    ``sigmoid(gate_logit)`` (fp32): the grouped MoE op then adds the gated shared expert."""
    shared_w = torch.sigmoid(gate_logit.float().reshape(-1, 1))
    shared_id = torch.full_like(ids[:, :1], shared_expert)
    return torch.cat([weights, shared_w], dim=1), torch.cat([ids, shared_id], dim=1)


def _router_outputs(
    x: torch.Tensor, shared_gate_weight: torch.Tensor | None, top_k: int, shared_expert: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty ``(weights, ids, shared gate logits)`` of the router for ``x``'s tokens."""
    choices = top_k + (shared_expert >= 0)
    gate_width = 1 if shared_gate_weight is not None and shared_expert < 0 else 0
    return (
        torch.empty((x.shape[0], choices), dtype=torch.float32, device=x.device),
        torch.empty((x.shape[0], choices), dtype=torch.int32, device=x.device),
        torch.empty((x.shape[0], gate_width), dtype=x.dtype, device=x.device),
    )


def _launch_router(
    x: torch.Tensor, router_weight: torch.Tensor, shared_gate_weight: torch.Tensor | None, top_k: int,
    shared_expert: int, outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    norm: tuple[torch.Tensor, torch.Tensor, float, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """One ``w4a16_moe_route_decode`` launch into ``outputs`` (inputs as :func:`router_fits`
    says); ``norm`` = ``(residual, norm_weight, eps, normed_out, summed_out)`` adds the residual
    and norms the rows first (:func:`moe_router_norm`)."""
    tokens, hidden = x.shape
    experts = router_weight.shape[0]
    weights, ids, shared = outputs
    stream = torch.cuda.current_stream(x.device).cuda_stream
    scratch = stream_buffer("moe_router", x.device, stream, 32 + tokens * experts, zeroed=True)
    rows = experts + (shared_gate_weight is not None)
    residual, norm_weight, eps, normed, summed = norm if norm is not None else (None, None, 0.0, None, None)
    get_kernel("w4a16_moe_route_decode", _device_index(x)).launch(
        (math.ceil(rows / _ROUTER_WARPS), 1, 1), 32 * _ROUTER_WARPS, stream,
        [_ptr(x), *_ints(x.stride(0), tokens, hidden), _ptr(router_weight), *_ints(experts),
         _ptr(shared_gate_weight), *_ints(top_k, shared_expert), ctypes.c_void_p(scratch.data_ptr() + 128),
         _ptr(scratch), _ptr(weights), _ptr(ids), _ptr(shared), _ptr(residual), _ptr(norm_weight),
         ctypes.c_float(eps), _ptr(normed), _ptr(summed)],
    )  # fmt: skip


def _aligned_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` if its rows are unit-stride, 16-byte aligned and a multiple of 8 halves apart, else a copy."""
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        return x.contiguous().clone()
    return x


def _cuda_router(
    x: torch.Tensor, router_weight: torch.Tensor, shared_gate_weight: torch.Tensor | None, top_k: int,
    shared_expert: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_router(x, router_weight, shared_gate_weight, top_k, shared_expert)
    if not router_fits(x, router_weight, shared_gate_weight):
        return reference_router(x, router_weight, shared_gate_weight, top_k, shared_expert)
    outputs = _router_outputs(x, shared_gate_weight, top_k, shared_expert)
    if x.shape[0]:
        _launch_router(_aligned_rows(x), router_weight, shared_gate_weight, top_k, shared_expert, outputs)
    return outputs


_LIB.impl("moe_router", _cuda_router, "CUDA")
_LIB.impl("moe_router", reference_router, "CPU")


@torch.library.register_fake("onecat::moe_router")
def _fake_router(x, router_weight, shared_gate_weight, top_k, shared_expert=-1):
    shape = (x.shape[0], top_k + (shared_expert >= 0))
    shared = (x.shape[0], 0 if shared_gate_weight is None or shared_expert >= 0 else 1)
    return (
        x.new_empty(shape, dtype=torch.float32), x.new_empty(shape, dtype=torch.int32), x.new_empty(shared),
    )


def moe_router(
    x: torch.Tensor, router_weight: torch.Tensor, shared_gate_weight: torch.Tensor | None, top_k: int,
    shared_expert: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's fp16 projection, :func:`moe_route` and the shared expert's gate logit in
    one GPU launch (``w4a16_moe_route.cu``, ``w4a16_moe_route_decode``) for decode batches.

    Args:
        x: fp16 ``[T, H]`` hidden states (on the GPU, up to :data:`ROUTER_MAX_TOKENS` tokens
            run the kernel; more run :func:`reference_router`).
        router_weight: fp16 ``[E, H]``, the router's (unquantized) weight.
        shared_gate_weight: fp16 ``[1, H]`` (or ``[H]``), the shared expert's gate, or None.
        top_k: experts per token.
        shared_expert: if >= 0, the index the shared expert has among the stacked experts
            (its weights folded in after the routed ones): it becomes choice ``k`` of every
            token with weight ``sigmoid(gate logit)`` (:func:`append_shared_expert`).

    Returns:
        ``(weights fp32 [T, k], ids int32 [T, k], shared gate logits [T, 1] or [T, 0])``:
        what ``moe_route(x @ router_weight^T, top_k)`` and ``x @ shared_gate_weight^T`` give
        with fp16-rounded logits (sums in fp32, in another order than cuBLAS's); with
        ``shared_expert >= 0``, ``[T, k+1]`` routing and no gate logits.
    """
    return torch.ops.onecat.moe_router(x, router_weight, shared_gate_weight, top_k, shared_expert)


# --- router with the residual add and the RMSNorm before it (decode) ------------------------


def _check_norm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor) -> None:
    where = "onecat.kernels.moe.moe_router_norm"
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise OnecatError(f"{where}: residual must be {x.dtype} {tuple(x.shape)} like x, got {residual.dtype} {tuple(residual.shape)}")
    if norm_weight.dim() != 1 or norm_weight.numel() != x.shape[-1]:
        raise OnecatError(f"{where}: norm_weight must be [H = {x.shape[-1]}], got {tuple(norm_weight.shape)}")


def router_norm_fits(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, router_weight: torch.Tensor,
    shared_gate_weight: torch.Tensor | None,
) -> bool:
    """True when :func:`moe_router_norm` runs its one-launch GPU kernel: :func:`router_fits`, and
    ``residual`` (shaped like ``x``, on its device) and ``norm_weight`` as the RMSNorm kernel
    takes them (:func:`onecat.kernels.rms_norm.supports`)."""
    return (
        router_fits(x, router_weight, shared_gate_weight) and residual.shape == x.shape
        and residual.device == x.device and rms_norm.supports(residual, None, norm_weight)
    )  # fmt: skip


def reference_router_norm(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, router_weight: torch.Tensor,
    shared_gate_weight: torch.Tensor | None, top_k: int, shared_expert: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`moe_router_norm` on any device: ``summed = x + residual`` (one rounding),
    ``normed = fp16(summed * rsqrt(mean(summed^2) + eps) * (1 + norm_weight))`` in fp32 (the
    runtime's ``add_rms_norm``), then :func:`reference_router` on ``normed``."""
    _check_norm(x, residual, norm_weight)
    summed = x + residual
    r = summed.float()
    normed = (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + norm_weight.float())).to(x.dtype)
    return (*reference_router(normed, router_weight, shared_gate_weight, top_k, shared_expert), normed, summed)


def _cuda_router_norm(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, router_weight: torch.Tensor,
    shared_gate_weight: torch.Tensor | None, top_k: int, shared_expert: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_router(x, router_weight, shared_gate_weight, top_k, shared_expert)
    _check_norm(x, residual, norm_weight)
    if not router_norm_fits(x, residual, norm_weight, router_weight, shared_gate_weight):
        return reference_router_norm(x, residual, norm_weight, eps, router_weight, shared_gate_weight, top_k, shared_expert)
    outputs = _router_outputs(x, shared_gate_weight, top_k, shared_expert)
    normed, summed = torch.empty_like(residual), torch.empty_like(residual)
    if x.shape[0]:
        _launch_router(_aligned_rows(x), router_weight, shared_gate_weight, top_k, shared_expert, outputs,
                       (residual, norm_weight, eps, normed, summed))  # fmt: skip
    return (*outputs, normed, summed)


_LIB.impl("moe_router_norm", _cuda_router_norm, "CUDA")
_LIB.impl("moe_router_norm", reference_router_norm, "CPU")


@torch.library.register_fake("onecat::moe_router_norm")
def _fake_router_norm(x, residual, norm_weight, eps, router_weight, shared_gate_weight, top_k, shared_expert=-1):
    return (*_fake_router(x, router_weight, shared_gate_weight, top_k, shared_expert), x.new_empty(x.shape),
            x.new_empty(x.shape))  # fmt: skip


def moe_router_norm(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, router_weight: torch.Tensor,
    shared_gate_weight: torch.Tensor | None, top_k: int, shared_expert: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The residual add, the post-attention RMSNorm and :func:`moe_router` in ONE GPU launch
    (decode batches: what :func:`router_norm_fits` accepts; elsewhere the same math in torch).

    Args:
        x: fp16 ``[T, H]``, the mixer's output; ``residual``: fp16 ``[T, H]`` contiguous.
        norm_weight: fp32 ``[H]``, the RMSNorm's weight stored centred on zero (``1 + w`` scales).
        eps: the norm's epsilon. The rest as :func:`moe_router`, applied to the normed rows.

    Returns:
        ``(weights, ids, shared gate logits)`` as :func:`moe_router`, then ``normed`` (the
        experts' input) and ``summed = x + residual`` (the new residual), fp16 ``[T, H]``.
    """
    return torch.ops.onecat.moe_router_norm(
        x, residual, norm_weight, eps, router_weight, shared_gate_weight, top_k, shared_expert
    )
