"""Tensor-level conversions: AutoAWQ GEMM and compressed-tensors decoding against independent
element-by-element implementations, on-the-fly packing, and tensor-parallel slicing."""

from __future__ import annotations

import pytest
import torch

from onecat.errors import OnecatError
from onecat.formats.awq_gemm import decode_awq_gemm, pack_awq_gemm
from onecat.formats.compressed_tensors import decode_compressed_tensors
from onecat.pack.repack import awq_to_volta, compressed_tensors_to_volta
from onecat.pack.volta_layout import pack_volta, slice_volta, unpack_volta


def random_ints(n: int, k: int, g: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    z = torch.randint(0, 16, (n, k // g), dtype=torch.uint8, generator=gen)
    s = (torch.rand(n, k // g, generator=gen) * 0.01 + 1e-4).half()
    return q, z, s


def nibble(word: int, i: int) -> int:
    return ((word & 0xFFFFFFFF) >> (4 * i)) & 0xF


@pytest.mark.parametrize("g", [32, 64, 128])
def test_decode_awq_gemm_elementwise(g):
    n, k = 64, 256
    q, z, s = random_ints(n, k, g, seed=g)
    packed = pack_awq_gemm(q, z, s)
    # independent check of the AWQ GEMM convention on a few elements:
    # qweight[k, c] nibble i holds column 8c + [0,2,4,6,1,3,5,7][i]
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    for kk, c, i in [(0, 0, 0), (5, 3, 1), (255, 7, 7), (100, 2, 4)]:
        assert nibble(int(packed["qweight"][kk, c]), i) == int(q[8 * c + order[i], kk])
        assert nibble(int(packed["qzeros"][kk // g, c]), i) == int(z[8 * c + order[i], kk // g])
    q2, z2, s2 = decode_awq_gemm(packed["qweight"], packed["qzeros"], packed["scales"])
    assert torch.equal(q2, q) and torch.equal(z2, z) and torch.equal(s2, s)
    qweight, scales_zeros = awq_to_volta(packed["qweight"], packed["qzeros"], packed["scales"])
    expected = pack_volta(q, z, s)
    assert torch.equal(qweight, expected[0]) and torch.equal(scales_zeros, expected[1])


def ct_pack(values: torch.Tensor) -> torch.Tensor:
    """Element-by-element compressed-tensors packing: word c of row r, bits 4i..4i+3 = v[r, 8c+i]."""
    rows, cols = values.shape
    out = torch.zeros(rows, (cols + 7) // 8, dtype=torch.int64)
    for r in range(rows):
        for c in range(cols):
            out[r, c // 8] |= int(values[r, c]) << (4 * (c % 8))
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("g", [32, 64, 128])
def test_decode_compressed_tensors_elementwise(symmetric, g):
    n, k = 40, 128  # N = 40: zero points need a padded last word
    gen = torch.Generator().manual_seed(g + symmetric)
    q_signed = torch.randint(-8, 8, (n, k), generator=gen)
    zp_signed = torch.zeros(n, k // g, dtype=torch.int64)
    if not symmetric:
        zp_signed = torch.randint(-8, 8, (n, k // g), generator=gen)
    s = (torch.rand(n, k // g, generator=gen) * 0.01 + 1e-4).to(torch.bfloat16)
    packed = ct_pack(q_signed + 8)
    zp = None
    if not symmetric:
        padded = torch.zeros(48, k // g, dtype=torch.int64)
        padded[:n] = zp_signed + 8
        zp = ct_pack(padded.t()).t().contiguous()  # packed along N
    shape = torch.tensor([n, k])
    q, z, s16 = decode_compressed_tensors(packed, s, zp, shape)
    assert s16.dtype == torch.float16 and torch.equal(s16, s.half())
    # same value as compressed-tensors' (q_signed - zp_signed) * s, element by element
    ours = (q.long() - z.long().repeat_interleave(g, 1)) * s16.double().repeat_interleave(g, 1)
    theirs = (q_signed - zp_signed.repeat_interleave(g, 1)) * s.double().repeat_interleave(g, 1)
    assert torch.equal(ours, theirs)
    if symmetric:
        assert bool((z == 8).all())


def test_compressed_tensors_to_volta_matches_pack():
    q, z, s = random_ints(64, 128, 64, seed=5)
    packed = ct_pack(q.long())
    zp = ct_pack(z.long().t()).t().contiguous()
    qweight, scales_zeros = compressed_tensors_to_volta(packed, s, zp, torch.tensor([64, 128]))
    expected = pack_volta(q, z, s)
    assert torch.equal(qweight, expected[0]) and torch.equal(scales_zeros, expected[1])


def test_activation_ordering_is_refused():
    q, z, s = random_ints(32, 64, 32, seed=1)
    g_idx = torch.arange(64).flip(0) // 32
    with pytest.raises(OnecatError, match="actorder"):
        decode_compressed_tensors(ct_pack(q.long()), s, None, None, g_idx)
    trivial = torch.arange(64) // 32
    decode_compressed_tensors(ct_pack(q.long()), s, None, None, trivial)


def test_bad_awq_shapes_are_clear_errors():
    q, z, s = random_ints(32, 64, 32, seed=2)
    p = pack_awq_gemm(q, z, s)
    with pytest.raises(OnecatError, match="inconsistent AWQ GEMM shapes"):
        decode_awq_gemm(p["qweight"], p["qzeros"], p["scales"][:, :16], where="layer.x")
    with pytest.raises(OnecatError, match="layer.x.qweight must be a 2-D int32"):
        decode_awq_gemm(p["qweight"][None], p["qzeros"], p["scales"], where="layer.x")


def test_scales_out_of_fp16_range_are_refused():
    q, z, s = random_ints(32, 64, 32, seed=3)
    s32 = s.float()
    s32[0, 0] = 1e-10  # underflows to 0 in fp16
    with pytest.raises(OnecatError, match="outside the fp16 range"):
        decode_compressed_tensors(ct_pack(q.long()), s32)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("g", [32, 128])
def test_slice_volta_equals_packing_the_slice(world_size, g):
    n, k = 256, 512
    q, z, s = random_ints(n, k, g, seed=world_size * g)
    qweight, scales_zeros = pack_volta(q, z, s)
    for rank in range(world_size):
        cols = slice(rank * n // world_size, (rank + 1) * n // world_size)
        out = slice_volta(qweight, scales_zeros, g, "out", rank, world_size)
        expected = pack_volta(q[cols], z[cols], s[cols])
        assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])
        ks = slice(rank * k // world_size, (rank + 1) * k // world_size)
        gs = slice(rank * k // g // world_size, (rank + 1) * k // g // world_size)
        inp = slice_volta(qweight, scales_zeros, g, "in", rank, world_size)
        expected = pack_volta(q[:, ks].contiguous(), z[:, gs].contiguous(), s[:, gs].contiguous())
        assert torch.equal(inp[0], expected[0]) and torch.equal(inp[1], expected[1])
        assert torch.equal(unpack_volta(*inp, g)[0], q[:, ks])


def test_slice_volta_refuses_splits_across_tiles_or_groups():
    # 35B-A3B expert down_proj: K = 512 at g128 splits at most 4 ways
    q, z, s = random_ints(64, 512, 128, seed=4)
    qweight, scales_zeros = pack_volta(q, z, s)
    slice_volta(qweight, scales_zeros, 128, "in", 3, 4)
    with pytest.raises(ValueError, match="in_features 512 with group size 128 cannot be split 8"):
        slice_volta(qweight, scales_zeros, 128, "in", 0, 8)
    with pytest.raises(ValueError, match="out_features 64 cannot be split 4 ways"):
        slice_volta(qweight, scales_zeros, 128, "out", 0, 4)
    with pytest.raises(ValueError, match="dim must be"):
        slice_volta(qweight, scales_zeros, 128, "rows", 0, 2)
