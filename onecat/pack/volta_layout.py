"""The Volta packed layout, version 1: how 4-bit weights sit in memory for onecat's kernels.

A linear ``W [N = out, K = in]`` with group size ``g`` is stored as 32-column x 32-k tiles of
512 contiguous bytes in lane order, so a warp reads one tile with one 128-bit load per lane
and a column tile's whole K stream is contiguous (split-K ranges are contiguous too).

- ``qweight`` int32 ``[N/32, K/32, 32, 4]``. For column tile ``t``, k tile ``kt``, lane ``l``
  and word ``w``: the lane owns output column ``n = 32*t + lane_to_column(l)`` (the
  ``mma.m8n8k4`` B-fragment ``.col`` rule), word ``w`` holds ``k = 32*kt + 8*w + o`` and
  nibble ``j`` (bits 4j..4j+3) holds k offset ``o = NIBBLE_K_OFFSET[j] = [0,2,4,6,1,3,5,7][j]``,
  so the ``lop3`` magic-number trick yields the fp16 pairs (k0,k1), (k2,k3), (k4,k5), (k6,k7).
- ``scales_zeros`` fp16 ``[N/32, K/g, 32, 2]``: for (column tile, group, lane) the half2
  ``(s, fp16(-z*s))``, same lane -> column rule.
- Dequant contract (kernels and the CPU reference): ``w = fp16(q*s + fp16(-z*s))`` with a
  single rounding (``fma.rn.f16x2``). ``(q - z) * s`` differs from it by up to an fp16 ulp.

Requirements: ``N % 32 == 0``, ``K % 32 == 0``, ``g % 32 == 0``, ``K % g == 0``.

Zero points are not stored; :func:`unpack_volta` recovers them as ``round(-nzs / s)``, which
is exact for every ``z`` in 0..15 whenever ``s`` is finite and non-zero and ``-z*s`` does not
overflow fp16 (``fp16(-z*s)`` has a relative error of at most 2^-11, so ``-nzs/s`` is within
15 * 2^-11 < 0.5 of ``z``; subnormal products are exact multiples of 2^-24). :func:`pack_volta`
refuses scales that break this, so the round trip is bit-exact.

All functions are vectorised torch code on CPU tensors (they also work on CUDA tensors).
"""

from __future__ import annotations

import sys

import torch

LAYOUT_VERSION = 1
"""Version of this layout; stored in the packed artifact's metadata."""

FORMAT_NAME = "volta-w4"
"""Name of the packed format in the artifact's ``quantization_config.format``."""

TILE = 32
"""Columns and k values per tile."""

NIBBLE_K_OFFSET = (0, 2, 4, 6, 1, 3, 5, 7)
"""Nibble j of a word holds k offset NIBBLE_K_OFFSET[j] within the word's 8 k values."""

# Byte b of a little-endian word holds nibbles 2b (low half) and 2b+1 (high half).
_NIBBLE_K = torch.tensor(NIBBLE_K_OFFSET, dtype=torch.int64)  # nibble j -> k offset
_K_NIBBLE = torch.argsort(_NIBBLE_K)  # k offset -> nibble j

if sys.byteorder != "little":  # pragma: no cover - every CUDA host is little-endian
    raise ImportError("onecat's packed layout code assumes a little-endian host")


def lane_to_column(lane: int | torch.Tensor) -> int | torch.Tensor:
    """Output column (0..31, within a 32-column tile) owned by ``lane`` (0..31).

    The ``mma.m8n8k4`` ``.col`` rule: ``8*((l % 16) // 4) + (l % 4) + 4*(l >= 16)``.
    Works on ints and on integer tensors.
    """
    if isinstance(lane, torch.Tensor):
        return 8 * ((lane % 16) // 4) + (lane % 4) + 4 * (lane >= 16).to(lane.dtype)
    return 8 * ((lane % 16) // 4) + (lane % 4) + 4 * int(lane >= 16)


LANE_COLUMNS = torch.tensor([lane_to_column(lane) for lane in range(TILE)], dtype=torch.int64)
"""LANE_COLUMNS[l] = column owned by lane l (a permutation of 0..31)."""

COLUMN_LANES = torch.argsort(LANE_COLUMNS)
"""COLUMN_LANES[c] = lane that owns column c (inverse of LANE_COLUMNS)."""


def check_shape(n: int, k: int, group_size: int) -> None:
    """Raise ValueError unless ``[n, k]`` with group ``group_size`` fits the layout."""
    problems = []
    if n % TILE:
        problems.append(f"out_features {n} is not a multiple of {TILE}")
    if k % TILE:
        problems.append(f"in_features {k} is not a multiple of {TILE}")
    if group_size <= 0 or group_size % TILE:
        problems.append(f"group size {group_size} is not a positive multiple of {TILE}")
    elif k % group_size:
        problems.append(f"in_features {k} is not a multiple of the group size {group_size}")
    if problems:
        raise ValueError("Volta layout needs " + "; ".join(problems))


def fits_layout(n: int, k: int, group_size: int) -> bool:
    """True when a ``[n, k]`` linear with this group size can be stored in the layout."""
    try:
        check_shape(n, k, group_size)
    except ValueError:
        return False
    return True


def negative_zero_times_scale(zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``fp16(-z * s)``, rounded once (the product is exact in fp32)."""
    return (-(zeros.to(torch.float32) * scales.to(torch.float32))).to(torch.float16)


def check_scales(zeros: torch.Tensor, scales: torch.Tensor) -> None:
    """Raise ValueError when a zero point could not be recovered from ``(s, fp16(-z*s))``.

    That happens for ``s == 0``, a non-finite ``s``, or ``-z*s`` overflowing fp16.
    """
    s = scales.to(torch.float16)
    bad_zero = s == 0
    bad_finite = ~torch.isfinite(s)
    nzs = negative_zero_times_scale(zeros, s)
    bad_overflow = ~torch.isfinite(nzs) & ~bad_finite
    for mask, what in (
        (bad_zero, "are zero"),
        (bad_finite, "are inf or NaN"),
        (bad_overflow, "give -z*s beyond the fp16 range"),
    ):
        count = int(mask.sum())
        if count:
            where = tuple(int(i) for i in mask.nonzero()[0])
            raise ValueError(
                f"{count} scales {what} (first at [row, group] = {list(where)}, "
                f"s = {float(s[where])}): the zero point would not survive packing"
            )


def pack_volta(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack ``q [N, K]`` uint8 (0..15), ``zeros [N, K/g]`` uint8 (0..15) and ``scales [N, K/g]``
    fp16 into ``(qweight int32 [N/32, K/32, 32, 4], scales_zeros fp16 [N/32, K/g, 32, 2])``.

    Raises ValueError on shapes the layout cannot hold, values outside 0..15, or scales from
    which the zero point could not be recovered (see :func:`check_scales`).
    """
    if q.dim() != 2 or zeros.dim() != 2 or scales.dim() != 2:
        raise ValueError("q, zeros and scales must be 2-D")
    n, k = q.shape
    if zeros.shape != scales.shape or zeros.shape[0] != n or zeros.shape[1] == 0:
        raise ValueError(
            f"inconsistent shapes: q {tuple(q.shape)}, zeros {tuple(zeros.shape)}, "
            f"scales {tuple(scales.shape)}"
        )
    groups = zeros.shape[1]
    if k % groups:
        raise ValueError(f"in_features {k} is not a multiple of the group count {groups}")
    group_size = k // groups
    check_shape(n, k, group_size)
    if scales.dtype != torch.float16:
        raise ValueError(f"scales must be float16, got {scales.dtype}")
    for name, t in (("q", q), ("zeros", zeros)):
        if t.dtype != torch.uint8:
            raise ValueError(f"{name} must be uint8, got {t.dtype}")
        if t.numel() and int(t.max()) > 15:
            raise ValueError(f"{name} holds values above 15: not 4-bit integers")
    check_scales(zeros, scales)

    tiles_n, tiles_k = n // TILE, k // TILE
    lanes = LANE_COLUMNS.to(q.device)
    # [N/32, 32 columns, K/32, 4 words, 8 k] -> lane order -> [N/32, K/32, 32 lanes, 4, 8]
    v = q.reshape(tiles_n, TILE, tiles_k, 4, 8).index_select(1, lanes).permute(0, 2, 1, 3, 4)
    nibbles = v.index_select(-1, _NIBBLE_K.to(q.device)).reshape(*v.shape[:-1], 4, 2)
    packed_bytes = nibbles[..., 0] | (nibbles[..., 1] << 4)  # [.., 4 words, 4 bytes], uint8
    qweight = packed_bytes.view(torch.int32).reshape(tiles_n, tiles_k, TILE, 4)

    nzs = negative_zero_times_scale(zeros, scales)
    pair = torch.stack([scales, nzs], dim=-1)  # [N, G, 2]
    pair = pair.reshape(tiles_n, TILE, groups, 2).index_select(1, lanes).permute(0, 2, 1, 3)
    return qweight, pair.contiguous()


def _check_packed(qweight: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> None:
    if qweight.dtype != torch.int32 or qweight.dim() != 4 or tuple(qweight.shape[2:]) != (32, 4):
        raise ValueError(
            f"qweight must be int32 [N/32, K/32, 32, 4], got {qweight.dtype} {tuple(qweight.shape)}"
        )
    if (
        scales_zeros.dtype != torch.float16
        or scales_zeros.dim() != 4
        or tuple(scales_zeros.shape[2:]) != (32, 2)
    ):
        raise ValueError(
            "scales_zeros must be float16 [N/32, K/g, 32, 2], got "
            f"{scales_zeros.dtype} {tuple(scales_zeros.shape)}"
        )
    tiles_n, tiles_k = qweight.shape[:2]
    check_shape(tiles_n * TILE, tiles_k * TILE, group_size)
    expected = (tiles_n, tiles_k * TILE // group_size)
    if tuple(scales_zeros.shape[:2]) != expected:
        raise ValueError(
            f"scales_zeros {tuple(scales_zeros.shape)} does not match qweight "
            f"{tuple(qweight.shape)} with group size {group_size}"
        )


def unpack_volta_weights(qweight: torch.Tensor) -> torch.Tensor:
    """The 4-bit integers ``q [N, K]`` (uint8) of a packed ``qweight``."""
    tiles_n, tiles_k = qweight.shape[:2]
    b = qweight.contiguous().view(torch.uint8).reshape(tiles_n, tiles_k, TILE, 4, 4)
    nibbles = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(tiles_n, tiles_k, TILE, 4, 8)
    v = nibbles.index_select(-1, _K_NIBBLE.to(qweight.device))  # k order
    # [N/32, K/32, lanes, 4, 8] -> [N/32, lanes, K/32, 4, 8] -> columns
    v = v.permute(0, 2, 1, 3, 4).index_select(1, COLUMN_LANES.to(qweight.device))
    return v.reshape(tiles_n * TILE, tiles_k * TILE)


def unpack_scales_zeros(scales_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, nzs)``, each fp16 ``[N, K/g]`` in column order, from a packed ``scales_zeros``."""
    tiles_n, groups = scales_zeros.shape[:2]
    cols = scales_zeros.permute(0, 2, 1, 3).index_select(1, COLUMN_LANES.to(scales_zeros.device))
    cols = cols.reshape(tiles_n * TILE, groups, 2)
    return cols[..., 0].contiguous(), cols[..., 1].contiguous()


def unpack_volta(
    qweight: torch.Tensor, scales_zeros: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bit-exact inverse of :func:`pack_volta`: ``(q [N, K] uint8, zeros [N, K/g] uint8,
    scales [N, K/g] fp16)``.

    Raises ValueError if the packed data is inconsistent (a zero point outside 0..15, or a
    ``nzs`` that is not ``fp16(-z*s)`` for an integer ``z``): such tensors were not written by
    :func:`pack_volta`.
    """
    _check_packed(qweight, scales_zeros, group_size)
    q = unpack_volta_weights(qweight)
    s, nzs = unpack_scales_zeros(scales_zeros)
    z = torch.round(-nzs.to(torch.float32) / s.to(torch.float32))
    if not bool(torch.isfinite(z).all()) or bool(((z < 0) | (z > 15)).any()):
        raise ValueError("scales_zeros holds zero points outside 0..15 (or zero scales)")
    zeros = z.to(torch.uint8)
    if not torch.equal(negative_zero_times_scale(zeros, s), nzs):
        raise ValueError("scales_zeros holds a -z*s that is not fp16(-z*s) for an integer z")
    return q, zeros, s


def dequantize_volta(
    qweight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """The weight ``W [N, K]`` as the kernels see it: ``fp16(q*s + fp16(-z*s))``, one rounding.

    ``q*s + nzs`` is exact in fp32 (both terms are multiples of ulp(s) and smaller than
    2^16 ulp(s)), so rounding the fp32 sum to fp16 once is exactly ``fma.rn.f16x2``.
    The result is returned in ``dtype`` (converted from the fp16 values).
    """
    _check_packed(qweight, scales_zeros, group_size)
    q = unpack_volta_weights(qweight)
    s, nzs = unpack_scales_zeros(scales_zeros)
    n, k = q.shape
    groups = s.shape[1]
    w = q.reshape(n, groups, group_size).to(torch.float32)
    w = w * s.to(torch.float32).unsqueeze(-1) + nzs.to(torch.float32).unsqueeze(-1)
    return w.to(torch.float16).reshape(n, k).to(dtype)


def reference_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """CPU reference of the W4A16 linear: dequant contract, then ``x @ W.T (+ bias)`` in fp32.

    ``x [..., K]`` of any float dtype; returns ``[..., N]`` in ``x.dtype``.
    """
    w = dequantize_volta(qweight, scales_zeros, group_size, dtype=torch.float32)
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects {w.shape[1]}")
    y = x.to(torch.float32) @ w.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


def slice_volta(
    qweight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    dim: str,
    rank: int,
    world_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tensor-parallel slice of a packed linear, without unpacking.

    ``dim="out"`` splits N (column parallel: each rank gets ``N/world_size`` output columns),
    ``dim="in"`` splits K (row parallel: ``K/world_size`` inputs). The result equals packing
    the same slice of the integer weights, because tiles never straddle the split: N/world_size
    must be a multiple of 32, K/world_size a multiple of the group size (itself a multiple
    of 32). Raises ValueError naming the sizes otherwise. Returns contiguous tensors.
    """
    _check_packed(qweight, scales_zeros, group_size)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    tiles_n, tiles_k = qweight.shape[:2]
    n, k = tiles_n * TILE, tiles_k * TILE
    if dim == "out":
        if n % (TILE * world_size):
            raise ValueError(
                f"out_features {n} cannot be split {world_size} ways in 32-column tiles "
                f"(needs a multiple of {TILE * world_size})"
            )
        step = tiles_n // world_size
        rows = slice(rank * step, (rank + 1) * step)
        return qweight[rows].contiguous(), scales_zeros[rows].contiguous()
    if dim == "in":
        if k % (group_size * world_size):
            raise ValueError(
                f"in_features {k} with group size {group_size} cannot be split {world_size} "
                f"ways (needs a multiple of {group_size * world_size})"
            )
        k_tiles = tiles_k // world_size
        groups = k_tiles * TILE // group_size
        return (
            qweight[:, rank * k_tiles : (rank + 1) * k_tiles].contiguous(),
            scales_zeros[:, rank * groups : (rank + 1) * groups].contiguous(),
        )
    raise ValueError(f"dim must be 'out' or 'in', got {dim!r}")
