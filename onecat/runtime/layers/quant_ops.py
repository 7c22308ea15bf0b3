"""The one place where the runtime calls onecat's W4A16 linear op.

fp16 activations (the GPU, and fp16 CPU runs) go to ``onecat.kernels.ops.w4a16_linear``:
the sm_70 kernels on a GPU, the reference on CPU. The fp32 CPU mode, used to compare with
transformers tightly, calls the same reference directly, since the op takes fp16 only: the
weights are the same dequantised values either way (the kernels' dequant contract).
"""

from __future__ import annotations

import torch

from onecat.kernels.ops import w4a16_linear as _kernel_op
from onecat.pack.volta_layout import reference_linear


def w4a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias)`` with ``W`` stored in the Volta packed layout."""
    if x.dtype == torch.float16:
        return _kernel_op(x, qweight, scales_zeros, group_size, bias)
    return reference_linear(x, qweight, scales_zeros, group_size, bias)
