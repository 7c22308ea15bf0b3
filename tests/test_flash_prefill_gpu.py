"""GPU tests of the flash-attention prefill kernel (``flash_prefill.cu``) against an fp64
reference.

Everything the kernel must not read or write is poisoned: cache slots past a sequence's
tokens and the blocks no table lists hold NaN, and so does the output before the call (the
rows outside the chunks must still be NaN after it). Outputs must agree with fp64 within fp16
rounding: ``|o - ref| <= 2e-3 * |ref| + 2e-3 * rms(ref of that query token)`` (the rms over
its heads and features: P is rounded to fp16 as in FlashAttention, so a row's error scales with
the size of its values, and the first rows of a long prompt average only a few). Long prompts (33k tokens) are
checked on a sample of query rows (each row's attention is independent of the others).
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
BLOCK = 16  # the runtime's kv_block_size
HEADS = [(24, 4, 256), (4, 4, 128), (24, 4, 128), (8, 8, 256)]  # (query heads, KV heads, dim): group 6 and 1


def paged(lengths, past, num_heads, kv_heads, dim, seed, pad_rows=3):
    """Chunks one after another in a flat batch (``pad_rows`` rows before them, as decode rows
    would be) over a paged cache of shuffled blocks; unused slots and blocks are NaN."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    counts = [math.ceil((n + p) / BLOCK) for n, p in zip(lengths, past, strict=True)]
    blocks = sum(counts) + 2
    k_cache = torch.full((blocks, BLOCK, kv_heads, dim), float("nan"), dtype=torch.float16, device="cuda")
    v_cache = torch.full_like(k_cache, float("nan"))
    order = torch.randperm(blocks, generator=gen, device="cuda")
    tables, first = [], 0
    for n, p, c in zip(lengths, past, counts, strict=True):
        table = order[first : first + c].clone()
        first += c
        tables.append(table)
        for cache in (k_cache, v_cache):
            flat = torch.randn(c * BLOCK, kv_heads, dim, generator=gen, device="cuda").half()
            flat[n + p :] = float("nan")
            cache[table] = flat.view(c, BLOCK, kv_heads, dim)
    starts = [pad_rows + sum(lengths[:i]) for i in range(len(lengths))]
    q = torch.randn(pad_rows + sum(lengths), num_heads, dim, generator=gen, device="cuda").half()
    return q, k_cache, v_cache, tables, starts


def reference_rows(q, k_cache, v_cache, table, start, length, past, scale, rows):
    """fp64 attention of chunk rows ``rows`` (indices into the chunk), bottom-right causal."""
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // kv_heads
    keys = k_cache[table].reshape(-1, kv_heads, dim)[: past + length].double()
    values = v_cache[table].reshape(-1, kv_heads, dim)[: past + length].double()
    out = []
    for part in rows.split(256):
        qs = q[start + part].double().view(len(part), kv_heads, group, dim)
        scores = torch.einsum("lkgd,tkd->lkgt", qs, keys) * scale
        visible = torch.arange(past + length, device="cuda")[None, :] <= (past + part)[:, None]
        probs = scores.masked_fill(~visible[:, None, None, :], float("-inf")).softmax(-1)
        out.append(torch.einsum("lkgt,tkd->lkgd", probs, values).reshape(len(part), -1, dim))
    return torch.cat(out)


def sample_rows(length, limit=768):
    """Every row of a short chunk; of a long one its first and last 256 rows and 256 between."""
    if length <= limit:
        return torch.arange(length, device="cuda")
    gen = torch.Generator().manual_seed(length)
    middle = torch.randint(256, length - 256, (256,), generator=gen)
    return torch.cat([torch.arange(256), middle, torch.arange(length - 256, length)]).to("cuda")


def run_and_check(lengths, past, num_heads, kv_heads, dim, seed=0, variant=None):
    from onecat.kernels import flash_prefill as fp

    q, k_cache, v_cache, tables, starts = paged(lengths, past, num_heads, kv_heads, dim, seed)
    scale = dim**-0.5
    batch = fp.prefill_attention_batch(starts, lengths, past, num_heads // kv_heads, q.device, tables)
    out = torch.full_like(q, float("nan"))
    fp.flash_prefill_attention(q, k_cache, v_cache, batch, scale, out=out, variant=variant or fp.DEFAULT_VARIANT)
    torch.cuda.synchronize()
    assert torch.isnan(out[: starts[0]]).all(), "rows outside the chunks were written"
    for s, (start, length, p) in enumerate(zip(starts, lengths, past, strict=True)):
        rows = sample_rows(length)
        got = out[start + rows].double()
        assert torch.isfinite(got).all(), f"sequence {s} (L={length}, P={p}): non-finite output"
        ref = reference_rows(q, k_cache, v_cache, tables[s], start, length, p, scale, rows)
        err = (got - ref).abs()
        tol = 2e-3 * ref.abs() + 2e-3 * ref.pow(2).mean(dim=(1, 2), keepdim=True).sqrt()
        assert (err <= tol).all(), (
            f"sequence {s} (L={length}, P={p}, H={num_heads}/{kv_heads}, D={dim}): max err {err.max().item():.3e}, "
            f"worst row {rows[err.amax(dim=(1, 2)).argmax()].item()}"
        )


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("length", [1, 2, 11, 64, 65, 333, 4097])
def test_one_prompt_matches_fp64(heads, length):
    run_and_check([length], [0], *heads, seed=length)


@pytest.mark.parametrize("heads", [(24, 4, 256), (4, 4, 128)])
def test_a_33k_token_prompt_matches_fp64(heads):
    run_and_check([33000], [0], *heads, seed=33)


@pytest.mark.parametrize("heads", HEADS[:2])
@pytest.mark.parametrize("length, past", [(1, 16), (1, 31), (63, 1000), (500, 8191), (2048, 30000)])
def test_a_chunk_after_cached_tokens_matches_fp64(heads, length, past):
    """The bottom-right causal offset: query i of the chunk sees keys 0 .. past + i."""
    run_and_check([length], [past], *heads, seed=length + past)


@pytest.mark.parametrize("variant", ["r16", "r32"])
@pytest.mark.parametrize("heads", HEADS)
def test_a_ragged_batch_in_one_launch_matches_fp64(heads, variant):
    run_and_check([1, 700, 64, 3000, 5, 129], [0, 129, 5000, 0, 33, 16], *heads, seed=7, variant=variant)


@pytest.mark.parametrize("variant", ["r16", "r32"])
@pytest.mark.parametrize("heads", HEADS[:2])
@pytest.mark.parametrize("length", [1, 65, 4097])
def test_both_variants_match_fp64(heads, length, variant):
    run_and_check([length], [length // 3], *heads, seed=length + 1, variant=variant)


def test_fresh_keys_without_a_cache():
    """The memory-profiling pass: no cache, keys and values are the chunks' own rows."""
    from onecat.kernels import flash_prefill as fp

    torch.manual_seed(0)
    lengths, starts = [300, 1, 77], [0, 300, 301]
    q = torch.randn(378, 24, 256, device="cuda").half()
    k = torch.randn(378, 4, 256, device="cuda").half()
    v = torch.randn(378, 4, 256, device="cuda").half()
    batch = fp.prefill_attention_batch(starts, lengths, [0, 0, 0], 6, q.device)
    out = fp.flash_prefill_attention(q, k, v, batch, 0.0625)
    ref = fp.flash_prefill_reference(q.double(), k.double(), v.double(), batch, 0.0625)
    tol = 2e-3 * ref.abs() + 2e-3 * ref.pow(2).mean(dim=(1, 2), keepdim=True).sqrt()
    assert ((out.double() - ref).abs() <= tol).all()


def test_the_layer_runs_decodes_and_ragged_chunks_with_the_gate():
    """``PagedAttention.forward`` on CUDA fp16: decode rows (the decode kernel) then ragged
    chunks (one prefill launch), the gate applied to both, against the torch reference path
    run on the same tensors in fp32."""
    from onecat.runtime.context import ForwardContext, PrefillChunk, set_context
    from onecat.runtime.layers.attention import PagedAttention

    heads, kv_heads, dim = 24, 4, 256
    lengths, past = [40, 257], [0, 100]
    q, k_cache, v_cache, tables, starts = paged(lengths, past, heads, kv_heads, dim, seed=5, pad_rows=2)
    gate = torch.randn(q.shape[0], heads * dim, device="cuda").half()
    layer = PagedAttention(heads, kv_heads, dim, dim**-0.5)
    layer.k_cache, layer.v_cache = k_cache, v_cache
    assert layer.uses_prefill_kernel(q)
    chunks = [PrefillChunk(s, n, p, t, 0) for s, n, p, t in zip(starts, lengths, past, tables, strict=True)]
    ctx = ForwardContext(slot_mapping=torch.zeros(q.shape[0], dtype=torch.int64, device="cuda"), num_decodes=2,
                         decode_block_tables=torch.stack([tables[1], tables[1]]),
                         decode_context_lens=torch.tensor([5, 101], device="cuda"), prefills=chunks)  # fmt: skip
    set_context(ctx)
    try:
        got = layer(q, None, None, stored=True, gate=gate)
    finally:
        set_context(None)
    reference = PagedAttention(heads, kv_heads, dim, dim**-0.5)
    reference.k_cache, reference.v_cache = k_cache.float().nan_to_num(0), v_cache.float().nan_to_num(0)
    fresh = [reference._gather(t, torch.float32)[i][p : p + n] for t, p, n in zip(tables, past, lengths, strict=True) for i in (0, 1)]
    k_rows = torch.cat([torch.zeros(2, kv_heads, dim, device="cuda"), fresh[0], fresh[2]])
    v_rows = torch.cat([torch.zeros(2, kv_heads, dim, device="cuda"), fresh[1], fresh[3]])
    set_context(ForwardContext(slot_mapping=ctx.slot_mapping, num_decodes=2, decode_block_tables=ctx.decode_block_tables,
                               decode_context_lens=ctx.decode_context_lens, prefills=chunks))  # fmt: skip
    try:
        expected = reference(q.float(), k_rows, v_rows, stored=True, gate=gate.float())
    finally:
        set_context(None)
    assert got.shape == q.shape and torch.isfinite(got).all()
    tol = 2e-3 * expected.abs() + 2e-3 * expected.pow(2).mean(dim=(1, 2), keepdim=True).sqrt()
    assert ((got.float() - expected).abs() <= tol).all()
