"""The plugin's one call into onecat's W4A16 linear.

fp16 activations (V100, and fp16 CPU runs) go to ``torch.ops.onecat.w4a16_linear``: the
sm_70 kernels on a GPU, the reference on CPU; a registered custom op with a fake
implementation, so vLLM's torch.compile and CUDA-graph capture treat it as one node.
Other activation dtypes exist only on vLLM's CPU backend (its Gated DeltaNet kernel needs
bf16) and use the same reference directly: the dequantised weights are identical.
"""

from __future__ import annotations

import torch

from onecat.errors import OnecatError
from onecat.kernels.ops import w4a16_linear
from onecat.pack.volta_layout import reference_linear


def volta_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias)`` with ``W`` in the Volta layout; returns ``x.dtype``."""
    if x.dtype == torch.float16:
        return w4a16_linear(x, qweight, scales_zeros, group_size, bias)
    if x.device.type != "cpu":
        raise OnecatError(
            f"onecat's vLLM plugin runs fp16 activations on GPUs, got {x.dtype}: "
            "start vLLM with --dtype half"
        )
    return reference_linear(x, qweight, scales_zeros, group_size, bias)
