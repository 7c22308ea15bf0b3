"""vLLM quantization configs: ``onecat`` (packed artifacts) and ``onecat_awq`` (plain AWQ).

- ``onecat``: selected by ``quant_method: onecat`` in the artifact's config.json (written by
  ``onecat pack``); checks ``format: volta-w4`` and the layout version.
- ``onecat_awq``: claims AutoAWQ GEMM checkpoints (``quant_method: awq``, 4 bits, zero
  point) through ``override_quantization_method`` when vLLM runs on an sm_70 GPU (vLLM's own
  AWQ kernels need sm_75), or anywhere with ``--quantization onecat_awq``.

Both take fp16 activations on GPUs (V100 has no bf16; start vLLM with ``--dtype half``) and
need compute capability 7.0. vLLM's CPU backend also gets bf16/fp32, because its Gated
DeltaNet kernel runs bf16 only; the reference op handles any float dtype.
Which modules are 4-bit is read from the checkpoint's tensors (``quantized_modules``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from vllm.platforms import current_platform

from onecat.errors import OnecatError
from onecat.formats.awq_gemm import check_awq_config
from onecat.pack.artifact import check_onecat_config
from onecat.pack.volta_layout import TILE
from onecat.vllm_plugin.linear_method import OnecatAwqLinearMethod, OnecatLinearMethod
from onecat.vllm_plugin.moe_method import OnecatAwqMoEMethod, OnecatMoEMethod
from onecat.vllm_plugin.quantized_modules import (
    checkpoint_tensor_names,
    experts_quantized,
    is_quantized,
    quantized_module_keys,
)

ONECAT = "onecat"
ONECAT_AWQ = "onecat_awq"
AWQ_NAMES = ("awq", "awq_marlin", "auto_awq")
"""``--quantization`` values a user may pass for an AWQ checkpoint that we still claim."""


def _act_dtypes() -> list[torch.dtype]:
    if current_platform.is_cpu():
        return [torch.float16, torch.bfloat16, torch.float32]
    return [torch.float16]


def _is_sm70() -> bool:
    if not current_platform.is_cuda():
        return False
    capability = current_platform.get_device_capability()
    return capability is not None and capability.to_int() == 70


class _OnecatConfigBase(QuantizationConfig):
    """What both configs share: group size, per-module detection, the method factory."""

    linear_method_cls: type = OnecatLinearMethod
    moe_method_cls: type = OnecatMoEMethod

    def __init__(self, group_size: int) -> None:
        super().__init__()
        self.group_size = group_size
        self.quantized: set[str] | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(group_size={self.group_size})"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        """fp16 on GPUs; the CPU backend also gets bf16/fp32 (reference path)."""
        return _act_dtypes()

    @classmethod
    def get_min_capability(cls) -> int:
        """Volta (sm_70) and newer."""
        return 70

    @staticmethod
    def get_config_filenames() -> list[str]:
        """The quantization config lives in config.json."""
        return []

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None) -> None:
        """Read which modules are 4-bit from the checkpoint's safetensors headers."""
        if Path(model_name).is_dir():
            names = checkpoint_tensor_names(model_name)
        else:  # a hub id: vLLM reads the headers from its cache or the hub
            from vllm.transformers_utils.config import get_safetensors_params_metadata

            names = list(get_safetensors_params_metadata(model_name, revision=revision))
        self.quantized = quantized_module_keys(names)
        if not self.quantized:
            raise OnecatError(
                f"{model_name}: no '.qweight' tensors found, but config.json declares a "
                f"{self.get_name()} checkpoint; re-run `onecat pack` / `onecat quantize`"
            )
        if "lm_head" in self.quantized:
            raise OnecatError(
                f"{model_name}: lm_head is 4-bit; the vLLM plugin serves fp16 lm_heads only "
                "(quantize without lm_head, the recipes' default)"
            )

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The onecat method for 4-bit linears and experts, vLLM's fp16 one otherwise."""
        if self.quantized is None:
            raise OnecatError(
                f"{self.get_name()}: the config was not initialised from a checkpoint "
                "(maybe_update_config was not called); load the model through vLLM"
            )
        if isinstance(layer, LinearBase):
            if not is_quantized(prefix, self.quantized, self.packed_modules_mapping):
                return UnquantizedLinearMethod()
            return self.linear_method_cls(self.group_size, prefix)
        if isinstance(layer, RoutedExperts):
            if not experts_quantized(prefix, self.quantized):
                return None  # vLLM falls back to its unquantized MoE method
            return self.moe_method_cls(layer.moe_config, self.group_size, prefix)
        return None


class OnecatConfig(_OnecatConfigBase):
    """``quant_method: onecat``: a packed artifact in the Volta layout (docs/FORMAT.md)."""

    @classmethod
    def get_name(cls) -> str:
        """The ``quant_method`` value in config.json."""
        return ONECAT

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> OnecatConfig:
        """Validate the artifact's ``quantization_config`` and build the config."""
        return cls(check_onecat_config(config, "config.json quantization_config"))


class OnecatAwqConfig(_OnecatConfigBase):
    """Plain AutoAWQ GEMM checkpoints, repacked into the Volta layout while loading."""

    linear_method_cls = OnecatAwqLinearMethod
    moe_method_cls = OnecatAwqMoEMethod

    @classmethod
    def get_name(cls) -> str:
        """Name for ``--quantization onecat_awq``."""
        return ONECAT_AWQ

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> OnecatAwqConfig:
        """Validate an AutoAWQ ``quantization_config`` (4 bits, zero point, GEMM)."""
        where = "config.json quantization_config"
        group_size = check_awq_config(config, where)
        if group_size is None or group_size % TILE:
            raise OnecatError(
                f"{where}: group_size {group_size!r}; the Volta layout needs a positive multiple "
                f"of {TILE} (g128 checkpoints work)"
            )
        return cls(group_size)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        """Claim AWQ checkpoints on sm_70 (or when asked by name) before vLLM's AWQ does."""
        if str(hf_quant_cfg.get("quant_method", "")).lower() != "awq":
            return None
        if user_quant == ONECAT_AWQ:
            return ONECAT_AWQ
        if (user_quant is None or user_quant in AWQ_NAMES) and _is_sm70():
            return ONECAT_AWQ
        return None
