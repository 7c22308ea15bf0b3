"""Repacking AutoAWQ GEMM tensors into the Volta layout on the weights' own device.

vLLM loads plain AWQ checkpoints through its parameter classes (so its tensor-parallel
sharding applies), and the plugin repacks each rank's slice once, in
``process_weights_after_loading``. ``onecat.pack.awq_gemm`` does the same unpacking with
CPU-only loops; these helpers are vectorised and run on the GPU that holds the weights.
"""

from __future__ import annotations

import torch

from onecat.pack.awq_gemm import AWQ_ORDER
from onecat.pack.volta_layout import pack_volta

# Column c of an 8-column word sits in nibble NIBBLE_OF_COLUMN[c].
NIBBLE_OF_COLUMN = tuple(AWQ_ORDER.index(c) for c in range(8))


def unpack_awq_words(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C]`` AutoAWQ words -> uint8 ``[R, 8*C]`` 4-bit values in column order."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    nibbles = (words.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF  # [R, C, 8] by nibble
    order = torch.tensor(NIBBLE_OF_COLUMN, dtype=torch.long, device=words.device)
    return nibbles.index_select(-1, order).to(torch.uint8).reshape(words.shape[0], -1)


def awq_to_integers(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ GEMM ``qweight [K, N/8]``, ``qzeros [K/g, N/8]``, ``scales [K/g, N]`` ->
    ``(q [N, K] uint8, zeros [N, K/g] uint8, scales [N, K/g] fp16)`` (onecat's contract)."""
    q = unpack_awq_words(qweight).t().contiguous()
    zeros = unpack_awq_words(qzeros).t().contiguous()
    return q, zeros, scales.t().contiguous().to(torch.float16)


def awq_to_volta(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ GEMM tensors -> Volta ``(qweight, scales_zeros)`` on the same device.

    Raises ValueError (from ``pack_volta``) when the shape does not fit the layout.
    """
    return pack_volta(*awq_to_integers(qweight, qzeros, scales))


def dequantize_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``W [N, K] = (q - z) * s`` in ``dtype``: the fallback for shapes the layout cannot hold."""
    q, zeros, s = awq_to_integers(qweight, qzeros, scales)
    group = q.shape[1] // zeros.shape[1]
    z = zeros.to(torch.float32).repeat_interleave(group, dim=1)
    s32 = s.to(torch.float32).repeat_interleave(group, dim=1)
    return ((q.to(torch.float32) - z) * s32).to(dtype)
