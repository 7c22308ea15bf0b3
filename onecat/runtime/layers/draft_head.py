"""A 4-bit copy of the output projection for the MTP drafter (speculative decoding).

Drafting reads the whole ``lm_head`` once per draft token: on the 27B shape that is 2.5 GB
of fp16 per draft step (0.62 ms of a 2.6 ms three-draft step on the H200; ~2.8 ms per draft
on a V100). Drafts only have to be likely, not exact (the model verifies every one with its
own fp16 ``lm_head``, so outputs do not change), so the drafter uses a copy of ``lm_head``
rounded to nearest at 4 bits (asymmetric, groups of :data:`GROUP_SIZE`), packed for the
W4A16 kernels: a quarter of the bytes. The acceptance cost is measured in BENCHMARKS.md.
Under tensor parallelism each rank rounds its own rows of the vocab-parallel ``lm_head``
(whole 32-row tiles, padding rows included) and ``compute_draft_logits`` gathers the drafts'
logits like the model's.
"""

from __future__ import annotations

import torch

from onecat.formats.integers import quantize_groups
from onecat.pack.volta_layout import TILE, fits_layout, pack_volta
from onecat.runtime.layers.linear import Linear

GROUP_SIZE = 128
_ROWS_PER_PASS = 8192  # rows rounded at a time (bounds the fp32 temporaries)


def quantized_draft_head(lm_head: Linear) -> Linear | None:
    """A packed 4-bit copy of the float ``lm_head`` on its device, or None when it is packed
    already or its shape does not fit the Volta layout."""
    if lm_head.is_packed:
        return None
    weight = lm_head.weight
    n, k = weight.shape
    if not fits_layout(n, k, GROUP_SIZE):
        return None
    with torch.device(weight.device):
        head = Linear(k, n, group_size=GROUP_SIZE, dtype=weight.dtype)
    for start in range(0, n, _ROWS_PER_PASS):
        rows = weight[start : start + _ROWS_PER_PASS]
        q, zeros, scales = quantize_groups(rows, GROUP_SIZE)
        qweight, scales_zeros = pack_volta(q, zeros, scales.half())
        tiles = slice(start // TILE, (start + rows.shape[0]) // TILE)
        head.qweight.data[tiles] = qweight
        head.scales_zeros.data[tiles] = scales_zeros
    if lm_head.bias is not None:
        head.bias = torch.nn.Parameter(lm_head.bias.detach().clone(), requires_grad=False)
    return head
