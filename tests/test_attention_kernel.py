"""CPU tests of paged decode attention: the torch reference of the kernel's contract
(``onecat.kernels.attention``) against the runtime's SDPA decode path, and the kernel's
argument checks and launch-shape rules (the GPU tests are in test_attention_kernel_gpu.py)."""

from __future__ import annotations

import math

import pytest
import torch

from onecat.errors import OnecatError
from onecat.kernels import attention, build
from onecat.runtime.context import ForwardContext, PrefillChunk, set_context
from onecat.runtime.layers.attention import PagedAttention, sigmoid_gate

BLOCK = 16


def paged_inputs(lengths, num_heads, kv_heads, dim, seed, extra_width=2):
    """fp32 paged cache with ``lengths`` tokens per sequence in shuffled blocks; the last
    block is scratch (pads every table row)."""
    gen = torch.Generator().manual_seed(seed)
    counts = [math.ceil(n / BLOCK) for n in lengths]
    total = sum(counts)
    k_cache = torch.randn(total + 1, BLOCK, kv_heads, dim, generator=gen)
    v_cache = torch.randn(total + 1, BLOCK, kv_heads, dim, generator=gen)
    tables = torch.full((len(lengths), max(counts) + extra_width), total, dtype=torch.int64)
    order = torch.randperm(total, generator=gen)
    start = 0
    for b, c in enumerate(counts):
        tables[b, :c] = order[start : start + c]
        start += c
    q = torch.randn(len(lengths), num_heads, dim, generator=gen)
    return q, k_cache, v_cache, tables, torch.tensor(lengths)


@pytest.mark.parametrize("num_heads, kv_heads, dim", [(4, 2, 32), (24, 4, 64), (16, 2, 32), (3, 3, 16)])
def test_reference_matches_the_runtime_sdpa_path(num_heads, kv_heads, dim):
    lengths = [1, 15, 16, 17, 40, 3]
    q, k_cache, v_cache, tables, lens = paged_inputs(lengths, num_heads, kv_heads, dim, seed=dim)
    layer = PagedAttention(num_heads, kv_heads, dim, dim**-0.5)
    layer.k_cache, layer.v_cache = k_cache, v_cache
    assert not layer.uses_decode_kernel()  # CPU: the torch path
    ctx = ForwardContext(
        slot_mapping=torch.zeros(len(lengths), dtype=torch.int64), num_decodes=len(lengths),
        decode_block_tables=tables, decode_context_lens=lens,
    )  # fmt: skip
    sdpa = layer._decode(q, ctx)
    ref = attention.paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, dim**-0.5)
    torch.testing.assert_close(ref, sdpa, rtol=1e-5, atol=1e-5)


def test_output_gate_in_the_reference_and_the_runtime_decode_path():
    """The kernel contract's output gate (fp32 attention times sigmoid(gate), one rounding)
    and the runtime's torch decode path with a gate (``[B, H, D]`` or ``[B, H*D]``) agree."""
    lengths = [1, 15, 16, 17, 40]
    num_heads, kv_heads, dim = 24, 4, 64
    q, k_cache, v_cache, tables, lens = paged_inputs(lengths, num_heads, kv_heads, dim, seed=5)
    gate = torch.randn(len(lengths), num_heads, dim, generator=torch.Generator().manual_seed(6)) * 3
    plain = attention.paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, dim**-0.5)
    ref = attention.paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, dim**-0.5, gate=gate)
    torch.testing.assert_close(ref, plain * torch.sigmoid(gate), rtol=1e-6, atol=1e-7)
    fp16 = attention.paged_decode_attention_reference(
        q.half(), k_cache.half(), v_cache.half(), tables, lens, dim**-0.5, gate=gate.half()
    )  # fmt: skip
    assert fp16.dtype == torch.float16
    torch.testing.assert_close(fp16.float(), ref, rtol=5e-3, atol=5e-3)
    layer = PagedAttention(num_heads, kv_heads, dim, dim**-0.5)
    layer.k_cache, layer.v_cache = k_cache, v_cache
    ctx = ForwardContext(
        slot_mapping=torch.zeros(len(lengths), dtype=torch.int64), num_decodes=len(lengths),
        decode_block_tables=tables, decode_context_lens=lens,
    )  # fmt: skip
    for shaped in (gate, gate.reshape(len(lengths), -1)):
        torch.testing.assert_close(layer._decode(q, ctx, shaped), ref, rtol=1e-5, atol=1e-5)


def test_forward_gates_decode_rows_and_prompt_chunks_alike():
    """``PagedAttention.forward`` with a gate equals the ungated output times sigmoid(gate)
    on a step of decode rows and two prompt chunks (one after cached tokens)."""
    torch.manual_seed(2)
    heads, kv_heads, dim, block = 4, 2, 16, 4
    layer = PagedAttention(heads, kv_heads, dim, dim**-0.5)
    layer.k_cache = torch.randn(16, block, kv_heads, dim)
    layer.v_cache = torch.randn(16, block, kv_heads, dim)
    decodes, first, second = 2, 5, 3  # rows: 2 decode rows, a fresh 5-token chunk, 3 tokens after 6 cached
    tokens = decodes + first + second
    q, k, v = torch.randn(tokens, heads, dim), torch.randn(tokens, kv_heads, dim), torch.randn(tokens, kv_heads, dim)
    gate = torch.randn(tokens, heads * dim) * 2
    ctx = ForwardContext(
        slot_mapping=torch.tensor([3, 9, 16, 17, 18, 19, 20, 30, 31, 32]), num_decodes=decodes,
        decode_block_tables=torch.tensor([[0, 15], [1, 2]]), decode_context_lens=torch.tensor([4, 6]),
        prefills=[PrefillChunk(decodes, first, 0, torch.tensor([4, 5]), 0),
                  PrefillChunk(decodes + first, second, 6, torch.tensor([6, 7, 8]), 1)],
    )  # fmt: skip
    set_context(ctx)
    try:
        plain = layer(q, k, v)
        got = layer(q, k, v, gate=gate)  # writes the same keys and values again
    finally:
        set_context(None)
    assert torch.equal(got, sigmoid_gate(plain, gate))


def test_gated_attention_gates_in_the_core_on_decode_only_passes():
    """A pass of decode rows only hands the gate to the core (``project`` carries nothing to
    ``finish``), and the layer's output is what gating in ``finish`` gives; a pass with a
    prompt chunk keeps the gate for ``finish``."""
    from onecat.runtime.models.config import ModelConfig
    from onecat.runtime.models.qwen3_5 import GatedAttention
    from onecat.runtime.quant_plan import QuantPlan
    from onecat.tiny import _text_kwargs

    cfg = ModelConfig.from_dict({"model_type": "qwen3_5", **_text_kwargs("qwen3_5", 64, 4)})
    layer = GatedAttention(cfg, "model.layers.3.self_attn", QuantPlan(), torch.float32)
    gen = torch.Generator().manual_seed(4)
    for param in layer.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    shape = (6, BLOCK, layer.num_kv_heads, layer.head_dim)
    layer.attn.k_cache, layer.attn.v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    x = torch.randn(2, cfg.hidden_size, generator=gen)
    positions = torch.tensor([20, 4])
    ctx = ForwardContext(
        slot_mapping=torch.tensor([36, 84]), num_decodes=2,
        decode_block_tables=torch.tensor([[0, 2], [5, 1]]), decode_context_lens=torch.tensor([21, 5]),
    )  # fmt: skip
    set_context(ctx)
    try:
        inputs, carry = layer.project(positions, x)
        assert len(inputs) == 4 and carry == ()
        q, k, v, gate = inputs
        in_core = layer.finish(layer.core(q, k, v, gate))
        in_finish = layer.finish(layer.core(q, k, v), gate)
        assert torch.equal(layer(positions, x), in_core)
    finally:
        set_context(None)
    assert torch.equal(in_core, in_finish)
    set_context(ForwardContext(slot_mapping=torch.tensor([36, 84]), num_decodes=1, decode_block_tables=ctx.decode_block_tables[:1],
                               decode_context_lens=ctx.decode_context_lens[:1],
                               prefills=[PrefillChunk(1, 1, 4, torch.tensor([5, 1]), 0)]))
    try:
        inputs, carry = layer.project(positions, x)
    finally:
        set_context(None)
    assert len(inputs) == 3 and len(carry) == 1


def test_reference_reads_no_table_entry_past_a_context():
    q, k_cache, v_cache, tables, lens = paged_inputs([17, 5, 33], 4, 2, 32, seed=1)
    ref = attention.paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.2)
    stale = tables.clone()
    for b, n in enumerate(lens.tolist()):
        stale[b, math.ceil(n / BLOCK) :] = 10**9  # would raise if read
    assert torch.equal(attention.paged_decode_attention_reference(q, k_cache, v_cache, stale, lens, 0.2), ref)


def test_supports_and_argument_errors():
    assert attention.supports(torch.device("cuda", 0), torch.float16, 256, 16)
    assert not attention.supports(torch.device("cpu"), torch.float16, 256, 16)
    assert not attention.supports(torch.device("cuda", 0), torch.float32, 256, 16)
    assert not attention.supports(torch.device("cuda", 0), torch.float16, 96, 16)
    assert not attention.supports(torch.device("cuda", 0), torch.float16, 128, 24)
    q, k_cache, v_cache, tables, lens = paged_inputs([3], 4, 2, 32, seed=2)
    with pytest.raises(OnecatError, match="paged_decode_attention"):
        attention.paged_decode_attention(q.half(), k_cache.half(), v_cache.half(), tables, lens, 0.1)


def test_heads_per_block_covers_every_group():
    few = attention.FEW_KV_PAIRS  # a launch of few (sequence, KV head) pairs spreads its heads
    assert [attention.heads_per_block(g, few + 1) for g in (1, 2, 3, 4, 6, 8, 12, 16)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [attention.heads_per_block(g, few) for g in (1, 2, 3, 6, 8, 16)] == [1, 2, 2, 2, 2, 2]
    assert attention.heads_per_block(8, few + 1) == 8
    names = set(build.kernel_names("paged_attention"))
    for dim in attention.HEAD_DIMS:
        assert f"paged_attention_reduce_d{dim}" in names
        for ng in (1, 2, 4, 8):
            assert f"paged_attention_split_d{dim}_g{ng}" in names


def test_kernel_ptx_is_sm70_legal():
    ptx = build.compile_program("paged_attention", "compute_70").image.decode(errors="replace")
    for forbidden in ("cp.async", "ldmatrix", "bf16", "mma.sync.aligned.m16n8k16"):
        assert forbidden not in ptx


@pytest.mark.parametrize("num_heads, kv_heads", [(4, 2), (8, 8)])
def test_prefill_after_cached_tokens_in_query_blocks(monkeypatch, num_heads, kv_heads):
    """A prompt chunk after cached tokens: split into query blocks (the bound forced down to
    a few rows) it gives what plain causal attention over the whole sequence gives."""
    from onecat.runtime.layers import attention as attention_layer

    torch.manual_seed(0)
    dim, block, past, length = 16, 4, 13, 11
    layer = PagedAttention(num_heads, kv_heads, dim, dim**-0.5)
    total = past + length
    layer.k_cache = torch.randn(8, block, kv_heads, dim)
    layer.v_cache = torch.randn(8, block, kv_heads, dim)
    table = torch.tensor([5, 2, 7, 0, 3, 6, 1])  # covers 28 >= 24 tokens
    q = torch.randn(length, num_heads, dim)
    k_all, v_all = (c[table].reshape(-1, kv_heads, dim)[:total] for c in (layer.k_cache, layer.v_cache))
    group = num_heads // kv_heads
    q_all = torch.cat([torch.randn(past, num_heads, dim), q])
    expected = torch.nn.functional.scaled_dot_product_attention(
        q_all.transpose(0, 1), k_all.transpose(0, 1).repeat_interleave(group, 0),
        v_all.transpose(0, 1).repeat_interleave(group, 0), is_causal=True, scale=dim**-0.5,
    ).transpose(0, 1)[past:]
    for bound in (num_heads * total * 3, 1 << 25):  # 3-row blocks, then one block
        monkeypatch.setattr(attention_layer, "PREFILL_SCORE_ELEMENTS", bound)
        got = layer._prefill(q, k_all[past:], v_all[past:], past, table)
        assert torch.allclose(got, expected, atol=1e-5), bound


@pytest.mark.slow
def test_a_32k_token_prompt_runs_with_bounded_attention_scores(monkeypatch):
    """Issue 12: a 32k-token prompt prefills in chunks, and no attention call holds more
    scores than ``PREFILL_SCORE_ELEMENTS`` (the trained tiny model on CPU, ~16 s)."""
    import torch.nn.functional as F

    from onecat.runtime.config import EngineConfig
    from onecat.runtime.engine import LLMEngine
    from onecat.runtime.layers import attention as attention_layer
    from onecat.runtime.sampling_params import SamplingParams
    from onecat.tiny_train import fixture_dir

    largest = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, *args, **kwargs):
        largest.append(q.shape[-3] * q.shape[-2] * k.shape[-2])  # heads x queries x keys
        return sdpa(q, k, *args, **kwargs)

    monkeypatch.setattr(attention_layer.F, "scaled_dot_product_attention", recording)
    engine = LLMEngine(EngineConfig(model=str(fixture_dir("qwen3_5")), device="cpu", max_num_seqs=2,
                                    max_model_len=33000, max_num_batched_tokens=2048))
    prompt = torch.randint(3, 2000, (32768,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("long", prompt, SamplingParams(max_tokens=4, temperature=0.0))
    tokens = [t for _ in range(400) if engine.has_unfinished_requests() for out in engine.step() for t in out.new_token_ids]
    assert len(tokens) == 4 and not engine.has_unfinished_requests()
    assert max(largest) <= attention_layer.PREFILL_SCORE_ELEMENTS
    assert len(largest) > 16 * 2  # chunks after cached tokens were split into query blocks


@pytest.mark.parametrize("backend", ["MATH", "FLASH_ATTENTION"])
@pytest.mark.parametrize("num_heads, kv_heads, past", [(4, 2, 0), (6, 1, 13), (8, 8, 5)])
def test_prompt_attention_sdpa_matches_the_reference_path(monkeypatch, backend, num_heads, kv_heads, past):
    """The benchmarks' switch (``prompt_attention_sdpa``): one SDPA call per prompt chunk under
    the given backend (CPU: math and flash exist) gives the reference path's output, for a
    fresh chunk (upper-left mask) and after cached tokens (lower-right), through ``forward``
    with its output gate; the switch is off again after the block."""
    from torch.nn.attention import SDPBackend

    from onecat.runtime.layers import attention as attention_layer

    torch.manual_seed(1)
    dim, block, length = 16, 4, 11
    layer = PagedAttention(num_heads, kv_heads, dim, dim**-0.5)
    layer.k_cache = torch.randn(8, block, kv_heads, dim)
    layer.v_cache = torch.randn(8, block, kv_heads, dim)
    table = torch.tensor([5, 2, 7, 0, 3, 6, 1])
    q = torch.randn(length, num_heads, dim)
    k, v = torch.randn(length, kv_heads, dim), torch.randn(length, kv_heads, dim)
    gate = torch.randn(length, num_heads * dim)
    slots = torch.stack([table[p // block] * block + p % block for p in range(past, past + length)])
    ctx = ForwardContext(slot_mapping=slots, prefills=[PrefillChunk(0, length, past, table, 0)])
    set_context(ctx)
    try:
        expected = layer(q, k, v, gate=gate)
        calls = []
        for name in ("causal_lower_right", "causal_upper_left"):
            mask = getattr(attention_layer, name)
            monkeypatch.setattr(attention_layer, name, lambda *a, mask=mask, name=name: calls.append(name) or mask(*a))
        with attention_layer.prompt_attention_sdpa(getattr(SDPBackend, backend)):
            got = layer(q, k, v, gate=gate)
    finally:
        set_context(None)
    assert attention_layer._prompt_sdpa_backend is None
    assert calls == ["causal_lower_right" if past else "causal_upper_left"]
    assert torch.allclose(got, expected, atol=1e-5)
