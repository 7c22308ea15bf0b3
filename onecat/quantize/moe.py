"""Per-expert linears standing in for transformers' fused 3-D MoE experts.

Qwen3.5-MoE stores experts as ``gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and
``down_proj [E, H, I]``. :class:`ExpertList` holds them as ``E.{gate,up,down}_proj`` nn.Linear
modules (so each expert is found, calibrated, smoothed and written like any linear) and
computes the same function as the fused module: each token's output is the routing-weighted
sum of its top-k experts (computed functionally, so forward hooks do not see it).

Calibration: when ``calibration_rows`` is set (row indices of a token sample), every expert
is additionally called, through its hooked modules, on those rows, whether or not the
router picks it: an expert no token picks is still calibrated and never divides by zero.
The sample is spread over all calibration tokens, so each expert sees about ``clip_tokens``
tokens per layer instead of all of them (E times cheaper than running every expert on
every token, which matters for 256 experts on a CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Expert(nn.Module):
    """One SwiGLU expert: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int, act_fn: nn.Module) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """The same function without module calls (no hooks fire)."""
        h = self.act_fn(F.linear(x, self.gate_proj.weight)) * F.linear(x, self.up_proj.weight)
        return F.linear(h, self.down_proj.weight)


class ExpertList(nn.ModuleList):
    """Experts ``0..E-1`` with the fused module's call signature ``(x, top_k_index, top_k_weights)``."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act_fn: nn.Module) -> None:
        super().__init__([Expert(hidden, intermediate, act_fn) for _ in range(num_experts)])
        self.calibration_rows: torch.Tensor | None = None

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        sample = None
        if self.calibration_rows is not None:
            sample = hidden_states[self.calibration_rows.to(hidden_states.device)]
        for e, expert in enumerate(self):
            if sample is not None and sample.shape[0]:
                expert(sample)  # seen by the calibration hooks; the output is not used
            token_idx, slot = torch.where(top_k_index == e)
            if not token_idx.numel():
                continue
            routed = expert.compute(hidden_states[token_idx])
            weight = top_k_weights[token_idx, slot, None].to(routed.dtype)
            out.index_add_(0, token_idx, (routed * weight).to(out.dtype))
        return out


def split_fused_experts(
    tensors: dict[str, torch.Tensor], module: str, gate_up: str, down: str
) -> dict[str, torch.Tensor]:
    """Rewrite ``{module}.{gate_up}`` / ``{module}.{down}`` 3-D tensors as per-expert 2-D keys
    ``{module}.E.{gate,up,down}_proj.weight``; other tensors pass through unchanged."""
    gu_key, down_key = f"{module}.{gate_up}", f"{module}.{down}"
    if gu_key not in tensors:
        return tensors
    out = {k: v for k, v in tensors.items() if k not in (gu_key, down_key)}
    fused_gu, fused_down = tensors[gu_key], tensors[down_key]
    inter = fused_gu.shape[1] // 2
    for e in range(fused_gu.shape[0]):
        out[f"{module}.{e}.gate_proj.weight"] = fused_gu[e, :inter]
        out[f"{module}.{e}.up_proj.weight"] = fused_gu[e, inter:]
        out[f"{module}.{e}.down_proj.weight"] = fused_down[e]
    return out
