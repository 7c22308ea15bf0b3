"""The MoE router of one Qwen3.5-35B-A3B layer at decode batch sizes (GPU).

    ONECAT_KERNEL_DIR=.ptx ONECAT_KERNEL_ARCH=70 python bench/router.py [--tokens 1,8,32,64] [--warps 16,8,4]

Times, in the same run (median of CUDA-graph replays, ``onecat.kernels.timing``): onecat's
one-launch router (``moe_router``: the router's projection [256, 2048], softmax / top-8 /
renormalisation and the shared expert's gate, with the shared expert appended as a 9th
choice), against the unfused path it replaces: two fp16 ``F.linear`` calls (cuBLAS) and the
routing kernel (``moe_route``). ``--warps`` times the router kernel at other block sizes
(weight rows per block, ``onecat.kernels.moe._ROUTER_WARPS``; the kernel takes any up to 16),
one ``moe_router_us_w<N>`` column each. ``moe_router_norm_us`` times the launch the decode step
makes (``moe_router_norm``: the residual add and the RMSNorm in the router's launch).

The calls rotate over ``--copies`` distinct router weights (default 96: 96 MiB, more than an
H200's L2), so every call reads its weights from DRAM as in a model's step, not from L2.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from onecat.kernels import moe
from onecat.kernels.moe import moe_route, moe_router, moe_router_norm
from onecat.kernels.timing import graph_time_us

EXPERTS, HIDDEN, TOP_K = 256, 2048, 8


def main() -> None:
    """Print one JSON row per token count."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,32,64")
    parser.add_argument("--warps", default="", help="other block sizes (rows per block) to time, e.g. 8,4")
    parser.add_argument("--copies", type=int, default=96, help="distinct router weights the calls rotate over")
    args = parser.parse_args()
    block_sizes = [int(w) for w in args.warps.split(",") if w]
    gen = torch.Generator(device="cuda").manual_seed(0)
    routers = [(torch.randn(EXPERTS, HIDDEN, device="cuda", generator=gen) / 32).half() for _ in range(args.copies)]
    shared = (torch.randn(1, HIDDEN, device="cuda", generator=gen) / 32).half()
    norm_weight = torch.randn(HIDDEN, device="cuda", generator=gen) / 8
    for tokens in map(int, args.tokens.split(",")):
        x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).half()
        residual = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).half()
        fused = [lambda x=x, r=r: moe_router(x, r, shared, TOP_K, EXPERTS) for r in routers]
        unfused = [lambda x=x, r=r: (moe_route(F.linear(x, r), TOP_K), F.linear(x, shared)) for r in routers]
        normed = [lambda x=x, r=r, residual=residual: moe_router_norm(x, residual, norm_weight, 1e-6, r, shared,
                                                                      TOP_K, EXPERTS) for r in routers]  # fmt: skip
        row = {"tokens": tokens, "moe_router_us": graph_time_us(fused), "moe_router_norm_us": graph_time_us(normed),
               "linear_route_linear_us": graph_time_us(unfused)}  # fmt: skip
        row["speedup"] = row["linear_route_linear_us"] / row["moe_router_us"]
        default_warps = moe._ROUTER_WARPS
        for warps in block_sizes:
            moe._ROUTER_WARPS = warps
            try:
                row[f"moe_router_us_w{warps}"] = graph_time_us(fused)
            finally:
                moe._ROUTER_WARPS = default_warps
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
