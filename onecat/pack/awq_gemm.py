"""The AutoAWQ "gemm" checkpoint format: packing and unpacking of 4-bit weights.

For a Linear with weight [N = out, K = in] and group size g (see awq.md):

- ``qweight`` [K, N/8] int32, packed along N: word c holds output channels 8c..8c+7 and
  nibble i (bits 4i..4i+3) holds channel ``8c + AWQ_ORDER[i]``;
- ``qzeros``  [K/g, N/8] int32, packed the same way, unsigned zero points 0..15;
- ``scales``  [K/g, N] fp16;
- dequantisation: ``w[n, k] = (q[n, k] - z[n, k // g]) * s[n, k // g]``.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Nibble i of a packed word holds channel 8c + AWQ_ORDER[i]."""


def pack_int4_columns(values: torch.Tensor) -> torch.Tensor:
    """Pack unsigned 4-bit values [R, N] into int32 words [R, N/8] in AutoAWQ's nibble order."""
    rows, cols = values.shape
    if cols % 8:
        raise ValueError(f"cannot pack {cols} columns: the count must divide by 8")
    v = values.to(torch.int64).reshape(rows, cols // 8, 8)  # [R, N/8, 8]
    word = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for nibble, channel in enumerate(AWQ_ORDER):
        word |= (v[:, :, channel] & 0xF) << (4 * nibble)
    # Reinterpret the low 32 bits as signed int32, as AutoAWQ stores them.
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32)


def unpack_int4_columns(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4_columns`: int32 [R, N/8] -> uint8 values [R, N]."""
    rows, packed = words.shape
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(rows, packed, 8, dtype=torch.uint8)
    for nibble, channel in enumerate(AWQ_ORDER):
        out[:, :, channel] = ((w >> (4 * nibble)) & 0xF).to(torch.uint8)
    return out.reshape(rows, packed * 8)


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


def unpack_awq_gemm(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpack AWQ GEMM tensors into (q [N, K] uint8, zeros [N, K/g] uint8, scales [N, K/g] fp16)."""
    q = unpack_int4_columns(qweight).t().contiguous()
    z = unpack_int4_columns(qzeros).t().contiguous()
    return q, z, scales.t().contiguous()


def dequantize_awq_gemm(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """Dequantise AWQ GEMM tensors to a float32 weight [N, K] as ``(q - z) * s``."""
    q, z, s = unpack_awq_gemm(qweight, qzeros, scales)
    group = q.shape[1] // z.shape[1]
    zf = z.to(torch.float32).repeat_interleave(group, dim=1)
    sf = s.to(torch.float32).repeat_interleave(group, dim=1)
    return (q.to(torch.float32) - zf) * sf


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
