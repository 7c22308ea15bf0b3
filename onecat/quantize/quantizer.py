"""Asymmetric group-wise 4-bit quantization of a weight matrix (the integers onecat writes).

For W [N, K] and group size g, each row's groups of g consecutive input channels get
``scale = (max - min).clamp(1e-5) / 15`` (rounded to fp16, the precision it is stored in),
``zero = clamp(-round(min / scale), 0, 15)`` and ``q = clamp(round(w / scale) + zero, 0, 15)``;
the dequantized value is ``(q - zero) * scale`` (the integers themselves:
:func:`onecat.formats.integers.quantize_groups`, which the runtime also uses).
:func:`pseudo_quantize` returns exactly the weights the written checkpoint dequantizes to, so
the search scores what ships.
"""

from __future__ import annotations

import torch

from onecat.formats.integers import MAX_INT

FP16_MAX = 65504.0


def pseudo_quantize(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Quantize and dequantize W [N, K] in one pass (same values as the written checkpoint).

    Works in W's dtype when it is float32, else float32; returns W's dtype.
    """
    n, k = w.shape
    wg = w.float().reshape(n, k // group_size, group_size)  # [N, G, g]
    wmax, wmin = wg.amax(dim=-1, keepdim=True), wg.amin(dim=-1, keepdim=True)
    scales = ((wmax - wmin).clamp(min=1e-5) / MAX_INT).half().float()
    zeros = (-torch.round(wmin / scales)).clamp(0, MAX_INT)
    q = (torch.round(wg / scales) + zeros).clamp(0, MAX_INT)
    return ((q - zeros) * scales).reshape(n, k).to(w.dtype)
