"""Probe: can the dequantise pass of the large-M W4A16 path hide behind cuBLAS?

Above 64 rows a W4A16 linear dequantises the whole packed weight to an fp16 ``[N, K]``
workspace (w4a16_dequant.cu) and then runs one cuBLAS GEMM: the pass reads 0.5 byte and
writes 2 bytes per weight before the GEMM starts, ~40% of an fp16 GEMM at M = 512 on the
H200 (BENCHMARKS.md, Kernels). This probe times, per shape and M, in CUDA graphs, with the
packed weights rotated over copies larger than L2:

- ``fp16``: ``torch.mm`` on an fp16 weight (the baseline, no dequantisation);
- ``whole``: today's path (one dequantise launch of the whole weight, one GEMM);
- ``chunks C``: the weight cut into column chunks of C output features, each dequantised
  into one of two small buffers that the next-but-one chunk reuses (so the fp16 chunk may be
  read back from L2), one GEMM per chunk writing its columns of y, all on one stream;
- ``overlap C``: the same, the dequantise launches on a second stream one chunk ahead of the
  GEMMs (events order buffer reuse), so a chunk's dequantisation runs beside the previous
  chunk's GEMM.

    ONECAT_KERNEL_DIR=.ptx ONECAT_KERNEL_ARCH=70 python bench/dequant_pipeline.py --m 512,2048

Each variant is checked against ``whole`` first (same dequant contract: equal up to cuBLAS's
choice of algorithm per shape).
"""

from __future__ import annotations

import argparse
import functools

import torch

from onecat.kernels.shapes import BENCH_SHAPES
from onecat.kernels.timing import copies_for, graph_time_us
from onecat.kernels.tuning import random_packed_weights
from onecat.kernels.variants import Variant, launch_plan

GROUP = 128


def dequantise(qweight: torch.Tensor, scales_zeros: torch.Tensor, out: torch.Tensor, rows: int) -> None:
    """Dequantise the first ``rows`` output features of ``qweight`` into ``out[:rows]``."""
    k = out.shape[1]
    plan = launch_plan(Variant("dequant"), 512, rows, k, GROUP, torch.cuda.current_device())
    stream = torch.cuda.current_stream().cuda_stream
    plan.launch(stream, qweight.data_ptr(), scales_zeros.data_ptr(), out.data_ptr(), rows, k, GROUP)


def whole(x: torch.Tensor, qweight: torch.Tensor, sz: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> None:
    """Today's path: the whole weight dequantised, then one GEMM."""
    dequantise(qweight, sz, w, w.shape[0])
    torch.mm(x, w.t(), out=y)


def chunked(
    x: torch.Tensor,
    qweight: torch.Tensor,
    sz: torch.Tensor,
    y: torch.Tensor,
    bufs: list[torch.Tensor],
    side: torch.cuda.Stream | None,
) -> None:
    """Column chunks through a ring of buffers; dequantisation on ``side`` when given."""
    main = torch.cuda.current_stream()
    n, chunk = y.shape[1], bufs[0].shape[0]
    freed: list[torch.cuda.Event | None] = [None] * len(bufs)
    if side is not None:
        side.wait_stream(main)
    for i, n0 in enumerate(range(0, n, chunk)):
        rows, slot = min(chunk, n - n0), i % len(bufs)
        buf = bufs[slot]
        if side is None:
            dequantise(qweight[n0 // 32 :], sz[n0 // 32 :], buf, rows)
        else:
            with torch.cuda.stream(side):
                if freed[slot] is not None:
                    side.wait_event(freed[slot])
                dequantise(qweight[n0 // 32 :], sz[n0 // 32 :], buf, rows)
                ready = torch.cuda.Event()
                ready.record(side)
            main.wait_event(ready)
        torch.mm(x, buf[:rows].t(), out=y[:, n0 : n0 + rows])
        if side is not None:
            freed[slot] = torch.cuda.Event()
            freed[slot].record(main)
    if side is not None:
        main.wait_stream(side)


def main() -> None:
    """Time the variants on the benchmark shapes and print one markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", default="512", help="comma-separated row counts")
    parser.add_argument("--chunks", default="2048,4096,8192", help="comma-separated chunk widths")
    parser.add_argument("--shapes", default="", help="comma-separated label prefixes (default: all)")
    args = parser.parse_args()
    ms = [int(v) for v in args.m.split(",")]
    chunks = [int(v) for v in args.chunks.split(",")]
    side = torch.cuda.Stream()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | N x K | M | fp16 us | whole us | x fp16 | best chunked | us | x fp16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, n, k in BENCH_SHAPES:
        if args.shapes and not any(label.startswith(p) for p in args.shapes.split(",")):
            continue
        copies = [random_packed_weights(n, k, GROUP, gen) for _ in range(copies_for(n * k // 2))]
        w16 = [torch.randn(n, k, dtype=torch.float16, device="cuda") * 0.02 for _ in range(copies_for(2 * n * k, limit=4))]
        w = torch.empty(n, k, dtype=torch.float16, device="cuda")
        for m in ms:
            x = torch.randn(m, k, dtype=torch.float16, device="cuda")
            y = torch.empty(m, n, dtype=torch.float16, device="cuda")
            ref = torch.empty_like(y)
            whole(x, *copies[0], ref, w)
            times = {
                "fp16": graph_time_us([functools.partial(torch.mm, x, c.t(), out=y) for c in w16]),
                "whole": graph_time_us([functools.partial(whole, x, q, s, y, w) for q, s in copies]),
            }
            for chunk in (c for c in chunks if c < n):
                bufs = [torch.empty(chunk, k, dtype=torch.float16, device="cuda") for _ in range(2)]
                for name, stream in (("chunks", None), ("overlap", side)):
                    y.fill_(float("nan"))
                    chunked(x, *copies[0], y, bufs, stream)
                    torch.cuda.synchronize()
                    err = (y.float() - ref.float()).abs().max().item()
                    scale = ref.float().abs().max().item()
                    if not err <= 1e-2 * scale:
                        raise SystemExit(f"{label} M={m} {name} {chunk}: max error {err} (scale {scale})")
                    calls = [functools.partial(chunked, x, q, s, y, bufs, stream) for q, s in copies]
                    times[f"{name} {chunk}"] = graph_time_us(calls)
            best = min(((t, v) for v, t in times.items() if v not in ("fp16", "whole")), default=(times["whole"], "-"))
            fp16 = times["fp16"]
            print(
                f"| {label} | {n}x{k} | {m} | {fp16:.1f} | {times['whole']:.1f} | {fp16 / times['whole']:.2f} "
                f"| {best[1]} | {best[0]:.1f} | {fp16 / best[0]:.2f} |",
                flush=True,
            )
            print("  " + ", ".join(f"{v} {t:.1f}" for v, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
