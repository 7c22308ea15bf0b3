"""The start-up fp16 headroom audit of a checkpoint that carries no plan.

A plain fp16 / bf16 checkpoint (or an AWQ one from elsewhere) has no
``onecat_fp16_headroom`` in its config.json, so before an fp16 engine loads it
:func:`startup_plan` runs it in fp32 over built-in text (``onecat.texts``: the pydoc topics,
:data:`AUDIT_SEQUENCES` windows of :data:`AUDIT_SEQLEN` tokens), measures the peak of every
site (``onecat.formats.fp16_headroom.SITES``) with the runtime's own layers, and derives the
plan the loader folds into the weights.

It runs layer by layer: each decoder layer is built in fp32 on the audit device, loaded from
the checkpoint (float, 4-bit ones dequantised), run over the hidden states of every window,
and freed, so its memory is one layer's fp32 weights plus the activations (Qwen3.5-27B:
about 1.7 GB per layer; the 35B-A3B's 256 experts about 3.2 GB), whatever the model size
and tensor-parallel degree; the logits are computed in vocabulary slices of ``lm_head``.
Its cost is a second read of the weights and a forward of ~2k tokens in fp32 at start-up.

Routed MoE experts run inside one op (``FusedExperts``), so their ``down_proj`` input is not
measured here (``onecat quantize`` measures it per expert); the shared expert's is.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from onecat.formats.fp16_headroom import HeadroomPlan, derive_plan, describe_plan, plan_from_config
from onecat.runtime.context import ForwardContext, PrefillChunk, set_context
from onecat.runtime.layers.norm import rms_norm_math
from onecat.runtime.loader import WeightSource, load_weights, read_model_config
from onecat.runtime.models.qwen3_5 import DecoderLayer
from onecat.runtime.quant_plan import QuantPlan
from onecat.texts import pydoc_documents

log = logging.getLogger(__name__)

AUDIT_SEQUENCES = 4
AUDIT_SEQLEN = 512
LOGIT_ROWS = 32768  # lm_head rows per fp32 slice


def audit_token_ids(tokenizer: Any, sequences: int = AUDIT_SEQUENCES, seqlen: int = AUDIT_SEQLEN) -> list[list[int]]:
    """``sequences`` windows of ``seqlen`` tokens of the built-in text, evenly spaced over it
    (fewer when the text is shorter)."""
    ids = tokenizer("\n\n".join(pydoc_documents()), add_special_tokens=False)["input_ids"]
    windows = max(1, len(ids) // seqlen)
    picks = sorted({w * windows // sequences for w in range(min(sequences, windows))})
    return [ids[w * seqlen : (w + 1) * seqlen] for w in picks]


class _LayerSource:
    """A weight source for one decoder layer built alone: its module-relative parameter names
    get the layer's prefix (linears and experts already carry full names)."""

    def __init__(self, base: WeightSource, prefix: str) -> None:
        self.base, self.prefix, self.path = base, prefix, base.path

    def actual(self, name: str) -> str:
        """The checkpoint key of ``name``."""
        return self.base.actual(name)

    def linear(self, name: str) -> Any:
        """The base source's linear."""
        return self.base.linear(name)

    def expert(self, prefix: str, expert: int, which: str) -> Any:
        """The base source's expert projection."""
        return self.base.expert(prefix, expert, which)

    def tensor(self, name: str) -> torch.Tensor:
        """Layer-relative tensor ``name``."""
        return self.base.tensor(self.prefix + name)


def _peak(t: torch.Tensor) -> float:
    return float(t.detach().abs().amax()) if t.numel() else 0.0


class _SiteHooks:
    """Forward hooks on one runtime decoder layer recording each site's peak."""

    def __init__(self, layer: DecoderLayer) -> None:
        self.peaks: dict[str, float] = {}
        self.handles = []
        for name, module in layer.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("qkv_proj", "in_proj_qkvz", "gate_up_proj") and not name.startswith("mlp.experts"):
                self.handles.append(module.register_forward_pre_hook(self._input("norm")))
            if leaf == "gate_up_proj":
                self.handles.append(module.register_forward_hook(self._gate_up))
            site = {"o_proj": "attn_out", "out_proj": "gdn_out", "down_proj": "down_in"}.get(leaf)
            if site is not None:
                self.handles.append(module.register_forward_pre_hook(self._input(site)))
                self.handles.append(module.register_forward_hook(self._output("residual")))

    def note(self, site: str, value: float) -> None:
        """Raise the recorded peak of ``site`` to ``value``."""
        self.peaks[site] = max(self.peaks.get(site, 0.0), value)

    def _input(self, site: str):
        def hook(module: nn.Module, args: tuple) -> None:
            self.note(site, _peak(args[0]))

        return hook

    def _output(self, site: str):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            self.note(site, _peak(output))

        return hook

    def _gate_up(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        gate, up = output.chunk(2, dim=-1)  # a merged gate/up projection: gate rows first
        self.note("gate", _peak(gate))
        self.note("up", _peak(up))

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def measure_peaks(path: str | Path, sequences: list[list[int]], device: torch.device) -> tuple[list[dict], float]:
    """Run checkpoint ``path`` in fp32 on ``device`` layer by layer over ``sequences`` (token
    ids); returns the per-layer peaks (``{"layer": i, "kind": ..., SITE: |max|}``) and the
    logits' peak."""
    path = Path(path)
    raw, cfg = read_model_config(path)
    source = WeightSource(path, raw)  # no plan: the unscaled model
    embed = source.tensor("model.embed_tokens.weight")
    hidden = [embed[torch.tensor(ids)].to(device=device, dtype=torch.float32) for ids in sequences]
    residual: list[torch.Tensor | None] = [None] * len(sequences)
    layers = []
    try:
        for i in range(cfg.num_hidden_layers):
            with torch.device(device):
                layer = DecoderLayer(cfg, i, QuantPlan(), torch.float32)
            load_weights(layer, _LayerSource(source, f"model.layers.{i}."))
            hooks = _SiteHooks(layer)
            for s, ids in enumerate(sequences):
                positions = torch.arange(len(ids), device=device)
                chunk = PrefillChunk(0, len(ids), 0, torch.zeros(1, dtype=torch.int64, device=device), 0)
                set_context(ForwardContext(slot_mapping=positions, prefills=[chunk]))
                hooks.note("residual", _peak(hidden[s] if residual[s] is None else hidden[s] + residual[s]))
                hidden[s], residual[s] = layer(positions, hidden[s], residual[s])
                hooks.note("residual", max(_peak(hidden[s]), _peak(residual[s])))
            hooks.remove()
            layers.append({"layer": i, "kind": layer.layer_type, **hooks.peaks})
            del layer, hooks
    finally:
        set_context(None)
    final = [h + r for h, r in zip(hidden, residual, strict=True)]
    layers[-1]["residual"] = max(layers[-1]["residual"], *(_peak(x) for x in final))
    norm_weight = source.tensor("model.norm.weight").to(device)
    normed = torch.cat([rms_norm_math(x, norm_weight, cfg.rms_norm_eps) for x in final])
    head = source.tensor("model.embed_tokens.weight") if cfg.tie_word_embeddings else source.linear("lm_head").dense()
    logits = 0.0
    for start in range(0, head.shape[0], LOGIT_ROWS):
        rows = head[start : start + LOGIT_ROWS].to(device=device, dtype=torch.float32)
        logits = max(logits, _peak(F.linear(normed, rows)))
    return layers, logits


def startup_plan(path: str | Path, tokenizer: Any, device: torch.device) -> HeadroomPlan | None:
    """For an fp16 engine: None when config.json already carries a plan (the loader reads
    it), else the plan an fp32 audit of the checkpoint on built-in text derives (logged)."""
    path = Path(path)
    raw, _ = read_model_config(path)
    if plan_from_config(raw, str(path / "config.json")) is not None:
        return None
    started = time.perf_counter()
    sequences = audit_token_ids(tokenizer)
    layers, logits = measure_peaks(path, sequences, device)
    plan = derive_plan(layers, logits, source="start-up audit")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    log.info("fp16 headroom audit of %s (%d tokens, fp32, %.1f s): %s", path,
             sum(map(len, sequences)), time.perf_counter() - started, describe_plan(plan))
    return plan
