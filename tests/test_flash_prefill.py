"""CPU tests of the flash-attention prefill's Python side (``onecat/kernels/flash_prefill.py``):
the chunk description, argument checks, the torch reference, an emulation of the kernel's tile
schedule (the index arithmetic of ``flash_prefill.cu``: row tiles over (token, head) rows,
key tiles through the block table, masks, online softmax with P rounded to fp16) against
the reference, the kernel program's PTX and sm_70 resources, and the runtime's choice of path.
"""

from __future__ import annotations

import math

import pytest
import torch

from onecat.errors import OnecatError
from onecat.kernels import build, kv_cache
from onecat.kernels import flash_prefill as fp
from onecat.runtime.context import ForwardContext, PrefillChunk, set_context
from onecat.runtime.layers.attention import PagedAttention

pytestmark = pytest.mark.usefixtures("one_thread")


def paged_inputs(lengths, past, num_heads, kv_heads, dim, block, seed=0, dtype=torch.float32):
    """A flat batch of chunks (``q`` rows one chunk after another, 2 padding rows first) over a
    paged cache holding each sequence's past and chunk keys in shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    counts = [math.ceil((n + p) / block) for n, p in zip(lengths, past, strict=True)]
    blocks = sum(counts) + 2
    k_cache = torch.randn(blocks, block, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, block, kv_heads, dim, generator=gen).to(dtype)
    order = torch.randperm(blocks, generator=gen)
    tables, first = [], 0
    for c in counts:
        tables.append(order[first : first + c].clone())
        first += c
    starts = [2 + sum(lengths[:i]) for i in range(len(lengths))]
    q = torch.randn(2 + sum(lengths), num_heads, dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, starts


def exact(q, k_cache, v_cache, tables, starts, lengths, past, scale):
    """fp64 causal attention of each chunk over its sequence (bottom-right offset)."""
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for table, start, n, p in zip(tables, starts, lengths, past, strict=True):
        keys = k_cache[table].reshape(-1, kv_heads, dim)[: n + p].double()
        values = v_cache[table].reshape(-1, kv_heads, dim)[: n + p].double()
        qs = q[start : start + n].double().view(n, kv_heads, group, dim)
        scores = torch.einsum("lkgd,tkd->lkgt", qs, keys) * scale
        visible = torch.arange(n + p)[None, :] <= (p + torch.arange(n))[:, None]
        probs = scores.masked_fill(~visible[:, None, None, :], float("-inf")).softmax(-1)
        out[start : start + n] = torch.einsum("lkgt,tkd->lkgd", probs, values).reshape(n, -1, dim)
    return out


def emulate_kernel(q, k, v, batch, scale, block_size):
    """flash_prefill.cu's schedule in torch: per work item and KV head, 64 rows of the
    (token, head) list, key tiles of 64 read through the flat table, the per-row limit, the
    online softmax in log2 units with P rounded to fp16, the final division."""
    rows_n, keys_n = fp.ROWS, fp.KEYS
    num_kv_heads, dim = k.shape[-2], k.shape[-1]
    group = batch.group
    seqs = batch.seqs.tolist()
    out = torch.full(q.shape, float("nan"), dtype=torch.float32)
    log2_bs = block_size.bit_length() - 1
    flat = None if batch.tables is None else batch.tables.tolist()
    for seq, tile in batch.items.tolist():
        q_start, length, past, offset = seqs[seq]
        rows, r0 = length * group, tile * rows_n
        last_token = min(length - 1, (r0 + rows_n - 1) // group)
        n_keys = past + last_token + 1
        for kvh in range(num_kv_heads):
            f = torch.arange(r0, r0 + rows_n)
            real = f < rows
            token = torch.where(real, f // group, 0)
            head = kvh * group + f % group
            qt = torch.where(real[:, None], q[q_start + token, head].float(), 0.0)  # [64, D]
            limit = past + torch.clamp((r0 + torch.arange(rows_n)) // group, max=length - 1)
            m = torch.full((rows_n,), float("-inf"))
            row_sum = torch.zeros(rows_n)
            o = torch.zeros(rows_n, dim)
            for k0 in range(0, n_keys, keys_n):
                key = torch.arange(k0, k0 + keys_n)
                valid = key < n_keys
                if flat is None:
                    cache_row = q_start + key
                else:
                    block = torch.tensor([flat[offset + (j >> log2_bs)] if j < n_keys else 0 for j in key.tolist()])
                    cache_row = (block << log2_bs) | (key & (block_size - 1))
                cache_row = torch.where(valid, cache_row, 0)
                kt = torch.where(valid[:, None], k.reshape(-1, num_kv_heads, dim)[cache_row, kvh].float(), 0.0)
                vt = torch.where(valid[:, None], v.reshape(-1, num_kv_heads, dim)[cache_row, kvh].float(), 0.0)
                s = qt @ kt.T
                x = torch.where(key[None, :] <= limit[:, None], s * (scale * math.log2(math.e)), float("-inf"))
                m_new = torch.maximum(m, x.max(1).values)
                base = torch.where(m_new == float("-inf"), 0.0, m_new)
                alpha = torch.exp2(m - base)
                p = torch.exp2(x - base[:, None])
                row_sum = row_sum * alpha + p.sum(1)
                m = m_new
                o = o * alpha[:, None] + p.half().float() @ vt
            result = o / row_sum[:, None]
            out[q_start + token[real], head[real]] = result[real]
    return out


def test_work_items_cover_every_tile_heaviest_first():
    items = fp.work_items([1, 100, 7], [0, 5, 300], group=6)
    tiles = {s: math.ceil(n * 6 / fp.ROWS) for s, n in enumerate([1, 100, 7])}
    assert sorted(items) == sorted((s, t) for s, c in tiles.items() for t in range(c))
    keys = [[0, 5, 300][s] + min([1, 100, 7][s] - 1, ((t + 1) * fp.ROWS - 1) // 6) + 1 for s, t in items]
    assert keys == sorted(keys, reverse=True)


def test_batch_meta_and_argument_checks():
    tables = [torch.tensor([3, 1]), torch.tensor([0, 2, 4])]
    batch = fp.prefill_attention_batch([0, 5], [5, 9], [2, 30], 2, torch.device("cpu"), tables)
    assert batch.seqs.tolist() == [[0, 5, 2, 0], [5, 9, 30, 2]]
    assert batch.items.shape == (batch.num_items, 2) and batch.num_rows == 14
    assert batch.tables.tolist() == [3, 1, 0, 2, 4] and batch.table_lengths == (2, 3)
    with pytest.raises(OnecatError, match="overlap"):
        fp.prefill_attention_batch([0, 3], [5, 9], [0, 0], 2, torch.device("cpu"))
    with pytest.raises(OnecatError, match="block tables"):
        fp.prefill_attention_batch([0], [5], [3], 2, torch.device("cpu"))
    with pytest.raises(OnecatError, match="length >= 1"):
        fp.prefill_attention_batch([0], [0], [0], 2, torch.device("cpu"))
    q = torch.zeros(14, 4, 16)
    cache = torch.zeros(5, 8, 2, 16)
    with pytest.raises(OnecatError, match="fewer than their tokens"):
        fp.flash_prefill_reference(q, cache, cache, batch, 0.25)  # 39 tokens in 3 blocks of 8
    with pytest.raises(OnecatError, match="do not agree"):
        fp.flash_prefill_reference(torch.zeros(14, 6, 16), cache, cache, batch, 0.25)
    with pytest.raises(OnecatError, match="variant"):
        fp.flash_prefill_attention(q.half(), cache.half(), cache.half(), batch, 0.25, variant="r8")
    with pytest.raises(OnecatError, match="CUDA fp16"):
        fp.flash_prefill_attention(q.half(), cache.half(), cache.half(), batch, 0.25)
    assert fp.supports(torch.device("cuda"), torch.float16, 256, 16)
    assert not fp.supports(torch.device("cuda"), torch.float16, 64, 16)
    assert not fp.supports(torch.device("cpu"), torch.float16, 256, 16)
    assert fp.shared_bytes(256) <= 96 * 1024


@pytest.mark.parametrize(
    "lengths, past, num_heads, kv_heads, dim, block",
    [([5, 70, 1], [0, 40, 129], 24, 4, 32, 16), ([33, 64, 65], [0, 64, 3], 4, 4, 16, 8), ([200], [77], 12, 2, 16, 32)],
)  # fmt: skip
def test_reference_and_kernel_schedule_match_fp64(lengths, past, num_heads, kv_heads, dim, block):
    """The torch reference and the emulated tile schedule agree with fp64 causal attention
    over ragged chunks after cached prefixes (group 6 and 1, tiles straddling tokens)."""
    q, k_cache, v_cache, tables, starts = paged_inputs(lengths, past, num_heads, kv_heads, dim, block)
    scale = dim**-0.5
    batch = fp.prefill_attention_batch(starts, lengths, past, num_heads // kv_heads, torch.device("cpu"), tables)
    expected = exact(q, k_cache, v_cache, tables, starts, lengths, past, scale)
    rows = slice(2, None)
    reference = fp.flash_prefill_reference(q, k_cache, v_cache, batch, scale)
    assert torch.allclose(reference[rows].double(), expected[rows], atol=1e-5)
    assert (reference[:2] == 0).all()
    emulated = emulate_kernel(q, k_cache, v_cache, batch, scale, block)
    assert torch.isfinite(emulated[rows]).all() and torch.isnan(emulated[:2]).all()
    tolerance = 2e-3 * expected[rows].abs() + 2e-3 * expected[rows].pow(2).mean().sqrt()
    assert ((emulated[rows].double() - expected[rows]).abs() <= tolerance).all()


def test_fresh_keys_without_tables():
    """No cache (the memory-profiling pass): keys and values are the chunks' own rows."""
    torch.manual_seed(0)
    q, k, v = torch.randn(40, 6, 16), torch.randn(40, 2, 16), torch.randn(40, 2, 16)
    batch = fp.prefill_attention_batch([0, 17], [17, 23], [0, 0], 3, torch.device("cpu"))
    expected = torch.cat([
        torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1).repeat_interleave(3, 0),
            v[a:b].transpose(0, 1).repeat_interleave(3, 0), is_causal=True, scale=0.25).transpose(0, 1)
        for a, b in ((0, 17), (17, 40))
    ])  # fmt: skip
    assert torch.allclose(fp.flash_prefill_reference(q, k, v, batch, 0.25), expected, atol=1e-5)
    assert torch.allclose(emulate_kernel(q, k, v, batch, 0.25, 1), expected, atol=2e-3)


def test_kernel_program_is_sm70_legal_and_does_not_spill():
    """The PTX uses nothing sm_70 lacks; the sm_70 cubin (ptxas -v through NVRTC) has no
    spills and fits a block's registers."""
    ptx = build.compile_program("flash_prefill", "compute_70").image.decode(errors="replace")
    for forbidden in ("cp.async", "ldmatrix", "bf16", "m16n8k16", "m8n8k4"):
        assert forbidden not in ptx
    assert "wmma.mma.sync.aligned.row.col.m16n16k16.f32.f32" in ptx
    resources = build.compile_program("flash_prefill", "sm_70").resources
    assert {r.name for r in resources} == {
        f"flash_prefill{suffix}_{v}_d{d}" for suffix in kv_cache.KERNEL_SUFFIX.values() for v in fp.VARIANTS
        for d in fp.HEAD_DIMS
    }  # fmt: skip
    for r in resources:
        assert r.spill_stores == r.spill_loads == r.stack_bytes == 0, r
        assert r.registers * 256 <= 65536, r


def test_runtime_torch_path_matches_reference_over_a_ragged_pass():
    """On CPU the layer's torch path (query blocks, no repeated K / V) gives the reference's
    result for a pass of decode rows and ragged chunks after cached prefixes; the kernel is
    not chosen there."""
    lengths, past, heads, kv_heads, dim, block = [9, 30], [0, 21], 8, 2, 16, 4
    q, k_cache, v_cache, tables, starts = paged_inputs(lengths, past, heads, kv_heads, dim, block, seed=2)
    layer = PagedAttention(heads, kv_heads, dim, dim**-0.5)
    layer.k_cache, layer.v_cache = k_cache, v_cache
    assert not layer.uses_prefill_kernel(q)
    chunks = [PrefillChunk(s, n, p, t, 0) for s, n, p, t in zip(starts, lengths, past, tables, strict=True)]
    # two "decode" rows first: one token each over the second sequence's first 5 keys
    ctx = ForwardContext(slot_mapping=torch.zeros(q.shape[0], dtype=torch.int64), num_decodes=2,
                         decode_block_tables=torch.stack([tables[1], tables[1]]),
                         decode_context_lens=torch.tensor([5, 5]), prefills=chunks)  # fmt: skip
    k_fresh = torch.zeros(q.shape[0], kv_heads, dim)
    for s, n, p, t in zip(starts, lengths, past, tables, strict=True):
        k_fresh[s : s + n] = k_cache[t].reshape(-1, kv_heads, dim)[p : p + n]
    v_fresh = torch.zeros_like(k_fresh)
    for s, n, p, t in zip(starts, lengths, past, tables, strict=True):
        v_fresh[s : s + n] = v_cache[t].reshape(-1, kv_heads, dim)[p : p + n]
    set_context(ctx)
    try:
        got = layer(q, k_fresh, v_fresh, stored=True)
    finally:
        set_context(None)
    batch = fp.prefill_attention_batch(starts, lengths, past, heads // kv_heads, torch.device("cpu"), tables)
    expected = fp.flash_prefill_reference(q, k_cache, v_cache, batch, dim**-0.5)
    assert got.shape == q.shape
    assert torch.allclose(got[2:], expected[2:], atol=1e-5)
