"""Tensor-parallel slices of ONE half of a packed linear (``qweight`` or ``scales_zeros``).

vLLM hands the plugin's MoE weight loader one checkpoint tensor at a time, so the two halves
of a packed linear arrive separately. :func:`slice_volta_part` cuts either one exactly as
``onecat.pack.volta_layout.slice_volta`` cuts the pair (the unit tests check both against
packing the sliced integers), with the same rules: a column split needs ``N/world`` to be a
multiple of 32, a row split needs ``K/world`` to be a multiple of the group size.
"""

from __future__ import annotations

import torch

from onecat.pack.volta_layout import TILE


def slice_volta_part(
    tensor: torch.Tensor, part: str, group_size: int, dim: str, rank: int, world_size: int
) -> torch.Tensor:
    """Rank ``rank``'s slice of a packed ``qweight`` (``part="qweight"``, int32
    ``[N/32, K/32, 32, 4]``) or ``scales_zeros`` (``part="scales_zeros"``, fp16
    ``[N/32, K/g, 32, 2]``); ``dim`` is ``"out"`` (split N) or ``"in"`` (split K).

    Returns a view. Raises ValueError naming the sizes when the split would cut a tile or
    a quantization group.
    """
    if part not in ("qweight", "scales_zeros"):
        raise ValueError(f"part must be 'qweight' or 'scales_zeros', got {part!r}")
    if tensor.dim() != 4:
        raise ValueError(f"a packed {part} is 4-D, got shape {tuple(tensor.shape)}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    n = tensor.shape[0] * TILE
    k = tensor.shape[1] * (TILE if part == "qweight" else group_size)
    if dim == "out":
        if n % (TILE * world_size):
            raise ValueError(
                f"out_features {n} cannot be split {world_size} ways in 32-column tiles "
                f"(needs a multiple of {TILE * world_size})"
            )
        step = tensor.shape[0] // world_size
        return tensor[rank * step : (rank + 1) * step]
    if dim == "in":
        if k % (group_size * world_size):
            raise ValueError(
                f"in_features {k} with group size {group_size} cannot be split {world_size} "
                f"ways (needs a multiple of {group_size * world_size})"
            )
        step = tensor.shape[1] // world_size
        return tensor[:, rank * step : (rank + 1) * step]
    raise ValueError(f"dim must be 'out' or 'in', got {dim!r}")
