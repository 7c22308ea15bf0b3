"""The Gated DeltaNet decode step of one layer on each kernel path, at decode batch sizes (GPU).

    ONECAT_KERNEL_DIR=.ptx ONECAT_KERNEL_ARCH=70 python bench/gdn_decode.py [--batches 1,4,8,9,16,32,64]
        [--positions 1] [--models 27b,35b]

Times, in the same run (median of CUDA-graph replays, ``onecat.kernels.timing``), for the
Qwen3.5-27B (48 value heads) and 35B-A3B (32) shapes, dv 128, ``B`` sequences of ``P``
positions: the fused kernel (``gdn_decode_d128``: delta rule and gated norm, b and a given as
rows), the same kernel projecting b and a itself from the layer input (``fused_projecting``),
the wide-batch path (``gdn_decode_wide_d128`` then ``gdn_decode_gated_norm``), in_proj_ba alone
(cuBLAS), and the conv launch before them (``gdn_decode_conv``) alone and projecting b and a
(``conv_projecting``). What the runtime runs for a decode-only pass is ``fused_step`` = conv +
fused_projecting up to ``WIDE_ABOVE_ROWS`` rows and ``wide_step`` = conv_projecting + wide
above. ``*_pct`` is the state traffic (one read and P writes of 64 KB per head and sequence)
over the time, in % of ``--copy-gbps``. Calls rotate over enough state pools to exceed L2, as
a model's layers do. Set ``onecat.kernels.gdn.WIDE_ABOVE_ROWS`` (rows = B x P) from where
``wide_step`` starts to win.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from onecat.kernels import gdn
from onecat.kernels.timing import copies_for, graph_time_us

MODELS = {"27b": (16, 48, 5120), "35b": (16, 32, 2048)}  # key heads, value heads, hidden
DK = DV = 128


def time_path(calls, wide: bool) -> float:
    """Median microseconds per call with the wide path forced on or off."""
    default = gdn.WIDE_ABOVE_ROWS
    gdn.WIDE_ABOVE_ROWS = 0 if wide else 1 << 30
    try:
        return graph_time_us(calls)
    finally:
        gdn.WIDE_ABOVE_ROWS = default


def measure(model: str, batch: int, positions: int, copy_gbps: float) -> dict:
    """One row: the paths' microseconds per layer and their share of the copy bandwidth."""
    gen = torch.Generator(device="cuda").manual_seed(batch * 10 + positions)
    num_k_heads, num_v_heads, hidden = MODELS[model]
    rows = batch * positions
    A_log = torch.rand(num_v_heads, device="cuda", generator=gen).add(1).log()
    dt_bias = torch.randn(num_v_heads, device="cuda", generator=gen)
    norm_w = torch.ones(DV, device="cuda")
    ba_w = (torch.randn(2 * num_v_heads, hidden, device="cuda", generator=gen) / hidden**0.5).half()
    mixed = torch.randn(rows, 2 * num_k_heads * DK + num_v_heads * DV, device="cuda", generator=gen).half()
    z = torch.randn(rows, num_v_heads * DV, device="cuda", generator=gen).half()
    x = torch.randn(rows, hidden, device="cuda", generator=gen).half()
    ba = F.linear(x, ba_w)
    out = torch.empty(rows, num_v_heads, DV, dtype=torch.float16, device="cuda")
    slots = torch.arange(batch, device="cuda")
    dst = torch.arange(rows, device="cuda") if positions > 1 else None  # position by position
    pool_bytes = rows * num_v_heads * DK * DV * 4
    pools = [torch.randn(rows, num_v_heads, DK, DV, device="cuda", generator=gen) * 0.1
             for _ in range(copies_for(pool_bytes))]  # fmt: skip

    def calls(project: bool) -> list:
        projection = {"hidden_states": x, "ba_weight": ba_w} if project else {}
        return [
            lambda state=state: gdn.gated_delta_rule_decode_(
                mixed, None if project else ba, z, A_log, dt_bias, norm_w, 1e-6, state, slots, num_k_heads,
                out=out, dst_slots=dst, positions=positions, **projection,
            )
            for state in pools
        ]

    channels = mixed.shape[1]
    conv_w = (torch.randn(channels, gdn.CONV_KERNEL, device="cuda", generator=gen) * 0.5).half()
    conv_state = torch.randn(rows, channels, gdn.CONV_KERNEL - 1, device="cuda", generator=gen).half()
    conv_out = torch.empty_like(mixed)
    ba_out = torch.empty(rows, 2 * num_v_heads, dtype=torch.float16, device="cuda")

    def conv(project: bool) -> float:
        projection = {"hidden_states": x, "ba_weight": ba_w, "ba_out": ba_out} if project else {}
        return graph_time_us([lambda: gdn.causal_conv1d_update_(
            mixed, conv_state, conv_w, slots, dst, positions, out=conv_out, **projection)])  # fmt: skip

    row = {"model": model, "batch": batch, "positions": positions, "rows": rows,
           "fused_us": time_path(calls(False), wide=False),
           "fused_projecting_us": time_path(calls(True), wide=False),
           "wide_us": time_path(calls(False), wide=True),
           "in_proj_ba_us": graph_time_us([lambda: F.linear(x, ba_w)]),
           "conv_us": conv(False), "conv_projecting_us": conv(True)}  # fmt: skip
    row["fused_step_us"] = row["conv_us"] + row["fused_projecting_us"]
    row["wide_step_us"] = row["conv_projecting_us"] + row["wide_us"]
    traffic = batch * num_v_heads * DK * DV * 4 * (1 + positions)  # bytes: one read, P writes
    for path in ("fused", "wide"):
        row[f"{path}_pct"] = 100 * traffic / (row[f"{path}_us"] * 1e3) / copy_gbps
    return row


def main() -> None:
    """Print one JSON row per (model, positions, batch)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,8,9,16,32,64")
    parser.add_argument("--positions", default="1")
    parser.add_argument("--models", default="27b,35b")
    parser.add_argument("--copy-gbps", type=float, default=4268.0, help="device copy bandwidth (H200: 4268)")
    args = parser.parse_args()
    for model in args.models.split(","):
        for positions in map(int, args.positions.split(",")):
            for batch in map(int, args.batches.split(",")):
                row = measure(model, batch, positions, args.copy_gbps)
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
