"""RMS norms of Qwen3.5: the zero-centred ``(1 + w)`` norm and the GDN's gated norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onecat.kernels import rms_norm as norm_kernel
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


_rms_norm_compiled = fused(rms_norm_math)
gated_rms_norm = fused(gated_rms_norm_math)

KERNEL_MIN_HIDDEN = 4096
"""Rows at least this wide take onecat's one-launch kernel (``onecat.kernels.rms_norm``), narrower
ones the compiled torch function. H200, compute_70 PTX, interleaved e2e runs (``bench/ab_prepare.sh``,
2026-12-01 19:05): with the kernel at every width the 27B (5120 features) decoded 1.0 / 0.6 / 0.5%
faster at batch 1 / 8 / 32 and the 35B-A3B (2048) 0.8% slower at batch 1 (+0.2 / -0.3% at 8 / 32),
although ``bench/norm.py`` times the kernel faster at both widths (after a projection, one row:
2.37 against 5.17 us at 5120, 1.88 against 2.23 at 2048)."""


def _takes_kernel(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
    return x.dim() > 0 and x.shape[-1] >= KERNEL_MIN_HIDDEN and norm_kernel.supports(x, residual, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x_hat * (1 + weight)`` in ``x.dtype``: one sm_70 launch for rows the kernel takes of at
    least :data:`KERNEL_MIN_HIDDEN` features (onecat.kernels.rms_norm), else compiled torch."""
    if _takes_kernel(x, None, weight):
        return norm_kernel.add_rms_norm(x, None, weight, eps)[0]
    return _rms_norm_compiled(x, weight, eps)


@fused
def _add_rms_norm_compiled(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm_math(summed, weight, eps), summed


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: the residual add fused with the next norm
    (one sm_70 launch as in :func:`rms_norm`, else compiled torch)."""
    if _takes_kernel(x, residual, weight):
        return norm_kernel.add_rms_norm(x, residual, weight, eps)
    return _add_rms_norm_compiled(x, residual, weight, eps)


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
