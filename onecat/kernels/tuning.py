"""Choose the fastest variant per (M bucket, N, K, group) on the GPU at hand, and remember it.

Winners live in a JSON file per GPU and kernel target (``cache_dir()/tune/<gpu>-<target>.json``)
together with the hash of the kernel sources (a change of the sources drops old winners).
Keys are ``N{n}-K{k}-g{g}-M{bucket}`` where the bucket is the smallest power of two >= M
(capped at 8192); each bucket is timed at its upper end.  ``onecat tune`` fills the table for
given shapes; with ``ONECAT_AUTOTUNE=1`` (the default) the op also tunes a missing key on first
use, outside CUDA-graph capture and torch.compile tracing.
"""

from __future__ import annotations

import functools
import json
import os
import re
import tempfile
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from onecat.kernels import build, loader
from onecat.kernels.loader import get_kernel
from onecat.kernels.timing import copies_for, graph_time_us
from onecat.kernels.variants import (
    GEMV_BUILT,
    WMMA_BUILT,
    WMMAR_BUILT,
    Variant,
    default_variant,
    gemv_tiles_per_warp,
    launch_plan,
    run_variant,
    wmma_splits,
)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_lock = threading.Lock()
_tables: dict[str, dict[str, str]] = {}


def bucket(m: int) -> int:
    """The M bucket of ``m`` rows: the smallest entry of BUCKETS >= m (the last for more)."""
    return next((b for b in BUCKETS if b >= m), BUCKETS[-1])


def table_path(device_index: int) -> Path:
    """Where the tuning table of this GPU and kernel target lives."""
    name = re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name(device_index)).strip("-")
    return build.cache_dir() / "tune" / f"{name}-{loader.choose_target(device_index)}.json"


def _key(m: int, n: int, k: int, group_size: int) -> str:
    return f"N{n}-K{k}-g{group_size}-M{bucket(m)}"


def _table(device_index: int) -> dict[str, str]:
    path = table_path(device_index)
    cached = _tables.get(str(path))
    if cached is not None:
        return cached
    entries: dict[str, str] = {}
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("sources_hash") == build.sources_hash():
                entries = dict(data.get("entries", {}))
        except (OSError, ValueError):
            entries = {}
    _tables[str(path)] = entries
    return entries


def _save(device_index: int) -> None:
    path = table_path(device_index)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "gpu": torch.cuda.get_device_name(device_index),
        "target": loader.choose_target(device_index),
        "sources_hash": build.sources_hash(),
        "entries": dict(sorted(_table(device_index).items())),
    }
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def candidates(m: int, n: int, k: int, device_index: int, group_size: int = 128) -> list[Variant]:
    """The variants worth timing for ``m`` rows of an ``[n, k]`` weight quantized with
    ``group_size``."""
    found: list[Variant] = []
    gemv_rows = next((r for r in GEMV_BUILT if r >= m), None)
    if gemv_rows is not None:
        for unroll in GEMV_BUILT[gemv_rows]:
            variant = Variant("gemv", gemv_rows, unroll, 0)
            kernel = get_kernel(variant.kernel_name(), device_index)
            base = gemv_tiles_per_warp(kernel, n, k, device_index)
            for per in sorted({base, 2 * base}):
                found.append(Variant("gemv", gemv_rows, unroll, per))
    tiles = [t for t in WMMA_BUILT if t >= min(m, 64)][:2]
    if m > 64:
        tiles = [64] if m <= 256 else []  # beyond that cuBLAS wins by far
    for kind, built in (("wmma", WMMA_BUILT), ("wmmar", WMMAR_BUILT)):
        for tile in tiles:
            for warps, chunk in built[tile]:
                if chunk != 2 and tile >= 16:  # never faster in measurements (BENCHMARKS.md)
                    continue
                variant = Variant(kind, tile, warps, 0, chunk)
                if not variant.supports_group(group_size):
                    continue
                kernel = get_kernel(variant.kernel_name(), device_index)
                base = wmma_splits(kernel, variant, m, n, k, device_index)
                for splits in sorted({base, max(1, base // 2), base * 2}):
                    found.append(Variant(kind, tile, warps, splits, chunk))
    if m >= 16:
        found.append(Variant("dequant"))
    return found


def time_variant(
    variant: Variant,
    x: torch.Tensor,
    weights: Sequence[tuple[torch.Tensor, torch.Tensor]],
    group_size: int,
) -> float:
    """Median microseconds per call of ``variant`` (CUDA graph of calls rotating over the
    ``(qweight, scales_zeros)`` copies in ``weights``, see timing.py)."""
    n = weights[0][0].shape[0] * 32
    out = torch.empty((x.shape[0], n), dtype=torch.float16, device=x.device)
    calls = [
        functools.partial(run_variant, variant, x, qw, sz, group_size, None, out)
        for qw, sz in weights
    ]
    return graph_time_us(calls)


def tune_shape(
    m: int,
    qweight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    save: bool = True,
) -> tuple[Variant, dict[str, float]]:
    """Time every candidate for the bucket of ``m`` and record the winner.

    Returns the winner and all timings (microseconds by variant name).
    """
    device = qweight.device
    device_index = device.index if device.index is not None else torch.cuda.current_device()
    n, k = qweight.shape[0] * 32, qweight.shape[1] * 32
    rows = bucket(m)
    x = torch.randn(rows, k, dtype=torch.float16, device=device)
    options = candidates(rows, n, k, device_index, group_size)
    # Rotate over weight copies larger than L2, but never take more than a quarter of the free
    # memory (first-use tuning runs inside a serving process that has filled the GPU).
    free_bytes, _ = torch.cuda.mem_get_info(device)
    weights = weight_copies(qweight, scales_zeros, min(256 << 20, free_bytes // 4))
    if len(options) == 1:
        timings = {options[0].name: time_variant(options[0], x, weights[:1], group_size)}
    else:
        timings = {v.name: time_variant(v, x, weights, group_size) for v in options}
    best = Variant.parse(min(timings, key=timings.get))
    with _lock:
        _table(device_index)[_key(m, n, k, group_size)] = best.name
        _choices.pop((bucket(m), n, k, group_size, device_index), None)
        if save:
            _save(device_index)
    forget_plans()
    return best, timings


def weight_copies(
    qweight: torch.Tensor, scales_zeros: torch.Tensor, target_bytes: int = 256 << 20
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(qweight, scales_zeros)`` and clones of it, together more than ``target_bytes``
    (:func:`~onecat.kernels.timing.copies_for`): calls rotating over them read their weights
    from memory, as a model's layers do, not from L2."""
    copies = copies_for(qweight.numel() * 4 + scales_zeros.numel() * 2, target_bytes)
    return [(qweight, scales_zeros)] + [(qweight.clone(), scales_zeros.clone()) for _ in range(copies - 1)]


def autotune_enabled() -> bool:
    """Whether the op tunes unknown shapes on first use (``ONECAT_AUTOTUNE``, default on)."""
    return os.environ.get("ONECAT_AUTOTUNE", "1") not in ("0", "false", "no", "")


_choices: dict[tuple[int, int, int, int, int], Variant] = {}


def choose_variant(
    m: int, qweight: torch.Tensor, scales_zeros: torch.Tensor, group_size: int
) -> Variant:
    """The variant to run: the tuned winner, else (tuning now if allowed) the default.

    Resolved once per (M bucket, N, K, group, device) and remembered in memory, so a call
    costs one dictionary lookup (no device or table-path queries)."""
    device_index = qweight.device.index
    if device_index is None:
        device_index = torch.cuda.current_device()
    n, k = qweight.shape[0] * 32, qweight.shape[1] * 32
    key = (bucket(m), n, k, group_size, device_index)
    variant = _choices.get(key)
    if variant is not None and variant.supports(m):
        return variant
    name = _table(device_index).get(_key(m, n, k, group_size))
    if name is not None:
        variant = Variant.parse(name)
        if variant.supports(m):
            _choices[key] = variant
            return variant
    if (
        autotune_enabled()
        and not torch.cuda.is_current_stream_capturing()
        and not torch.compiler.is_compiling()
    ):
        variant = _choices[key] = tune_shape(m, qweight, scales_zeros, group_size)[0]
        return variant
    return default_variant(m)  # not remembered: tuning may still happen outside capture


def is_remembered(m: int, n: int, k: int, group_size: int, device_index: int) -> bool:
    """Whether :func:`choose_variant`'s answer for this shape is final in this process."""
    return (bucket(m), n, k, group_size, device_index) in _choices or not autotune_enabled()


_plans: dict[tuple, object] = {}
"""The op's launch-plan cache: input signature (shapes, dtypes, devices, group size, bias or
not, SwiGLU or not; built by ``ops._cuda_impl``) -> its validated launch plan. It lives here,
beside the variant choice it depends on, so that a new winner can drop it
(:func:`forget_plans`) without this module importing ``ops``."""

_MAX_PLANS = 1 << 14  # prefill chunks of every length: stay bounded


def remembered_plan(signature: tuple) -> object | None:
    """The launch plan remembered for ``signature``, or None (one dictionary lookup)."""
    return _plans.get(signature)


def remember_plan(signature: tuple, plan: object) -> None:
    """Remember ``plan`` for ``signature`` (the cache is cleared when it grows past its bound)."""
    if len(_plans) > _MAX_PLANS:
        _plans.clear()
    _plans[signature] = plan


def forget_plans() -> None:
    """Drop the remembered launch plans (:func:`tune_shape` calls this when a winner changes)."""
    _plans.clear()


def plan_signature(
    signature: tuple, m: int, qweight: torch.Tensor, scales_zeros: torch.Tensor, group_size: int,
    silu_mul: bool,
) -> object:
    """The launch plan of a validated input signature of ``m > 0`` rows: the chosen variant
    (:func:`choose_variant`) with its launch parameters (``variants.launch_plan``; the SwiGLU
    epilogue only where the variant has one). Remembered for ``signature`` unless the choice
    may still change (a default picked during graph capture or compilation)."""
    n, k = qweight.shape[0] * 32, qweight.shape[1] * 32
    device_index = qweight.device.index
    variant = choose_variant(m, qweight, scales_zeros, group_size)
    plan = launch_plan(variant, m, n, k, group_size, device_index, silu_mul and variant.fuses_silu_mul(n))
    if is_remembered(m, n, k, group_size, device_index):
        remember_plan(signature, plan)
    return plan


def random_packed_weights(
    n: int, k: int, group_size: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random Volta-layout weights ``(qweight, scales_zeros)`` of an ``[n, k]`` linear on
    ``gen``'s device: any nibbles, scales in [0.001, 0.011), zero points 0..15."""
    device = gen.device
    qweight = torch.randint(
        -(2**31), 2**31 - 1, (n // 32, k // 32, 32, 4), dtype=torch.int32, device=device, generator=gen
    )
    scales = torch.rand(n // 32, k // group_size, 32, 1, device=device, generator=gen)
    scales = (scales * 0.01 + 0.001).to(torch.float16)
    zeros = torch.randint(0, 16, scales.shape, device=device, generator=gen).to(torch.float16)
    return qweight, torch.cat([scales, -(zeros * scales)], dim=-1).contiguous()


def tune_shapes(
    shapes: Iterable[tuple[int, int]],
    ms: Iterable[int],
    group_size: int = 128,
    device: str = "cuda",
) -> list[tuple[int, int, int, str, float]]:
    """Tune every (N, K) in ``shapes`` for every M in ``ms`` on random weights.

    Returns rows ``(n, k, m, winner, microseconds)`` and saves the table.
    """
    results = []
    ms = list(ms)
    for n, k in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        qweight, scales_zeros = random_packed_weights(n, k, group_size, gen)
        for m in ms:
            best, timings = tune_shape(m, qweight, scales_zeros, group_size, save=False)
            results.append((n, k, m, best.name, timings[best.name]))
    if results:
        device_index = torch.device(device).index
        _save(device_index if device_index is not None else torch.cuda.current_device())
    return results
