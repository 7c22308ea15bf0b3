"""Expert parallelism: each tensor-parallel rank owns a contiguous share of the routed experts.

Every rank routes every token (the router is replicated), then runs only the (token, expert)
pairs whose expert it owns; the others add nothing on this rank. The all-reduce after the
MoE block sums the ranks' partial outputs. Eagerly, pairs of other ranks' experts are
skipped (their ids are mapped past the local experts); in CUDA graphs, where shapes are
static, they run on local expert 0 with routing weight 0.
"""

from __future__ import annotations

import torch

from onecat.runtime.context import get_context
from onecat.runtime.distributed.parallel_state import tp_rank, tp_size
from onecat.runtime.layers.moe import FusedExperts


class LocalExperts(FusedExperts):
    """Experts ``first_expert .. first_expert + num_experts - 1`` of ``num_global_experts``."""

    def __init__(
        self,
        num_global_experts: int,
        first_expert: int,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        group_size: int | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, group_size=group_size, dtype=dtype)
        self.num_global_experts = num_global_experts
        self.first_expert = first_expert

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Like :meth:`FusedExperts.forward` with global ``expert_ids``; returns this rank's
        partial sum (only its experts' contributions)."""
        local = expert_ids - self.first_expert
        owned = (local >= 0) & (local < self.num_experts)
        weights = weights * owned.to(weights.dtype)
        elsewhere = 0 if get_context().capturing_graph else self.num_experts
        return super().forward(x, torch.where(owned, local, elsewhere), weights)


def routed_experts(
    num_experts: int, hidden_size: int, intermediate_size: int, *, group_size: int | None, dtype: torch.dtype
) -> FusedExperts:
    """All experts without tensor parallelism, else this rank's ``num_experts / N`` of them."""
    world = tp_size()
    if world == 1:
        return FusedExperts(num_experts, hidden_size, intermediate_size, group_size=group_size, dtype=dtype)
    count = num_experts // world
    return LocalExperts(
        num_experts, tp_rank() * count, count, hidden_size, intermediate_size, group_size=group_size, dtype=dtype
    )
