"""vLLM MoE methods for Qwen3.5-35B-A3B's routed experts on onecat's grouped W4A16 MoE op.

Per local expert the layer holds ``w13`` (gate rows, then up rows: ``[2*I_p, H]``) and ``w2``
(``[H, I_p]``) in the Volta layout, stacked along a leading expert dimension:
``w13_qweight [E, 2*I_p/32, H/32, 32, 4]``, ``w13_scales_zeros [E, 2*I_p/32, H/g, 32, 2]``,
``w2_qweight [E, H/32, I_p/32, 32, 4]``, ``w2_scales_zeros [E, H/32, I_p/g, 32, 2]``.
Tensor parallelism splits the intermediate size ``I`` (columns of gate/up, inputs of down);
expert parallelism gives each rank whole experts (vLLM's expert map).

- ``OnecatMoEMethod`` (packed artifacts): its own weight loader cuts each rank's slice of a
  per-expert Volta tensor with ``slice_volta_part`` (no unpacking).
- ``OnecatAwqMoEMethod`` (plain AWQ): vLLM's expert loader fills AWQ-shaped parameters as
  for its own AWQ method; ``process_weights_after_loading`` repacks expert by expert.

``apply`` runs ``torch.ops.onecat.w4a16_moe`` (onecat.kernels.moe): all routed experts in a
few launches that read the stacked expert weights in place, with no host sync, so the same
call serves eager steps and CUDA-graph capture; experts that vLLM's expert map marks ``-1``
(other ranks') contribute nothing. On the CPU the op's reference runs.
"""

from __future__ import annotations

from functools import partial

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEConfig, FusedMoEMethodBase

from onecat.errors import OnecatError
from onecat.kernels.moe import w4a16_moe
from onecat.pack.partitions import check_expert_partition
from onecat.pack.repack import awq_to_volta
from onecat.pack.volta_layout import TILE
from onecat.vllm_plugin.tp_slicing import slice_volta_part

AWQ_PACK_FACTOR = 8


def _replace(layer: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    if hasattr(layer, name):
        delattr(layer, name)
    layer.register_parameter(name, torch.nn.Parameter(value.contiguous(), requires_grad=False))


def _register(layer: torch.nn.Module, name: str, data: torch.Tensor, attrs: dict) -> None:
    param = torch.nn.Parameter(data, requires_grad=False)
    layer.register_parameter(name, param)
    for key, value in attrs.items():
        setattr(param, key, value)


class _OnecatExpertsBase(FusedMoEMethodBase):
    """Shared ``apply``: the grouped W4A16 MoE op on the Volta-layout expert weights."""

    def __init__(self, moe: FusedMoEConfig | None, group_size: int, prefix: str = "") -> None:
        super().__init__(moe)
        self.group_size = group_size
        self.prefix = prefix

    def maybe_roundup_sizes(
        self,
        hidden_size: int,
        intermediate_size_per_partition: int,
        act_dtype: torch.dtype,
        moe_parallel_config: object,
    ) -> tuple[int, int]:
        """The Volta layout needs the true sizes: never pad them."""
        return hidden_size, intermediate_size_per_partition

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> None:
        """No fused-MoE kernel is involved."""
        return None

    def _check_activation(self, layer: torch.nn.Module) -> None:
        activation = getattr(layer.activation, "value", layer.activation)
        if str(activation).lower() != "silu" or layer.apply_router_weight_on_input:
            raise OnecatError(
                f"{self.prefix}: onecat's MoE method supports SiLU experts with router "
                f"weights applied to the output (Qwen3.5), got activation {activation!r}"
            )

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: torch.nn.Module | None,
        shared_experts_input: torch.Tensor | None,
    ) -> torch.Tensor:
        """Routed experts' output ``[T, H]`` (vLLM adds the shared expert and all-reduces)."""
        ids = topk_ids
        if layer.expert_map is not None:
            ids = layer.expert_map[ids.long()]  # global -> local expert, -1 when not on this rank
        return w4a16_moe(
            x, ids, topk_weights, layer.w13_qweight, layer.w13_scales_zeros,
            layer.w2_qweight, layer.w2_scales_zeros, self.group_size,
        )  # fmt: skip


class OnecatMoEMethod(_OnecatExpertsBase):
    """Routed experts of a packed onecat artifact (per-expert Volta tensors on disk)."""

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        """Register Volta-layout expert weights with a slicing loader (see module docs)."""
        g, h, i_p = self.group_size, hidden_size, intermediate_size_per_partition
        check_expert_partition(self.prefix, h, i_p, g)
        loader = {"weight_loader": partial(self._load_expert, layer)}
        e = num_experts
        _register(
            layer,
            "w13_qweight",
            torch.empty(e, 2 * i_p // TILE, h // TILE, TILE, 4, dtype=torch.int32),
            loader,
        )
        _register(
            layer,
            "w13_scales_zeros",
            torch.empty(e, 2 * i_p // TILE, h // g, TILE, 2, dtype=torch.float16),
            loader,
        )
        _register(
            layer,
            "w2_qweight",
            torch.empty(e, h // TILE, i_p // TILE, TILE, 4, dtype=torch.int32),
            loader,
        )
        _register(
            layer,
            "w2_scales_zeros",
            torch.empty(e, h // TILE, i_p // g, TILE, 2, dtype=torch.float16),
            loader,
        )

    def _load_expert(
        self,
        layer: torch.nn.Module,
        param: torch.nn.Parameter,
        loaded_weight: torch.Tensor,
        weight_name: str,
        shard_id: str,
        expert_id: int,
        return_success: bool = False,
    ) -> bool | None:
        """Copy this rank's slice of one expert's ``qweight`` or ``scales_zeros``."""
        local = layer._map_global_expert_id_to_local_expert_id(expert_id)
        if local == -1:
            return False if return_success else None
        part_name = "qweight" if weight_name.endswith("qweight") else "scales_zeros"
        rank, world = layer.moe_config.tp_rank, layer.moe_config.tp_size
        split = "in" if shard_id == "w2" else "out"
        try:
            part = slice_volta_part(loaded_weight, part_name, self.group_size, split, rank, world)
        except ValueError as exc:
            raise OnecatError(f"{self.prefix}: expert {expert_id} {shard_id}: {exc}") from exc
        dest = param.data[local]
        if shard_id in ("w1", "w3"):
            half = dest.shape[0] // 2
            dest = dest[:half] if shard_id == "w1" else dest[half:]
        if tuple(dest.shape) != tuple(part.shape):
            raise OnecatError(
                f"{self.prefix}: expert {expert_id} {shard_id} {weight_name}: checkpoint slice "
                f"{tuple(part.shape)} does not match the layer's {tuple(dest.shape)}; "
                "was the artifact packed from this model?"
            )
        dest.copy_(part)
        return True if return_success else None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Check the activation; make the parameters plain and contiguous."""
        self._check_activation(layer)
        for name in ("w13_qweight", "w13_scales_zeros", "w2_qweight", "w2_scales_zeros"):
            _replace(layer, name, getattr(layer, name).data)


class OnecatAwqMoEMethod(_OnecatExpertsBase):
    """Routed experts of a plain AutoAWQ GEMM checkpoint, repacked after loading."""

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        """Register AWQ-shaped expert tensors that vLLM's expert loader fills and shards."""
        from vllm.model_executor.layers.fused_moe import FusedMoeWeightScaleSupported

        g, h, i_p, e = self.group_size, hidden_size, intermediate_size_per_partition, num_experts
        check_expert_partition(self.prefix, h, i_p, g)
        attrs = dict(extra_weight_attrs)
        attrs.update(is_transposed=True, quant_method=FusedMoeWeightScaleSupported.GROUP.value)
        f = AWQ_PACK_FACTOR
        _register(layer, "w13_qweight", torch.empty(e, h, 2 * i_p // f, dtype=torch.int32), attrs)
        _register(
            layer, "w13_qzeros", torch.empty(e, h // g, 2 * i_p // f, dtype=torch.int32), attrs
        )
        _register(layer, "w13_scales", torch.empty(e, h // g, 2 * i_p, dtype=torch.float16), attrs)
        _register(layer, "w2_qweight", torch.empty(e, i_p, h // f, dtype=torch.int32), attrs)
        _register(layer, "w2_qzeros", torch.empty(e, i_p // g, h // f, dtype=torch.int32), attrs)
        _register(layer, "w2_scales", torch.empty(e, i_p // g, h, dtype=torch.float16), attrs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack every local expert's gate/up and down to the Volta layout."""
        self._check_activation(layer)
        for stem in ("w13", "w2"):
            q, z, s = (
                getattr(layer, f"{stem}_{part}").data for part in ("qweight", "qzeros", "scales")
            )
            packed = [awq_to_volta(q[e], z[e], s[e]) for e in range(q.shape[0])]
            for part in ("qweight", "qzeros", "scales"):
                delattr(layer, f"{stem}_{part}")
            _replace(layer, f"{stem}_qweight", torch.stack([p[0] for p in packed]))
            _replace(layer, f"{stem}_scales_zeros", torch.stack([p[1] for p in packed]))
