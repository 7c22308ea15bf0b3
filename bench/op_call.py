"""Host cost of one W4A16 op call outside CUDA graphs, against torch.matmul (GPU).

Queues ``--calls`` back-to-back calls of ``torch.ops.onecat.w4a16_linear`` on small decode
shapes (the GPU finishes each call faster than Python issues the next, so the wall time per
call is the host cost) and the same number of fp16 ``torch.matmul`` calls on the same shapes.

    ONECAT_KERNEL_DIR=.ptx ONECAT_KERNEL_ARCH=70 python bench/op_call.py
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from onecat.kernels.ops import w4a16_linear
from onecat.kernels.tuning import random_packed_weights


def per_call_us(fn, calls: int) -> float:
    """Wall microseconds per call of ``fn`` over ``calls`` queued calls (best of 3)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for m, n, k in ((1, 2048, 2048), (8, 4096, 2048), (32, 5120, 5120), (256, 1024, 2048)):
        qweight, scales_zeros = random_packed_weights(n, k, 128, gen)
        x = torch.randn(m, k, dtype=torch.float16, device="cuda")
        weight = torch.randn(n, k, dtype=torch.float16, device="cuda")
        ours = per_call_us(lambda: w4a16_linear(x, qweight, scales_zeros, 128), args.calls)  # noqa: B023
        theirs = per_call_us(lambda: torch.matmul(x, weight.t()), args.calls)  # noqa: B023
        rows.append({"m": m, "n": n, "k": k, "onecat_us": ours, "matmul_us": theirs})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
