"""Paged decode attention at long context: which heads-per-block (NG) reads the cache fastest,
on Qwen3.5-27B's (24 / 4) and 35B-A3B's (16 / 2) attention heads (GPU).

    ONECAT_KERNEL_ARCH=70 python bench/decode_long_context.py [--out results.json]

Per shape, batch (1, 4) and context (2k, 8k, 32k, 64k): one layer's ``paged_decode_attention``
(a CUDA graph of one call per layer over ``LAYERS`` layers' caches, so each reads DRAM, not
L2) for every NG of the split kernel (1, 2, 4, 8) with the default split count: the median
time, the cache bytes over it, and the output's largest difference from the default
choice's (NG changes only which block computes which query heads). Each row names the NG
that :func:`onecat.kernels.attention.heads_per_block` picks and how much slower it is than
the best. Why: at batch 1 that function picks NG 2 (tuned at a 192-token context), so each
K / V row is read by group / 2 blocks; at 32k tokens a layer's cache no longer fits in L2,
and the 35B-A3B's decode at 32k reached 76% of its 2k rate (BENCHMARKS.md, 2026-12-03).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os

import torch
from gdn_prefill import median_ms  # bench/: CUDA-event median after two warm-ups

from onecat.benchmarks.report import write_result_json
from onecat.kernels import attention as attention_kernel
from onecat.runtime.engine.graph_capture import capture

SHAPES = {"27b": (24, 4), "35b-a3b": (16, 2)}
DIM, BLOCK, LAYERS, REPS = 256, 16, 4, 20


def time_choice(ng: int | None, q, layers, tables, lens, outs) -> float:
    """Microseconds per layer with the split kernel's NG forced to ``ng`` (None: the default)."""
    default = attention_kernel.heads_per_block
    attention_kernel._plans.clear()
    if ng is not None:
        attention_kernel.heads_per_block = lambda group, pairs: ng
    try:
        def step() -> None:
            for (k, v), out in zip(layers, outs, strict=True):
                attention_kernel.paged_decode_attention(q, k, v, tables, lens, DIM**-0.5, out=out)

        graph = torch.cuda.CUDAGraph()
        capture(graph, None, step)
        us = 1000 * median_ms(graph.replay, REPS) / LAYERS
        graph.replay()
        torch.cuda.synchronize()
    finally:
        attention_kernel.heads_per_block = default
        attention_kernel._plans.clear()
    return us


def main() -> None:
    """Run every case and print (and optionally write) the JSON result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON result here")
    parser.add_argument("--contexts", default="2048,8192,32768,65536")
    parser.add_argument("--batches", default="1,4")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (heads, kv_heads) in SHAPES.items():
        group = heads // kv_heads
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                per_seq = math.ceil(context / BLOCK)
                blocks = batch * per_seq
                layers = [tuple(torch.randn(blocks, BLOCK, kv_heads, DIM, generator=gen, device="cuda").half()
                                for _ in range(2)) for _ in range(LAYERS)]  # fmt: skip
                tables = torch.randperm(blocks, generator=gen, device="cuda").view(batch, per_seq)
                lens = torch.full((batch,), context, dtype=torch.int64, device="cuda")
                q = torch.randn(batch, heads, DIM, generator=gen, device="cuda").half()
                outs = [torch.empty_like(q) for _ in layers]
                read = batch * context * kv_heads * 2 * DIM * 2
                row = {"shape": name, "batch": batch, "context": context, "cache_mb": round(read / 1e6, 1),
                       "default_ng": attention_kernel.heads_per_block(group, batch * kv_heads), "ng": {}}
                time_choice(None, q, layers, tables, lens, outs)
                reference = outs[0].clone()
                for ng in attention_kernel._HEADS_PER_BLOCK:
                    for out in outs:
                        out.fill_(float("nan"))
                    us = time_choice(ng, q, layers, tables, lens, outs)
                    diff = (outs[0].float() - reference.float()).abs().max().item()
                    row["ng"][ng] = {"us": round(us, 2), "gb_per_s": round(read / us / 1e3, 1), "max_diff": diff}
                best = min(row["ng"], key=lambda g: row["ng"][g]["us"])
                row["best_ng"] = best
                row["default_over_best"] = round(row["ng"][row["default_ng"]]["us"] / row["ng"][best]["us"], 3)
                print(json.dumps(row), flush=True)
                rows.append(row)
                del layers
                torch.cuda.empty_cache()
    result = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "kernel_arch": os.environ.get("ONECAT_KERNEL_ARCH", "native"), "rows": rows}
    if args.out:
        write_result_json(args.out, result)


if __name__ == "__main__":
    main()
