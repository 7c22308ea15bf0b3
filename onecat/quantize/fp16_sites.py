"""Measure the fp16 headroom sites (``onecat.formats.fp16_headroom.SITES``) of one decoder
layer during the calibration pass, and the logits' peak after the last layer.

Sites are found by the module names transformers' decoder layers share (Llama, Qwen3,
Qwen3.5 and their MoE variants): the inputs of the ``*layernorm`` modules are the residual
stream and their outputs the norm outputs; ``o_proj`` / ``out_proj`` / ``down_proj`` inputs are
the attention output, the GDN output and ``silu(gate) * up``, and their outputs are added into
the residual stream; ``gate_proj`` / ``up_proj`` outputs are the gate·up product's factors.
Routed experts (``mlp.experts.E.*``) count as the layer's MLP.
"""

from __future__ import annotations

import torch
from torch import nn

from onecat.formats.fp16_headroom import FP16_MAX

INPUT_SITES = {"o_proj": "attn_out", "out_proj": "gdn_out", "down_proj": "down_in"}
OUTPUT_SITES = {"gate_proj": "gate", "up_proj": "up", "o_proj": "residual", "out_proj": "residual",
                "down_proj": "residual"}
LOGIT_TOKENS = 2048  # calibration tokens whose logits are measured
LOGIT_ROWS = 32768  # lm_head rows per fp32 slice


def _peak(t: torch.Tensor) -> float:
    if not t.numel():
        return 0.0
    value = float(t.detach().abs().amax())
    return value if value == value else float("inf")


class SiteProbe:
    """Forward hooks on one transformers decoder layer keeping each site's peak ``|x|``."""

    def __init__(self, layer: nn.Module) -> None:
        self.peaks: dict[str, float] = {}
        self.handles = []
        for name, module in layer.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf.endswith("layernorm"):
                self.handles.append(module.register_forward_pre_hook(self._input("residual")))
                self.handles.append(module.register_forward_hook(self._output("norm")))
            if leaf in INPUT_SITES and isinstance(module, nn.Linear):
                self.handles.append(module.register_forward_pre_hook(self._input(INPUT_SITES[leaf])))
            if leaf in OUTPUT_SITES and isinstance(module, nn.Linear):
                self.handles.append(module.register_forward_hook(self._output(OUTPUT_SITES[leaf])))

    def note(self, site: str, value: float) -> None:
        """Raise the peak of ``site`` to ``value``."""
        self.peaks[site] = max(self.peaks.get(site, 0.0), value)

    def _input(self, site: str):
        def hook(module: nn.Module, args: tuple) -> None:
            if args:
                self.note(site, _peak(args[0]))

        return hook

    def _output(self, site: str):
        def hook(module: nn.Module, args: tuple, output) -> None:
            self.note(site, _peak(output[0] if isinstance(output, tuple) else output))

        return hook

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self.handles:
            handle.remove()
        self.handles = []


@torch.no_grad()
def logits_peak(hidden: torch.Tensor, norm_weight: torch.Tensor, head: torch.Tensor, eps: float,
                one_plus: bool) -> float:
    """The peak ``|logit|`` of the final hidden states ``hidden [S, L, H]`` (about
    :data:`LOGIT_TOKENS` strided tokens) through the final RMSNorm and ``head [V, H]``, fp32,
    ``head`` in slices of :data:`LOGIT_ROWS` rows."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    flat = flat[:: max(1, flat.shape[0] // LOGIT_TOKENS)].float()
    weight = norm_weight.float().to(flat.device)
    normed = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps) * ((1.0 + weight) if one_plus else weight)
    peak = 0.0
    for start in range(0, head.shape[0], LOGIT_ROWS):
        rows = head[start : start + LOGIT_ROWS].to(device=flat.device, dtype=torch.float32)
        peak = max(peak, _peak(normed @ rows.T))
    return peak


def fraction_of_fp16(value: float) -> float:
    """``value / 65504`` rounded for the report."""
    return round(value / FP16_MAX, 6)
