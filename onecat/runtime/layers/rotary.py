"""Partial rotary position embedding (Qwen3.5 rotates the first quarter of each head).

Text-only inputs give Qwen3.5's multimodal RoPE identical temporal, height and width
positions, which makes it the plain RoPE below: the first ``rotary_dim`` features of a head
are split into two halves rotated by ``position * inv_freq``; the rest pass through.
"""

from __future__ import annotations

import torch
from torch import nn


def apply_partial_rope(
    positions: torch.Tensor, x: torch.Tensor, inv_freq: torch.Tensor, rotary_dim: int
) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` features of ``x [T, heads, D]`` by ``positions [T]``."""
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, rotary_dim / 2]
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
    half = rotary_dim // 2
    x1 = x[..., :half].float()
    x2 = x[..., half:rotary_dim].float()
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


class PartialRotaryEmbedding(nn.Module):
    """Holds the inverse frequencies of the rotated features (see :func:`apply_partial_rope`)."""

    def __init__(self, rotary_dim: int, theta: float) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
