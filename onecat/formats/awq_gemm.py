"""The AutoAWQ "gemm" checkpoint format: the one codec of its 4-bit tensors and config.

For a Linear with weight [N = out, K = in] and group size g (see awq.md):

- ``qweight`` [K, N/8] int32, packed along N: word c holds output channels 8c..8c+7 and
  nibble i (bits 4i..4i+3) holds channel ``8c + AWQ_ORDER[i]``;
- ``qzeros``  [K/g, N/8] int32, packed the same way, unsigned zero points 0..15;
- ``scales``  [K/g, N] fp16;
- dequantisation: ``w[n, k] = (q[n, k] - z[n, k // g]) * s[n, k // g]``.

Unpacking is vectorised and runs on the tensors' device (the vLLM plugin repacks on the GPU).
"""

from __future__ import annotations

from typing import Any

import torch

from onecat.errors import OnecatError
from onecat.formats.integers import dequantize, scales_to_fp16

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Nibble i of a packed word holds channel 8c + AWQ_ORDER[i]."""

NIBBLE_OF_COLUMN = tuple(AWQ_ORDER.index(c) for c in range(8))
"""Column c of an 8-column word sits in nibble NIBBLE_OF_COLUMN[c]."""

PARTS = ("qweight", "qzeros", "scales")
"""The tensors of one AWQ GEMM linear, ``PREFIX.<part>``."""


def pack_int4_columns(values: torch.Tensor) -> torch.Tensor:
    """Pack unsigned 4-bit values [R, N] into int32 words [R, N/8] in AutoAWQ's nibble order."""
    rows, cols = values.shape
    if cols % 8:
        raise ValueError(f"cannot pack {cols} columns: the count must divide by 8")
    v = values.to(torch.int64).reshape(rows, cols // 8, 8)  # [R, N/8, 8]
    word = torch.zeros(rows, cols // 8, dtype=torch.int64, device=values.device)
    for nibble, channel in enumerate(AWQ_ORDER):
        word |= (v[:, :, channel] & 0xF) << (4 * nibble)
    # Reinterpret the low 32 bits as signed int32, as AutoAWQ stores them.
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32)


def unpack_int4_columns(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4_columns`: int32 [R, N/8] -> uint8 values [R, N]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    nibbles = (words.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF  # [R, C, 8] by nibble
    order = torch.tensor(NIBBLE_OF_COLUMN, dtype=torch.long, device=words.device)
    return nibbles.index_select(-1, order).to(torch.uint8).reshape(words.shape[0], -1)


def pack_awq_gemm(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Pack integer weights q [N, K], zeros [N, K/g] and scales [N, K/g] into AWQ GEMM tensors.

    Returns ``{"qweight", "qzeros", "scales"}`` with AutoAWQ's shapes and dtypes.
    """
    n, k = q.shape
    if zeros.shape != scales.shape or zeros.shape[0] != n or k % zeros.shape[1]:
        raise ValueError(
            f"inconsistent shapes: q {tuple(q.shape)}, zeros {tuple(zeros.shape)}, "
            f"scales {tuple(scales.shape)}"
        )
    return {
        "qweight": pack_int4_columns(q.t().contiguous()),
        "qzeros": pack_int4_columns(zeros.t().contiguous()),
        "scales": scales.t().contiguous().to(torch.float16),
    }


def decode_awq_gemm(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, where: str = "AWQ linear"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ GEMM tensors -> ``(q [N, K], zeros [N, K/g], scales [N, K/g] fp16)``.

    OnecatError naming ``where`` when the dtypes or shapes are not AutoAWQ GEMM's, or a scale
    does not fit fp16.
    """
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dtype != torch.int32 or t.dim() != 2:
            raise OnecatError(
                f"{where}.{name} must be a 2-D int32 tensor, got {t.dtype} {tuple(t.shape)} "
                "(fused 3-D experts must be stored per expert)"
            )
    k, n8 = qweight.shape
    groups = qzeros.shape[0]
    if (
        qzeros.shape[1] != n8
        or scales.dim() != 2
        or tuple(scales.shape) != (groups, 8 * n8)
        or groups == 0
        or k % groups
    ):
        raise OnecatError(
            f"{where}: inconsistent AWQ GEMM shapes qweight {tuple(qweight.shape)}, qzeros "
            f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)} (expected [K, N/8], "
            "[K/g, N/8], [K/g, N])"
        )
    q = unpack_int4_columns(qweight).t().contiguous()
    z = unpack_int4_columns(qzeros).t().contiguous()
    return q, z, scales_to_fp16(scales.t().contiguous(), f"{where}.scales")


def dequantize_awq_gemm(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    where: str = "AWQ linear",
) -> torch.Tensor:
    """AWQ GEMM tensors to a weight [N, K] in ``dtype``, ``(q - z) * s``."""
    return dequantize(*decode_awq_gemm(qweight, qzeros, scales, where), dtype=dtype)


def check_awq_config(qc: dict[str, Any], where: str) -> int | None:
    """Validate an AutoAWQ ``quantization_config`` (4 bits, zero point, GEMM); returns its
    group size (None when it names none). OnecatError naming the field otherwise."""
    expected = "onecat reads 4-bit AutoAWQ GEMM checkpoints with zero points"
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise OnecatError(
            f"{where}: AWQ version {version!r} is not supported: {expected} (re-export with "
            "version='gemm')"
        )
    bits = qc.get("bits", qc.get("w_bit", 4))
    if bits != 4:
        raise OnecatError(f"{where}: AWQ bits={bits!r} is not supported: {expected}")
    if qc.get("zero_point", True) is not True:
        raise OnecatError(
            f"{where}: AWQ zero_point={qc.get('zero_point')!r} is not supported: {expected}"
        )
    group = qc.get("group_size", qc.get("q_group_size"))
    if group is None or group == -1:
        return None
    if not isinstance(group, int) or isinstance(group, bool) or group <= 0:
        raise OnecatError(f"{where}: AWQ group_size {group!r} must be a positive integer")
    return group


def awq_config(source_config: dict, group_size: int, not_convert: list[str]) -> dict:
    """``source_config`` (a config.json dict) plus AutoAWQ's GEMM ``quantization_config``."""
    config = dict(source_config)
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": list(not_convert),
    }
    return config
