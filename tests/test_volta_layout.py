"""The Volta packed layout (version 1): mapping, bit-exact round trip, dequant contract."""

from __future__ import annotations

import pytest
import torch

from onecat.pack.volta_layout import (
    LANE_COLUMNS,
    LAYOUT_VERSION,
    check_scales,
    dequantize_volta,
    lane_to_column,
    pack_volta,
    reference_linear,
    unpack_volta,
)


def random_quantized(n: int, k: int, g: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    z = torch.randint(0, 16, (n, k // g), dtype=torch.uint8, generator=gen)
    # Realistic AWQ scales: (max - min) / 15 of weights around 1e-2, spread over decades.
    s = (10 ** (torch.rand(n, k // g, generator=gen) * 4 - 5)).to(torch.float16)
    return q, z, s


def test_layout_version_is_one():
    assert LAYOUT_VERSION == 1


def test_lane_to_column_matches_hand_computed_table():
    # m8n8k4 B .col rule, written out by hand: lanes 0-3 own columns 0-3, lanes 4-7 own
    # 8-11, 8-11 own 16-19, 12-15 own 24-27; lanes 16-31 the same plus 4.
    expected = [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27,
                4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31]  # fmt: skip
    assert [lane_to_column(lane) for lane in range(32)] == expected
    assert LANE_COLUMNS.tolist() == expected
    assert lane_to_column(torch.arange(32)).tolist() == expected


def test_packed_word_matches_hand_computed_example():
    # One 32x32 tile, group 32. Column 4 holds q[4, k] = k + 1 for k < 8 (lane 16, word 0),
    # column 9 holds q[9, 8 + i] = 15 - i (lane 5, word 1); everything else 0.
    q = torch.zeros(32, 32, dtype=torch.uint8)
    q[4, :8] = torch.arange(1, 9, dtype=torch.uint8)
    q[9, 8:16] = torch.arange(15, 7, -1, dtype=torch.uint8)
    z = torch.zeros(32, 1, dtype=torch.uint8)
    z[4, 0] = 3
    s = torch.full((32, 1), 0.5, dtype=torch.float16)
    qweight, scales_zeros = pack_volta(q, z, s)
    assert qweight.shape == (1, 1, 32, 4) and qweight.dtype == torch.int32
    assert scales_zeros.shape == (1, 1, 32, 2) and scales_zeros.dtype == torch.float16
    words = qweight.to(torch.int64) & 0xFFFFFFFF
    # nibbles j = 0..7 hold k offsets 0,2,4,6,1,3,5,7 -> values 1,3,5,7,2,4,6,8
    assert int(words[0, 0, 16, 0]) == 0x86427531
    # values 15-i at k offsets 0,2,4,6,1,3,5,7 -> 15,13,11,9,14,12,10,8
    assert int(words[0, 0, 5, 1]) == 0x8ACE9BDF
    nonzero = (words != 0).nonzero().tolist()
    assert nonzero == [[0, 0, 5, 1], [0, 0, 16, 0]]
    assert scales_zeros[0, 0, 16].tolist() == [0.5, -1.5]
    assert scales_zeros[0, 0, 0].tolist() == [0.5, 0.0]


@pytest.mark.parametrize("g", [32, 64, 128])
def test_round_trip_bit_exact(g):
    q, z, s = random_quantized(96, 512, g, seed=g)
    qweight, scales_zeros = pack_volta(q, z, s)
    assert qweight.shape == (3, 16, 32, 4)
    assert scales_zeros.shape == (3, 512 // g, 32, 2)
    q2, z2, s2 = unpack_volta(qweight, scales_zeros, g)
    assert torch.equal(q2, q) and torch.equal(z2, z)
    assert torch.equal(s2.view(torch.int16), s.view(torch.int16))


def all_finite_nonzero_fp16() -> torch.Tensor:
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = bits.view(torch.float16)
    return values[torch.isfinite(values) & (values != 0)]


def test_zero_point_recovered_for_every_fp16_scale_and_zero():
    # Exhaustive: every finite non-zero fp16 scale (subnormals included, both signs) and every
    # z in 0..15 for which -z*s stays in the fp16 range gives back z exactly.
    s = all_finite_nonzero_fp16()
    s = s.repeat_interleave(16)
    z = torch.arange(16, dtype=torch.uint8).repeat(s.numel() // 16)
    ok = torch.isfinite((-(z.float() * s.float())).half())
    s, z = s[ok], z[ok]
    assert s.numel() > 60000 * 15
    pad = (-s.numel()) % 32
    s = torch.cat([s, torch.ones(pad, dtype=torch.float16)]).reshape(-1, 1)
    z = torch.cat([z, torch.zeros(pad, dtype=torch.uint8)]).reshape(-1, 1)
    q = torch.zeros(s.shape[0], 32, dtype=torch.uint8)
    qweight, scales_zeros = pack_volta(q, z, s)
    _, z2, s2 = unpack_volta(qweight, scales_zeros, 32)
    assert torch.equal(z2, z)
    assert torch.equal(s2.view(torch.int16), s.view(torch.int16))


@pytest.mark.parametrize(
    "scale, message",
    [(0.0, "are zero"), (float("inf"), "inf or NaN"), (float("nan"), "inf or NaN"), (8000.0, "beyond")],
)
def test_unrecoverable_scales_are_refused(scale, message):
    q, z, s = random_quantized(32, 64, 32)
    z[3, 1] = 15
    s[3, 1] = scale
    with pytest.raises(ValueError, match=message):
        check_scales(z, s)
    with pytest.raises(ValueError, match=message):
        pack_volta(q, z, s)


def test_bad_shapes_and_values_are_refused():
    q, z, s = random_quantized(64, 128, 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_volta(q[:48], z[:48], s[:48])
    with pytest.raises(ValueError, match="above 15"):
        pack_volta(q + 16, z, s)
    with pytest.raises(ValueError, match="float16"):
        pack_volta(q, z, s.float())
    q16, z16, s16 = random_quantized(32, 64, 16)
    with pytest.raises(ValueError, match="group size 16"):
        pack_volta(q16, z16, s16)


def test_corrupted_zero_point_is_detected_on_unpack():
    q, z, s = random_quantized(32, 64, 32)
    qweight, scales_zeros = pack_volta(q, z, s)
    scales_zeros[0, 0, 0, 1] = -17 * scales_zeros[0, 0, 0, 0]
    with pytest.raises(ValueError, match="outside 0..15"):
        unpack_volta(qweight, scales_zeros, 32)


@pytest.mark.parametrize("g", [32, 128])
def test_dequant_contract_is_a_single_fp16_rounding(g):
    # Independent fp64 computation of fp16(q*s + fp16(-z*s)) from the integers.
    q, z, s = random_quantized(64, 256, g, seed=1)
    qweight, scales_zeros = pack_volta(q, z, s)
    w = dequantize_volta(qweight, scales_zeros, g)
    s64 = s.double().repeat_interleave(g, dim=1)
    z64 = z.double().repeat_interleave(g, dim=1)
    nzs = (-z64 * s64).half().double()
    expected = (q.double() * s64 + nzs).half()
    assert w.dtype == torch.float16
    assert torch.equal(w.view(torch.int16), expected.view(torch.int16))
    # and it differs from (q - z) * s by at most about one fp16 ulp of the group's range
    exact = (q.double() - z64) * s64
    assert float((w.double() - exact).abs().max()) <= float((16 * s64).max()) * 2**-10


@pytest.mark.parametrize("bias", [False, True])
def test_reference_linear_against_fp64(bias):
    g = 64
    q, z, s = random_quantized(128, 256, g, seed=2)
    s = (torch.rand(s.shape) * 0.01 + 1e-3).half()  # keep outputs in a useful fp16 range
    qweight, scales_zeros = pack_volta(q, z, s)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, 256, generator=gen).half()
    b = torch.randn(128, generator=gen).half() if bias else None
    y = reference_linear(x, qweight, scales_zeros, g, bias=b)
    assert y.shape == (5, 7, 128) and y.dtype == torch.float16
    s64 = s.double().repeat_interleave(g, dim=1)
    z64 = z.double().repeat_interleave(g, dim=1)
    w64 = (q.double() * s64 + (-z64 * s64).half().double()).half().double()
    expected = x.double() @ w64.t() + (b.double() if bias else 0)
    # Tolerance: one fp16 rounding of the output (2^-11 relative) plus fp32 accumulation.
    err = (y.double() - expected).abs()
    assert float((err / (expected.abs() + 1e-2)).max()) < 1e-3
