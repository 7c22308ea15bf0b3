"""Folding an AWQ scale s [K] into a layer: the smooth op's output is divided by s and every
balance layer's input columns are multiplied by s, which leaves the fp function unchanged.

- RMSNorm with ``x_hat * w`` (Llama, Qwen3): ``w' = w / s``.
- RMSNorm with ``x_hat * (1 + w)`` (Qwen3.5, norm_style ``one_plus``): ``w' = (1 + w) / s - 1``.
- A linear smooth op (up_proj -> down_proj): its output rows (and bias) are divided by s.
- Balance layers are anything with a 2-D ``weight [N, K]`` (Linear, MoE router):
  ``W' = W * s`` column-wise.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


@torch.no_grad()
def fold_into_smooth(module: nn.Module, s: torch.Tensor, norm_style: str) -> None:
    """Divide the output of ``module`` (a norm or a linear) by ``s`` in place."""
    weight = module.weight
    s = s.to(device=weight.device, dtype=torch.float32)
    if weight.dim() == 1:  # a norm
        if norm_style == "one_plus":
            new = (1.0 + weight.float()) / s - 1.0
        else:
            new = weight.float() / s
        weight.copy_(new.to(weight.dtype))
    else:  # a linear: weight [N, K], scale output rows
        weight.copy_((weight.float() / s.unsqueeze(1)).to(weight.dtype))
    bias = getattr(module, "bias", None)
    if bias is not None:
        bias.copy_((bias.float() / s).to(bias.dtype))


@torch.no_grad()
def fold_into_balance(modules: Iterable[nn.Module], s: torch.Tensor) -> None:
    """Multiply the input columns of every balance layer's ``weight [N, K]`` by ``s`` in place."""
    for module in modules:
        weight = module.weight
        scale = s.to(device=weight.device, dtype=torch.float32)
        weight.copy_((weight.float() * scale.unsqueeze(0)).to(weight.dtype))
