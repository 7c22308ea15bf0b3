"""Depthwise causal 1-D convolution with a carried state (Gated DeltaNet's short conv).

A channel's output at token t is ``sum_i w[i] * x[t - (K-1) + i]``; the state holds the last
``K - 1`` inputs of the sequence so that chunks and single decode tokens continue it.
SiLU follows the convolution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_chunk(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, C]`` of one sequence, ``state [C, K-1]``, ``weight [C, K]`` ->
    (``silu(conv) [T, C]``, new state ``[C, K-1]``)."""
    window = torch.cat((state.to(x.dtype), x.t()), dim=1)  # [C, K-1+T]
    out = F.conv1d(window[None], weight.to(x.dtype)[:, None, :], groups=weight.shape[0])[0]
    return F.silu(out).t(), window[:, -(weight.shape[1] - 1) :]


def causal_conv1d_step(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of ``B`` sequences: ``x [B, C]``, ``state [B, C, K-1]`` ->
    (``silu(conv) [B, C]``, new state)."""
    window = torch.cat((state.to(x.dtype), x[:, :, None]), dim=2)  # [B, C, K]
    out = (window * weight.to(x.dtype)[None]).sum(-1)
    return F.silu(out), window[:, :, 1:]
