"""Build a Qwen3.5 model from a checkpoint directory and load its weights.

Three kinds of checkpoint are read, each decided from config.json's quantization_config:

- a onecat packed artifact (``quant_method: onecat``): packed linears are used as stored;
- a 4-bit AutoAWQ GEMM or compressed-tensors ``pack-quantized`` checkpoint: each quantized
  linear is packed into the Volta layout while loading (``onecat pack`` does the same once);
- an fp16 / bf16 / fp32 checkpoint.

Which linears are quantized is read per module from the tensors present (a
:class:`~onecat.runtime.quant_plan.QuantPlan`), so mixed checkpoints load. Keys may use the
multimodal wrapper's layout (``model.language_model.layers.N...``) or the text-only one
(``model.layers.N...``); ``model.visual.*`` is ignored, ``mtp.*`` is read only when the
multi-token-prediction head is asked for (speculative decoding). MoE experts may be
fused 3-D tensors (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]) or
per expert (``experts.E.gate_proj`` ...). Each parameter loads itself (its ``weight_loader``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from onecat.errors import OnecatError
from onecat.formats.checkpoint import Checkpoint
from onecat.formats.files import read_checkpoint_json
from onecat.formats.fp16_headroom import HeadroomPlan, plan_from_config
from onecat.formats.integers import dequantize, group_size_of
from onecat.formats.quant_config import ONECAT, detect_format
from onecat.formats.quantized_linears import (
    find_quantized_linears,
    read_quantized_linear,
    stored_group_size,
)
from onecat.pack.artifact import open_packed
from onecat.pack.repack import to_volta
from onecat.pack.volta_layout import fits_layout
from onecat.runtime import fp16_headroom as headroom
from onecat.runtime.layers.linear import Linear, LinearWeights
from onecat.runtime.layers.moe import DOWN, GATE, UP, FusedExperts
from onecat.runtime.models.config import ModelConfig
from onecat.runtime.models.qwen3_5 import Qwen3_5ForCausalLM
from onecat.runtime.quant_plan import QuantPlan

WRAPPER_PREFIX = "model.language_model."


class WeightSource:
    """Tensors of one checkpoint by text-model name (``model.layers.N...``, ``lm_head``).

    With a ``headroom`` plan (``onecat.formats.fp16_headroom``) every linear and tensor comes
    back with the plan's power of two folded in (``onecat.runtime.fp16_headroom``)."""

    def __init__(self, path: Path, config: dict[str, Any], headroom: HeadroomPlan | None = None) -> None:
        self.path = path
        self.config = config
        self.headroom = headroom if headroom is not None and not headroom.is_identity else None
        self.tied = bool(config.get("tie_word_embeddings", (config.get("text_config") or {}).get(
            "tie_word_embeddings", False)))
        self._format = detect_format(config, str(path / "config.json"))
        self.kind = self._format.kind
        self._packed = None
        self._ckpt = None
        self._quantized: dict[str, int] = {}
        if self.kind == ONECAT:
            self._packed = open_packed(path)
            names = self._packed.tensor_names()
            for prefix in self._packed.linear_prefixes():
                entry = self._packed.manifest["linears"][prefix]
                self._quantized[prefix] = int(entry["group_size"])
        else:
            self._ckpt = Checkpoint(path)
            names = self._ckpt.names()
            if self._format.quantized_source:
                for prefix in find_quantized_linears(self._ckpt, self._format):
                    self._quantized[prefix] = stored_group_size(self._ckpt, self._format, prefix)
        self._names = set(names)
        self._wrapped = any(n.startswith(WRAPPER_PREFIX) for n in names)
        self._fused_cache: dict[str, torch.Tensor] = {}

    def actual(self, name: str) -> str:
        """The checkpoint's key for text-model name ``name``."""
        if self._wrapped and name.startswith("model."):
            return WRAPPER_PREFIX + name[len("model.") :]
        return name

    def plan(self) -> QuantPlan:
        """Which text-model linears are quantized, with their group sizes."""
        text_name = {}
        for prefix, group in self._quantized.items():
            name = "model." + prefix[len(WRAPPER_PREFIX) :] if prefix.startswith(WRAPPER_PREFIX) else prefix
            text_name[name] = group
        return QuantPlan(text_name)

    def has(self, name: str) -> bool:
        """True when the checkpoint holds tensor ``name`` (text-model name)."""
        return self.actual(name) in self._names

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` (text-model name) on the CPU (the headroom plan folded in)."""
        key = self.actual(name)
        if key not in self._names:
            raise OnecatError(f"tensor {key} is missing from the checkpoint {self.path}")
        t = self._packed.get_tensor(key) if self._packed else self._ckpt.get(key)
        plan = self.headroom
        if plan is None:
            return t
        if self.tied and name in ("model.norm.weight", "mtp.norm.weight"):  # lm_head is the scaled embedding
            return headroom.scale_one_plus(t, plan.residual_shift)
        return headroom.scale_tensor(t, headroom.tensor_shift(plan, name), key)

    def linear(self, name: str) -> LinearWeights | None:
        """The linear ``name`` (without ``.weight``), packed when it is quantized; None if absent
        (the headroom plan folded in)."""
        weights = self._linear(name)
        if weights is None or self.headroom is None:
            return weights
        return headroom.scale_linear(weights, headroom.linear_shift(self.headroom, name), self.actual(name))

    def _linear(self, name: str) -> LinearWeights | None:
        key = self.actual(name)
        bias = self.tensor(f"{name}.bias") if self.has(f"{name}.bias") else None
        if key in self._quantized:
            if self._packed is not None:
                packed = self._packed.get_linear(key)
                return LinearWeights(
                    qweight=packed.qweight,
                    scales_zeros=packed.scales_zeros,
                    group_size=packed.group_size,
                    bias=packed.bias,
                )
            q, zeros, scales = read_quantized_linear(self._ckpt, self._format, key)
            group = group_size_of(q, zeros)
            if not fits_layout(q.shape[0], q.shape[1], group):
                return LinearWeights(weight=dequantize(q, zeros, scales, torch.float16), bias=bias)
            qweight, scales_zeros = to_volta(q, zeros, scales, f"{key} in {self.path}")
            return LinearWeights(qweight=qweight, scales_zeros=scales_zeros, group_size=group, bias=bias)
        if self.has(f"{name}.weight"):
            return LinearWeights(weight=self.tensor(f"{name}.weight"), bias=bias)
        return None

    def expert(self, prefix: str, expert: int, which: str) -> LinearWeights:
        """Expert ``expert``'s ``which`` projection of the experts at ``prefix`` (the headroom
        plan folded in)."""
        weights = self._expert(prefix, expert, which)
        if self.headroom is None:
            return weights
        shift = headroom.expert_shift(self.headroom, prefix, which)
        return headroom.scale_linear(weights, shift, f"{self.actual(prefix)}.{expert}.{which}")

    def _expert(self, prefix: str, expert: int, which: str) -> LinearWeights:
        per_expert = self._linear(f"{prefix}.{expert}.{which}")
        if per_expert is not None:
            return per_expert
        fused_name = f"{prefix}.down_proj" if which == DOWN else f"{prefix}.gate_up_proj"
        if not self.has(fused_name):
            raise OnecatError(
                f"{self.path}: expert {expert} {which} of {self.actual(prefix)} is missing (neither "
                "per-expert weights nor fused gate_up_proj / down_proj are present)"
            )
        if fused_name not in self._fused_cache:
            self._fused_cache.clear()  # one layer's fused experts at a time
            key = self.actual(fused_name)
            self._fused_cache[fused_name] = self._packed.get_tensor(key) if self._packed else self._ckpt.get(key)
        fused = self._fused_cache[fused_name][expert]
        if which != DOWN:
            half = fused.shape[0] // 2
            fused = fused[:half] if which == GATE else fused[half:]
        return LinearWeights(weight=fused)


def read_model_config(path: str | Path) -> tuple[dict[str, Any], ModelConfig]:
    """config.json of ``path`` and the model facts parsed from it."""
    path = Path(path)
    if not path.is_dir():
        raise OnecatError(f"{path} is not a directory; give a checkpoint or packed artifact directory")
    raw = read_checkpoint_json(path, "config.json")
    return raw, ModelConfig.from_dict(raw, str(path / "config.json"))


def load_model(
    path: str | Path, device: torch.device, dtype: torch.dtype, *, mtp: bool = False,
    headroom: HeadroomPlan | None = None,
) -> Qwen3_5ForCausalLM:
    """Build the model of checkpoint ``path`` on ``device`` (activations in ``dtype``) and load
    every weight; ``mtp`` also loads the multi-token-prediction head (``mtp.*``). ``headroom``:
    the fp16 headroom plan to fold into the weights (None: the one in config.json, if any).
    Raises OnecatError on unsupported or incomplete checkpoints."""
    path = Path(path)
    raw, cfg = read_model_config(path)
    plan = headroom if headroom is not None else plan_from_config(raw, str(path / "config.json"))
    source = WeightSource(path, raw, plan)
    if mtp:
        check_mtp(source)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(cfg, source.plan(), dtype, mtp=mtp)
    load_weights(model, source)
    apply_norm_eps(model, source)
    return model


def apply_norm_eps(model: nn.Module, source: WeightSource) -> None:
    """After :func:`load_weights`: scale the norms' eps for the source's headroom plan."""
    if source.headroom is not None:
        headroom.scale_norm_eps(model, source.headroom, source.tied)


def check_mtp(source: WeightSource) -> None:
    """Raise OnecatError when the checkpoint lacks the multi-token-prediction head."""
    if not source.has("mtp.fc.weight"):
        raise OnecatError(
            f"{source.path}: speculative decoding with method 'mtp' needs the checkpoint's "
            "multi-token-prediction head (mtp.* tensors), which it lacks; copy them from the "
            "original checkpoint (onecat quantize and pack keep them) or drop --speculative-config"
        )


def load_weights(model: nn.Module, source: WeightSource) -> None:
    """Load every parameter of ``model`` from ``source`` (OnecatError on a missing tensor)."""
    done: set[str] = set()
    for module_name, module in model.named_modules():
        if isinstance(module, Linear) and getattr(module, "sources", None):
            for shard, name in enumerate(module.sources):
                weights = source.linear(name)
                if weights is None:
                    raise OnecatError(f"{source.path}: linear {source.actual(name)} is missing")
                try:
                    module.load_weights(weights, shard if len(module.sources) > 1 else None)
                except ValueError as exc:
                    raise OnecatError(f"{source.path}: {source.actual(name)}: {exc}") from None
        elif isinstance(module, FusedExperts):
            for expert in range(module.num_experts):
                for which in (GATE, UP, DOWN):
                    weights = source.expert(module.prefix, expert, which)
                    try:
                        module.load_weights(expert, which, weights)
                    except ValueError as exc:
                        raise OnecatError(f"{source.path}: {module.prefix}: {exc}") from None
        else:
            continue
        done.update(f"{module_name}.{p}" for p, _ in module.named_parameters())
    for name, param in model.named_parameters():
        if name in done:
            continue
        loaded = source.tensor(name)
        loader = getattr(param, "weight_loader", None)
        with torch.no_grad():
            if loader is not None:
                loader(param, loaded.to(param.device))
            elif tuple(loaded.shape) != tuple(param.shape):
                raise OnecatError(
                    f"{source.path}: {source.actual(name)} has shape {tuple(loaded.shape)}, the "
                    f"model expects {tuple(param.shape)}; config.json does not match the weights"
                )
            else:
                param.data.copy_(loaded)
