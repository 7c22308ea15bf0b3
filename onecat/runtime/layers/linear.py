"""Linear layers that hold either a floating-point weight or a 4-bit Volta-packed weight.

One class, :class:`Linear`, serves every projection of the model. What it stores is decided
when the model is built (from what the checkpoint holds for that module):

- ``weight`` ``[N, K]`` in the model dtype (fp16 on GPU, fp32 on CPU), or
- ``qweight`` int32 ``[N/32, K/32, 32, 4]`` + ``scales_zeros`` fp16 ``[N/32, K/g, 32, 2]``
  (docs/FORMAT.md), computed by :func:`onecat.kernels.ops.packed_linear`.

A merged linear (q/k/v, gate/up, ...) concatenates its parts along the output dimension.
Every parameter carries a ``weight_loader(param, loaded, shard_id)`` that copies one part
into its rows, as nano-vllm's parameters do: the loader asks the parameter, not a switch.
In the packed layout a part of ``n`` rows starting at row ``o`` is tiles ``o/32 ..
(o+n)/32`` of dimension 0, so parts must start and end on 32-row boundaries. Tensor
parallelism will slice here too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from onecat.kernels import ops
from onecat.kernels.ops import packed_linear, packed_linear_silu_mul
from onecat.pack.volta_layout import TILE, dequantize_volta, fits_layout
from onecat.runtime.layers.fusion import fused

silu_and_mul = fused(ops.silu_and_mul)
"""``silu(gate) * up`` of a merged ``[..., 2I]`` gate/up projection (compiled on CUDA)."""


@dataclass
class LinearWeights:
    """One source linear as read from a checkpoint: a float weight or packed tensors."""

    weight: torch.Tensor | None = None  # [N, K]
    qweight: torch.Tensor | None = None  # int32 [N/32, K/32, 32, 4]
    scales_zeros: torch.Tensor | None = None  # fp16 [N/32, K/g, 32, 2]
    group_size: int = 0
    bias: torch.Tensor | None = None

    @property
    def is_packed(self) -> bool:
        """True when the weight is in the Volta packed layout."""
        return self.qweight is not None

    def dense(self) -> torch.Tensor:
        """The weight ``[N, K]`` as a float tensor (dequantised with the kernels' contract)."""
        if self.weight is not None:
            return self.weight
        return dequantize_volta(self.qweight, self.scales_zeros, self.group_size)


def _load_rows(param: torch.Tensor, loaded: torch.Tensor, start: int, rows: int, what: str) -> None:
    target = param.data.narrow(0, start, rows)
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"{what}: expected shape {tuple(target.shape)}, got {tuple(loaded.shape)}")
    target.copy_(loaded)


class Linear(nn.Module):
    """``y = x @ W.T (+ b)`` over one or several merged parts (``output_sizes``).

    ``group_size`` None keeps a float weight; an int stores the weight packed.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int] | int,
        *,
        bias: bool = False,
        group_size: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.in_features = in_features
        self.out_features = sum(self.output_sizes)
        self.offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
        self.group_size = group_size
        n, k = self.out_features, in_features
        if group_size is None:
            self.weight = nn.Parameter(torch.empty(n, k, dtype=dtype), requires_grad=False)
            self.weight.weight_loader = self._load_dense_rows
        else:
            if not fits_layout(n, k, group_size) or any(s % TILE for s in self.output_sizes):
                raise ValueError(
                    f"a packed linear [{n}, {k}] with parts {self.output_sizes} and group "
                    f"{group_size} does not fit the Volta layout (multiples of {TILE})"
                )
            self.qweight = nn.Parameter(
                torch.empty(n // TILE, k // TILE, TILE, 4, dtype=torch.int32), requires_grad=False
            )
            self.scales_zeros = nn.Parameter(
                torch.empty(n // TILE, k // group_size, TILE, 2, dtype=torch.float16),
                requires_grad=False,
            )
            self.qweight.weight_loader = self._load_tile_rows
            self.scales_zeros.weight_loader = self._load_tile_rows
        if bias:
            self.bias = nn.Parameter(torch.zeros(n, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self._load_dense_rows
        else:
            self.bias = None

    @property
    def is_packed(self) -> bool:
        """True when this layer computes with the 4-bit kernel."""
        return self.group_size is not None

    def _part(self, shard_id: int | None) -> tuple[int, int]:
        index = 0 if shard_id is None else shard_id
        return self.offsets[index], self.output_sizes[index]

    def _load_dense_rows(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None) -> None:
        start, rows = self._part(shard_id)
        _load_rows(param, loaded.to(param.dtype), start, rows, f"part {shard_id}")

    def _load_tile_rows(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None) -> None:
        start, rows = self._part(shard_id)
        _load_rows(param, loaded, start // TILE, rows // TILE, f"packed part {shard_id}")

    def load_weights(self, weights: LinearWeights, shard_id: int | None = None) -> None:
        """Copy one source linear into part ``shard_id`` (None: the only part)."""
        if self.is_packed:
            if not weights.is_packed or weights.group_size != self.group_size:
                raise ValueError("a packed layer needs packed weights with its group size")
            self.qweight.weight_loader(self.qweight, weights.qweight, shard_id)
            self.scales_zeros.weight_loader(self.scales_zeros, weights.scales_zeros, shard_id)
        else:
            self.weight.weight_loader(self.weight, weights.dense(), shard_id)
        if weights.bias is not None:
            if self.bias is None:
                raise ValueError("the checkpoint has a bias this layer does not expect")
            self.bias.weight_loader(self.bias, weights.bias, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer to ``x [..., K]``."""
        if self.is_packed:
            return packed_linear(x, self.qweight, self.scales_zeros, self.group_size, self.bias)
        return F.linear(x, self.weight, self.bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a merged gate/up layer (two equal parts) applied to ``x``:
        ``[..., N/2]``. Packed, on the GPU, for the few rows a GEMV serves, it is one launch
        whose epilogue applies the activation (:func:`packed_linear_silu_mul`); otherwise the
        projection, then one compiled activation kernel."""
        if len(self.output_sizes) != 2 or self.output_sizes[0] != self.output_sizes[1]:
            raise ValueError(f"silu_mul needs a gate/up layer of two equal parts, got parts {self.output_sizes}")
        if self.is_packed and ops.fuses_silu_mul(x.numel() // x.shape[-1], self.qweight, self.scales_zeros, self.group_size):
            return packed_linear_silu_mul(x, self.qweight, self.scales_zeros, self.group_size, self.bias)
        return silu_and_mul(self(x))
