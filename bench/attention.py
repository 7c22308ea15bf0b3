"""Benchmark paged decode attention: onecat's kernel against the torch gather + SDPA path.

    ONECAT_KERNEL_ARCH=70 python bench/attention.py [--out results.json]

Qwen3.5-27B's attention (24 query heads, 4 KV heads, head dim 256, KV block 16 tokens), one
decode token per sequence, at batch 1 / 8 / 32 and contexts of 160 / 256 / 2048 / 8192 tokens (all
sequences alike), plus two mixed batches (one sequence at 8192, the others at 256). Per row,
all measured in the same run on the same GPU (median of CUDA-graph replays; each call rotates
over several layers' caches so that they come from DRAM, not L2):

- ``ideal``: the bytes of K and V the batch must read, at the device copy bandwidth (a 1 GiB
  device-to-device copy, bytes read + written);
- ``kernel``: :func:`onecat.kernels.attention.paged_decode_attention`, block tables as wide as
  the longest sequence needs, and ``kernel@32k``: the same with tables 2048 blocks wide (a
  graph captured once for a 32768-token max_model_len); the two should be equal;
- ``sdpa``: the runtime's torch decode path (``PagedAttention._decode_torch``: gather the
  table's blocks, mask, SDPA) at the table width the runtime's graphs use today (the next
  power of two of the longest sequence's blocks, at least 16).
- ``prep_then_kernel``: what a decode step ran before the prep form: ``attention_prep`` (the
  queries and the new key normed and rotated, key and value written to the cache), then the
  kernel with the output gate; ``prep_form``: the same work as one
  :func:`onecat.kernels.attention.paged_decode_attention_prep` call (rotary dim 64, as Qwen3.5).
On an H200 SDPA runs cuDNN / flash kernels that a V100 does not have; the kernel runs the
compute_70 PTX when ``ONECAT_KERNEL_ARCH=70`` is set.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from kernels import copy_bandwidth_gbs  # bench/kernels.py (scripts run from bench/)

from onecat.kernels.attention import paged_decode_attention, paged_decode_attention_prep
from onecat.kernels.attention_prep import prepare_attention_inputs
from onecat.kernels.timing import copies_for, graph_time_us
from onecat.runtime.context import ForwardContext
from onecat.runtime.engine.model_runner import next_power_of_two
from onecat.runtime.layers.attention import PagedAttention

HEADS, KV_HEADS, DIM, BLOCK = 24, 4, 256, 16
MAX_MODEL_LEN = 32768
CASES = [(b, [n] * b) for b in (1, 8, 32) for n in (160, 256, 2048, 8192)] + [
    (b, [8192] + [256] * (b - 1)) for b in (8, 32)
]


def make_batch(lengths: list[int], layers: int, gen: torch.Generator):
    """``layers`` caches holding ``lengths`` tokens per sequence in shuffled blocks, their
    block tables (padded with a scratch block to 2048 columns) and one query."""
    counts = [math.ceil(n / BLOCK) for n in lengths]
    total = sum(counts)
    caches = [
        (
            torch.randn(total + 1, BLOCK, KV_HEADS, DIM, generator=gen, device="cuda").half(),
            torch.randn(total + 1, BLOCK, KV_HEADS, DIM, generator=gen, device="cuda").half(),
        )
        for _ in range(layers)
    ]
    tables = torch.full((len(lengths), MAX_MODEL_LEN // BLOCK), total, dtype=torch.int64, device="cuda")
    order = torch.randperm(total, generator=gen, device="cuda")
    start = 0
    for b, c in enumerate(counts):
        tables[b, :c] = order[start : start + c]
        start += c
    q = torch.randn(len(lengths), HEADS, DIM, generator=gen, device="cuda").half()
    lens = torch.tensor(lengths, dtype=torch.int64, device="cuda")
    return caches, tables, q, lens


def bench_case(lengths: list[int], copy_gbs: float, gen: torch.Generator) -> dict:
    batch = len(lengths)
    kv_bytes = sum(lengths) * KV_HEADS * DIM * 2 * 2
    layers = copies_for(kv_bytes, target_bytes=512 << 20, limit=64)
    caches, tables, q, lens = make_batch(lengths, layers, gen)
    blocks = max(math.ceil(n / BLOCK) for n in lengths)
    exact = tables[:, :blocks].contiguous()
    graph_width = min(next_power_of_two(max(blocks, 16)), MAX_MODEL_LEN // BLOCK)
    padded = tables[:, :graph_width].contiguous()
    scale = DIM**-0.5

    def kernel_calls(table):
        return [
            lambda k=k, v=v: paged_decode_attention(q, k, v, table, lens, scale) for k, v in caches
        ]

    t_kernel = graph_time_us(kernel_calls(exact))
    t_kernel_wide = graph_time_us(kernel_calls(tables))
    sdpa_calls = []
    for k, v in caches:
        layer = PagedAttention(HEADS, KV_HEADS, DIM, scale)
        layer.k_cache, layer.v_cache = k, v
        ctx = ForwardContext(
            slot_mapping=torch.zeros(batch, dtype=torch.int64, device="cuda"), num_decodes=batch,
            decode_block_tables=padded, decode_context_lens=lens,
        )  # fmt: skip
        sdpa_calls.append(lambda layer=layer, ctx=ctx: layer._decode_torch(q, ctx))
    t_sdpa = graph_time_us(sdpa_calls)
    t_prep_then_kernel, t_prep_form = bench_prep(caches, exact, lens, gen)
    ideal = kv_bytes / (copy_gbs * 1e9) * 1e6
    return {
        "batch": batch,
        "lengths": "x".join(str(n) for n in sorted(set(lengths), reverse=True)),
        "kv_mb": kv_bytes / 2**20,
        "ideal_us": ideal,
        "kernel_us": t_kernel,
        "kernel_32k_us": t_kernel_wide,
        "pct_copy": 100 * ideal / t_kernel,
        "sdpa_us": t_sdpa,
        "sdpa_width": graph_width,
        "speedup": t_sdpa / t_kernel,
        "prep_then_kernel_us": t_prep_then_kernel,
        "prep_form_us": t_prep_form,
    }


def bench_prep(caches: list, table: torch.Tensor, lens: torch.Tensor, gen: torch.Generator) -> tuple[float, float]:
    """(attention_prep then the gated kernel, the prep form) in us, one new token per sequence
    at position ``len - 1``, its key and value written where the table puts that position."""
    batch, rot = len(lens), 64
    qkv = torch.randn(batch, 2 * (HEADS + KV_HEADS) * DIM, generator=gen, device="cuda").half()
    positions = lens - 1
    slots = table.gather(1, (positions // BLOCK).unsqueeze(1)).squeeze(1) * BLOCK + positions % BLOCK
    q_weight = torch.randn(DIM, generator=gen, device="cuda") * 0.1
    k_weight = torch.randn(DIM, generator=gen, device="cuda") * 0.1
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, rot, 2, device="cuda").float() / rot))
    gate = qkv[:, : 2 * HEADS * DIM].view(batch, HEADS, 2 * DIM)[..., DIM:]
    scale = DIM**-0.5

    def two_launches(k, v):
        q, _, _ = prepare_attention_inputs(qkv, positions, q_weight, k_weight, inv_freq, 1e-6, slots, k, v, HEADS,
                                           KV_HEADS, DIM, rot)  # fmt: skip
        return paged_decode_attention(q, k, v, table, lens, scale, gate=gate)

    def one_launch(k, v):
        return paged_decode_attention_prep(qkv, positions, q_weight, k_weight, inv_freq, 1e-6, rot, slots, k, v,
                                           table, lens, scale, HEADS)  # fmt: skip

    return (
        graph_time_us([lambda k=k, v=v: two_launches(k, v) for k, v in caches]),
        graph_time_us([lambda k=k, v=v: one_launch(k, v) for k, v in caches]),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/attention.py needs a CUDA GPU")
    copy_gbs = copy_bandwidth_gbs()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbs:.0f} GB/s; "
          f"H={HEADS} KVH={KV_HEADS} D={DIM} block {BLOCK}")  # fmt: skip
    print("| B | context | KV MB | ideal us | kernel us | kernel@32k us | % of copy bw | sdpa us (width) | sdpa / kernel "
          "| prep + kernel us | prep form us |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for _, lengths in CASES:
        r = bench_case(lengths, copy_gbs, gen)
        rows.append(r)
        torch.cuda.empty_cache()  # the case's caches are gone: leave room for the next
        print(
            f"| {r['batch']} | {r['lengths']} | {r['kv_mb']:.1f} | {r['ideal_us']:.1f} | {r['kernel_us']:.1f} "
            f"| {r['kernel_32k_us']:.1f} | {r['pct_copy']:.0f}% | {r['sdpa_us']:.1f} ({r['sdpa_width']}) "
            f"| {r['speedup']:.2f}x | {r['prep_then_kernel_us']:.1f} | {r['prep_form_us']:.1f} |",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
