"""One Gated DeltaNet layer's prefill core, sm_70 kernels vs the runtime's torch path (GPU).

Per layer and prompt length (one sequence): the causal conv + the chunked gated delta rule,
states read from and written to a slot, output ``[T, Hv, dv]`` fp16 (the projections and the
gated norm are the same on both paths and left out). Times are the median of ``--reps``
CUDA-event timings; the kernel path is also split into its three launches.

    ONECAT_KERNEL_ARCH=70 python bench/gdn_prefill.py --model 27b --tokens 2048,8192
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from onecat.kernels import gdn_prefill
from onecat.runtime.layers.causal_conv import causal_conv1d_chunk
from onecat.runtime.layers.delta_rule import gated_delta_rule_chunked
from onecat.runtime.models.qwen3_5 import decay_and_rate, split_heads

SHAPES = {"27b": (16, 48, 128), "35b": (16, 32, 128)}  # key heads, value heads, value head dim
DK = 128


def median_ms(fn, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` CUDA-event timings (after 2 warm-ups)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench(model: str, tokens: int, reps: int) -> dict:
    """Times of one layer's prefill core at ``tokens`` tokens for ``model``'s GDN shape."""
    hk, hv, dv = SHAPES[model]
    channels = 2 * hk * DK + hv * dv
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, channels, generator=gen, device="cuda").half()
    ba = torch.randn(tokens, 2 * hv, generator=gen, device="cuda").half()
    weight = (torch.randn(channels, 4, generator=gen, device="cuda") * 0.5).half()
    A_log = torch.empty(hv, device="cuda").uniform_(0.5, 4.0, generator=gen).log()
    dt_bias = torch.log(torch.expm1(torch.empty(hv, device="cuda").uniform_(-7.0, -1.0, generator=gen).exp()))
    conv_state = torch.zeros(2, channels, 3, dtype=torch.float16, device="cuda")
    state = torch.zeros(2, hv, DK, dv, device="cuda")
    batch = gdn_prefill.prefill_batch([0], [tokens], [1], x.device)

    def kernels():
        mixed = gdn_prefill.causal_conv1d_prefill_(x, conv_state, weight, batch)
        return gdn_prefill.gated_delta_rule_prefill_(mixed, ba, A_log, dt_bias, state, batch, hk)

    def torch_path():
        mixed, new_conv = causal_conv1d_chunk(x, conv_state[1], weight)
        q, k, v = split_heads(mixed, hk, DK, hv, dv)
        g, beta = decay_and_rate(ba[:, hv:], ba[:, :hv], A_log, dt_bias)
        out, new_state = gated_delta_rule_chunked(q, k, v, g, beta, state[1])
        conv_state[1].copy_(new_conv)
        state[1].copy_(new_state)
        return out

    mixed = gdn_prefill.causal_conv1d_prefill_(x, conv_state, weight, batch)
    row = {
        "model": model,
        "tokens": tokens,
        "kernels_ms": median_ms(kernels, reps),
        "conv_kernel_ms": median_ms(lambda: gdn_prefill.causal_conv1d_prefill_(x, conv_state, weight, batch), reps),
        "delta_rule_kernels_ms": median_ms(
            lambda: gdn_prefill.gated_delta_rule_prefill_(mixed, ba, A_log, dt_bias, state, batch, hk), reps
        ),
        "torch_ms": median_ms(torch_path, reps),
    }
    row["speedup"] = row["torch_ms"] / row["kernels_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="27b", choices=sorted(SHAPES) + ["all"])
    parser.add_argument("--tokens", default="2048,8192", help="comma-separated prompt lengths")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    for model in sorted(SHAPES) if args.model == "all" else [args.model]:
        for tokens in (int(t) for t in args.tokens.split(",")):
            rows.append(bench(model, tokens, args.reps))
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
