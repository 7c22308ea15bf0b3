"""4-bit checkpoint tensors -> the Volta layout on the fly (for loaders of unpacked checkpoints).

``onecat pack`` repacks once, on disk; the runtime loader and the vLLM plugin repack while
loading an AutoAWQ GEMM or compressed-tensors checkpoint, through these functions.
"""

from __future__ import annotations

import torch

from onecat.errors import OnecatError
from onecat.formats.awq_gemm import decode_awq_gemm
from onecat.formats.compressed_tensors import decode_compressed_tensors
from onecat.pack.volta_layout import pack_volta


def to_volta(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, where: str = "linear"
) -> tuple[torch.Tensor, torch.Tensor]:
    """onecat's integers -> ``(qweight [N/32, K/32, 32, 4] int32, scales_zeros [N/32, K/g, 32,
    2] fp16)``; OnecatError naming ``where`` when the shape does not fit the layout."""
    try:
        return pack_volta(q, zeros, scales)
    except ValueError as exc:
        raise OnecatError(f"{where}: cannot pack it into the Volta layout: {exc}") from None


def awq_to_volta(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, where: str = "AWQ linear"
) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ GEMM tensors -> Volta ``(qweight, scales_zeros)`` on the tensors' device."""
    return to_volta(*decode_awq_gemm(qweight, qzeros, scales, where), where=where)


def compressed_tensors_to_volta(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None = None,
    weight_shape: torch.Tensor | None = None,
    where: str = "compressed-tensors linear",
) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors ``pack-quantized`` tensors -> Volta ``(qweight, scales_zeros)``."""
    integers = decode_compressed_tensors(
        weight_packed, weight_scale, weight_zero_point, weight_shape, where=where
    )
    return to_volta(*integers, where=where)
