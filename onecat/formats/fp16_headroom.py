"""fp16 headroom: the measured activation peaks of a model and the plan that keeps it in range.

A V100 has no bf16, so onecat runs bf16-trained checkpoints in fp16 (largest finite value
65504). Qwen models are known to exceed that (QwenLM/Qwen3 issues 826 and 868). An audit
(``onecat quantize`` on its calibration data, or the runtime on built-in text at start-up)
records, per decoder layer, the largest ``|activation|`` at each site the runtime computes in
fp16 (:data:`SITES`); :func:`derive_plan` turns those peaks into a :class:`HeadroomPlan` of
powers of two that the runtime folds into weights when it loads them, at no cost per token:

- ``residual_shift`` k: the whole residual stream is carried times ``2^-k``. Every reader of
  the stream is a ``(1 + w)`` RMSNorm, which is scale-invariant once its eps is scaled by
  ``2^-2k`` too, so the model computes the same function: the embedding rows and every linear
  that adds into the stream (attention ``o_proj``, GDN ``out_proj``, MLP / expert / shared
  expert ``down_proj``) are scaled by ``2^-k``. Powers of two are exact in fp16 and fp32
  unless a value becomes subnormal (the loader counts those).
- ``mlp_shift[i]`` m: layer i's ``up`` and ``silu(gate) * up`` are carried times ``2^-m``
  (``up_proj``'s output scaled by ``2^-m``, ``down_proj``'s weights by ``2^m``: its output is
  unchanged).
- ``attn_shift[i]`` / ``gdn_shift[i]``: the same for the input of an attention layer's
  ``o_proj`` (through ``v_proj``: attention output is a convex mix of values) or of a GDN
  layer's ``out_proj`` (through the gated norm's weight).

Each shift is the smallest that brings its measured peak under :data:`TARGET` (an eighth of
the fp16 maximum: the audit sees a few thousand tokens, a user's prompt may go higher). Sites
no fold can move (norm outputs, the gate projection, logits) are listed in ``unhandled``.

The plan is stored in config.json under :data:`CONFIG_KEY` (``onecat quantize`` writes it;
``onecat pack`` keeps every top-level key, so a packed artifact carries it); docs/FORMAT.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from onecat.errors import OnecatError

FP16_MAX = 65504.0
TARGET = FP16_MAX / 8
"""A peak above this (an eighth of the fp16 maximum) is handled: the safety margin for text
the audit did not see."""
CONFIG_KEY = "onecat_fp16_headroom"
PLAN_VERSION = 1
SITES = ("residual", "norm", "gate", "up", "down_in", "attn_out", "gdn_out")
"""Per-layer sites: the residual stream (and the outputs added into it), the RMSNorm outputs,
the gate and up projections' outputs (the gate·up product's factors), ``down_proj``'s input
``silu(gate) * up``, attention's ``o_proj`` input and the GDN's ``out_proj`` input (MoE layers:
the shared and routed experts'). Logits are one more site, model-wide."""
UNMOVABLE = ("norm", "gate")


def shift_for(peak: float, target: float = TARGET) -> int:
    """The smallest ``k >= 0`` with ``peak * 2^-k <= target`` (OnecatError for a non-finite peak)."""
    if not math.isfinite(peak):
        raise OnecatError(f"an activation peak is not finite ({peak}); the fp32 model itself overflows")
    if peak <= target:
        return 0
    return max(0, math.ceil(math.log2(peak / target)))


@dataclass
class HeadroomPlan:
    """Powers of two the runtime folds into the weights (see the module docstring)."""

    residual_shift: int = 0
    mlp_shift: dict[int, int] = field(default_factory=dict)
    attn_shift: dict[int, int] = field(default_factory=dict)
    gdn_shift: dict[int, int] = field(default_factory=dict)
    unhandled: dict[str, float] = field(default_factory=dict)  # "layer 3 norm" -> fraction of FP16_MAX
    source: str = ""  # what measured it: "calibration", "start-up audit"

    @property
    def is_identity(self) -> bool:
        """True when nothing is scaled."""
        return not (self.residual_shift or any(self.mlp_shift.values()) or any(self.attn_shift.values())
                    or any(self.gdn_shift.values()))

    def to_json(self) -> dict[str, Any]:
        """The config.json form (string layer keys, zero shifts left out)."""
        def nonzero(shifts: dict[int, int]) -> dict[str, int]:
            return {str(i): m for i, m in sorted(shifts.items()) if m}

        return {
            "version": PLAN_VERSION, "source": self.source, "target": TARGET,
            "residual_shift": self.residual_shift, "mlp_shift": nonzero(self.mlp_shift),
            "attn_shift": nonzero(self.attn_shift), "gdn_shift": nonzero(self.gdn_shift),
            "unhandled": dict(self.unhandled),
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> HeadroomPlan:
        """Parse :meth:`to_json`'s form; OnecatError naming ``where`` when it is malformed."""
        def shifts(key: str) -> dict[int, int]:
            raw = data.get(key, {})
            if not isinstance(raw, dict):
                raise OnecatError(f"{where}: {CONFIG_KEY}.{key} must be an object of layer -> shift")
            out = {}
            for layer, m in raw.items():
                if not (str(layer).isdigit() and isinstance(m, int) and not isinstance(m, bool) and 0 <= m <= 24):
                    raise OnecatError(f"{where}: {CONFIG_KEY}.{key}[{layer!r}] = {m!r}: expected a layer "
                                      "index and a shift from 0 to 24")
                out[int(layer)] = m
            return out

        if not isinstance(data, dict) or data.get("version") != PLAN_VERSION:
            raise OnecatError(f"{where}: {CONFIG_KEY} is not a version-{PLAN_VERSION} plan; re-run "
                              "onecat quantize (or delete the key: onecat serve then audits at start-up)")
        k = data.get("residual_shift", 0)
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 24:
            raise OnecatError(f"{where}: {CONFIG_KEY}.residual_shift = {k!r}: expected 0 to 24")
        return cls(k, shifts("mlp_shift"), shifts("attn_shift"), shifts("gdn_shift"),
                   dict(data.get("unhandled", {})), str(data.get("source", "")))


def plan_from_config(config: dict[str, Any], where: str = "config.json") -> HeadroomPlan | None:
    """The plan stored in a config.json dict (top level or ``text_config``); None when absent."""
    for scope in (config, config.get("text_config") or {}):
        if CONFIG_KEY in scope:
            return HeadroomPlan.from_json(scope[CONFIG_KEY], where)
    return None


def derive_plan(layers: list[dict[str, Any]], logits: float | None = None, *, source: str = "",
                target: float = TARGET) -> HeadroomPlan:
    """The plan for measured peaks: ``layers`` in order, each ``{"layer": i, SITE: |max|...}``
    (absolute values; a site a layer lacks is absent), ``logits`` the model-wide peak."""
    peaks = [layer.get("residual", 0.0) for layer in layers]
    k = shift_for(max(peaks, default=0.0), target)
    plan = HeadroomPlan(residual_shift=k, source=source)
    for layer in layers:
        i = int(layer["layer"])
        if "down_in" in layer or "up" in layer:
            plan.mlp_shift[i] = shift_for(max(layer.get("down_in", 0.0), layer.get("up", 0.0)), target)
        for site, shifts in (("attn_out", plan.attn_shift), ("gdn_out", plan.gdn_shift)):
            if site in layer:
                shifts[i] = shift_for(layer[site], target)
        for site in UNMOVABLE:
            if layer.get(site, 0.0) > target:
                plan.unhandled[f"layer {i} {site}"] = round(layer[site] / FP16_MAX, 4)
    if logits is not None and logits > target:
        plan.unhandled["logits"] = round(logits / FP16_MAX, 4)
    return plan


def fractions(peaks: dict[str, float]) -> dict[str, float]:
    """``{site: peak / FP16_MAX}`` rounded for a report (values above 1 overflow fp16)."""
    return {site: round(value / FP16_MAX, 6) for site, value in peaks.items()}


def describe_plan(plan: HeadroomPlan) -> str:
    """One log line: what the plan scales."""
    parts = [f"residual stream x 2^-{plan.residual_shift}"] if plan.residual_shift else []
    for label, shifts in (("MLP", plan.mlp_shift), ("attention", plan.attn_shift), ("GDN", plan.gdn_shift)):
        layers = {i: m for i, m in shifts.items() if m}
        if layers:
            parts.append(f"{label} inputs of layers {sorted(layers)} scaled down (max 2^-{max(layers.values())})")
    text = "; ".join(parts) or "nothing to scale"
    if plan.unhandled:
        text += f"; near the fp16 limit, unmovable: {plan.unhandled}"
    return text
