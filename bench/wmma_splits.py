"""Splits of K for the tensor-core W4A16 kernels: the wave model's choice against a sweep (GPU).

For each Qwen3.5 decode shape and batch M, times one register-dequant wmma variant at every
split count in a range (CUDA graphs, weights rotated past L2, as the tuner times them) and
``dequant`` + cuBLAS, and marks the split count ``variants.wmma_splits`` would pick.

    cd bench && ONECAT_KERNEL_DIR=../.ptx ONECAT_KERNEL_ARCH=70 python wmma_splits.py --ms 8,32
"""

from __future__ import annotations

import argparse
import json

import torch

from onecat.kernels import tuning
from onecat.kernels.loader import get_kernel
from onecat.kernels.variants import Variant, wmma_splits

SHAPES = (
    ("27B gate_up merged", 34816, 5120),
    ("27B down_proj", 5120, 17408),
    ("27B in_proj_qkvz", 16384, 5120),
    ("27B out_proj", 5120, 6144),
    ("35B in_proj_qkvz", 12288, 2048),
    ("35B out_proj", 2048, 4096),
)
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def main() -> None:
    """Print one JSON row per (shape, M)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default="8,32")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--tile", type=int, default=0, help="row tile (8, 16, 32, 64; 0: the smallest >= M)")
    parser.add_argument("--shapes", default="", help="only the shapes whose label contains one of these, e.g. 35B")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    g = args.group_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    wanted = [w for w in args.shapes.split(",") if w]
    for label, n, k in SHAPES:
        if wanted and not any(w in label for w in wanted):
            continue
        qweight, scales_zeros = tuning.random_packed_weights(n, k, g, gen)
        weights = tuning.weight_copies(qweight, scales_zeros)
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, dtype=torch.float16, device="cuda", generator=gen)
            tile = args.tile or (8 if m <= 8 else 16 if m <= 16 else 32)
            base = Variant("wmmar", tile, 4, 0, 2)
            chosen = wmma_splits(get_kernel(base.kernel_name(), 0), base, m, n, k, 0)
            times = {}
            for s in SPLITS:
                if s <= k // 32 // 2:
                    times[s] = tuning.time_variant(Variant("wmmar", tile, 4, s, 2), x, weights, g)
            dequant = tuning.time_variant(Variant("dequant"), x, weights, g) if m >= 16 else None
            best = min(times, key=times.get)
            row = dict(shape=label, n=n, k=k, m=m, tile=tile, wave_model_splits=chosen,
                       wave_model_us=tuning.time_variant(Variant("wmmar", tile, 4, chosen, 2), x, weights, g),
                       best_splits=best, best_us=times[best], dequant_us=dequant,
                       us_by_splits={str(s): round(t, 2) for s, t in times.items()})  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        del weights
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
