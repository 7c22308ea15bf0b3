"""RMS norms of Qwen3.5: the zero-centred ``(1 + w)`` norm and the GDN's gated norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onecat.runtime.layers.fusion import fused


def _rms_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dimension, computed in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_math(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x_hat * (1 + weight)`` in ``x.dtype`` (plain torch, for use inside fused functions)."""
    return (_rms_normalise(x, eps) * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm_math(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x_hat * silu(z)`` in ``x.dtype`` (plain torch)."""
    x_hat = _rms_normalise(x, eps).to(x.dtype)
    return (weight * x_hat * F.silu(z.float())).to(x.dtype)


rms_norm = fused(rms_norm_math)
gated_rms_norm = fused(gated_rms_norm_math)


@fused
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: the residual add fused with the next norm."""
    summed = x + residual
    return rms_norm_math(summed, weight, eps), summed


class RMSNorm(nn.Module):
    """``x_hat * (1 + weight)``: the weight is stored centred on zero."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x [..., dim]``; returns ``x.dtype``."""
        return rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """The Gated DeltaNet output norm: ``weight * x_hat * silu(z)`` (weight not centred)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Normalise ``x [..., dim]`` and gate it with ``z`` of the same shape."""
        return gated_rms_norm(x, z, self.weight, self.eps)
