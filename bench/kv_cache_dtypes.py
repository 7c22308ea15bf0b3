"""Benchmark the 8-bit KV caches (``--kv-cache-dtype``) on the GPU: attention error against the
fp16 cache and kernel times, per cache dtype, on Qwen3.5-27B's attention shapes.

    ONECAT_KERNEL_ARCH=70 python bench/kv_cache_dtypes.py [--out results.json] [--context 32768]

24 query heads, 4 KV heads, head dim 256, 16-token blocks in shuffled order; random N(0, 1)
queries, keys and values (the same fp16 values encoded for each dtype: ``kv_cache.encode``).

- decode (``attention.paged_decode_attention``) at batch 1 and 8, every sequence at
  ``--context`` tokens: the median time of one layer's call (a CUDA graph of one call per layer
  over ``LAYERS`` layers' caches, so each reads DRAM, not L2), the bytes it must read (codes,
  and int8's scales) and what that is at the measured time;
- prefill (``flash_prefill.flash_prefill_attention``): one ``--context``-token prompt, and a
  2048-token chunk after ``--context - 2048`` cached tokens: the median of eager calls;
- error against the fp16 cache, per dtype: the kernel's output vs the fp16-cache kernel's
  output on the same keys and values (rms of the difference over the rms of the output, and
  the largest difference over it; decode over every head of every sequence, prefill over
  512 sampled query tokens), and against fp64 attention over the dequantized cache (the
  kernel's own rounding, which should be the fp16 kernel's).

Prints one JSON object (and writes it to ``--out``); BENCHMARKS.md has the numbers.
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
from onecat.kernels import flash_prefill as fp
from onecat.kernels import kv_cache
from onecat.runtime.engine.graph_capture import capture

HEADS, KV_HEADS, DIM, BLOCK = 24, 4, 256, 16
DTYPES = ("auto", "fp8_e5m2", "int8")
LAYERS = 4
REPS = 20


def encoded(cache16: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The cache as stored for ``name`` (``auto``: the fp16 cache itself)."""
    if name == "auto":
        return cache16, None
    data, scales = kv_cache.encode(cache16, name)
    return data.contiguous(), None if scales is None else scales.contiguous()


def errors(out: torch.Tensor, reference: torch.Tensor) -> dict:
    """rms(out - reference) / rms(reference) and max |out - reference| / rms(reference)."""
    diff = out.double() - reference.double()
    rms = reference.double().pow(2).mean().sqrt().item()
    return {"rel_rms": diff.pow(2).mean().sqrt().item() / rms, "rel_max": diff.abs().max().item() / rms}


def fp64_attention(q, k, v, scale, past):
    """fp64 causal attention of ``q [L, H, D]`` (query i sees keys 0 .. past + i) over
    ``k``, ``v`` ``[past + L, KVH, D]``."""
    group = HEADS // KV_HEADS
    out = []
    for part in torch.arange(q.shape[0], device=q.device).split(256):
        qs = q[part].double().view(len(part), KV_HEADS, group, DIM)
        scores = torch.einsum("lkgd,tkd->lkgt", qs, k.double()) * scale
        visible = torch.arange(k.shape[0], device=q.device)[None, :] <= (past + part)[:, None]
        probs = scores.masked_fill(~visible[:, None, None, :], float("-inf")).softmax(-1)
        out.append(torch.einsum("lkgt,tkd->lkgd", probs, v.double()).reshape(len(part), HEADS, DIM))
    return torch.cat(out)


def decode_rows(context: int, gen: torch.Generator) -> list[dict]:
    """Decode at batch 1 and 8: time, bytes and errors per dtype."""
    rows = []
    scale = DIM**-0.5
    for batch in (1, 8):
        per_seq = math.ceil(context / BLOCK)
        blocks = batch * per_seq
        caches16 = [(torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen, device="cuda").half(),
                     torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen, device="cuda").half())
                    for _ in range(LAYERS)]  # fmt: skip
        tables = torch.randperm(blocks, generator=gen, device="cuda").view(batch, per_seq)
        lens = torch.full((batch,), context, dtype=torch.int64, device="cuda")
        q = torch.randn(batch, HEADS, DIM, generator=gen, device="cuda").half()
        row = {"kind": "decode", "batch": batch, "context": context}
        outputs = {}
        for name in DTYPES:
            layers = []
            for k16, v16 in caches16:
                (k, ks), (v, vs) = encoded(k16, name), encoded(v16, name)
                layers.append((k, v, ks, vs))
            outs = [torch.empty_like(q) for _ in layers]

            def step(layers=layers, outs=outs, q=q, tables=tables, lens=lens):
                for (k, v, ks, vs), out in zip(layers, outs, strict=True):
                    attention_kernel.paged_decode_attention(q, k, v, tables, lens, scale, out=out, k_scale=ks,
                                                            v_scale=vs)  # fmt: skip

            graph = torch.cuda.CUDAGraph()
            capture(graph, None, step)
            ms = median_ms(graph.replay, REPS) / LAYERS
            k, v, ks, vs = layers[0]
            read = batch * context * KV_HEADS * (2 * DIM * k.element_size() + (8 if ks is not None else 0))
            row[name] = {"us": round(ms * 1000, 2), "bytes_read_mb": round(read / 1e6, 1),
                         "gb_per_s": round(read / ms / 1e6, 1)}  # fmt: skip
            graph.replay()
            torch.cuda.synchronize()
            outputs[name] = outs[0].clone()
            if name != "auto":
                ref64 = torch.stack([
                    fp64_attention(q[b : b + 1], kv_cache.decode(k[tables[b]], None if ks is None else ks[tables[b]],
                                                                 torch.float32).reshape(-1, KV_HEADS, DIM)[:context],
                                   kv_cache.decode(v[tables[b]], None if vs is None else vs[tables[b]],
                                                   torch.float32).reshape(-1, KV_HEADS, DIM)[:context],
                                   scale, context - 1)[0]
                    for b in range(batch)
                ])  # fmt: skip
                row[name]["vs_fp16_cache"] = errors(outputs[name], outputs["auto"])
                row[name]["vs_fp64_of_dequantized"] = errors(outputs[name], ref64)
            del graph, layers
        row["speedup_vs_fp16"] = {name: round(row["auto"]["us"] / row[name]["us"], 3) for name in DTYPES[1:]}
        rows.append(row)
        del caches16
        torch.cuda.empty_cache()
    return rows


def prefill_rows(context: int, gen: torch.Generator) -> list[dict]:
    """One ``context``-token prompt and a 2048-token chunk after ``context - 2048`` cached ones."""
    rows = []
    scale = DIM**-0.5
    for length, past in ((context, 0), (2048, context - 2048)):
        total = length + past
        blocks = math.ceil(total / BLOCK)
        k16 = torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen, device="cuda").half()
        v16 = torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen, device="cuda").half()
        table = torch.randperm(blocks, generator=gen, device="cuda")
        q = torch.randn(length, HEADS, DIM, generator=gen, device="cuda").half()
        batch = fp.prefill_attention_batch([0], [length], [past], HEADS // KV_HEADS, q.device, [table])
        if length > 512:  # the first and last 128 query tokens and 256 between
            middle = torch.randint(128, length - 128, (256,), generator=torch.Generator().manual_seed(length))
            sample = torch.cat([torch.arange(128), middle, torch.arange(length - 128, length)]).to("cuda")
        else:
            sample = torch.arange(length, device="cuda")
        row = {"kind": "prefill", "length": length, "past": past}
        outputs = {}
        for name in DTYPES:
            (k, ks), (v, vs) = encoded(k16, name), encoded(v16, name)
            out = torch.empty_like(q)

            def call(k=k, v=v, ks=ks, vs=vs, out=out, q=q, batch=batch):
                fp.flash_prefill_attention(q, k, v, batch, scale, out=out, k_scale=ks, v_scale=vs)

            ms = median_ms(call, 5)
            pairs = length * past + length * (length + 1) // 2
            row[name] = {"ms": round(ms, 3), "tflops": round(4 * DIM * HEADS * pairs / ms / 1e9, 1)}
            call()
            torch.cuda.synchronize()
            outputs[name] = out[sample].clone()
            if name != "auto":
                keys = kv_cache.decode(k[table], None if ks is None else ks[table], torch.float32)
                values = kv_cache.decode(v[table], None if vs is None else vs[table], torch.float32)
                keys, values = keys.reshape(-1, KV_HEADS, DIM)[:total], values.reshape(-1, KV_HEADS, DIM)[:total]
                ref64 = torch.cat([fp64_attention(q[i : i + 1], keys, values, scale, past + int(i))
                                   for i in sample.tolist()])  # fmt: skip
                row[name]["vs_fp16_cache"] = errors(outputs[name], outputs["auto"])
                row[name]["vs_fp64_of_dequantized"] = errors(outputs[name], ref64)
        row["speedup_vs_fp16"] = {name: round(row["auto"]["ms"] / row[name]["ms"], 3) for name in DTYPES[1:]}
        rows.append(row)
        del k16, v16
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    """Run the cases and print (and optionally write) the JSON result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON result here")
    parser.add_argument("--context", type=int, default=32768)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "kernel_arch": os.environ.get("ONECAT_KERNEL_ARCH", "native"),
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM, "block": BLOCK},
        "rows": decode_rows(args.context, gen) + prefill_rows(args.context, gen),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        write_result_json(args.out, result)


if __name__ == "__main__":
    main()
