"""A few launches of onecat's decode kernels at real Qwen3.5 shapes, for Nsight Compute (GPU).

Runs each target ``--repeats`` times with no tuning (fixed variants), so that ``ncu`` can
profile exactly one launch of each kernel of interest:

    cd bench && ONECAT_AUTOTUNE=0 ONECAT_KERNEL_DIR=../.ptx ONECAT_KERNEL_ARCH=70 \
        ncu --clock-control none --kernel-name regex:'w4a16_(wmmar|moe)' --launch-skip 1 \
        --launch-count 8 --section WarpStateStats --section SpeedOfLight python ncu_targets.py

Targets: the 27B merged gate/up (34816 x 5120) and down (5120 x 17408) at M = 8 and 32 on
the register-dequant wmma kernels, the 35B-A3B one-row GEMVs (in_proj_qkvz 12288 x 2048,
out_proj 2048 x 4096) and the 35B-A3B MoE op and router at ``--moe-tokens`` (1, 8 and 32).
"""

from __future__ import annotations

import argparse

import torch
from kernels import GROUP, MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, MOE_TOP_K, random_experts

from onecat.kernels.moe import moe_router, w4a16_moe
from onecat.kernels.tuning import random_packed_weights
from onecat.kernels.variants import Variant, run_variant


def dense_targets(gen: torch.Generator, repeats: int) -> None:
    """The 27B MLP linears at M = 8 and 32 on the tuner's usual winners."""
    for n, k in ((34816, 5120), (5120, 17408)):
        qweight, scales_zeros = random_packed_weights(n, k, GROUP, gen)
        for m, name in ((8, "wmmar-mt8-w4-c2-s0"), (32, "wmmar-mt32-w4-c2-s0")):
            x = torch.randn(m, k, dtype=torch.float16, device="cuda", generator=gen)
            for _ in range(repeats):
                run_variant(Variant.parse(name), x, qweight, scales_zeros, GROUP)


def gemv_targets(gen: torch.Generator, repeats: int) -> None:
    """The 35B-A3B GDN layer's one-row projections on ``gemv-m1-u4-p0`` (one wave of warps)."""
    for n, k in ((12288, 2048), (2048, 4096)):
        qweight, scales_zeros = random_packed_weights(n, k, GROUP, gen)
        x = torch.randn(1, k, dtype=torch.float16, device="cuda", generator=gen)
        for _ in range(repeats):
            run_variant(Variant.parse("gemv-m1-u4-p0"), x, qweight, scales_zeros, GROUP)


def moe_targets(gen: torch.Generator, repeats: int, token_counts: tuple[int, ...] = (1, 8, 32)) -> None:
    """The 35B-A3B MoE op (routed top-8 plus the folded shared expert) and router."""
    w13 = random_experts(MOE_EXPERTS, 2 * MOE_INTER, MOE_HIDDEN)
    w2 = random_experts(MOE_EXPERTS, MOE_HIDDEN, MOE_INTER)
    router = (torch.randn(MOE_EXPERTS - 1, MOE_HIDDEN, device="cuda", generator=gen) / 32).half()
    shared = (torch.randn(1, MOE_HIDDEN, device="cuda", generator=gen) / 32).half()
    for tokens in token_counts:
        x = torch.randn(tokens, MOE_HIDDEN, dtype=torch.float16, device="cuda", generator=gen)
        for _ in range(repeats):
            weights, ids, _ = moe_router(x, router, shared, MOE_TOP_K, MOE_EXPERTS - 1)
            w4a16_moe(x, ids, weights, *w13, *w2, GROUP)


def main() -> None:
    """Run the targets (see the module doc)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", choices=("dense", "gemv", "moe"), default=None)
    parser.add_argument("--moe-tokens", default="1,8,32")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.only in (None, "dense"):
        dense_targets(gen, args.repeats)
    if args.only in (None, "gemv"):
        gemv_targets(gen, args.repeats)
    if args.only in (None, "moe"):
        moe_targets(gen, args.repeats, tuple(int(t) for t in args.moe_tokens.split(",")))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
