"""Whether a tensor-parallel rank's slice of a layer fits the Volta layout (no vLLM import).

vLLM tells a quantization method the per-rank sizes in ``create_weights``; these checks turn
a size the layout cannot hold into an error that names the layer and the way out, instead
of a silent mis-slice (vLLM's packed-parameter arithmetic rounds down).
"""

from __future__ import annotations

from onecat.errors import OnecatError
from onecat.pack.volta_layout import TILE


def check_partition(
    prefix: str, output_partition_sizes: list[int], input_size_per_partition: int, group_size: int
) -> None:
    """Raise OnecatError unless this rank's slice of a layer fits the Volta layout."""
    problems = [
        f"output part {size} is not a multiple of {TILE}"
        for size in output_partition_sizes
        if size % TILE
    ]
    if input_size_per_partition % group_size:
        problems.append(
            f"input slice {input_size_per_partition} is not a multiple of the group size "
            f"{group_size}"
        )
    if problems:
        raise OnecatError(
            f"{prefix or 'a linear layer'}: this tensor-parallel slice cannot be cut from the "
            f"Volta layout ({'; '.join(problems)}). Use a smaller --tensor-parallel-size "
            "(docs/VLLM.md lists the sizes each model allows)."
        )


def check_expert_partition(
    prefix: str, hidden_size: int, intermediate_size_per_partition: int, group_size: int
) -> None:
    """Raise OnecatError unless this rank's expert slices fit the Volta layout."""
    i_p = intermediate_size_per_partition
    problems = []
    if i_p % TILE:
        problems.append(f"the intermediate slice {i_p} is not a multiple of {TILE}")
    if i_p % group_size:
        problems.append(
            f"the intermediate slice {i_p} is not a multiple of the group size {group_size}"
        )
    if hidden_size % group_size or hidden_size % TILE:
        problems.append(f"the hidden size {hidden_size} does not fit group size {group_size}")
    if problems:
        raise OnecatError(
            f"{prefix or 'an MoE layer'}: experts cannot be split this way "
            f"({'; '.join(problems)}). Use a smaller --tensor-parallel-size, or "
            "--enable-expert-parallel, which keeps experts whole (docs/VLLM.md)."
        )
