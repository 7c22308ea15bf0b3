"""Every GEMV launch shape of the W4A16 op on a few weights, against floors (GPU).

    ONECAT_KERNEL_DIR=.ptx ONECAT_KERNEL_ARCH=70 python bench/gemv_sweep.py [--shapes 12288x2048,2048x4096] [--rows 1,2,4]

For each ``N x K`` weight (default: the Qwen3.5-35B-A3B decode projections, whose one-row
GEMVs are the largest kernel group of its batch-1 step) this times, in the same run and as
the tuner does (median of CUDA-graph replays, calls rotating over weight copies larger than
L2), every built GEMV unroll depth for ``--rows`` activation rows (default 1) at k tiles per
warp from a quarter of one wave's share up to a whole column, and three floors for moving the
same bytes in one launch: ``copy`` (``Tensor.copy_`` of half the packed bytes, so bytes read +
written match), ``fp16 matvec`` (cuBLAS on an fp16 weight of the same byte count, same rows)
and ``tiny op`` (a one-element add: what a launch in a graph costs by itself).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from onecat.kernels.loader import get_kernel
from onecat.kernels.timing import graph_time_us
from onecat.kernels.tuning import random_packed_weights, weight_copies
from onecat.kernels.variants import (
    GEMV_BUILT,
    Variant,
    gemv_tiles_per_warp,
    run_variant,
)

DEFAULT_SHAPES = "12288x2048,9216x2048,2048x4096"


def sweep_shape(n: int, k: int, group_size: int, rows: int = 1) -> dict[str, float]:
    """Microseconds per call of every GEMV launch shape for ``rows`` activation rows (the
    kernels built for that many) and of the floors, for one weight."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    qweight, scales_zeros = random_packed_weights(n, k, group_size, gen)
    copies = weight_copies(qweight, scales_zeros)
    packed_bytes = qweight.numel() * 4 + scales_zeros.numel() * 2
    x = torch.randn(rows, k, device="cuda", generator=gen).half()
    out = torch.empty(rows, n, device="cuda", dtype=torch.float16)
    device_index = torch.cuda.current_device()
    row: dict[str, float] = {"n": n, "k": k, "rows": rows, "mb": packed_bytes / 1e6}
    ktiles = k // 32
    for unroll in GEMV_BUILT[rows]:
        base = gemv_tiles_per_warp(get_kernel(Variant("gemv", rows, unroll).kernel_name(), device_index), n, k, device_index)
        for per in sorted({max(4, base // 4), max(4, base // 2), base, 2 * base, 4 * base, ktiles}):
            variant = Variant("gemv", rows, unroll, per)
            calls = [lambda qw=qw, sz=sz, v=variant: run_variant(v, x, qw, sz, group_size, None, out) for qw, sz in copies]
            row[variant.name] = graph_time_us(calls)
    halves = [torch.empty(packed_bytes // 4, device="cuda", dtype=torch.float16) for _ in range(len(copies))]
    dst = torch.empty_like(halves[0])
    row["copy"] = graph_time_us([lambda s=s: dst.copy_(s) for s in halves])
    fp16 = [torch.randn(max(1, packed_bytes // (2 * k)), k, device="cuda").half() for _ in range(len(copies))]
    row["fp16 matvec"] = graph_time_us([lambda w=w: F.linear(x, w) for w in fp16])
    one = torch.zeros(1, device="cuda")
    row["tiny op"] = graph_time_us([lambda: one.add_(1)])
    gemvs = {key: v for key, v in row.items() if key.startswith("gemv")}
    best = min(gemvs, key=gemvs.get)
    row["best"] = best
    row["best_vs_copy"] = row["copy"] / gemvs[best]
    return row


def main() -> None:
    """Print one JSON row per shape."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated NxK weights")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--rows", default="1", help=f"activation rows, comma-separated (built: {sorted(GEMV_BUILT)})")
    parser.add_argument("--out", default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        n, k = map(int, shape.lower().split("x"))
        for m in map(int, args.rows.split(",")):
            rows.append(sweep_shape(n, k, args.group_size, m))
            print(json.dumps({key: round(v, 2) if isinstance(v, float) else v for key, v in rows[-1].items()}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
