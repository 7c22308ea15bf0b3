"""Benchmark prefill attention alone: onecat's flash-attention prefill kernel against torch SDPA's
memory-efficient and FlashAttention-2 backends, in the same run on the same GPU.

    ONECAT_KERNEL_ARCH=70 python bench/flash_prefill.py [--out results.json] [--lengths 8192 32768]

Qwen3.5-27B's attention (24 query heads, 4 KV heads, head dim 256, causal), one prompt of
L tokens. onecat's kernel reads keys and values from a paged cache of 16-token blocks in
shuffled order, through the block table, as the runtime does; the SDPA backends get K and V
already repeated to 24 heads and laid out ``[1, H, L, D]`` (their best case: the repeat is
not timed). Also one chunk of 2048 tokens after 30720 cached tokens (chunked prefill, the
bottom-right causal mask; SDPA gets the lower-right ``CausalBias``). Each figure is the
median of CUDA-event timings of eager calls after a warm-up; TFLOP/s count the visible
(query, key) pairs only (4 * D flops each). A V100 has no FlashAttention-2: that column is
a reference point on the H200. Every kernel variant (``flash_prefill.VARIANTS``) is timed. The kernel runs the compute_70 PTX when ``ONECAT_KERNEL_ARCH=70``.
Prints one JSON object (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os

import torch
import torch.nn.functional as F
from gdn_prefill import median_ms  # bench/: CUDA-event median after two warm-ups
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from onecat.kernels import flash_prefill as fp

HEADS, KV_HEADS, DIM, BLOCK = 24, 4, 256, 16
REPS = 5


def case(length: int, past: int, gen: torch.Generator) -> dict:
    """One row: the kernel and both SDPA backends on a chunk of ``length`` tokens after
    ``past`` cached ones."""
    total = past + length
    blocks = math.ceil(total / BLOCK)
    k_cache = torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen, device="cuda").half()
    v_cache = torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen, device="cuda").half()
    table = torch.randperm(blocks, generator=gen, device="cuda")
    q = torch.randn(length, HEADS, DIM, generator=gen, device="cuda").half()
    scale = DIM**-0.5
    batch = fp.prefill_attention_batch([0], [length], [past], HEADS // KV_HEADS, q.device, [table])
    out = torch.empty_like(q)

    def ours(variant):
        return lambda: fp.flash_prefill_attention(q, k_cache, v_cache, batch, scale, out=out, variant=variant)

    group = HEADS // KV_HEADS
    k_all = k_cache[table].reshape(-1, KV_HEADS, DIM)[:total]
    v_all = v_cache[table].reshape(-1, KV_HEADS, DIM)[:total]
    q4 = q.transpose(0, 1)[None].contiguous()
    k4 = k_all.transpose(0, 1).repeat_interleave(group, 0)[None].contiguous()
    v4 = v_all.transpose(0, 1).repeat_interleave(group, 0)[None].contiguous()
    mask = {} if not past else {"attn_mask": causal_lower_right(length, total)}
    causal = {"is_causal": True} if not past else {}

    def sdpa(backend):
        def call():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q4, k4, v4, scale=scale, **mask, **causal)

        return call

    pairs = length * past + length * (length + 1) // 2
    flops = 4 * DIM * HEADS * pairs
    row = {"length": length, "past": past, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM}
    for variant in fp.VARIANTS:
        row[f"onecat_{variant}_ms"] = median_ms(ours(variant), REPS)
    ours(fp.DEFAULT_VARIANT)()
    reference = None
    for name, backend in (("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION), ("sdpa_flash2", SDPBackend.FLASH_ATTENTION)):
        try:
            row[f"{name}_ms"] = median_ms(sdpa(backend), REPS)
            reference = sdpa(backend)()[0].transpose(0, 1) if reference is None else reference
        except RuntimeError as exc:  # a backend that refuses the shape or mask
            row[f"{name}_ms"] = None
            row[f"{name}_error"] = str(exc).splitlines()[0][:200]
    ours_keys = [f"onecat_{variant}" for variant in fp.VARIANTS]
    for key in (*ours_keys, "sdpa_efficient", "sdpa_flash2"):
        ms = row.get(f"{key}_ms")
        row[f"{key}_tflops"] = None if not ms else round(flops / ms / 1e9, 1)
    for mine in ours_keys:
        for key in ("sdpa_efficient", "sdpa_flash2"):
            ms = row.get(f"{key}_ms")
            row[f"{mine}_speedup_vs_{key}"] = None if not ms else round(ms / row[f"{mine}_ms"], 3)
    if reference is not None:
        err = (out.float() - reference.float()).abs().max().item()
        row[f"onecat_{fp.DEFAULT_VARIANT}_max_abs_diff_vs_sdpa"] = err
    return row


def main() -> None:
    """Run the cases and print (and optionally write) the JSON result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON result here")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--chunk-after", type=int, nargs=2, default=[2048, 30720], metavar=("LENGTH", "PAST"),
                        help="one chunked-prefill case: LENGTH new tokens after PAST cached ones (0 0: none)")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = [(n, 0) for n in args.lengths] + ([tuple(args.chunk_after)] if args.chunk_after[0] else [])
    rows = []
    for length, past in cases:
        rows.append(case(length, past, gen))
        torch.cuda.empty_cache()
    result = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "kernel_arch": os.environ.get("ONECAT_KERNEL_ARCH", "native"),
        "rows": rows,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
