"""Routed experts of a mixture-of-experts block, stored stacked (one tensor per projection).

``w13`` holds each expert's gate rows then up rows (``[E, 2I, H]``), ``w2`` its down
projection (``[E, H, I]``), either as float weights or in the Volta packed layout with an
expert dimension in front (``[E, N/32, K/32, 32, 4]`` and ``[E, N/32, K/g, 32, 2]``).

Packed experts run ``torch.ops.onecat.w4a16_moe`` (onecat.kernels.moe): on CUDA a few
launches that read the chosen experts' weights in place, with no host sync, so the same call
serves eager steps and CUDA-graph capture; on the CPU its reference. Float experts (fp16/bf16
checkpoints) keep plain torch: eagerly each expert that received tokens runs on them (the
counts are read on the host); under graph capture each token's chosen experts are gathered
into one merged weight per projection (copies; fine for the small float models that use it).
Expert ids outside ``[0, E)`` (other ranks' experts) contribute nothing on every path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onecat.kernels.moe import w4a16_moe
from onecat.pack.volta_layout import TILE
from onecat.runtime.context import get_context
from onecat.runtime.layers.linear import Linear, LinearWeights, silu_and_mul

GATE, UP, DOWN = "gate_proj", "up_proj", "down_proj"



class FusedExperts(nn.Module):
    """``num_experts`` SwiGLU experts (hidden -> intermediate -> hidden), and ``spare_slots``
    more stacked after them that another MLP of the same shape can be folded into
    (:meth:`fold_in`: the MoE block's shared expert, so one grouped launch runs both)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        group_size: int | None,
        dtype: torch.dtype,
        spare_slots: int = 0,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.group_size = group_size
        e, h, i = num_experts + spare_slots, hidden_size, intermediate_size
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

    def fold_in(self, slot: int, gate_up: Linear, down: Linear) -> bool:
        """Copy a packed SwiGLU MLP (merged gate/up, down) into spare ``slot`` and make its
        layers' parameters views of that slot (no second copy is kept). Returns False, and
        changes nothing, unless both layers are packed with exactly the experts' tile shapes."""
        if not self.is_packed or not self.num_experts <= slot < self.w13_qweight.shape[0]:
            return False
        pairs = [
            (layer, name, getattr(self, f"{stack}_{name}"))
            for layer, stack in ((gate_up, "w13"), (down, "w2")) for name in ("qweight", "scales_zeros")
        ]  # fmt: skip
        if not all(layer.is_packed and layer.bias is None for layer in (gate_up, down)) or any(
            getattr(layer, name).shape != stacked.shape[1:] for layer, name, stacked in pairs
        ):
            return False
        for layer, name, stacked in pairs:
            stacked.data[slot].copy_(getattr(layer, name))
            getattr(layer, name).data = stacked.data[slot]
        return True

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

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, routing ``expert_ids``/``weights`` ``[T, k]`` -> weighted sum ``[T, H]``.
        Ids outside ``[0, num_experts)`` contribute nothing."""
        if self.is_packed:
            return w4a16_moe(
                x, expert_ids, weights, self.w13_qweight, self.w13_scales_zeros,
                self.w2_qweight, self.w2_scales_zeros, self.group_size,
            )  # fmt: skip
        if get_context().capturing_graph:
            return self._forward_gathered(x, expert_ids, weights)
        return self._forward_grouped(x, expert_ids, weights)

    def _expert(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """SwiGLU of float expert ``index`` on ``x [M, H]``."""
        return F.linear(silu_and_mul(F.linear(x, self.w13[index])), self.w2[index])

    def _forward_grouped(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        top_k = expert_ids.shape[1]
        flat_ids = expert_ids.flatten().long()
        flat_ids = torch.where((flat_ids >= 0) & (flat_ids < self.num_experts), flat_ids, self.num_experts)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        flat_weights = weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts[: self.num_experts]):  # ids beyond: other ranks' experts
            if count == 0:
                continue
            pairs = order[start : start + count]
            start += count
            tokens = pairs // top_k
            y = self._expert(x[tokens], expert) * flat_weights[pairs, None].to(x.dtype)
            out.index_add_(0, tokens, y)
        return out

    def _forward_gathered(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Per token, its chosen experts' weights merged into one linear each (copies):
        ``w13`` stacked along N (``[T, k*2I, H]``: all experts see the same input) and ``w2``
        along K (``[T, H, k*I]``: fed the concatenated, routing-weighted expert activations,
        it sums the experts' outputs). Fixed shapes and no host reads: capturable."""
        tokens, top_k = expert_ids.shape
        i, h = self.intermediate_size, self.hidden_size
        ids = expert_ids.long()
        owned = (ids >= 0) & (ids < self.num_experts)
        ids, weights = torch.where(owned, ids, 0), weights * owned.to(weights.dtype)
        w13 = self.w13.index_select(0, ids.flatten()).view(tokens, top_k * 2 * i, h)
        w2 = self.w2[ids].permute(0, 2, 1, 3).reshape(tokens, h, top_k * i)
        gate_up = torch.bmm(w13, x.unsqueeze(-1)).view(tokens, top_k, 2 * i)
        hidden = silu_and_mul(gate_up) * weights.unsqueeze(-1).to(x.dtype)
        return torch.bmm(w2, hidden.reshape(tokens, top_k * i, 1)).squeeze(-1)
