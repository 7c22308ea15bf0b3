"""AWQ clip search as pure functions: per quantization group, the weight range that minimises
the error of that group's contribution to the output (AutoAWQ's auto_clip, batched with bmm).

For W [N, K] with G = K / g groups and sampled inputs X [T, K]:
``out[G, T, N] = X_g [G, T, g] @ W_g [G, g, N]`` is each group's partial output. For shrink
step i < grid * max_shrink the candidate range is ``max|W_group| * (1 - i / grid)``; W is clamped
to +-range, pseudo-quantized, and the mean squared partial-output error over T picks the best
range per (row, group).
"""

from __future__ import annotations

import torch

from onecat.quantize.quantizer import pseudo_quantize


def search_clip(
    w: torch.Tensor,
    x: torch.Tensor,
    group_size: int,
    *,
    grid: int = 20,
    max_shrink: float = 0.5,
    budget_bytes: int = 256 << 20,
) -> torch.Tensor:
    """Best clip range per group: ``max_val [N, G]`` (float32, on W's device)."""
    n, k = w.shape
    groups = k // group_size
    t = x.shape[0]
    xg = x.float().reshape(t, groups, group_size).permute(1, 0, 2).contiguous()  # [G, T, g]
    best_max = torch.empty(n, groups, dtype=torch.float32, device=w.device)
    # rows per chunk so that one [G, T, rows] output stays within the budget
    rows = max(8, min(n, budget_bytes // max(1, groups * t * 4)))
    for start in range(0, n, rows):
        wc = w[start : start + rows].float()  # [R, K]
        r = wc.shape[0]
        org_max = wc.reshape(r, groups, group_size).abs().amax(dim=-1, keepdim=True)  # [R, G, 1]
        wt = wc.reshape(r, groups, group_size).permute(1, 2, 0)  # [G, g, R]
        org_out = torch.bmm(xg, wt)  # [G, T, R]
        min_err = torch.full((groups, r), float("inf"), device=w.device)
        chosen = org_max.squeeze(-1).t().clone()  # [G, R]
        for i in range(int(max_shrink * grid)):
            max_val = org_max * (1 - i / grid)  # [R, G, 1]
            clamped = torch.clamp(wc.reshape(r, groups, group_size), -max_val, max_val)
            q = pseudo_quantize(clamped.reshape(r, k), group_size)
            out = torch.bmm(xg, q.reshape(r, groups, group_size).permute(1, 2, 0))  # [G, T, R]
            err = (out - org_out).pow_(2).mean(dim=1)  # [G, R]
            better = err < min_err
            min_err = torch.where(better, err, min_err)
            chosen = torch.where(better, max_val.squeeze(-1).t(), chosen)
        best_max[start : start + r] = chosen.t()
    return best_max


def apply_clip(w: torch.Tensor, max_val: torch.Tensor) -> torch.Tensor:
    """Clamp W [N, K] group-wise to ``+-max_val [N, G]``; returns a new tensor of W's dtype."""
    n, k = w.shape
    groups = max_val.shape[1]
    m = max_val.to(w.dtype).unsqueeze(-1)
    return torch.clamp(w.reshape(n, groups, k // groups), -m, m).reshape(n, k)
