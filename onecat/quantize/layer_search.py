"""AWQ for one decoder layer: calibrate, search scales, fold them, search clips, quantize.

Steps for layer i (built by :class:`~onecat.quantize.layer_build.LayerFactory`):

1. Resolve the recipe's mappings against the layer's modules (``*`` = expert index; a mapping
   whose modules are absent, e.g. attention in a linear-attention layer, or whose shapes do
   not chain, e.g. v_proj -> o_proj under grouped-query attention, is skipped).
2. One fp forward over all calibration sequences, in chunks. Hooks accumulate ``mean |x|``
   per input channel for each mapping, keep a strided token sample of every quantized
   linear's input, and keep the scored modules' inputs for the "loss chunk" (evenly spaced
   whole sequences, about ``loss_tokens`` tokens, run first). Every MoE expert also runs on a
   token sample spread over all tokens, routed or not (only routed outputs enter the result).
   The fp outputs feed the next layer (as AutoAWQ does), so a resumed run can recompute them
   from the source weights bit for bit.
3. Per mapping: :func:`~onecat.quantize.auto_scale.search_scale`, scored by the MSE of the
   scored module's output (a whole attention / GDN / MLP / MoE block, or a single linear on
   its token sample) against the fp output. Weights are snapshotted with a real clone.
4. Fold every chosen scale, then quantize. ``awq``: clip-search each quantized linear (except
   ``clip_skip``) on its token sample divided by its input scale, round plainly, then refit
   the group scales for those codes by least squares against the unclipped weight under the
   token sample's Hessian (damped by ``gptq.damp``; :func:`~onecat.quantize.gptq.refit_scales`).
   ``awq+gptq``: no clip search; GPTQ (:mod:`onecat.quantize.gptq`), then the least-squares
   refit of its group scales, against the Hessian of the linear's inputs after smoothing; with
   ``gptq.sequential`` (the recipes' default) input by input in execution order, each later
   input recomputed through the already-quantized linears before it (two forwards of the
   layer per input, each stopped at that input) and its linears' target corrected for their
   error (gptq.py, "Sequential inputs") (on SmolLM2-135M g64, over 10 layers, GPTQ on the
   unclipped weights left 15% less layer-output error than GPTQ within AWQ's clip ranges,
   and saves the clip search). The calibration pass accumulates
   ``X^T X`` of every quantized linear's input over all tokens (experts: over their token
   sample; with ``gptq.sequential`` only the first input's, the others being recomputed)
   before the scale search; smoothing divides the inputs by the chosen scale s, so
   the smoothed Hessian is ``diag(1/s) H diag(1/s)`` and no second pass is needed. A linear
   with fewer than K/4 calibration rows (an MoE expert that saw few tokens) or whose Hessian
   cannot be factorised is rounded plainly, and the report names it.
5. Measure the whole layer's output MSE on the loss chunk for plain round-to-nearest, AWQ
   (smoothing, clip, plain rounding; under ``awq+gptq`` smoothing and plain rounding) and,
   with GPTQ, the result, for the report.
"""

from __future__ import annotations

import re
import time
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from onecat.errors import OnecatError
from onecat.formats.awq_gemm import pack_awq_gemm
from onecat.formats.integers import dequantize, quantize_groups
from onecat.quantize.auto_clip import apply_clip, search_clip
from onecat.quantize.auto_scale import ScaleResult, search_scale, weight_mean
from onecat.quantize.fp16_sites import SiteProbe
from onecat.quantize.gptq import (
    HessianNotPositiveDefinite,
    activation_order,
    add_to_hessian,
    damped_inverse_factor,
    enough_rows,
    error_product_target,
    gptq_round,
    permute_hessian,
    refit_scales,
    smoothed_hessian,
    unpermute_hessian,
)
from onecat.quantize.layer_build import LayerFactory
from onecat.quantize.moe import ExpertList, split_fused_experts
from onecat.quantize.quantizer import FP16_MAX, pseudo_quantize
from onecat.quantize.recipe import Mapping, Recipe
from onecat.quantize.smoothing import fold_into_balance, fold_into_smooth

CHUNK_TOKENS = 4096  # tokens per forward chunk of the calibration pass
# weights, working copies, factors and damped Hessians of one batched GPTQ call (row slices
# beyond it); 1.5 GiB keeps Qwen3.5-27B's stacked gate/up (34816 x 5120) in one slice
GPTQ_BATCH_BYTES = 3 << 29


@dataclass
class ResolvedMapping:
    """A recipe mapping bound to concrete module names of one layer."""

    smooth: str
    balance: list[str]
    scored: str
    gated_query: str | None
    quantized: list[str]  # the balance layers that are quantized

    @property
    def owner(self) -> str:
        """The module whose input stands for the whole group's input (the first balance layer)."""
        return self.balance[0]


@dataclass
class LayerOutcome:
    """What one layer produced: output tensors (layer-relative names), report and next input."""

    tensors: dict[str, torch.Tensor]
    report: dict
    next_hidden: torch.Tensor
    fp16_kept: list[str] = field(default_factory=list)


def plan_chunks(num_seqs: int, seqlen: int, loss_tokens: int) -> tuple[list[int], list[list[int]]]:
    """Deterministic chunking: (loss sequences, chunks) with the loss sequences as chunk 0."""
    n_loss = max(1, min(num_seqs, -(-loss_tokens // seqlen)))
    loss = sorted({i * num_seqs // n_loss for i in range(n_loss)})
    rest = [i for i in range(num_seqs) if i not in set(loss)]
    per_chunk = max(1, CHUNK_TOKENS // seqlen)
    return loss, [loss] + [rest[i : i + per_chunk] for i in range(0, len(rest), per_chunk)]


def _expand(mapping: Mapping, names: set[str]) -> list[tuple[str, list[str], str, str | None]]:
    """Bind ``*`` (an expert index): in ``smooth``, one mapping per expert; only in balance
    names, every expert's module joins the one mapping (sorted by expert index)."""
    def matches(pattern_name: str) -> list[tuple[int, str]]:
        pattern = re.compile(re.escape(pattern_name).replace(r"\*", r"(\d+)"))
        return sorted((int(m.group(1)), n) for n in names if (m := pattern.fullmatch(n)))

    if "*" not in mapping.smooth:
        balance = []
        for b in mapping.balance:
            balance += [n for _, n in matches(b)] if "*" in b else [b]
        return [(mapping.smooth, balance, mapping.scored, mapping.gated_query)]
    return [
        (smooth, [b.replace("*", str(e)) for b in mapping.balance],
         mapping.scored.replace("*", str(e)), mapping.gated_query)
        for e, smooth in matches(mapping.smooth)
    ]


class LayerQuantizer:
    """Runs AWQ, AWQ + GPTQ (``gptq=True``) or plain round-to-nearest (``awq=False``) on
    decoder layers one at a time."""

    def __init__(self, factory: LayerFactory, recipe: Recipe, group_size: int, awq: bool = True,
                 gptq: bool = False) -> None:
        self.factory, self.recipe, self.group_size, self.awq = factory, recipe, group_size, awq
        self.gptq = gptq and awq
        self.device, self.dtype = factory.device, factory.dtype
        cfg = factory.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    # ---- which modules ---------------------------------------------------------------
    def quantized_linears(self, layer: nn.Module, where: str) -> tuple[list[str], list[str]]:
        """(quantized linear names, linears kept fp16 because K or N do not fit the format)."""
        chosen, kept = [], []
        for name, module in layer.named_modules():
            if not isinstance(module, nn.Linear) or not self.recipe.is_quantized(name):
                continue
            n, k = module.weight.shape
            if k % self.group_size == 0 and n % 8 == 0:
                chosen.append(name)
                continue
            why = (
                f"in-features {k} do not divide by group size {self.group_size}"
                if k % self.group_size
                else f"out-features {n} do not divide by 8"
            )
            if self.recipe.indivisible == "fail":
                raise OnecatError(
                    f"{where}{name}: {why}; recipe {self.recipe.path} says "
                    f"quantization.indivisible: fail. Pick another --group-size or set "
                    f"indivisible: keep_fp16"
                )
            warnings.warn(f"{where}{name}: {why}; kept in fp16", stacklevel=2)
            kept.append(name)
        return chosen, kept

    def resolve(self, layer: nn.Module, quantized: set[str]) -> tuple[list[ResolvedMapping], list[str]]:
        """Bind the recipe mappings to this layer; returns (mappings, notes on skipped ones)."""
        modules = dict(layer.named_modules())
        resolved, notes = [], []
        for mapping in self.recipe.mappings:
            for smooth, balance, scored, gated in _expand(mapping, set(modules)):
                missing = [n for n in (smooth, *balance, scored) if n not in modules]
                if not missing:
                    pass
                elif all(b in missing for b in balance):
                    continue  # not this kind of layer (e.g. attention in a GDN layer)
                else:
                    raise OnecatError(
                        f"recipe {self.recipe.path}: mapping {mapping.smooth} -> "
                        f"{', '.join(mapping.balance)} names modules this layer lacks: "
                        f"{', '.join(missing)}"
                    )
                ks = {modules[b].weight.shape[1] for b in balance}
                sw = modules[smooth].weight
                width = sw.shape[0]
                if len(ks) != 1 or width != next(iter(ks)):
                    notes.append(f"{smooth} -> {', '.join(balance)}: shapes do not chain, skipped")
                    continue
                q = [b for b in balance if b in quantized]
                if not q:
                    notes.append(f"{smooth} -> {', '.join(balance)}: nothing quantized, skipped")
                    continue
                resolved.append(ResolvedMapping(smooth, balance, scored, gated, q))
        return resolved, notes

    # ---- passes ------------------------------------------------------------------------
    @torch.no_grad()
    def propagate(self, layer: nn.Module, hidden: torch.Tensor, loss_tokens: int) -> torch.Tensor:
        """The fp layer's outputs for all sequences (same chunks as calibration: same bits)."""
        _, chunks = plan_chunks(hidden.shape[0], hidden.shape[1], loss_tokens)
        out = torch.empty_like(hidden)
        for chunk in chunks:
            out[chunk] = self.factory.run(layer, hidden[chunk])
        return out

    @torch.no_grad()
    def quantize_layer(
        self, index: int, tensors: dict[str, torch.Tensor], hidden: torch.Tensor | None, where: str
    ) -> LayerOutcome:
        """Quantize layer ``index`` from its source ``tensors``; ``hidden`` [S, L, H] are its
        calibration inputs (None for round-to-nearest without calibration)."""
        start = time.perf_counter()
        rcp = self.recipe
        source = tensors
        if rcp.experts is not None:
            source = split_fused_experts(
                tensors, rcp.experts.module, rcp.experts.gate_up_proj, rcp.experts.down_proj)
        layer = self.factory.build(index, tensors, where)
        quantized, kept = self.quantized_linears(layer, where)
        modules = dict(layer.named_modules())
        report: dict = {"layer": index, "kind": getattr(layer, "block_type", None) or "decoder"}
        modified: set[str] = set()
        next_hidden = hidden
        if self.awq and hidden is not None:
            mappings, notes = self.resolve(layer, set(quantized))
            report["skipped_mappings"] = notes
            seqs, seqlen = hidden.shape[0], hidden.shape[1]
            loss_idx, chunks = plan_chunks(seqs, seqlen, rcp.loss_tokens)
            cap = _Capture(self, layer, mappings, quantized, seqs * seqlen)
            probe = SiteProbe(layer)
            next_hidden = torch.empty_like(hidden)
            for c, chunk in enumerate(chunks):
                cap.begin_chunk(chunk, seqlen, loss=(c == 0))
                next_hidden[chunk] = self.factory.run(layer, hidden[chunk])
            cap.remove()
            probe.remove()
            probe.note("residual", float(next_hidden.abs().amax()))
            report["fp16_peaks"] = probe.peaks
            self._check_activations(where, cap, next_hidden, report)

            results = [self._search(m, modules, cap, where) for m in mappings]
            report["mappings"] = [
                {"smooth": m.smooth, "balance": m.balance, "scored": m.scored,
                 "ratio": r.ratio, "loss_rtn": r.loss_identity, "loss_awq": r.loss_best}
                for m, r in zip(mappings, results, strict=True)
            ]
            input_scale: dict[str, torch.Tensor] = {}
            for m, r in zip(mappings, results, strict=True):
                if r.ratio is None:
                    continue
                fold_into_smooth(modules[m.smooth], r.scales, rcp.norm_style)
                fold_into_balance([modules[b] for b in m.balance], r.scales)
                modified.update([m.smooth, *m.balance])
                input_scale[m.owner] = r.scales.to(self.device)
            if self.gptq:  # GPTQ replaces the clip search (see the module docstring)
                awq_weights = {n: pseudo_quantize(modules[n].weight.data, self.group_size)
                               for n in quantized}
                packed, report["gptq"] = self._quantize_gptq(quantized, modules, cap, input_scale, where,
                                                             layer, hidden)
            else:
                unclipped = {n: modules[n].weight.data for n in quantized}  # clipping makes new tensors
                if rcp.clip:
                    report["clip"] = self._clip(quantized, modules, cap, input_scale)
                awq_weights = None
                packed = self._quantize_refit(quantized, modules, cap, input_scale, unclipped, where)
            del cap
            report.update(self._layer_error(index, tensors, layer, quantized, hidden[loss_idx],
                                            where, awq_weights))
        else:
            packed = self._quantize(quantized, modules, where)
        out = self._collect(layer, quantized, packed, modified, source)
        report["fp16_kept"] = kept
        report["time_s"] = round(time.perf_counter() - start, 3)
        return LayerOutcome(out, report, next_hidden, kept)

    # ---- pieces --------------------------------------------------------------------------
    def _check_activations(self, where: str, cap: _Capture, out: torch.Tensor, report: dict) -> None:
        peak = {name: v for name, v in cap.absmax.items()}
        peak["<layer output>"] = float(out.abs().amax())
        bad = [n for n, v in peak.items() if not v < float("inf")]
        if bad:
            raise OnecatError(
                f"{where}: activations are not finite ({', '.join(bad[:4])}) in {self.dtype}; "
                f"the checkpoint's weights (or the calibration text) drive this layer to inf/NaN"
            )
        over = {n: v for n, v in peak.items() if v > FP16_MAX}
        report["max_abs_activation"] = max(peak.values())
        if over:
            report["fp16_overflow"] = over
            warnings.warn(
                f"{where}: activations exceed the fp16 range (max {max(over.values()):.4g} in "
                f"{', '.join(over)}); fp16 inference of this layer may overflow", stacklevel=2
            )

    def _search(self, m: ResolvedMapping, modules: dict, cap: _Capture, where: str) -> ScaleResult:
        g = self.group_size
        qmods = [modules[b] for b in m.quantized]
        originals = [mod.weight.detach().clone() for mod in qmods]  # real copies (not .cpu())
        rows = None
        if m.gated_query is not None and m.gated_query in m.quantized:
            n = modules[m.gated_query].weight.shape[0]
            rows = ((torch.arange(n, device=self.device) // self.head_dim) % 2 == 0).unsqueeze(1)
        scored = modules[m.scored]
        args, kwargs = cap.scored_inputs(m.scored)
        reference = _first(scored(*args, **kwargs)).float()
        if m.owner not in cap.abs_sum:
            raise OnecatError(f"{where}{m.owner}: received no calibration tokens in the forward pass")
        x_mean = (cap.abs_sum[m.owner] / cap.count[m.owner]).to(self.device)
        w_mean = weight_mean(originals, g).to(self.device)

        def loss(s: torch.Tensor) -> float:
            s = s.to(device=self.device, dtype=torch.float32)
            for name, mod, orig in zip(m.quantized, qmods, originals, strict=True):
                w = (pseudo_quantize(orig.float() * s, g) / s).to(orig.dtype)
                if rows is not None and name == m.gated_query:
                    w = torch.where(rows, w, orig)
                mod.weight.data = w
            out = _first(scored(*args, **kwargs)).float()
            return float((out - reference).pow(2).mean())

        try:
            result = search_scale(x_mean, w_mean, loss, grid=self.recipe.grid, duo=self.recipe.duo_scaling)
        finally:
            for mod, orig in zip(qmods, originals, strict=True):
                mod.weight.data = orig
        if not result.loss_best < float("inf"):
            raise OnecatError(f"{where}{m.scored}: every scale candidate gave a non-finite loss")
        return result

    def _clip(self, quantized: list[str], modules: dict, cap: _Capture, input_scale: dict) -> dict:
        shrink = {}
        for name in quantized:
            if self.recipe.skips_clip(name):
                continue
            key = cap.key_of[name]
            if key not in cap.samples:
                continue  # never called during calibration: plain round-to-nearest
            x = cap.sample(key, self.recipe.clip_tokens).to(self.device, torch.float32)
            if key in input_scale:
                x = x / input_scale[key]
            w = modules[name].weight
            max_val = search_clip(
                w.data, x, self.group_size, grid=self.recipe.clip_grid,
                max_shrink=self.recipe.clip_max_shrink,
            )
            org = w.float().reshape(w.shape[0], -1, self.group_size).abs().amax(-1)
            shrink[name] = round(float((max_val / org.clamp(min=1e-12)).mean()), 4)
            w.data = apply_clip(w.data, max_val)
        return shrink

    def _quantize_refit(self, quantized: list[str], modules: dict, cap: _Capture, input_scale: dict,
                        unclipped: dict, where: str) -> dict[str, dict]:
        """Plain rounding of every (clipped) quantized linear, then the least-squares refit of
        its group scales (:func:`~onecat.quantize.gptq.refit_scales`) against the unclipped
        smoothed weight under the damped Hessian of its calibration token sample; a linear
        that saw no calibration tokens keeps the rounding's scales."""
        packed = {}
        hessians: dict[str, torch.Tensor | None] = {}  # per input: q/k/v, gate/up share one
        for name in quantized:
            w = modules[name].weight.data
            q, z, s = quantize_groups(w, self.group_size)
            key = cap.key_of.get(name)
            if key is not None and key not in hessians:
                hessians[key] = self._damped_sample_hessian(cap, key, input_scale, w.device)
            h = hessians.get(key)
            if h is not None:
                s = refit_scales(unclipped[name].float()[None], h[None], q[None], z[None], s[None], self.group_size)[0]
            packed[name] = self._store(modules[name], (q, z, s), where + name)
        return packed

    def _damped_sample_hessian(self, cap: _Capture, key: str, input_scale: dict,
                               device: torch.device) -> torch.Tensor | None:
        """The Hessian of input ``key``'s calibration token sample, smoothed like the weights
        and damped by ``gptq.damp``; None when the input saw no tokens."""
        h, rows = cap.hessian(key)
        if h is None or not rows:
            return None
        h = h.to(device)
        if key in input_scale:
            h = smoothed_hessian(h, input_scale[key])
        h.diagonal().add_(self.recipe.gptq.damp * float(h.diagonal().mean()))
        return h

    def _quantize(self, quantized: list[str], modules: dict, where: str) -> dict[str, dict]:
        """Plain rounding of every quantized linear (its module gets the dequantized weight)."""
        return {name: self._store(modules[name], quantize_groups(modules[name].weight.data,
                                                                 self.group_size), where + name)
                for name in quantized}

    def _quantize_gptq(self, quantized: list[str], modules: dict, cap: _Capture,
                       input_scale: dict, where: str, layer: nn.Module,
                       hidden: torch.Tensor) -> tuple[dict, dict]:
        """GPTQ of every quantized linear against its smoothed Hessian (plain rounding where
        there are too few calibration rows); returns (packed, report).

        Linears that share an input (q/k/v, gate/up, every expert's gate/up) share one
        Hessian factor and are stacked along their rows; inputs with distinct Hessians but
        equal shapes (each expert's down_proj) run as one batch; both within
        ``GPTQ_BATCH_BYTES`` per call.

        With ``gptq.sequential`` the inputs are taken in the order the forward pass reached
        them (:func:`gptq_stages`); from the second stage on, a stage's input is recomputed
        (:meth:`_stage_inputs`) from the calibration tokens run through the layer whose
        earlier linears are already quantized, and its linears are moved to the target
        :func:`~onecat.quantize.gptq.input_error_target` before GPTQ under the recomputed
        Hessian, so each compensates the rounding error of those before it. Expert inputs
        keep the Hessians of the calibration pass.

        Memory: the widest input (Qwen3.5-27B's down_proj, K = 17408: one float32 ``[K, K]``
        is 1.2 GB) holds at most three or four ``[K, K]`` tensors at once: ``H~`` and ``D``
        (plus a chunk's inputs) while recomputing them; ``H~`` and the LU factors while
        solving for the target from ``W D`` (``D`` freed first); ``H~`` damped in place, the
        Cholesky factor and the inverse (plus the cuSOLVER inverse's working copy on a GPU)
        while factorising; then the factor and the damped ``H~``, which the scale refit
        takes directly. Jobs run as soon as a call's worth is ready, so their factors never
        pile up (every MoE expert's gate/up input has its own)."""
        settings = self.recipe.gptq
        by_key: dict[str, list[str]] = {}
        for name in quantized:
            by_key.setdefault(cap.key_of[name], []).append(name)
        rank = {key: i for i, key in enumerate(cap.order)}
        keys = sorted(by_key, key=lambda key: rank.get(key, len(rank)))
        recomputed = {key for key in keys if cap.stride.get(key) and key in rank}  # not experts
        stages = gptq_stages(keys, recomputed) if settings.sequential else [keys]
        # the full-precision (smoothed) weights: the targets of every stage's inputs
        fp_weights = {n: modules[n].weight.data for n in quantized} if len(stages) > 1 else {}
        ints: dict[str, tuple] = {}
        fallback: dict[str, str] = {}
        packed: dict[str, dict] = {}
        for number, stage in enumerate(stages):
            fresh = None
            if number:
                h, rows, delta = self._stage_inputs(layer, hidden, stage[0], modules, fp_weights)
                if h is not None:  # else (never reached) the calibration pass's Hessian
                    fresh = [h, rows]
                    names = by_key[stage[0]]
                    products = {n: modules[n].weight.data.float() @ delta for n in names}  # W D [N, K]
                    del delta  # before the solves: at most h, the LU factors and [N, K] tensors live
                    for name in names:
                        w = modules[name].weight.data
                        target = error_product_target(w, h, products.pop(name), settings.damp)
                        modules[name].weight.data = target.to(w.dtype)
                        del target
                    del h
            # (rows, K) -> [(names, upper, dead, order, damped Hessian)], run whenever a call's worth is ready
            jobs: dict[tuple[int, int], list] = {}
            for key in stage:
                names = by_key[key]
                k = modules[names[0]].weight.shape[1]
                if fresh is not None and key == stage[0]:
                    h, rows = fresh  # inputs of the smoothed, partly quantized layer
                    fresh.clear()  # h's one reference is ours: damped in place below, then kept for the refit
                else:
                    h, rows = cap.hessian(key)
                    if h is not None and key in input_scale:
                        h = smoothed_hessian(h, input_scale[key])
                why = None
                if h is None or not enough_rows(rows, k):
                    why = f"{rows} calibration rows for {k} in-features"
                else:
                    order = activation_order(h) if settings.act_order else None
                    if order is not None:
                        h = permute_hessian(h, order)
                    try:
                        upper, dead, h = damped_inverse_factor(h.float(), settings.damp)
                    except HessianNotPositiveDefinite as exc:
                        why = f"Hessian: {exc}"
                if why is not None:
                    del h
                    for name in names:
                        fallback[name] = why
                        ints[name] = quantize_groups(modules[name].weight.data, self.group_size)
                    continue
                if order is not None:  # the refit wants the damped Hessian in the original column order
                    h = unpermute_hessian(h, order)
                rows_total = sum(modules[n].weight.shape[0] for n in names)
                pending = jobs.setdefault((rows_total, k), [])
                pending.append((names, upper, dead, order, h))
                del upper, h
                if len(pending) == self._gptq_per_call(rows_total, k):
                    ints.update(self._gptq_batch(pending, modules, rows_total, k))
                    pending.clear()
            for (rows_total, k), pending in jobs.items():
                if pending:
                    ints.update(self._gptq_batch(pending, modules, rows_total, k))
                    pending.clear()
            # the modules take their dequantized weights: the next stage's inputs see them
            packed.update({name: self._store(modules[name], ints[name], where + name)
                           for key in stage for name in by_key[key]})
        return {name: packed[name] for name in quantized}, {"linears": len(quantized) - len(fallback),
                                                           "fallback_rtn": fallback}

    @torch.no_grad()
    def _stage_inputs(self, layer: nn.Module, hidden: torch.Tensor, key: str, modules: dict,
                      fp_weights: dict[str, torch.Tensor]
                      ) -> tuple[torch.Tensor | None, int, torch.Tensor | None]:
        """``(H~, rows, D)`` of module ``key``'s input over every calibration token:
        ``H~ = X~^T X~ / T`` of its inputs ``X~`` through ``layer`` as it is now (earlier
        linears quantized) and ``D = (X - X~)^T X~ / T`` against its inputs ``X`` through the
        full-precision weights ``fp_weights`` (:func:`~onecat.quantize.gptq.input_error_target`).
        Each chunk runs twice, each forward stopping at that input; ``(None, 0, None)`` when
        the forward never reaches it."""
        seen: list[torch.Tensor] = []

        def hook(module, args, kwargs):
            x = args[0] if args else next(iter(kwargs.values()))
            seen.append(x.reshape(-1, x.shape[-1]).float())
            raise _InputReached

        def run(chunk: list[int]) -> None:
            try:
                self.factory.run(layer, hidden[chunk])
            except _InputReached:
                pass

        h = delta = None
        rows = 0
        handle = modules[key].register_forward_pre_hook(hook, with_kwargs=True)
        try:
            _, chunks = plan_chunks(hidden.shape[0], hidden.shape[1], self.recipe.loss_tokens)
            for chunk in chunks:
                seen.clear()
                current = {n: modules[n].weight.data for n in fp_weights}
                try:
                    for n, w in fp_weights.items():
                        modules[n].weight.data = w
                    run(chunk)
                finally:
                    for n, w in current.items():
                        modules[n].weight.data = w
                run(chunk)
                if len(seen) != 2:
                    return None, 0, None
                x, xq = seen
                seen.clear()
                h = add_to_hessian(h, xq)
                diff = x - xq
                del x  # two of the chunk's [T, K] float32 tensors live during the product
                delta = diff.t() @ xq if delta is None else delta.addmm_(diff.t(), xq)
                rows += xq.shape[0]
                del xq, diff
        finally:
            handle.remove()
        if h is None:
            return None, 0, None
        return h.div_(rows), rows, delta.div_(rows)

    @staticmethod
    def _gptq_per_call(rows_total: int, k: int) -> int:
        """Jobs of shape ``(rows_total, k)`` run per :meth:`_gptq_batch` call: their weights,
        working copies, factors and damped Hessians within ``GPTQ_BATCH_BYTES``."""
        per_job = (rows_total * k * 2 + 2 * k * k) * 4
        return max(1, GPTQ_BATCH_BYTES // per_job)

    def _gptq_batch(self, batch: list, modules: dict, rows_total: int, k: int) -> dict[str, tuple]:
        """Run GPTQ on jobs of equal shape, ``batch = [(names, upper, dead, order, hessian)]``
        (``hessian``: the damped Hessian ``upper`` factorises, in the original column order),
        in row slices."""
        settings, g = self.recipe.gptq, self.group_size

        def stacked(i: int) -> torch.Tensor:  # one job: a view, no copy of its [K, K] tensors
            parts = [job[i] for job in batch]
            return parts[0].unsqueeze(0) if len(parts) == 1 else torch.stack(parts)

        upper, dead, hessian = stacked(1), stacked(2), stacked(4)
        order = stacked(3) if settings.act_order else None
        weights = [[modules[n].weight.data for n in job[0]] for job in batch]
        out = {n: (torch.empty(w.shape, dtype=torch.uint8, device=w.device),
                   torch.empty(w.shape[0], k // g, dtype=torch.uint8, device=w.device),
                   torch.empty(w.shape[0], k // g, dtype=torch.float32, device=w.device))
               for job, ws in zip(batch, weights, strict=True) for n, w in zip(job[0], ws, strict=True)}
        step = max(1, GPTQ_BATCH_BYTES // (len(batch) * k * 8))
        for r0 in range(0, rows_total, step):
            r1 = min(r0 + step, rows_total)
            parts = [_rows(ws, r0, r1) for ws in weights]
            w = parts[0].unsqueeze(0) if len(parts) == 1 else torch.stack(parts)
            del parts
            q, z, s = gptq_round(w, upper, dead, g, block_size=settings.block_size, order=order)
            s = refit_scales(w, hessian, q, z, s, g)
            for b, job in enumerate(batch):
                start = 0
                for n in job[0]:
                    lo, hi = max(r0, start), min(r1, start + out[n][0].shape[0])
                    if lo < hi:
                        for dst, src in zip(out[n], (q, z, s), strict=True):
                            dst[lo - start : hi - start] = src[b, lo - r0 : hi - r0]
                    start += out[n][0].shape[0]
        return out

    def _store(self, mod: nn.Module, ints: tuple, where: str) -> dict[str, torch.Tensor]:
        """Set ``mod.weight`` to the dequantized integers and return its AWQ GEMM tensors."""
        q, z, s = ints
        if not bool(torch.isfinite(s).all()) or float(s.amax()) > FP16_MAX:
            raise OnecatError(
                f"{where}: quantization scales overflow fp16 (max {float(s.amax()):.4g}); "
                f"the smoothed weights are too large for an fp16 checkpoint"
            )
        mod.weight.data = dequantize(q, z, s, mod.weight.dtype)
        out = pack_awq_gemm(q.cpu(), z.cpu(), s.cpu())
        if mod.bias is not None:
            out["bias"] = mod.bias.detach().to("cpu", torch.float16)
        return out

    def _layer_error(self, index, tensors, layer, quantized, loss_hidden, where,
                     awq_weights: dict | None = None) -> dict:
        """Whole-layer output MSE on the loss sequences: round-to-nearest, AWQ and (when
        ``awq_weights`` holds AWQ's plainly rounded weights) AWQ + GPTQ, the result."""
        fresh = self.factory.build(index, tensors, where)
        fmods = dict(fresh.named_modules())
        reference = self.factory.run(fresh, loss_hidden).float()
        for name in quantized:
            w = fmods[name].weight
            w.data = pseudo_quantize(w.data, self.group_size)
        rtn = float((self.factory.run(fresh, loss_hidden).float() - reference).pow(2).mean())
        del fresh, fmods
        result = float((self.factory.run(layer, loss_hidden).float() - reference).pow(2).mean())
        if awq_weights is None:
            return {"output_mse_rtn": rtn, "output_mse_awq": result}
        modules = dict(layer.named_modules())
        shipped = {n: modules[n].weight.data for n in awq_weights}
        for n, w in awq_weights.items():
            modules[n].weight.data = w.to(shipped[n].dtype)
        awq = float((self.factory.run(layer, loss_hidden).float() - reference).pow(2).mean())
        for n, w in shipped.items():
            modules[n].weight.data = w
        return {"output_mse_rtn": rtn, "output_mse_awq": awq, "output_mse_gptq": result}

    def _collect(self, layer, quantized, packed, modified, source) -> dict[str, torch.Tensor]:
        """Output tensors of the layer: packed linears; tensors changed by smoothing in their
        source dtype (fp16 when the source was bf16); every other tensor exactly as in the source."""
        out: dict[str, torch.Tensor] = {}
        quantized_set = set(quantized)
        for name, tensor in layer.state_dict().items():
            module, _, leaf = name.rpartition(".")
            if module in quantized_set:
                continue
            if module not in modified:
                out[name] = source[name].contiguous()
                continue
            dtype = source[name].dtype
            out[name] = tensor.detach().to("cpu", torch.float16 if dtype == torch.bfloat16 else dtype).contiguous()
        for module, parts in packed.items():
            for leaf, t in parts.items():
                out[f"{module}.{leaf}"] = t.contiguous()
        return out


class _InputReached(Exception):
    """Raised by :meth:`LayerQuantizer._stage_inputs`' hook to end a forward pass early."""


def gptq_stages(keys: list[str], recomputed: set[str]) -> list[list[str]]:
    """Split the inputs ``keys`` (in execution order) into sequential GPTQ stages: each key of
    ``recomputed`` after the first key opens a new stage (its Hessian is recomputed with the
    stages before it quantized); any other key joins the stage before it."""
    stages: list[list[str]] = []
    for key in keys:
        if not stages or key in recomputed:
            stages.append([key])
        else:
            stages[-1].append(key)
    return stages


def _rows(weights: list[torch.Tensor], r0: int, r1: int) -> torch.Tensor:
    """Rows ``r0:r1`` of the row-wise concatenation of ``weights`` (without building it)."""
    parts, start = [], 0
    for w in weights:
        lo, hi = max(r0, start), min(r1, start + w.shape[0])
        if lo < hi:
            parts.append(w[lo - start : hi - start])
        start += w.shape[0]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _first(output):
    return output[0] if isinstance(output, tuple | list) else output


class _Capture:
    """Forward hooks for the calibration pass (statistics, token samples, scored inputs)."""

    def __init__(self, lq: LayerQuantizer, layer: nn.Module, mappings: list[ResolvedMapping],
                 quantized: list[str], total_tokens: int) -> None:
        self.lq = lq
        modules = dict(layer.named_modules())
        rcp = lq.recipe
        expert_prefix = f"{rcp.experts.module}." if rcp.experts is not None else None
        # whose input sample does each quantized linear use?
        self.key_of: dict[str, str] = {}
        for m in mappings:
            for b in m.balance:
                self.key_of[b] = m.owner
        for name in quantized:
            self.key_of.setdefault(name, name)
        scored_linears = {m.scored for m in mappings if isinstance(modules[m.scored], nn.Linear)}
        # experts are only called on the sampled rows (ExpertList.calibration_rows): keep all
        self.experts = [m for m in layer.modules() if isinstance(m, ExpertList)]
        self.expert_stride = max(1, total_tokens // rcp.clip_tokens)
        self.stride: dict[str, int] = {}
        for key in set(self.key_of.values()):
            if expert_prefix and key.startswith(expert_prefix):
                self.stride[key] = 0
                continue
            want = rcp.clip_tokens
            if key in scored_linears:
                want = max(want, rcp.loss_tokens)
            self.stride[key] = max(1, total_tokens // want)
        self.scored_linears = scored_linears
        self.abs_sum: dict[str, torch.Tensor] = {}
        self.count: dict[str, int] = {}
        self.absmax: dict[str, float] = {}
        self.samples: dict[str, list[torch.Tensor]] = {k: [] for k in self.stride}
        self.scored: dict[str, tuple] = {}
        self.stats_keys = {m.owner for m in mappings}
        # X^T X of each input over all tokens, for GPTQ (experts: from their sample, later).
        # Sequential GPTQ recomputes every input's Hessian but the first one's (gptq_stages:
        # each later non-expert input opens a stage), so only the first input reached keeps one
        self.hessians: dict[str, torch.Tensor] | None = {} if lq.gptq else None
        self.first_hessian_only = lq.gptq and rcp.gptq.sequential
        self.hessian_rows: dict[str, int] = {}
        self.order: list[str] = []  # inputs in the order the forward pass first reached them
        self.handles = []
        for key in self.stride:
            self.handles.append(modules[key].register_forward_pre_hook(self._input_hook(key), with_kwargs=True))
        for name in {m.scored for m in mappings} - scored_linears:
            self.handles.append(modules[name].register_forward_pre_hook(self._scored_hook(name), with_kwargs=True))
        self.positions = None
        self.loss = False

    def begin_chunk(self, seqs: list[int], seqlen: int, loss: bool) -> None:
        """Set the global token ids of the coming chunk (sequence-major) and whether it is the loss chunk."""
        seq = torch.tensor(seqs, dtype=torch.int64).unsqueeze(1)
        self.positions = (seq * seqlen + torch.arange(seqlen)).reshape(-1)
        self.loss = loss
        for experts in self.experts:
            experts.calibration_rows = (self.positions % self.expert_stride == 0).nonzero().squeeze(1)

    def _input_hook(self, key: str):
        def hook(module, args, kwargs):
            x = args[0] if args else next(iter(kwargs.values()))
            if key not in self.absmax:
                self.order.append(key)
            flat = x.reshape(-1, x.shape[-1])
            xf = flat.float()
            if key in self.stats_keys:
                part = xf.abs().sum(dim=0)
                self.abs_sum[key] = part if key not in self.abs_sum else self.abs_sum[key] + part
                self.count[key] = self.count.get(key, 0) + flat.shape[0]
            peak = float(xf.abs().amax()) if xf.numel() else 0.0
            if not peak == peak:
                peak = float("inf")
            self.absmax[key] = max(self.absmax.get(key, 0.0), peak)
            if self.hessians is not None and self.stride[key] and (
                    not self.first_hessian_only or key == self.order[0]):
                self.hessians[key] = add_to_hessian(self.hessians.get(key), xf)
                self.hessian_rows[key] = self.hessian_rows.get(key, 0) + xf.shape[0]
            if self.stride[key]:
                keep = (self.positions % self.stride[key] == 0).nonzero().squeeze(1)
                flat = flat[keep.to(flat.device)]
            self.samples[key].append(flat.clone())

        return hook

    def _scored_hook(self, name: str):
        def hook(module, args, kwargs):
            if self.loss and name not in self.scored:
                self.scored[name] = (args, dict(kwargs))

        return hook

    def remove(self) -> None:
        """Detach the hooks and join each token sample into one tensor."""
        for h in self.handles:
            h.remove()
        for experts in self.experts:
            experts.calibration_rows = None
        self.samples = {k: torch.cat(v) for k, v in self.samples.items() if v}

    def sample(self, key: str, tokens: int) -> torch.Tensor:
        """About ``tokens`` evenly strided rows of the input sample of ``key``."""
        x = self.samples[key]
        step = max(1, x.shape[0] // tokens)
        return x[::step][:tokens] if step > 1 else x

    def hessian(self, key: str) -> tuple[torch.Tensor | None, int]:
        """(mean X^T X [K, K] of the inputs of ``key``, rows); (None, 0) when it saw none."""
        if self.hessians is not None and key in self.hessians:
            rows = self.hessian_rows[key]
            return self.hessians.pop(key).div_(max(rows, 1)), rows  # used once: freed after
        if key in self.samples and self.samples[key].shape[0]:
            x = self.samples[key]
            return add_to_hessian(None, x) / x.shape[0], x.shape[0]
        return None, 0

    def scored_inputs(self, name: str) -> tuple[tuple, dict]:
        """(args, kwargs) to call the scored module ``name`` on the loss tokens."""
        if name in self.scored_linears:
            return (self.samples[name],), {}
        return self.scored[name]
