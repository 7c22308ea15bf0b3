"""RMS norms of Qwen3.5: the zero-centred ``(1 + w)`` norm and the GDN's gated norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _rms_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dimension, computed in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """``x_hat * (1 + weight)``: the weight is stored centred on zero."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x [..., dim]``; returns ``x.dtype``."""
        return (_rms_normalise(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """The Gated DeltaNet output norm: ``weight * x_hat * silu(z)`` (weight not centred)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Normalise ``x [..., dim]`` and gate it with ``z`` of the same shape."""
        x_hat = _rms_normalise(x, self.eps).to(x.dtype)
        return (self.weight * x_hat * F.silu(z.float())).to(x.dtype)
