"""vLLM linear methods: 4-bit weights in onecat's Volta layout, run by onecat's W4A16 op.

Two ways in, one way out:

- ``OnecatLinearMethod`` (packed artifacts, ``quant_method: onecat``) creates the parameters
  directly in the Volta layout: ``qweight`` int32 ``[N/32, K/32, 32, 4]`` and
  ``scales_zeros`` fp16 ``[N/32, K/g, 32, 2]``. Both are tile-major along N and K, so a
  tensor-parallel slice is a contiguous range of tiles (``onecat.pack.volta_layout.
  slice_volta``): vLLM's own ``PackedvLLMParameter`` loaders do the sharding with
  ``packed_factor=32`` on the output dimension (one row of tiles = 32 output columns), for
  column- and row-parallel layers and merged q/k/v, gate/up and GDN ``in_proj_qkvz``.
- ``OnecatAwqLinearMethod`` (plain AutoAWQ GEMM checkpoints) loads ``qweight``/``qzeros``/
  ``scales`` exactly as vLLM's AWQ method does and repacks each rank's slice once in
  ``process_weights_after_loading``. A slice the layout cannot hold (N not a multiple of
  32) is dequantised to an fp16 weight instead, with a warning.

Both call :func:`onecat.kernels.ops.packed_linear` in ``apply``.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.linear import (
    LinearMethodBase,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.parameter import GroupQuantScaleParameter, PackedvLLMParameter

from onecat.errors import OnecatError
from onecat.formats.awq_gemm import dequantize_awq_gemm
from onecat.kernels.ops import packed_linear
from onecat.pack.partitions import check_partition
from onecat.pack.repack import awq_to_volta
from onecat.pack.volta_layout import TILE, fits_layout

logger = logging.getLogger(__name__)

AWQ_PACK_FACTOR = 8
"""4-bit values per int32 word in AutoAWQ's format."""


def _replace(layer: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    if hasattr(layer, name):
        delattr(layer, name)
    layer.register_parameter(name, torch.nn.Parameter(value.contiguous(), requires_grad=False))


@register_weight_loader_v2_supported_method
class OnecatLinearMethod(LinearMethodBase):
    """Linear layers of a packed onecat artifact (Volta layout on disk)."""

    def __init__(self, group_size: int, prefix: str = "") -> None:
        self.group_size = group_size
        self.prefix = prefix

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        """Register ``qweight`` and ``scales_zeros`` for this rank's slice."""
        g = self.group_size
        check_partition(self.prefix, output_partition_sizes, input_size_per_partition, g)
        n_tiles = sum(output_partition_sizes) // TILE
        weight_loader = extra_weight_attrs.get("weight_loader")
        qweight = PackedvLLMParameter(
            data=torch.empty(n_tiles, input_size_per_partition // TILE, TILE, 4, dtype=torch.int32),
            input_dim=1,
            output_dim=0,
            packed_dim=0,
            packed_factor=TILE,
            weight_loader=weight_loader,
        )
        scales_zeros = PackedvLLMParameter(
            data=torch.empty(n_tiles, input_size_per_partition // g, TILE, 2, dtype=torch.float16),
            input_dim=1,
            output_dim=0,
            packed_dim=0,
            packed_factor=TILE,
            weight_loader=weight_loader,
        )
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("scales_zeros", scales_zeros)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Turn the loader parameters into plain, contiguous ones."""
        _replace(layer, "qweight", layer.qweight.data)
        _replace(layer, "scales_zeros", layer.scales_zeros.data)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ W.T (+ bias)`` through onecat's W4A16 op."""
        return packed_linear(x, layer.qweight, layer.scales_zeros, self.group_size, bias)


@register_weight_loader_v2_supported_method
class OnecatAwqLinearMethod(LinearMethodBase):
    """Linear layers of a plain AutoAWQ GEMM checkpoint, repacked to the Volta layout."""

    def __init__(self, group_size: int, prefix: str = "") -> None:
        self.group_size = group_size
        self.prefix = prefix

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        """Register AWQ's ``qweight``/``qzeros``/``scales`` for this rank's slice."""
        g = self.group_size
        n = sum(output_partition_sizes)
        bad_parts = [size for size in output_partition_sizes if size % AWQ_PACK_FACTOR]
        if input_size_per_partition % g or bad_parts:
            raise OnecatError(
                f"{self.prefix or 'a linear layer'}: the tensor-parallel slice "
                f"[{n} x {input_size_per_partition}] cannot be cut from the AWQ tensors "
                f"(group size {g}, 8 columns per word); use a smaller --tensor-parallel-size"
            )
        weight_loader = extra_weight_attrs.get("weight_loader")
        groups = input_size_per_partition // g
        qweight = PackedvLLMParameter(
            data=torch.empty(input_size_per_partition, n // AWQ_PACK_FACTOR, dtype=torch.int32),
            input_dim=0,
            output_dim=1,
            packed_dim=1,
            packed_factor=AWQ_PACK_FACTOR,
            weight_loader=weight_loader,
        )
        qzeros = PackedvLLMParameter(
            data=torch.empty(groups, n // AWQ_PACK_FACTOR, dtype=torch.int32),
            input_dim=0,
            output_dim=1,
            packed_dim=1,
            packed_factor=AWQ_PACK_FACTOR,
            weight_loader=weight_loader,
        )
        # fp16 whatever the activation dtype: the scales must reach pack_volta unrounded.
        scales = GroupQuantScaleParameter(
            data=torch.empty(groups, n, dtype=torch.float16),
            input_dim=0,
            output_dim=1,
            weight_loader=weight_loader,
        )
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("qzeros", qzeros)
        layer.register_parameter("scales", scales)
        layer.onecat_dtype = params_dtype

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack this rank's AWQ slice to the Volta layout (or dequantise it, see above)."""
        qweight, qzeros, scales = layer.qweight.data, layer.qzeros.data, layer.scales.data
        n, k = qweight.shape[1] * AWQ_PACK_FACTOR, qweight.shape[0]
        for name in ("qweight", "qzeros", "scales"):
            delattr(layer, name)
        if fits_layout(n, k, self.group_size):
            packed_q, packed_sz = awq_to_volta(qweight, qzeros, scales, self.prefix)
            _replace(layer, "qweight", packed_q)
            _replace(layer, "scales_zeros", packed_sz)
            layer.onecat_dense = False
        else:
            logger.warning(
                "onecat: %s [%d x %d] does not fit the Volta layout; running it dequantised in %s",
                self.prefix,
                n,
                k,
                layer.onecat_dtype,
            )
            dense = dequantize_awq_gemm(qweight, qzeros, scales, layer.onecat_dtype, self.prefix)
            _replace(layer, "weight", dense)
            layer.onecat_dense = True

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ W.T (+ bias)``: onecat's W4A16 op, or a dense matmul for the fallback."""
        if layer.onecat_dense:
            return F.linear(x, layer.weight, bias)
        return packed_linear(x, layer.qweight, layer.scales_zeros, self.group_size, bias)
