"""AWQ scale search as pure functions over tensors (the model walking lives in layer_search.py).

For one mapping (a smooth op feeding balance layers with weights W_i [N_i, K]):

- ``x_mean [K]``: mean |x| per input channel over the calibration tokens;
- ``w_mean [K]``: mean over all balance rows of |W| / max|W| within each quantization group;
- candidates: the identity (plain round-to-nearest), then for ratio r = i / grid, i < grid,
  ``s = clamp(x_mean^r / (w_mean^(1-r) + 1e-4), 1e-4)`` ("duo scaling"; ``x_mean^r`` without
  it), normalised by ``sqrt(max(s) * min(s))``;
- each candidate is scored by ``loss(s)``: the caller sets every quantized balance layer to
  ``Q(W * s) / s``, runs the scored module and returns the MSE against the fp output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch


@dataclass
class ScaleResult:
    """The outcome of one scale search: ratio None means the identity won."""

    scales: torch.Tensor  # [K] float32
    ratio: float | None
    loss_identity: float
    loss_best: float
    losses: list[float]


def weight_mean(weights: Iterable[torch.Tensor], group_size: int) -> torch.Tensor:
    """w_mean [K]: mean over the rows of all weights of |W| / max|W| per group (fp32, streamed)."""
    total, rows = None, 0
    for w in weights:
        n, k = w.shape
        g = group_size if k % group_size == 0 else k
        wg = w.float().abs().reshape(n, k // g, g)  # [N, G, g]
        normed = wg / wg.amax(dim=-1, keepdim=True).clamp(min=1e-12)
        part = normed.reshape(n, k).sum(dim=0)
        total = part if total is None else total + part
        rows += n
    return total / rows


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor, ratio: float, duo: bool) -> torch.Tensor:
    """The AWQ scale vector [K] for one grid ratio."""
    x = x_mean.float().clamp(min=1e-12)
    if duo:
        s = (x.pow(ratio) / (w_mean.float().pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
    else:
        s = x.pow(ratio).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def search_scale(
    x_mean: torch.Tensor,
    w_mean: torch.Tensor,
    loss: Callable[[torch.Tensor], float],
    *,
    grid: int = 20,
    duo: bool = True,
) -> ScaleResult:
    """Score the identity and ``grid`` ratios with ``loss(s)``; return the best (finite) one.

    A non-finite loss disqualifies its candidate; the identity is always a valid fallback.
    """
    identity = torch.ones_like(x_mean, dtype=torch.float32)
    loss_identity = float(loss(identity))
    best = (loss_identity if loss_identity == loss_identity else float("inf"), None, identity)
    losses = [loss_identity]
    for i in range(grid):
        ratio = i / grid
        s = candidate_scales(x_mean, w_mean, ratio, duo)
        value = float(loss(s)) if torch.isfinite(s).all() else float("inf")
        losses.append(value)
        if value < best[0]:
            best = (value, ratio, s)
    return ScaleResult(best[2], best[1], loss_identity, best[0], losses)
