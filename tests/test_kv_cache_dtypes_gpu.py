"""GPU tests of the 8-bit KV caches (``--kv-cache-dtype fp8_e5m2 | int8``) in every kernel that
writes or reads the cache: ``attention_prep.cu`` (writes), ``paged_attention.cu`` (``split``
and ``split_prep``: reads, and the prep form writes the new token) and ``flash_prefill.cu``.

- Writing: the kernel's codes are bit-equal to the torch encoder's (``kv_cache.encode``) of the
  fp16 keys and values it computes (its ``fresh_kv`` outputs), its int8 scales equal within
  1e-6 relative; slots no row maps to keep their poison.
- Reading: every output is poisoned (NaN) first, and so are the cache rows past a sequence's
  tokens and the unused blocks (an fp8 NaN code, or an int8 row with a NaN scale, decodes to
  NaN); the result must be within fp16 rounding of fp64 attention over the DEQUANTIZED cache
  (``kv_cache.decode``: the same tolerance as the fp16 kernels' tests), and close to the
  fp16-cache kernel on the same (unquantized) keys and values: per sequence, the rms of the
  difference within ``LOOSE[fmt][0]`` of the rms of the output and its largest element within
  ``LOOSE[fmt][1]`` of it (random N(0, 1) keys and values, CPU-simulated: fp8 ~0.07 / 0.44,
  int8 ~0.01 / 0.04).

Shapes: Qwen3.5-27B's attention (24 query / 4 KV heads, head dim 256), head dim 128, one query
head per KV head; lengths 1 to 32k (decode) and 33k (prefill), chunks after cached prefixes,
ragged batches. Run with ``pytest -m gpu tests/test_kv_cache_dtypes_gpu.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from attention_prep_reference import reference_inputs
from test_attention_kernel_gpu import BLOCK, check, gated, lengths_for, make_inputs, reference
from test_attention_prep_gpu import QWEN_27B, QWEN_35B_A3B, make_case
from test_flash_prefill_gpu import paged, reference_rows, sample_rows

from onecat.kernels import attention as attention_kernel
from onecat.kernels import attention_prep, kv_cache
from onecat.kernels import flash_prefill as fp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
FORMATS = ("fp8_e5m2", "int8")
LOOSE = {"fp8_e5m2": (0.12, 1.0), "int8": (0.02, 0.15)}
INT8_POISON = -128  # a code the encoder never writes (it clamps to +-127)


def encode_cache(cache: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(codes, scales)`` of an fp16 cache ``[blocks, bs, KVH, D]`` (NaN rows stay poison: an
    fp8 NaN code, or int8 codes 0 with a NaN scale)."""
    data, scales = kv_cache.encode(cache, fmt)
    return data.contiguous(), None if scales is None else scales.contiguous()


def decoded(data: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """The cache's values in fp64 (what the reference attends over)."""
    return kv_cache.decode(data, scales, torch.float32).double()


def close_to_fp16_cache(out: torch.Tensor, fp16_out: torch.Tensor, fmt: str, what: str) -> None:
    """Per row of ``[B or T, H, D]``: rms(out - fp16_out) <= LOOSE[0] rms(fp16_out) and
    max |out - fp16_out| <= LOOSE[1] rms(fp16_out)."""
    err = (out.double() - fp16_out.double()).flatten(1)
    rms = fp16_out.double().flatten(1).pow(2).mean(1).sqrt().clamp_min(1e-6)
    rel_rms = err.pow(2).mean(1).sqrt() / rms
    rel_max = err.abs().amax(1) / rms
    bound_rms, bound_max = LOOSE[fmt]
    assert (rel_rms <= bound_rms).all() and (rel_max <= bound_max).all(), (
        f"{what}: {fmt} cache against the fp16 cache: rms ratio up to {rel_rms.max().item():.4f} (bound "
        f"{bound_rms}), max ratio up to {rel_max.max().item():.4f} (bound {bound_max})"
    )


# --- the cache-writing kernel -----------------------------------------------------------------


def poisoned_cache(shape: tuple[int, ...], fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    if fmt == "fp8_e5m2":
        return torch.full(shape, 0xFF, dtype=torch.uint8, device="cuda"), None  # a NaN code
    scales = torch.full(shape[:3], float("nan"), dtype=torch.float32, device="cuda")
    return torch.full(shape, INT8_POISON, dtype=torch.int8, device="cuda"), scales


def assert_codes_match(got: torch.Tensor, want: torch.Tensor, fmt: str, what: str) -> None:
    """fp8 codes bit-equal to the torch encoder's; int8 codes within one step of them in at
    most 1% of the values (measured on the H200: the kernel's codes and torch's CUDA encoder's
    part by one step at some code boundaries while their scales agree to 1e-6)."""
    if fmt == "fp8_e5m2":
        assert torch.equal(got, want), f"{what}: codes differ from the torch encoder's"
        return
    diff = (got.int() - want.int()).abs()
    share = (diff > 0).float().mean().item()
    assert diff.max().item() <= 1 and share <= 0.01, (
        f"{what}: int8 codes differ from the torch encoder's by up to {diff.max().item()} in {share:.2%} of values")


def check_written(cache, scales, slots, fresh, fmt, what):
    """Rows at ``slots`` hold ``kv_cache.encode(fresh)`` (codes bit-equal, scales within 1e-6
    relative); every other row its poison."""
    kv_heads, dim = cache.shape[2:]
    flat = cache.view(-1, kv_heads, dim)
    valid = (slots >= 0) & (slots < flat.shape[0])
    rows = slots[valid]
    want, want_scales = kv_cache.encode(fresh[valid], fmt)
    assert_codes_match(flat[rows], want, fmt, what)
    untouched = torch.ones(flat.shape[0], dtype=torch.bool, device="cuda")
    untouched[rows] = False
    poison = 0xFF if fmt == "fp8_e5m2" else INT8_POISON
    assert bool((flat[untouched] == poison).all()), f"{what}: a row no token maps to was written"
    if scales is not None:
        flat_scales = scales.view(-1, kv_heads)
        torch.testing.assert_close(flat_scales[rows], want_scales, rtol=1e-6, atol=0, msg=f"{what}: scales")
        assert bool(flat_scales[untouched].isnan().all()), f"{what}: a scale no token maps to was written"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("shape", [QWEN_27B, QWEN_35B_A3B, (8, 8, 128, 128), (4, 2, 64, 32)],
                         ids=["27B", "35B-A3B", "d128", "d64"])  # fmt: skip
def test_cache_writing_kernel_encodes_as_the_torch_encoder(fmt, tokens, shape):
    heads, kv_heads, dim, rot = shape
    qkv, positions, q_w, k_w, inv_freq, slots, k16, _ = make_case(tokens, heads, kv_heads, dim, rot, seed=tokens)
    if tokens > 2:
        slots[2] = -1  # a padding row writes nothing
    k_cache, k_scale = poisoned_cache(k16.shape, fmt)
    v_cache, v_scale = poisoned_cache(k16.shape, fmt)
    q, k, v = attention_prep.prepare_attention_inputs(
        qkv, positions, q_w, k_w, inv_freq, 1e-6, slots, k_cache, v_cache, heads, kv_heads, dim, rot,
        fresh_kv=True, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    torch.cuda.synchronize()
    what = f"attention_prep {fmt} T={tokens} H={heads}/{kv_heads} D={dim}"
    assert torch.isfinite(q).all() and torch.isfinite(k).all(), what
    check_written(k_cache, k_scale, slots, k, fmt, f"{what} keys")
    check_written(v_cache, v_scale, slots, v, fmt, f"{what} values")
    # the fp16 keys it encodes are the fp16 cache's (the same launch into an fp16 cache)
    q16, k16_out, _ = attention_prep.prepare_attention_inputs(
        qkv, positions, q_w, k_w, inv_freq, 1e-6, slots, k16, k16.clone(), heads, kv_heads, dim, rot, fresh_kv=True,
    )  # fmt: skip
    assert torch.equal(q16, q) and torch.equal(k16_out, k), what


def test_int8_scale_of_an_all_zero_row_is_zero():
    heads, kv_heads, dim, rot = QWEN_27B
    qkv, positions, q_w, k_w, inv_freq, slots, k16, _ = make_case(3, heads, kv_heads, dim, rot, seed=5)
    qkv[:, (2 * heads + kv_heads) * dim :] = 0  # every value row is zero
    k_cache, k_scale = poisoned_cache(k16.shape, "int8")
    v_cache, v_scale = poisoned_cache(k16.shape, "int8")
    attention_prep.prepare_attention_inputs(qkv, positions, q_w, k_w, inv_freq, 1e-6, slots, k_cache, v_cache, heads,
                                            kv_heads, dim, rot, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    torch.cuda.synchronize()
    assert bool((v_scale.view(-1, kv_heads)[slots] == 0).all())
    assert bool((v_cache.view(-1, kv_heads, dim)[slots] == 0).all())


# --- the decode kernel ------------------------------------------------------------------------


DECODE_SHAPES = [(1, 24, 4, 256), (8, 24, 4, 256), (5, 16, 2, 256), (4, 8, 8, 128), (3, 24, 4, 128)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("splits", [1, 7, None])
@pytest.mark.parametrize("batch, num_heads, kv_heads, dim", DECODE_SHAPES)
def test_decode_matches_fp64_over_the_dequantized_cache(fmt, splits, batch, num_heads, kv_heads, dim):
    lengths = lengths_for(batch, 1)  # 1 .. 32768 tokens, ragged
    q, k16, v16, tables, lens = make_inputs(lengths, num_heads, kv_heads, dim, seed=batch + dim)
    k_cache, k_scale = encode_cache(k16, fmt)
    v_cache, v_scale = encode_cache(v16, fmt)
    scale = dim**-0.5
    out = torch.full(q.shape, float("nan"), dtype=torch.float16, device="cuda")
    attention_kernel.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, out=out, splits=splits,
                                            k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    torch.cuda.synchronize()
    what = f"decode {fmt} splits={splits} B={batch} H={num_heads}/{kv_heads} D={dim}"
    ref = reference(q, decoded(k_cache, k_scale), decoded(v_cache, v_scale), tables, lens, scale)
    check(out, ref, lens, what)
    fp16_out = attention_kernel.paged_decode_attention(q, k16, v16, tables, lens, scale, splits=splits)
    close_to_fp16_cache(out, fp16_out, fmt, what)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_with_the_output_gate(fmt):
    batch, num_heads, kv_heads, dim = 6, 24, 4, 256
    lengths = lengths_for(batch, 2)
    q, k16, v16, tables, lens = make_inputs(lengths, num_heads, kv_heads, dim, seed=11)
    k_cache, k_scale = encode_cache(k16, fmt)
    v_cache, v_scale = encode_cache(v16, fmt)
    gen = torch.Generator(device="cuda").manual_seed(3)
    wide = torch.full((batch, num_heads, 2 * dim), float("nan"), dtype=torch.float16, device="cuda")
    wide[..., dim:] = (torch.randn(batch, num_heads, dim, generator=gen, device="cuda") * 3).half()
    gate = wide[..., dim:]
    out = torch.full(q.shape, float("nan"), dtype=torch.float16, device="cuda")
    attention_kernel.paged_decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5, out=out, gate=gate,
                                            k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    torch.cuda.synchronize()
    ref = gated(reference(q, decoded(k_cache, k_scale), decoded(v_cache, v_scale), tables, lens, dim**-0.5), gate)
    check(out, ref, lens, f"decode {fmt} with the gate")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("splits", [1, 7, None])
@pytest.mark.parametrize("batch, num_heads, kv_heads, dim, rot",
                         [(1, 24, 4, 256, 64), (8, 24, 4, 256, 64), (32, 16, 2, 256, 64), (3, 4, 4, 128, 128)])
def test_prep_form_writes_the_new_token_encoded_and_attends_over_it(fmt, splits, batch, num_heads, kv_heads, dim,
                                                                     rot):  # fmt: skip
    """``split_prep`` over an 8-bit cache: the new token's rows (poisoned before the call) hold
    the encoding of its fp16 key / value (the key within fp16 rounding of the fp64 contract,
    then encoded: within the encoding's step of it; the value's codes bit-equal to the
    encoder's), every other row is unchanged, and the output is fp64 attention over the cache
    as the kernel left it (decoded), gated."""
    lengths = lengths_for(batch, 2)
    _, k16, v16, tables, lens = make_inputs(lengths, num_heads, kv_heads, dim, seed=batch + dim + rot)
    k_cache, k_scale = encode_cache(k16, fmt)
    v_cache, v_scale = encode_cache(v16, fmt)
    gen = torch.Generator(device="cuda").manual_seed(rot + 1)
    width = 2 * (num_heads + kv_heads) * dim
    qkv = torch.randn(batch, width + 8, generator=gen, device="cuda").half()[:, :width]
    q_weight = torch.randn(dim, generator=gen, device="cuda") * 0.1
    k_weight = torch.randn(dim, generator=gen, device="cuda") * 0.1
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, device="cuda").float() / max(rot, 1)))
    positions = lens - 1
    slots = tables.gather(1, (positions // BLOCK).unsqueeze(1)).squeeze(1) * BLOCK + positions % BLOCK
    q64, k64, v64 = reference_inputs(qkv, positions, q_weight, k_weight, inv_freq, 1e-6, num_heads, kv_heads, dim, rot)
    flat = lambda t: t.view(-1, *t.shape[2:])  # noqa: E731
    before = [flat(t).clone() for t in (k_cache, v_cache)] + [flat(t).clone() for t in (k_scale, v_scale) if t is not None]
    poison = 0xFF if fmt == "fp8_e5m2" else INT8_POISON
    flat(k_cache)[slots], flat(v_cache)[slots] = poison, poison
    if k_scale is not None:
        flat(k_scale)[slots], flat(v_scale)[slots] = float("nan"), float("nan")
    out = torch.full((batch, num_heads, dim), float("nan"), dtype=torch.float16, device="cuda")
    attention_kernel.paged_decode_attention_prep(
        qkv, positions, q_weight, k_weight, inv_freq, 1e-6, rot, slots, k_cache, v_cache, tables, lens, dim**-0.5,
        num_heads, out=out, splits=splits, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    torch.cuda.synchronize()
    what = f"prep form {fmt} splits={splits} B={batch} H={num_heads}/{kv_heads} D={dim} rot={rot}"
    new_k = decoded(flat(k_cache)[slots], None if k_scale is None else flat(k_scale)[slots])
    assert torch.isfinite(new_k).all(), f"{what}: the new keys were not written"
    # one encoding step (the kernel's fp16 key may round one ulp apart from the contract's, and
    # move a code across a rounding boundary) plus attention_prep_reference's fp16 tolerance
    step = new_k.abs().amax(-1, keepdim=True) / 127 if fmt == "int8" else k64.abs() * 2**-3
    rms = k64.pow(2).mean(-1, keepdim=True).sqrt()
    assert ((new_k - k64).abs() <= step + 2e-3 * k64.abs() + 4e-3 * rms).all(), f"{what}: new keys"
    data, scales = kv_cache.encode(v64.half(), fmt)
    assert_codes_match(flat(v_cache)[slots], data, fmt, f"{what}: new values")
    if scales is not None:
        torch.testing.assert_close(flat(v_scale)[slots], scales, rtol=1e-6, atol=0)
    untouched = torch.ones(flat(k_cache).shape[0], dtype=torch.bool, device="cuda")
    untouched[slots] = False
    after = [flat(t) for t in (k_cache, v_cache)] + [flat(t) for t in (k_scale, v_scale) if t is not None]
    for b, a in zip(before, after, strict=True):
        torch.testing.assert_close(a[untouched], b[untouched], rtol=0, atol=0, equal_nan=True,
                                   msg=f"{what}: other cache rows changed")  # fmt: skip
    gate = qkv[:, : 2 * num_heads * dim].view(batch, num_heads, 2 * dim)[..., dim:]
    ref = gated(reference(q64, decoded(k_cache, k_scale), decoded(v_cache, v_scale), tables, lens, dim**-0.5), gate)
    check(out, ref, lens, what, tol=4e-3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_runtime_layer_decode_kernel_matches_its_torch_path(fmt):
    from onecat.runtime.context import ForwardContext, set_context
    from onecat.runtime.layers.attention import PagedAttention

    batch, num_heads, kv_heads, dim = 4, 24, 4, 256
    q, k16, v16, tables, lens = make_inputs([5, 300, 17, 2048], num_heads, kv_heads, dim, seed=21)
    k16, v16 = k16.nan_to_num(), v16.nan_to_num()  # SDPA's masked p @ v would turn poison into NaN
    layer = PagedAttention(num_heads, kv_heads, dim, dim**-0.5)
    layer.k_cache, layer.k_scale = encode_cache(k16, fmt)
    layer.v_cache, layer.v_scale = encode_cache(v16, fmt)
    assert layer.uses_decode_kernel()
    ctx = ForwardContext(slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device="cuda"), num_decodes=batch,
                         decode_block_tables=tables, decode_context_lens=lens)  # fmt: skip
    set_context(ctx)
    try:
        kernel = layer._decode(q, ctx)
        torch_path = layer._decode_torch(q, ctx)
    finally:
        set_context(None)
    check(kernel, torch_path.double(), lens, f"layer decode {fmt}", tol=4e-3)


# --- the prefill kernel -----------------------------------------------------------------------


PREFILL_HEADS = [(24, 4, 256), (24, 4, 128), (4, 4, 128)]


def run_prefill(fmt, lengths, past, num_heads, kv_heads, dim, seed=0, variant=None):
    """The fp16 test's case (test_flash_prefill_gpu.paged: NaN past each sequence's tokens and in
    spare blocks) with the cache encoded; checks fp64 over the decoded cache and the fp16 kernel."""
    q, k16, v16, tables, starts = paged(lengths, past, num_heads, kv_heads, dim, seed)
    k_cache, k_scale = encode_cache(k16, fmt)
    v_cache, v_scale = encode_cache(v16, fmt)
    # the kernel decodes each K/V tile into fp16 shared memory: it attends over fp16(q * s)
    k64, v64 = (decoded(c, sc).half().double() for c, sc in ((k_cache, k_scale), (v_cache, v_scale)))
    scale = dim**-0.5
    batch = fp.prefill_attention_batch(starts, lengths, past, num_heads // kv_heads, q.device, tables)
    out = torch.full_like(q, float("nan"))
    fp.flash_prefill_attention(q, k_cache, v_cache, batch, scale, out=out, variant=variant or fp.DEFAULT_VARIANT,
                               k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    fp16_out = fp.flash_prefill_attention(q, k16, v16, batch, scale, variant=variant or fp.DEFAULT_VARIANT)
    torch.cuda.synchronize()
    assert torch.isnan(out[: starts[0]]).all(), "rows outside the chunks were written"
    for s, (start, length, p) in enumerate(zip(starts, lengths, past, strict=True)):
        rows = sample_rows(length)
        got = out[start + rows].double()
        what = f"prefill {fmt} sequence {s} (L={length}, P={p}, H={num_heads}/{kv_heads}, D={dim})"
        assert torch.isfinite(got).all(), f"{what}: non-finite output"
        ref = reference_rows(q, k64, v64, tables[s], start, length, p, scale, rows)
        err = (got - ref).abs()
        tol = 2e-3 * ref.abs() + 2e-3 * ref.pow(2).mean(dim=(1, 2), keepdim=True).sqrt()
        assert (err <= tol).all(), f"{what}: max err {err.max().item():.3e} against fp64 over the decoded cache"
        close_to_fp16_cache(got, fp16_out[start + rows], fmt, what)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads", PREFILL_HEADS)
@pytest.mark.parametrize("length", [1, 2, 11, 64, 65, 333, 4097])
def test_prefill_one_prompt_matches_fp64(fmt, heads, length):
    run_prefill(fmt, [length], [0], *heads, seed=length)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads", [(24, 4, 256), (4, 4, 128)])
def test_prefill_a_33k_token_prompt_matches_fp64(fmt, heads):
    run_prefill(fmt, [33000], [0], *heads, seed=33)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads", PREFILL_HEADS[:2])
@pytest.mark.parametrize("length, past", [(1, 16), (1, 31), (63, 1000), (500, 8191), (2048, 30000)])
def test_prefill_a_chunk_after_cached_tokens_matches_fp64(fmt, heads, length, past):
    run_prefill(fmt, [length], [past], *heads, seed=length + past)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("variant", fp.VARIANTS)
@pytest.mark.parametrize("heads", PREFILL_HEADS)
def test_prefill_a_ragged_batch_in_one_launch_matches_fp64(fmt, heads, variant):
    run_prefill(fmt, [1, 700, 64, 3000, 5, 129], [0, 129, 5000, 0, 33, 16], *heads, seed=7, variant=variant)


@pytest.mark.parametrize("fmt", FORMATS)
def test_runtime_layer_prefill_kernel_matches_its_torch_path(fmt):
    """A prompt chunk after cached tokens through ``PagedAttention.forward`` (the kernel) and
    ``_prefill`` (the torch reference path) over the same 8-bit cache."""
    from onecat.runtime.context import ForwardContext, PrefillChunk, set_context
    from onecat.runtime.layers.attention import PagedAttention

    heads, kv_heads, dim, past, length = 24, 4, 256, 700, 300
    total = past + length
    layer = PagedAttention(heads, kv_heads, dim, dim**-0.5)
    num_blocks = math.ceil(total / BLOCK) + 3
    gen = torch.Generator(device="cuda").manual_seed(4)
    k16 = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=gen, device="cuda").half()
    v16 = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=gen, device="cuda").half()
    layer.k_cache, layer.k_scale = encode_cache(k16, fmt)
    layer.v_cache, layer.v_scale = encode_cache(v16, fmt)
    assert layer.uses_prefill_kernel(torch.zeros(1, dtype=torch.float16, device="cuda"))
    table = torch.randperm(num_blocks, generator=gen, device="cuda")[: math.ceil(total / BLOCK)]
    k_all, v_all = layer._gather(table, torch.float16)
    q = torch.randn(length, heads, dim, generator=gen, device="cuda").half()
    set_context(ForwardContext(slot_mapping=torch.full((length,), -1, dtype=torch.int64, device="cuda"),
                               prefills=[PrefillChunk(0, length, past, table, 0)]))  # fmt: skip
    try:
        kernel = layer(q, k_all[past:total], v_all[past:total], stored=True)
    finally:
        set_context(None)
    torch_path = layer._prefill(q, k_all[past:total], v_all[past:total], past, table)
    assert torch.isfinite(kernel).all()
    ref = torch_path.double()
    assert ((kernel.double() - ref).abs() <= 4e-3 * ref.abs() + 4e-3 * ref.pow(2).mean().sqrt()).all()


# --- the engine -------------------------------------------------------------------------------


WIDE_HEADS = {"head_dim": 256, "num_attention_heads": 6, "num_key_value_heads": 1}


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """A tiny random Qwen3.5 whose attention has Qwen3.5's head dim (256), so that every
    kernel path runs on it: the input kernel, the decode kernel's prep form and graphs, the
    flash prefill kernel (the random tiny model has no MTP head: speculation over a quantized
    cache is ``test_kv_cache_dtypes.py``'s, on the torch path)."""
    from onecat.tiny import build_tiny_model

    return build_tiny_model("qwen3_5", tmp_path_factory.mktemp("kvdtype-gpu") / "wide", config_overrides=WIDE_HEADS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_engine_on_the_gpu_matches_the_cpu_engine_with_the_same_cache(wide_model, fmt):
    """The CUDA engine (fp16, CUDA graphs, prefix cache on, a shared prefix that hits it)
    against the CPU engine (fp32, the torch path) with the same
    --kv-cache-dtype: logits within 2e-2 of the largest while the tokens agree, which may part
    only at near ties (``assert_same_greedy_runs``, relative), every logit finite."""
    from runtime_helpers import assert_same_greedy_runs, drain, record_logits

    from onecat.runtime.config import EngineConfig
    from onecat.runtime.engine import LLMEngine
    from onecat.runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(9)
    prefix = torch.randint(3, 500, (40,), generator=gen).tolist()
    prompts = {"a": prefix + [7, 8, 9], "b": torch.randint(3, 500, (300,), generator=gen).tolist(), "c": prefix + [7, 8, 9, 11]}

    def run(device):
        engine = LLMEngine(EngineConfig(model=str(wide_model), device=device, max_num_seqs=4, max_model_len=1024,
                                        kv_cache_memory_bytes=256 << 20, kv_cache_dtype=fmt, state_checkpoint_interval=16))  # fmt: skip
        logits = record_logits(engine)
        tokens = {}
        for wave in (["a", "b"], ["c"]):  # c continues a's prompt: hits its last full block
            for rid in wave:
                engine.add_request(rid, prompts[rid], params)
            for rid, outs in drain(engine).items():
                tokens[rid] = [t for o in outs for t in o.new_token_ids]
        stats = engine.stats()
        rows = {rid: torch.stack([r.float().cpu() for r in rows]) for rid, rows in logits.items()}
        return (tokens, rows), stats

    (cpu, _), (gpu, stats) = run("cpu"), run("cuda")
    assert stats["prefix_cache_hits"] > 0
    for rows in gpu[1].values():
        assert torch.isfinite(rows).all()
    assert_same_greedy_runs(cpu, gpu, 2e-2, relative=True, label=f"{fmt} GPU vs CPU")
