"""A few launches of onecat's decode kernels at real Qwen3.5 shapes, for Nsight Compute (GPU).

Runs each target ``--repeats`` times with no tuning (fixed variants), so that ``ncu`` can
profile exactly one launch of each kernel of interest:

    cd bench && ONECAT_AUTOTUNE=0 ONECAT_KERNEL_DIR=../.ptx ONECAT_KERNEL_ARCH=70 \
        ncu --clock-control none --kernel-name regex:'w4a16_(wmmar|moe)' --launch-skip 1 \
        --launch-count 8 --section WarpStateStats --section SpeedOfLight python ncu_targets.py

Targets: the 27B merged gate/up (34816 x 5120) and down (5120 x 17408) at M = 8 and 32 on
the register-dequant wmma kernels, and the 35B-A3B MoE op and router at 1, 8 and 32 tokens.
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


def moe_targets(gen: torch.Generator, repeats: int) -> None:
    """The 35B-A3B MoE op (routed top-8 plus the folded shared expert) and router."""
    w13 = random_experts(MOE_EXPERTS, 2 * MOE_INTER, MOE_HIDDEN)
    w2 = random_experts(MOE_EXPERTS, MOE_HIDDEN, MOE_INTER)
    router = (torch.randn(MOE_EXPERTS - 1, MOE_HIDDEN, device="cuda", generator=gen) / 32).half()
    shared = (torch.randn(1, MOE_HIDDEN, device="cuda", generator=gen) / 32).half()
    for tokens in (1, 8, 32):
        x = torch.randn(tokens, MOE_HIDDEN, dtype=torch.float16, device="cuda", generator=gen)
        for _ in range(repeats):
            weights, ids, _ = moe_router(x, router, shared, MOE_TOP_K, MOE_EXPERTS - 1)
            w4a16_moe(x, ids, weights, *w13, *w2, GROUP)


def main() -> None:
    """Run the targets (see the module doc)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", choices=("dense", "moe"), default=None)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.only != "moe":
        dense_targets(gen, args.repeats)
    if args.only != "dense":
        moe_targets(gen, args.repeats)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
