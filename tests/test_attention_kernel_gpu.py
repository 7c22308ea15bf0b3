"""GPU tests of the paged decode-attention kernel (``paged_attention.cu``) against an fp64
reference.

Every test poisons what the kernel must not read: cache slots past a sequence's length and
the scratch block that pads the block tables hold NaN, and so does the output before the
call, so a read past a context or an unwritten output shows up as a non-finite value.
Outputs must agree with fp64 within fp16 rounding: ``|o - ref| <= 2e-3 * |ref| +
2e-3 * rms(ref of that sequence)``. With Qwen3.5's output gate the reference is the fp64
attention times ``sigmoid(gate)`` (the kernels apply it before their one rounding to fp16);
the gate is a strided view of a wider tensor, as the runtime hands it (the second half of
each head's q_proj rows).
"""

from __future__ import annotations

import math

import pytest
import torch

from onecat.runtime.engine.graph_capture import capture

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
BLOCK = 16  # the runtime's kv_block_size
LENGTHS = (1, 15, 16, 17, 300, 4097, 32768)


def reference(q, k_cache, v_cache, tables, lens, scale):
    """fp64 attention of each sequence over its first ``lens[b]`` cached tokens."""
    batch, num_heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        blocks = tables[b, : math.ceil(n / BLOCK)]
        k = k_cache[blocks].reshape(-1, kv_heads, dim)[:n].double()
        v = v_cache[blocks].reshape(-1, kv_heads, dim)[:n].double()
        qb = q[b].double().view(kv_heads, num_heads // kv_heads, dim)
        p = (torch.einsum("kgd,tkd->kgt", qb, k) * scale).softmax(-1)
        out[b] = torch.einsum("kgt,tkd->kgd", p, v).reshape(num_heads, dim)
    return out


def gated(ref, gate):
    """The fp64 reference times ``sigmoid(gate)``."""
    return ref * torch.sigmoid(gate.double())


def gate_view(batch, num_heads, dim, seed):
    """A gate ``[B, H, D]`` viewed from ``[B, H, 2D]`` (the runtime's layout: strides
    (2HD, 2D, 1)), values ~ N(0, 3^2) so sigmoid spans (0, 1); the other half is NaN."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    wide = torch.full((batch, num_heads, 2 * dim), float("nan"), dtype=torch.float16, device="cuda")
    wide[..., dim:] = (torch.randn(batch, num_heads, dim, generator=gen, device="cuda") * 3).half()
    return wide[..., dim:]


def make_inputs(lengths, num_heads, kv_heads, dim, seed, extra_width=3, q_scale=1.0, width=None):
    """A paged cache holding ``lengths`` tokens per sequence in shuffled blocks; slots past a
    length and the scratch block (the last one, padding every table row) are NaN."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    counts = [math.ceil(n / BLOCK) for n in lengths]
    total = sum(counts)
    scratch = total
    shape = (total + 1, BLOCK, kv_heads, dim)
    k_cache = torch.randn(shape, generator=gen, device="cuda").half()
    v_cache = torch.randn(shape, generator=gen, device="cuda").half()
    width = width or max(max(counts), 1) + extra_width
    tables = torch.full((len(lengths), width), scratch, dtype=torch.int64, device="cuda")
    order = torch.randperm(total, generator=gen, device="cuda")
    start = 0
    for b, (n, c) in enumerate(zip(lengths, counts, strict=True)):
        tables[b, :c] = order[start : start + c]
        start += c
        if n % BLOCK:
            last = tables[b, c - 1]
            k_cache[last, n % BLOCK :] = float("nan")
            v_cache[last, n % BLOCK :] = float("nan")
    k_cache[scratch] = float("nan")
    v_cache[scratch] = float("nan")
    q = (torch.randn(len(lengths), num_heads, dim, generator=gen, device="cuda") * q_scale).half()
    lens = torch.tensor(lengths, dtype=torch.int64, device="cuda")
    return q, k_cache, v_cache, tables, lens


def check(out, ref, lens, what, tol=2e-3):
    lens = lens.tolist()
    finite = torch.isfinite(out).flatten(1).all(1).tolist()
    bad = [(b, n) for b, (n, ok) in enumerate(zip(lens, finite, strict=True)) if not ok]
    assert not bad, f"{what}: non-finite output (unwritten, or a read past the context) in (row, ctx) {bad}"
    err = (out.double() - ref).abs()
    rms = ref.pow(2).mean(dim=(1, 2), keepdim=True).sqrt()
    excess = (err - tol * ref.abs() - tol * rms).flatten(1).amax(1)
    failing = [
        f"row {b} ctx {n}: max err {err[b].max().item():.3e}, rms(ref) {rms[b].item():.3e}"
        for b, n in enumerate(lens)
        if excess[b] > 0
    ]
    assert not failing, f"{what}: outside fp16 rounding of the fp64 reference: " + "; ".join(failing)


def lengths_for(batch, shift):
    return [LENGTHS[(3 * i + shift) % len(LENGTHS)] for i in range(batch)]


@pytest.mark.parametrize(
    "batch, num_heads, kv_heads, dim",
    [
        (1, 24, 4, 256),  # Qwen3.5-27B, GQA 6
        (8, 24, 4, 256),
        (32, 24, 4, 256),
        (8, 16, 2, 256),  # Qwen3.5-35B-A3B, GQA 8
        (32, 16, 2, 256),
        (8, 4, 2, 32),  # the tiny test models
        (32, 12, 1, 64),  # GQA 12: two head chunks per KV head, the second half full
        (8, 4, 4, 128),  # no grouping
    ],
)
def test_matches_fp64_at_mixed_lengths(batch, num_heads, kv_heads, dim):
    from onecat.kernels.attention import paged_decode_attention

    for shift in (0, 5) if batch == 1 else (0,):  # batch 1: a long and a short context
        lengths = lengths_for(batch, shift)
        q, k_cache, v_cache, tables, lens = make_inputs(lengths, num_heads, kv_heads, dim, seed=batch + dim)
        scale = dim**-0.5
        ref = reference(q, k_cache, v_cache, tables, lens, scale)
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, out=out)
        torch.cuda.synchronize()
        check(out, ref, lens, f"B={batch} H={num_heads} KVH={kv_heads} D={dim} lengths {lengths}")


@pytest.mark.parametrize("splits", [1, 2, 7, 64])
def test_any_split_count_matches_fp64(splits):
    from onecat.kernels.attention import paged_decode_attention

    lengths = list(LENGTHS) + [129, 128, 2048]
    q, k_cache, v_cache, tables, lens = make_inputs(lengths, 24, 4, 256, seed=splits)
    ref = reference(q, k_cache, v_cache, tables, lens, 256**-0.5)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, tables, lens, 256**-0.5, out=out, splits=splits)
    torch.cuda.synchronize()
    check(out, ref, lens, f"splits={splits}")


@pytest.mark.parametrize("splits", [1, 7, None])
@pytest.mark.parametrize(
    "batch, num_heads, kv_heads, dim",
    [(8, 24, 4, 256), (3, 16, 2, 256), (8, 4, 2, 32)],  # 27B, 35B-A3B, the tiny models
)
def test_output_gate_matches_fp64(splits, batch, num_heads, kv_heads, dim):
    """``attention * sigmoid(gate)`` from the split kernel (one split: it writes the output)
    and from the reduce kernel (several), a zero-length context included (zeros)."""
    from onecat.kernels.attention import paged_decode_attention

    lengths = lengths_for(batch, 1)
    q, k_cache, v_cache, tables, lens = make_inputs(lengths, num_heads, kv_heads, dim, seed=batch + dim)
    lens[-1] = 0
    gate = gate_view(batch, num_heads, dim, seed=dim)
    ref = gated(reference(q, k_cache, v_cache, tables, lens, dim**-0.5), gate)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5, out=out, splits=splits, gate=gate)
    torch.cuda.synchronize()
    assert torch.equal(out[-1], torch.zeros_like(out[-1])), "context 0 must give a zero output"
    check(out, ref, lens, f"gated, splits={splits} B={batch} H={num_heads} KVH={kv_heads} D={dim}")


def test_output_gate_unaligned_and_contiguous():
    """A gate whose rows are not 16-byte aligned (copied by the wrapper) and a contiguous one."""
    from onecat.kernels.attention import paged_decode_attention

    lengths = [300, 1, 4097]
    q, k_cache, v_cache, tables, lens = make_inputs(lengths, 24, 4, 256, seed=21)
    flat = (torch.randn(3 * 24 * 256 + 1, device="cuda") * 3).half()
    unaligned = flat[1:].view(3, 24, 256)
    ref = reference(q, k_cache, v_cache, tables, lens, 256**-0.5)
    for what, gate in (("unaligned", unaligned), ("contiguous", unaligned.clone())):
        out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 256**-0.5, gate=gate)
        torch.cuda.synchronize()
        check(out, gated(ref, gate), lens, f"{what} gate")


def test_sharp_scores_and_strided_queries():
    """Large scores (a peaked softmax: the running max matters) and q a strided view."""
    from onecat.kernels.attention import paged_decode_attention

    lengths = [4097, 17, 32768, 300]
    q, k_cache, v_cache, tables, lens = make_inputs(lengths, 16, 2, 256, seed=3, q_scale=6.0)
    wide = torch.full((len(lengths), 16, 2 * 256), float("nan"), dtype=torch.float16, device="cuda")
    wide[..., :256] = q
    view = wide[..., :256]  # strides (8192, 512, 1)
    ref = reference(q, k_cache, v_cache, tables, lens, 256**-0.5)
    out = paged_decode_attention(view, k_cache, v_cache, tables, lens, 256**-0.5)
    torch.cuda.synchronize()
    check(out, ref, lens, "sharp scores, strided q")


def test_zero_length_context_gives_zeros():
    from onecat.kernels.attention import paged_decode_attention

    q, k_cache, v_cache, tables, lens = make_inputs([5, 1, 40], 8, 2, 128, seed=4)
    lens[1] = 0
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, tables, lens, 128**-0.5, out=out)
    torch.cuda.synchronize()
    assert torch.equal(out[1], torch.zeros_like(out[1])), "context 0 must give a zero output"
    check(out, reference(q, k_cache, v_cache, tables, lens, 128**-0.5), lens, "with a zero-length row")


@pytest.mark.parametrize("with_gate", [False, True])
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_cuda_graph_replay_follows_changed_lengths(batch, with_gate):
    """Captured once at a fixed table width, replayed with new context lengths and tables
    (and a new output gate)."""
    from onecat.kernels.attention import paged_decode_attention

    num_heads, kv_heads, dim = 24, 4, 256
    width = math.ceil(32768 / BLOCK)
    rounds = [lengths_for(batch, shift) for shift in (0, 3, 6)] + [[1] * batch]
    cases = [make_inputs(ls, num_heads, kv_heads, dim, seed=10 + r, width=width) for r, ls in enumerate(rounds)]
    pool = max(c[1].shape[0] for c in cases)
    static_k = torch.zeros(pool, BLOCK, kv_heads, dim, dtype=torch.float16, device="cuda")
    static_v = torch.zeros_like(static_k)
    static_q = torch.zeros(batch, num_heads, dim, dtype=torch.float16, device="cuda")
    static_tables = torch.zeros(batch, width, dtype=torch.int64, device="cuda")
    static_lens = torch.ones(batch, dtype=torch.int64, device="cuda")
    static_out = torch.full_like(static_q, float("nan"))
    static_gate = gate_view(batch, num_heads, dim, seed=0) if with_gate else None

    def step():
        paged_decode_attention(static_q, static_k, static_v, static_tables, static_lens, dim**-0.5, out=static_out,
                               gate=static_gate)

    graph = torch.cuda.CUDAGraph()
    capture(graph, None, step)  # warm-up on the capture stream: kernels and workspace first
    for r, (q, k_cache, v_cache, tables, lens) in enumerate(cases):
        static_k[: k_cache.shape[0]].copy_(k_cache)
        static_v[: v_cache.shape[0]].copy_(v_cache)
        static_q.copy_(q)
        static_tables.copy_(tables)
        static_lens.copy_(lens)
        static_out.fill_(float("nan"))
        if with_gate:
            static_gate.copy_(gate_view(batch, num_heads, dim, seed=r + 1))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference(q, k_cache, v_cache, tables, lens, dim**-0.5)
        ref = gated(ref, static_gate) if with_gate else ref
        check(static_out, ref, lens, f"graph replay {r} (B={batch}, lengths {rounds[r]})")


def test_runtime_decode_uses_the_kernel_and_matches_the_sdpa_path():
    from onecat.runtime.context import ForwardContext, set_context
    from onecat.runtime.layers.attention import PagedAttention

    lengths = [1, 17, 300, 4097, 16, 15]
    q, k_cache, v_cache, tables, lens = make_inputs(lengths, 24, 4, 256, seed=7)
    k_cache[k_cache.isnan()] = 0  # the SDPA path multiplies masked slots by zero weights
    v_cache[v_cache.isnan()] = 0
    layer = PagedAttention(24, 4, 256, 256**-0.5)
    layer.k_cache, layer.v_cache = k_cache, v_cache
    assert layer.uses_decode_kernel()
    ctx = ForwardContext(
        slot_mapping=torch.zeros(len(lengths), dtype=torch.int64, device="cuda"),
        num_decodes=len(lengths), decode_block_tables=tables, decode_context_lens=lens,
    )  # fmt: skip
    out = layer._decode(q, ctx)
    sdpa = layer._decode_torch(q, ctx)
    torch.cuda.synchronize()
    ref = reference(q, k_cache, v_cache, tables, lens, 256**-0.5)
    check(out, ref, lens, "runtime kernel path")
    check(sdpa, ref, lens, "runtime SDPA path (the old decode)", tol=1e-2)
    gate = gate_view(len(lengths), 24, 256, seed=8)  # the layer's [T, H, D] view of q_proj's output
    check(layer._decode(q, ctx, gate), gated(ref, gate), lens, "runtime kernel path, gated")
    flat_gate = gate.reshape(len(lengths), -1)  # the torch input path's [T, H*D]
    set_context(ctx)
    try:
        forward = layer(q, None, None, stored=True, gate=flat_gate)
    finally:
        set_context(None)
    check(forward, gated(ref, gate), lens, "PagedAttention.forward, gated")


@pytest.mark.parametrize("past, length", [(0, 300), (1000, 300), (31, 1)])
def test_prefill_chunks_match_fp64(past, length):
    """Prompt chunks on the GPU (27B heads: 24 query, 4 KV, dim 256), fresh or after cached
    tokens, agree with fp64 causal attention over the whole sequence: through the layer (the
    flash-attention prefill kernel) and through the torch reference path (query blocks)."""
    from onecat.runtime.context import ForwardContext, PrefillChunk, set_context
    from onecat.runtime.layers.attention import PagedAttention

    torch.manual_seed(3)
    heads, kv_heads, dim, scale = 24, 4, 256, 256**-0.5
    total = past + length
    layer = PagedAttention(heads, kv_heads, dim, scale)
    num_blocks = math.ceil(total / BLOCK) + 3
    layer.k_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, device="cuda", dtype=torch.float16)
    layer.v_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, device="cuda", dtype=torch.float16)
    table = torch.randperm(num_blocks, device="cuda")[: math.ceil(total / BLOCK)]
    k_all, v_all = (c[table].reshape(-1, kv_heads, dim)[:total] for c in (layer.k_cache, layer.v_cache))
    q = torch.randn(length, heads, dim, device="cuda", dtype=torch.float16)
    group = heads // kv_heads
    qd = q.double().view(length, kv_heads, group, dim)
    scores = torch.einsum("lkgd,skd->kgls", qd, k_all.double()) * scale
    visible = torch.arange(total, device="cuda")[None, :] <= (past + torch.arange(length, device="cuda"))[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    expected = torch.einsum("kgls,skd->lkgd", probs, v_all.double()).reshape(length, heads, dim)
    tolerance = 2e-3 * expected.abs() + 2e-3 * expected.pow(2).mean().sqrt()
    set_context(ForwardContext(slot_mapping=torch.zeros(length, dtype=torch.int64, device="cuda"),
                               prefills=[PrefillChunk(0, length, past, table, 0)]))  # fmt: skip
    try:
        kernel = layer(q, k_all[past:], v_all[past:], stored=True)
    finally:
        set_context(None)
    torch_path = layer._prefill(q, k_all[past:], v_all[past:], past, table)
    for what, got in (("kernel", kernel), ("torch", torch_path)):
        assert got.shape == (length, heads, dim) and torch.isfinite(got).all(), what
        assert ((got.double() - expected).abs() <= tolerance).all(), what


@pytest.mark.parametrize("splits", [1, 7, None])
@pytest.mark.parametrize(
    "batch, num_heads, kv_heads, dim, rot",
    [(1, 24, 4, 256, 64), (8, 24, 4, 256, 64), (32, 16, 2, 256, 64), (8, 4, 2, 32, 16), (5, 12, 1, 64, 0),
     (3, 4, 4, 128, 128)],
)  # fmt: skip
def test_prep_form_matches_fp64_and_writes_the_new_rows(splits, batch, num_heads, kv_heads, dim, rot):
    """``paged_decode_attention_prep`` (the split kernel doing attention_prep's work for each
    sequence's new token, position ctx - 1) against the fp64 input contract followed by fp64
    attention over the cache holding the new rows: the new token's cache rows are NaN before
    the call (the kernel writes them before it reads them), every other cache row is left as
    it was, the output starts as NaN; a row whose slot is -1 writes nothing (and attends over
    what its cache row holds)."""
    from attention_prep_reference import assert_close_to_reference, reference_inputs

    from onecat.kernels.attention import paged_decode_attention_prep

    lengths = lengths_for(batch, 2)
    _, k_cache, v_cache, tables, lens = make_inputs(lengths, num_heads, kv_heads, dim, seed=batch + dim + rot)
    gen = torch.Generator(device="cuda").manual_seed(rot + 1)
    width = 2 * (num_heads + kv_heads) * dim
    wide = torch.randn(batch, width + 8, generator=gen, device="cuda").half()  # strided rows
    qkv = wide[:, :width]
    q_weight = torch.randn(dim, generator=gen, device="cuda") * 0.1
    k_weight = torch.randn(dim, generator=gen, device="cuda") * 0.1
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, device="cuda").float() / max(rot, 1)))
    positions = lens - 1
    slots = tables.gather(1, (positions // BLOCK).unsqueeze(1)).squeeze(1) * BLOCK + positions % BLOCK
    slots[-1] = -1 if batch > 1 else slots[-1]  # a row that writes nothing (its cache row stays)
    q64, k64, v64 = reference_inputs(qkv, positions, q_weight, k_weight, inv_freq, 1e-6, num_heads, kv_heads, dim, rot)
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    expected_k, expected_v = flat_k.clone(), flat_v.clone()
    written = slots[slots >= 0]
    expected_k[written], expected_v[written] = k64.half()[slots >= 0], v64.half()[slots >= 0]
    if batch > 1:  # the row without a slot attends over what its cache row holds
        row = tables[-1, positions[-1] // BLOCK] * BLOCK + positions[-1] % BLOCK
        expected_k[row], expected_v[row] = k64.half()[-1], v64.half()[-1]
        flat_k[row], flat_v[row] = expected_k[row], expected_v[row]
    flat_k[written], flat_v[written] = float("nan"), float("nan")
    scale = dim**-0.5
    ref_cache = (expected_k.view_as(k_cache), expected_v.view_as(v_cache))
    gate = qkv[:, : 2 * num_heads * dim].view(batch, num_heads, 2 * dim)[..., dim:]
    ref = gated(reference(q64, *ref_cache, tables, lens, scale), gate)
    out = torch.full((batch, num_heads, dim), float("nan"), dtype=torch.float16, device="cuda")
    paged_decode_attention_prep(
        qkv, positions, q_weight, k_weight, inv_freq, 1e-6, rot, slots, k_cache, v_cache, tables, lens, scale,
        num_heads, out=out, splits=splits,
    )  # fmt: skip
    torch.cuda.synchronize()
    what = f"prep form, splits={splits} B={batch} H={num_heads} KVH={kv_heads} D={dim} rot={rot}"
    check(out, ref, lens, what, tol=4e-3)
    assert_close_to_reference(flat_k[written], k64[slots >= 0], f"{what}: new keys")
    assert torch.equal(flat_v[written], v64.half()[slots >= 0]), f"{what}: new values"
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device="cuda")
    untouched[written] = False
    for name, got, want in (("keys", flat_k, expected_k), ("values", flat_v, expected_v)):
        torch.testing.assert_close(got[untouched], want[untouched], rtol=0, atol=0, equal_nan=True,
                                   msg=f"{what}: other cache rows of the {name} changed")  # fmt: skip
