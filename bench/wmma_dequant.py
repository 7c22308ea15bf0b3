"""Tensor-core W4A16 kernels: fp16 weights through shared memory (``wmma``) against packed
words through shared memory and dequantisation on the B fragments (``wmmar``), GPU.

For each Qwen3.5 shape (``onecat.kernels.shapes.BENCH_SHAPES``) and batch M, every candidate
variant of the tuner is timed (CUDA graphs, weights rotated past L2, ``tuning.tune_shape``);
the table shows the fastest of each kind (and of the CUDA-core GEMV where M is small enough
for it), the ratio, and each one's share of the copy bandwidth over the packed weight's bytes
measured in the same run.

    cd bench && ONECAT_KERNEL_DIR=../.ptx ONECAT_KERNEL_ARCH=70 python wmma_dequant.py --ms 8,16,32,64
"""

from __future__ import annotations

import argparse
import json

import torch
from kernels import copy_bandwidth_gbs

from onecat.kernels import tuning
from onecat.kernels.shapes import BENCH_SHAPES


def best_of(timings: dict[str, float], kind: str) -> tuple[str, float]:
    """The fastest variant of ``kind`` in a tuner's timings (name, microseconds)."""
    mine = {name: us for name, us in timings.items() if name.split("-")[0] == kind}
    name = min(mine, key=mine.get)
    return name, mine[name]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ms", default="8,16,32,64")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--out", default=None, help="write the rows as JSON")
    args = parser.parse_args()
    copy_gbs = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbs:.0f} GB/s, group size {args.group_size}")
    print("| shape | N x K | M | wmma us (% BW) | wmmar us (% BW) | wmma / wmmar | fastest wmmar | CUDA-core GEMV us (% BW) |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for label, n, k in BENCH_SHAPES:
        qweight, scales_zeros = tuning.random_packed_weights(n, k, args.group_size, gen)
        weight_bytes = qweight.numel() * 4 + scales_zeros.numel() * 2
        for m in (int(v) for v in args.ms.split(",")):
            _, timings = tuning.tune_shape(m, qweight, scales_zeros, args.group_size, save=False)
            old_name, old_us = best_of(timings, "wmma")
            new_name, new_us = best_of(timings, "wmmar")
            gemv_us = min((us for name, us in timings.items() if name.startswith("gemv")), default=None)
            share = {us: 100 * weight_bytes / (us * 1e-6) / (copy_gbs * 1e9) for us in (old_us, new_us, gemv_us) if us}
            gemv = f"{gemv_us:.1f} ({share[gemv_us]:.0f}%)" if gemv_us else "-"
            print(f"| {label} | {n} x {k} | {m} | {old_us:.1f} ({share[old_us]:.0f}%) | {new_us:.1f} "
                  f"({share[new_us]:.0f}%) | {old_us / new_us:.2f}x | {new_name} | {gemv} |", flush=True)
            rows.append({"shape": label, "n": n, "k": k, "m": m, "timings_us": timings})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"copy_gbs": copy_gbs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
