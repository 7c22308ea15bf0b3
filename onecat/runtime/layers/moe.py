"""Routed experts of a mixture-of-experts block, stored stacked (one tensor per projection).

``w13`` holds each expert's gate rows then up rows (``[E, 2I, H]``), ``w2`` its down
projection (``[E, H, I]``), either as float weights or in the Volta packed layout with an
expert dimension in front (``[E, N/32, K/32, 32, 4]`` and ``[E, N/32, K/g, 32, 2]``).

Two ways to run them:

- grouped (eager): sort the (token, expert) pairs by expert, read the expert ids on the host
  once, and run each chosen expert on its tokens; every expert's weights are read once;
- gathered (for CUDA graph capture and its warm-up, where the host cannot see the routing):
  copy each token's chosen experts' weights into one merged linear per projection and run
  two matmuls per token. It moves each chosen expert's bytes three times but launches few
  kernels, so the runner captures MoE decode graphs only for batches up to 32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onecat.kernels.ops import packed_linear
from onecat.pack.volta_layout import TILE
from onecat.runtime.context import get_context
from onecat.runtime.layers.fusion import fused
from onecat.runtime.layers.linear import LinearWeights

GATE, UP, DOWN = "gate_proj", "up_proj", "down_proj"


@fused
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a merged ``[..., 2I]`` gate/up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class FusedExperts(nn.Module):
    """``num_experts`` SwiGLU experts (hidden -> intermediate -> hidden)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        group_size: int | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.group_size = group_size
        e, h, i = num_experts, hidden_size, intermediate_size
        for name, (n, k) in (("w13", (2 * i, h)), ("w2", (h, i))):
            if group_size is None:
                self._add(name, torch.empty(e, n, k, dtype=dtype))
            else:
                self._add(f"{name}_qweight", torch.empty(e, n // TILE, k // TILE, TILE, 4, dtype=torch.int32))
                self._add(
                    f"{name}_scales_zeros",
                    torch.empty(e, n // TILE, k // group_size, TILE, 2, dtype=torch.float16),
                )

    def _add(self, name: str, tensor: torch.Tensor) -> None:
        param = nn.Parameter(tensor, requires_grad=False)
        param.weight_loader = self._load_rows
        self.register_parameter(name, param)

    @property
    def is_packed(self) -> bool:
        """True when the experts compute with the 4-bit kernel."""
        return self.group_size is not None

    def _load_rows(self, param: torch.Tensor, loaded: torch.Tensor, shard: tuple[int, str]) -> None:
        expert, which = shard
        tile = TILE if self.is_packed else 1
        start = self.intermediate_size // tile if which == UP else 0
        target = param.data[expert].narrow(0, start, loaded.shape[0])
        if target.shape != loaded.shape:
            raise ValueError(f"expert {expert} {which}: expected {tuple(target.shape)}, got {tuple(loaded.shape)}")
        target.copy_(loaded.to(param.dtype))

    def load_weights(self, expert: int, which: str, weights: LinearWeights) -> None:
        """Load one expert's ``gate_proj``, ``up_proj`` or ``down_proj``."""
        name = "w2" if which == DOWN else "w13"
        if self.is_packed:
            if not weights.is_packed or weights.group_size != self.group_size:
                raise ValueError("packed experts need packed weights with their group size")
            for suffix, tensor in (("qweight", weights.qweight), ("scales_zeros", weights.scales_zeros)):
                param = getattr(self, f"{name}_{suffix}")
                param.weight_loader(param, tensor, (expert, which))
        else:
            param = getattr(self, name)
            param.weight_loader(param, weights.dense(), (expert, which))

    def _project(self, x: torch.Tensor, params: dict[str, torch.Tensor], name: str, index: int) -> torch.Tensor:
        if self.is_packed:
            qweight, scales_zeros = params[f"{name}_qweight"][index], params[f"{name}_scales_zeros"][index]
            return packed_linear(x, qweight, scales_zeros, self.group_size)
        return F.linear(x, params[name][index])

    def _expert(self, x: torch.Tensor, params: dict[str, torch.Tensor], index: int) -> torch.Tensor:
        """SwiGLU of expert ``index`` of the stacked ``params`` on ``x [M, H]``."""
        return self._project(silu_and_mul(self._project(x, params, "w13", index)), params, "w2", index)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, routing ``expert_ids``/``weights`` ``[T, k]`` -> weighted sum ``[T, H]``."""
        if get_context().capturing_graph:
            return self._forward_gathered(x, expert_ids, weights)
        return self._forward_grouped(x, expert_ids, weights)

    def _forward_grouped(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        top_k = expert_ids.shape[1]
        flat_ids = expert_ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        flat_weights = weights.flatten()
        params = dict(self.named_parameters(recurse=False))
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts[: self.num_experts]):  # ids beyond: other ranks' experts
            if count == 0:
                continue
            pairs = order[start : start + count]
            start += count
            tokens = pairs // top_k
            y = self._expert(x[tokens], params, expert) * flat_weights[pairs, None].to(x.dtype)
            out.index_add_(0, tokens, y)
        return out

    def _token_weights(self, expert_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per token, its chosen experts' weights merged into one linear each (copies):
        ``w13`` stacked along N (``[T, k*2I, H]``: all experts see the same input) and ``w2``
        along K (``[T, H, k*I]``: fed the concatenated, routing-weighted expert activations,
        it sums the experts' outputs). In the packed layout N is tile dimension 0 and K tile
        dimension 1 (groups follow K), so both are plain gathers and permutes."""
        tokens, top_k = expert_ids.shape
        i, h = self.intermediate_size, self.hidden_size
        flat = expert_ids.flatten()
        if not self.is_packed:
            return {
                "w13": self.w13.index_select(0, flat).view(tokens, top_k * 2 * i, h),
                "w2": self.w2[expert_ids].permute(0, 2, 1, 3).reshape(tokens, h, top_k * i),
            }
        g = self.group_size
        w13_q = self.w13_qweight.index_select(0, flat)
        w13_s = self.w13_scales_zeros.index_select(0, flat)
        w2_q = self.w2_qweight[expert_ids].permute(0, 2, 1, 3, 4, 5)  # [T, H/32, k, I/32, 32, 4]
        w2_s = self.w2_scales_zeros[expert_ids].permute(0, 2, 1, 3, 4, 5)
        return {
            "w13_qweight": w13_q.view(tokens, top_k * 2 * i // TILE, h // TILE, TILE, 4),
            "w13_scales_zeros": w13_s.view(tokens, top_k * 2 * i // TILE, h // g, TILE, 2),
            "w2_qweight": w2_q.reshape(tokens, h // TILE, top_k * i // TILE, TILE, 4),
            "w2_scales_zeros": w2_s.reshape(tokens, h // TILE, top_k * i // g, TILE, 2),
        }

    def _forward_gathered(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Two matmuls per token over its experts' merged weights (see :meth:`_token_weights`)."""
        num_tokens, top_k = expert_ids.shape
        merged = self._token_weights(expert_ids)
        rows = []
        for token in range(num_tokens):
            gate_up = self._project(x[token : token + 1], merged, "w13", token)  # [1, k*2I]
            hidden = silu_and_mul(gate_up.view(top_k, -1)) * weights[token, :, None].to(x.dtype)
            rows.append(self._project(hidden.reshape(1, -1), merged, "w2", token))
        return torch.cat(rows)
