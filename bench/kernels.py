"""Benchmark onecat's W4A16 op against fp16 cuBLAS and PyTorch's int4 weight-only kernel.

    python bench/kernels.py [--quick] [--m 1,2,4] [--out results.md] [--moe-tokens 1,8] [--moe-only]

For each Qwen3.5 shape (onecat.kernels.shapes.BENCH_SHAPES) and M it reports, all measured in
the same run on the same GPU: microseconds per call (median of CUDA-graph replays, weights
rotated over copies larger than L2), GB/s (weights + scales + x + y), % of the device copy
bandwidth (a 2 GiB device-to-device copy, bytes read + written), TFLOP/s (2*M*N*K), and the
speed-up over fp16 ``torch.matmul`` and over ``torch.ops.aten._weight_int4pack_mm`` (bf16,
g128, prepared with ``_convert_weight_to_int4pack``).  Writes a markdown table (``--out``) and
prints the targets of issue 3 with met / not met.

The MoE section times ``torch.ops.onecat.w4a16_moe`` (routed experts of one Qwen3.5-35B-A3B
layer: 256 experts, H=2048, I=512, top-8, g128) at 1/8/32/256/2048 tokens against the bytes
of the experts each call touches (distinct experts x their packed bytes, + x and out) at the
device copy bandwidth, and against an fp16 grouped matmul of the same routing
(``torch._grouped_mm`` on tokens already sorted by expert where this torch and GPU run it
and a CUDA graph captures it, else a per-expert ``torch.matmul`` loop over the routed
experts, captured in a graph, so that both sides are kernel time): both baselines leave out
the routing and sorting that the op includes. Each call rotates over 8 routings and 2 weight
copies so that touched experts are mostly cold in L2.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import re
import sys
from unittest import mock

import torch

from onecat.kernels import moe
from onecat.kernels.moe import GATHER_MAX_PAIRS, w4a16_moe
from onecat.kernels.ops import w4a16_linear
from onecat.kernels.shapes import BENCH_SHAPES
from onecat.kernels.timing import copies_for, graph_time_us
from onecat.kernels.tuning import choose_variant

M_VALUES = (1, 2, 4, 8, 16, 32, 64, 128, 512, 2048, 8192)
GROUP = 128
MOE_TOKENS = (1, 8, 32, 256, 2048)
MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, MOE_TOP_K = 256, 2048, 512, 8


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written), median of 10."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times = sorted(times[2:])
    return 2 * src.numel() / (times[len(times) // 2] * 1e-3) / 1e9


def random_packed(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    qweight = torch.randint(
        -(2**31), 2**31 - 1, (n // 32, k // 32, 32, 4), dtype=torch.int32, device="cuda"
    )
    s = (torch.rand(n // 32, k // GROUP, 32, 1, device="cuda") * 0.01 + 0.001).half()
    z = torch.randint(0, 16, s.shape, device="cuda").half()
    return qweight, torch.cat([s, -(z * s)], dim=-1).contiguous()


def int4mm_weights(n: int, k: int):
    """PyTorch's tinygemm int4 weight and bf16 scales/zeros, or None if unsupported here."""
    try:
        w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
        packed = torch._convert_weight_to_int4pack(w, 8)
        sz = torch.rand(k // GROUP, n, 2, device="cuda").to(torch.bfloat16)
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        torch.ops.aten._weight_int4pack_mm(x, packed, GROUP, sz)
        return packed, sz
    except (RuntimeError, AttributeError) as exc:  # pragma: no cover - depends on the build
        print(f"int4pack unavailable for {n}x{k}: {exc}", file=sys.stderr)
        return None


def bench_shape(label: str, n: int, k: int, ms: list[int], copy_gbs: float) -> list[dict]:
    w4_bytes = n * k // 2 + n * (k // GROUP) * 4
    ours = [random_packed(n, k) for _ in range(copies_for(w4_bytes))]
    fp16 = [
        torch.randn(n, k, device="cuda", dtype=torch.float16) for _ in range(copies_for(2 * n * k))
    ]
    first = int4mm_weights(n, k)
    int4 = (
        [first] + [int4mm_weights(n, k) for _ in range(copies_for(w4_bytes) - 1)] if first else []
    )
    rows = []
    for m in ms:
        x = torch.randn(m, k, dtype=torch.float16, device="cuda")
        xb = x.bfloat16()
        w4a16_linear(x, *ours[0], GROUP)  # tunes this bucket on first use (ONECAT_AUTOTUNE)
        variant = choose_variant(m, ours[0][0], ours[0][1], GROUP).name
        t_ours = graph_time_us(
            [functools.partial(w4a16_linear, x, qw, sz, GROUP) for qw, sz in ours]
        )
        t_fp16 = graph_time_us([functools.partial(torch.matmul, x, w.t()) for w in fp16])
        t_int4 = None
        if int4:
            mm = torch.ops.aten._weight_int4pack_mm
            t_int4 = graph_time_us([functools.partial(mm, xb, p, GROUP, s) for p, s in int4])
        moved = w4_bytes + 2 * m * k + 2 * m * n
        gbs = moved / (t_ours * 1e-6) / 1e9
        rows.append(
            dict(
                shape=label,
                n=n,
                k=k,
                m=m,
                variant=variant,
                us=t_ours,
                gbs=gbs,
                pct_copy=100 * gbs / copy_gbs,
                tflops=2 * m * n * k / (t_ours * 1e-6) / 1e12,
                fp16_us=t_fp16,
                vs_fp16=t_fp16 / t_ours,
                int4_us=t_int4,
                vs_int4=(t_int4 / t_ours) if t_int4 else None,
                weight_mb=w4_bytes / 1e6,
            )
        )
        print(
            f"{label:22s} {n:6d}x{k:<6d} M={m:<5d} {variant:18s} {t_ours:9.1f} us "
            f"{gbs:7.0f} GB/s {100 * gbs / copy_gbs:5.1f}%  fp16 {t_fp16:9.1f} us "
            f"x{t_fp16 / t_ours:5.2f}  int4mm {t_int4 or float('nan'):9.1f} us",
            flush=True,
        )
    return rows


def random_experts(e: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked packed experts ``[E, N/32, K/32, 32, 4]`` and scales ``[E, N/32, K/g, 32, 2]``."""
    qweight, scales_zeros = random_packed(e * n, k)
    return qweight.view(e, n // 32, k // 32, 32, 4), scales_zeros.view(e, n // 32, k // GROUP, 32, 2)


def moe_expert_bytes(h: int, i: int) -> int:
    """Packed bytes of one expert: gate+up and down weights with their (s, -z*s) pairs."""
    return 2 * i * h // 2 + 2 * i * (h // GROUP) * 4 + h * i // 2 + h * (i // GROUP) * 4


def moe_routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(tokens, MOE_EXPERTS, device="cuda", generator=gen)
    ids = scores.argsort(dim=-1)[:, :MOE_TOP_K].to(torch.int32).contiguous()
    weights = torch.softmax(torch.randn(tokens, MOE_TOP_K, device="cuda", generator=gen), -1)
    return ids, weights


def _fp16_grouped_calls(
    x: torch.Tensor, ids: torch.Tensor, w13_t: torch.Tensor, w2_t: torch.Tensor
) -> list[tuple]:
    """fp16 grouped-matmul MoEs of this routing (tokens pre-sorted by expert) as
    ``(zero-argument callable, name)``: ``torch._grouped_mm`` where this torch and GPU run
    it, then a per-expert ``torch.matmul`` loop over the routed experts."""
    top_k = ids.shape[1]
    flat = ids.flatten().long()
    order = torch.argsort(flat, stable=True)
    xs = x[order // top_k].contiguous()
    counts = torch.bincount(flat, minlength=MOE_EXPERTS)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    inter = w2_t.shape[1]
    calls = []

    def grouped():
        gate_up = torch._grouped_mm(xs, w13_t, offs=offs)
        hidden = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        return torch._grouped_mm(hidden, w2_t, offs=offs)

    try:
        if not hasattr(torch, "_grouped_mm"):
            raise RuntimeError("torch._grouped_mm missing")
        grouped()
        torch.cuda.synchronize()
        calls.append((grouped, "torch._grouped_mm"))
    except (RuntimeError, NotImplementedError) as exc:
        print(f"torch._grouped_mm unusable here ({str(exc).splitlines()[0]})", file=sys.stderr)
    bounds = [0] + torch.cumsum(counts, 0).tolist()
    pieces = [(e, bounds[e], bounds[e + 1]) for e in range(MOE_EXPERTS) if bounds[e + 1] > bounds[e]]

    def loop():
        for e, lo, hi in pieces:
            gate_up = xs[lo:hi] @ w13_t[e]
            hidden = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            hidden @ w2_t[e]

    calls.append((loop, "per-expert torch.matmul loop"))
    return calls


def fp16_baseline_us(
    x: torch.Tensor, ids: torch.Tensor, w13_t: torch.Tensor, w2_t: torch.Tensor
) -> tuple[float, str]:
    """Microseconds of the first fp16 grouped MoE of :func:`_fp16_grouped_calls` that a CUDA
    graph captures (kernel time, as the op's; ``torch._grouped_mm`` copies to the host during
    capture on some builds), and its name."""
    for call, how in _fp16_grouped_calls(x, ids, w13_t, w2_t):
        try:
            return graph_time_us([call]), how
        except RuntimeError as exc:
            print(f"{how} not capturable in a CUDA graph ({str(exc).splitlines()[0][:80]})", file=sys.stderr)
            torch.cuda.synchronize()
    raise RuntimeError("no fp16 grouped MoE baseline could be captured")


def bench_moe(tokens_list: list[int], copy_gbs: float) -> list[dict]:
    """The MoE op at 35B-A3B shapes vs touched-expert bytes and an fp16 grouped matmul."""
    e, h, i = MOE_EXPERTS, MOE_HIDDEN, MOE_INTER
    packed = [(*random_experts(e, 2 * i, h), *random_experts(e, h, i)) for _ in range(2)]
    w13_t = torch.randn(e, h, 2 * i, device="cuda", dtype=torch.float16) * 0.02  # [E, K, N]
    w2_t = torch.randn(e, i, h, device="cuda", dtype=torch.float16) * 0.02
    per_expert = moe_expert_bytes(h, i)
    rows = []
    for tokens in tokens_list:
        x = torch.randn(tokens, h, dtype=torch.float16, device="cuda")
        routings = [moe_routing(tokens, seed) for seed in range(8)]
        calls = [
            functools.partial(w4a16_moe, x, ids, w, *packed[n % 2], GROUP)
            for n, (ids, w) in enumerate(routings)
        ]
        t_ours = graph_time_us(calls)
        touched = sum(torch.unique(ids).numel() for ids, _ in routings) / len(routings)
        moved = touched * per_expert + 2 * 2 * tokens * h
        gbs = moved / (t_ours * 1e-6) / 1e9
        t_fp16, how = fp16_baseline_us(x, routings[0][0], w13_t, w2_t)
        pairs = tokens * MOE_TOP_K
        small = pairs <= moe.SMALL_TILE_PAIRS_PER_EXPERT * e
        if pairs > GATHER_MAX_PAIRS:
            path = f"grouped r{16 if small else 64}"
        else:
            path = "grouped-GEMV" if tokens >= moe.GROUPED_GEMV_MIN_TOKENS else "gather-GEMV"
        other = unpacked = None
        if pairs > GATHER_MAX_PAIRS:  # the other row-tile size and fp16 staging (16-row tiles), for the record
            with mock.patch.object(moe, "SMALL_TILE_PAIRS_PER_EXPERT", 0 if small else 1 << 30):
                other = graph_time_us(calls)
            with mock.patch.object(moe, "PACKED_FRAGMENTS", False):
                unpacked = graph_time_us(calls)
        rows.append(dict(tokens=tokens, path=path, us=t_ours, experts=touched, mb=moved / 1e6, gbs=gbs,
                         pct_copy=100 * gbs / copy_gbs, tflops=2 * pairs * 3 * h * i / (t_ours * 1e-6) / 1e12,
                         fp16_us=t_fp16, fp16_how=how, vs_fp16=t_fp16 / t_ours, other_tile_us=other,
                         fp16_staging_us=unpacked))  # fmt: skip
        print(
            f"moe T={tokens:<5d} {path:13s} {t_ours:9.1f} us  {touched:5.1f} experts {moved / 1e6:7.1f} MB "
            f"{gbs:7.0f} GB/s {100 * gbs / copy_gbs:5.1f}%  fp16 {how} {t_fp16:9.1f} us x{t_fp16 / t_ours:5.2f}"
            + (f"  other tile size {other:9.1f} us  fp16 staging {unpacked:9.1f} us" if other else ""),
            flush=True,
        )
    return rows


def gather_shapes() -> dict[str, list]:
    """The (warps, batch) shapes ``w4a16_moe_gemv.cu`` builds per gather kernel, and the
    (warps, batch, rows per block) shapes of its grouped decode kernels."""
    from onecat.kernels import build

    found: dict[str, list[tuple[int, ...]]] = {"gate_up": [], "down": [], "grouped": moe.built_grouped_gemv_shapes()}
    for name in build.kernel_names("w4a16_moe_gemv"):
        if match := re.fullmatch(r"w4a16_moe_gemv_(gate_up|down)_w(\d+)_b(\d+)", name):
            kind, warps, batch = match.groups()
            found[kind].append((int(warps), int(batch)))
    return found


def bench_gather_shapes(tokens_list: list[int]) -> list[dict]:
    """The gather path of the MoE op with every built (gate_up, down) kernel shape, and the
    grouped decode path with every built (warps, batch, rows per block), 35B-A3B layer with its
    shared expert folded in as the runtime runs it (expert E of E+1 stacked, chosen by every
    token as pair column top_k): microseconds per op call for each (CUDA graphs, two weight
    copies)."""
    e, h, i = MOE_EXPERTS, MOE_HIDDEN, MOE_INTER
    packed = [(*random_experts(e + 1, 2 * i, h), *random_experts(e + 1, h, i)) for _ in range(2)]
    shapes = gather_shapes()
    rows = []
    for tokens in tokens_list:
        if tokens * (MOE_TOP_K + 1) > GATHER_MAX_PAIRS:
            continue
        x = torch.randn(tokens, h, dtype=torch.float16, device="cuda")
        shared = torch.full((tokens, 1), e, dtype=torch.int32, device="cuda")
        routings = [moe_routing(tokens, seed) for seed in range(8)]
        routings = [(torch.cat([ids, shared], 1), torch.cat([w, torch.sigmoid(w[:, :1])], 1)) for ids, w in routings]
        calls = [functools.partial(w4a16_moe, x, ids, w, *packed[n % 2], GROUP) for n, (ids, w) in enumerate(routings)]
        timings = {}
        with mock.patch.object(moe, "GROUPED_GEMV_MIN_TOKENS", 1 << 30):
            for gate in shapes["gate_up"]:
                for down in shapes["down"]:
                    with mock.patch.object(moe, "GATHER_SHAPES", ((1 << 30, gate, down),)):
                        timings[f"gate_up w{gate[0]} b{gate[1]} + down w{down[0]} b{down[1]}"] = graph_time_us(calls)
        for warps, batch, rows_per_block in shapes["grouped"]:
            with mock.patch.object(moe, "GROUPED_GEMV_MIN_TOKENS", 1), \
                    mock.patch.object(moe, "GROUPED_GEMV_SHAPE", (warps, batch, rows_per_block)):
                timings[f"grouped w{warps} b{batch} r{rows_per_block}"] = graph_time_us(calls)
        best = min(timings, key=timings.get)
        print(f"gather T={tokens}: best {best} {timings[best]:.1f} us; " + "; ".join(
            f"{k} {v:.1f}" for k, v in sorted(timings.items(), key=lambda kv: kv[1])), flush=True)
        rows.append({"tokens": tokens, "timings_us": timings, "best": best})
    return rows


def moe_markdown(rows: list[dict]) -> str:
    """The MoE table and issue 11's op target (>= 60% of copy bandwidth at 1..32 tokens)."""
    out = [
        f"MoE routed experts, one Qwen3.5-35B-A3B layer (E={MOE_EXPERTS}, H={MOE_HIDDEN}, "
        f"I={MOE_INTER}, top-{MOE_TOP_K}, g{GROUP}):",
        "",
        "| tokens | path | us | experts touched | MB touched | GB/s | % copy BW | TFLOP/s | fp16 baseline | fp16 us | x fp16 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['tokens']} | {r['path']} | {r['us']:.1f} | {r['experts']:.1f} | {r['mb']:.1f} | "
            f"{r['gbs']:.0f} | {r['pct_copy']:.1f} | {r['tflops']:.1f} | {r['fp16_how']} | "
            f"{r['fp16_us']:.1f} | {r['vs_fp16']:.2f} |"
        )
    out += ["", "Targets:", ""]
    for r in rows:
        if r["tokens"] <= 32:
            ok = r["pct_copy"] >= 60
            out.append(f"- MoE op T={r['tokens']} >= 60% of copy BW over touched experts: {r['pct_copy']:.1f}% {'MET' if ok else 'NOT MET'}")  # fmt: skip
    return "\n".join(out) + "\n"


def markdown(rows: list[dict], header: str) -> str:
    out = [header, "", "| shape | N x K | M | variant | us | GB/s | % copy BW | TFLOP/s | fp16 matmul us | x fp16 | int4mm us | x int4mm |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        int4 = f"{r['int4_us']:.1f} | {r['vs_int4']:.2f}" if r["int4_us"] else "- | -"
        out.append(
            f"| {r['shape']} | {r['n']}x{r['k']} | {r['m']} | {r['variant']} | {r['us']:.1f} | "
            f"{r['gbs']:.0f} | {r['pct_copy']:.1f} | {r['tflops']:.1f} | {r['fp16_us']:.1f} | "
            f"{r['vs_fp16']:.2f} | {int4} |"
        )
    return "\n".join(out) + "\n"


def targets(rows: list[dict]) -> str:
    """Issue 3's targets, each with the measured values and met / not met."""
    lines = []
    by = {(r["n"], r["k"], r["m"]): r for r in rows}
    big = [r for r in rows if r["m"] == 1 and r["weight_mb"] >= 20]
    for r in big:
        ok = r["pct_copy"] >= 80
        lines.append(f"- M=1 >= 80% copy BW, {r['shape']} ({r['weight_mb']:.0f} MB): {r['pct_copy']:.1f}% {'MET' if ok else 'NOT MET'}")  # fmt: skip
    for r in rows:
        if 1 < r["m"] <= 16 and (r["n"], r["k"], 1) in by:
            ratio = r["us"] / by[(r["n"], r["k"], 1)]["us"]
            lines.append(f"- M={r['m']} within 1.25x of M=1, {r['shape']}: {ratio:.2f}x {'MET' if ratio <= 1.25 else 'NOT MET'}")  # fmt: skip
    for r in rows:
        if r["m"] >= 512:
            lines.append(f"- M={r['m']} >= 90% of fp16 cuBLAS, {r['shape']}: {100 * r['vs_fp16']:.0f}% {'MET' if r['vs_fp16'] >= 0.9 else 'NOT MET'}")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run the benchmark and write the markdown table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--m", default=",".join(map(str, M_VALUES)), help="comma-separated M values"
    )
    parser.add_argument("--quick", action="store_true", help="only the first three shapes")
    parser.add_argument("--out", default="bench-kernels.md", help="markdown output file")
    parser.add_argument("--json", default=None, help="also write the raw rows as JSON")
    parser.add_argument(
        "--moe-tokens", default=",".join(map(str, MOE_TOKENS)),
        help="comma-separated token counts for the MoE op (empty: skip it)",
    )  # fmt: skip
    parser.add_argument("--moe-only", action="store_true", help="only the MoE section")
    parser.add_argument("--moe-shapes", action="store_true",
                        help="only the decode MoE kernels' shapes (gather and grouped), at --moe-tokens")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA GPU")
    ms = [int(v) for v in args.m.split(",")]
    shapes = BENCH_SHAPES[:3] if args.quick else BENCH_SHAPES
    if args.moe_shapes:
        rows = bench_gather_shapes([int(v) for v in args.moe_tokens.split(",") if v])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    copy_gbs = copy_bandwidth_gbs()
    name = torch.cuda.get_device_name()
    print(f"{name}: device copy {copy_gbs:.0f} GB/s", flush=True)
    rows = []
    for label, n, k in [] if args.moe_only else shapes:
        rows += bench_shape(label, n, k, ms, copy_gbs)
        torch.cuda.empty_cache()
    moe_tokens = [int(v) for v in args.moe_tokens.split(",") if v]
    moe_rows = bench_moe(moe_tokens, copy_gbs) if moe_tokens else []
    env = {
        key: os.environ[key]
        for key in ("ONECAT_KERNEL_ARCH", "ONECAT_KERNEL_DIR")
        if key in os.environ
    }
    header = (
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {name} "
        f"(torch {torch.__version__}, Python {platform.python_version()}, env {env}); "
        f"device copy {copy_gbs:.0f} GB/s; command: `{' '.join(['python'] + sys.argv)}`"
    )
    text = markdown(rows, header) + "\nTargets:\n\n" + targets(rows) if rows else header + "\n"
    if moe_rows:
        text += "\n" + moe_markdown(moe_rows)
    with open(args.out, "w") as f:
        f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"linear": rows, "moe": moe_rows}, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
