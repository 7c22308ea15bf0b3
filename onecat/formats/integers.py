"""onecat's 4-bit integer contract, shared by every format (DEVELOPMENT.md, "Quantized integers").

A 4-bit linear with weight ``W [N = out, K = in]`` and group size ``g`` is ``q [N, K]`` uint8
0..15, ``zeros [N, K/g]`` uint8 0..15 and ``scales [N, K/g]`` fp16; its value is
``(q - z) * s``. The codecs (:mod:`~onecat.formats.awq_gemm`,
:mod:`~onecat.formats.compressed_tensors`, the Volta layout) turn their tensors into these
integers and back; :func:`dequantize` is the one way to a float weight, and
:func:`quantize_groups` the one way to integers by rounding to nearest (``onecat quantize``
and the runtime's 4-bit draft ``lm_head``).
"""

from __future__ import annotations

import logging

import torch

from onecat.errors import OnecatError

logger = logging.getLogger(__name__)

MAX_INT = 15  # 4 bits, unsigned


def group_size_of(q: torch.Tensor, zeros: torch.Tensor) -> int:
    """The group size of integers ``q [N, K]`` with ``zeros [N, K/g]``."""
    return q.shape[1] // zeros.shape[1]


def quantize_groups(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize W [N, K] (K % group_size == 0).

    Returns ``(q [N, K] uint8, zeros [N, K/g] uint8, scales [N, K/g] float32)``; the scales
    hold fp16-representable values (they may be inf if the weights overflow fp16: callers check).
    """
    n, k = w.shape
    wg = w.float().reshape(n, k // group_size, group_size)  # [N, G, g]
    scales, zeros = range_params(wg.amin(dim=-1), wg.amax(dim=-1))  # [N, G]
    q = (torch.round(wg / scales.unsqueeze(-1)) + zeros.unsqueeze(-1)).clamp(0, MAX_INT)
    return q.reshape(n, k).to(torch.uint8), zeros.to(torch.uint8), scales


def range_params(wmin: torch.Tensor, wmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, zeros)`` (float32; scales fp16-representable, zeros integers 0..15) of groups
    whose weights span ``[wmin, wmax]`` (any matching shapes)."""
    scales = ((wmax - wmin).clamp(min=1e-5) / MAX_INT).half().float()
    zeros = (-torch.round(wmin / scales)).clamp(0, MAX_INT)
    return scales, zeros


def dequantize(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``W [N, K] = (q - z) * s``, computed in float32 (exact for fp16 scales up to the final
    rounding) and returned in ``dtype``, on the integers' device."""
    n, k = q.shape
    groups = zeros.shape[1]
    qg = q.to(torch.float32).reshape(n, groups, k // groups)
    w = (qg - zeros.to(torch.float32).unsqueeze(-1)) * scales.to(torch.float32).unsqueeze(-1)
    return w.reshape(n, k).to(dtype)


def scales_to_fp16(scales: torch.Tensor, where: str) -> torch.Tensor:
    """Scales in fp16; OnecatError if a non-zero scale becomes 0 or inf in fp16, a debug log
    when the conversion rounds (bf16 / fp32 sources)."""
    if scales.dtype == torch.float16:
        return scales
    s32 = scales.to(torch.float32)
    s16 = s32.to(torch.float16)
    lost = ((s16 == 0) & (s32 != 0)) | (~torch.isfinite(s16) & torch.isfinite(s32))
    if bool(lost.any()):
        raise OnecatError(
            f"{where}: {int(lost.sum())} {scales.dtype} scales fall outside the fp16 range; "
            "this checkpoint cannot run in fp16 on a V100"
        )
    changed = s16.to(torch.float32) != s32
    if bool(changed.any()):
        rel = ((s16.to(torch.float32) - s32).abs() / s32.abs().clamp_min(1e-30)).max()
        logger.debug("%s: %s scales rounded to fp16 (max relative change %.2e)", where,
                     scales.dtype, float(rel))
    return s16
