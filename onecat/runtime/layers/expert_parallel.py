"""Expert parallelism: each tensor-parallel rank owns a contiguous share of the routed experts.

Every rank routes every token (the router is replicated), then runs only the (token, expert)
pairs whose expert it owns: global ids are shifted to local ones, and ids that land outside
``[0, num_experts)`` (other ranks' experts) contribute nothing in :class:`FusedExperts` (the
``w4a16_moe`` op skips them, eagerly and in CUDA graphs alike). The all-reduce after the MoE
block sums the ranks' partial outputs.
"""

from __future__ import annotations

import torch

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
        return super().forward(x, expert_ids - self.first_expert, weights)


def routed_experts(
    num_experts: int, hidden_size: int, intermediate_size: int, *, group_size: int | None, dtype: torch.dtype,
    spare_slots: int = 0,
) -> FusedExperts:
    """All experts without tensor parallelism (with ``spare_slots`` for a folded shared
    expert, see :meth:`FusedExperts.fold_in`), else this rank's ``num_experts / N`` of them
    (no spare slots: the shared expert is split across the ranks instead)."""
    world = tp_size()
    if world == 1:
        return FusedExperts(
            num_experts, hidden_size, intermediate_size, group_size=group_size, dtype=dtype, spare_slots=spare_slots
        )
    count = num_experts // world
    return LocalExperts(
        num_experts, tp_rank() * count, count, hidden_size, intermediate_size, group_size=group_size, dtype=dtype
    )
