"""Apply an fp16 headroom plan (``onecat.formats.fp16_headroom``) while loading weights.

Every shift is a power of two folded into a tensor as it is read, so the served model has
the same weights' shapes, the same kernels and no extra work per token:

| tensor (text-model names) | times |
|---|---|
| ``model.embed_tokens.weight`` | ``2^-k`` |
| ``layers.i.self_attn.o_proj``, ``linear_attn.out_proj``, ``mlp.down_proj`` | ``2^-k`` times the layer's attention / GDN / MLP ``2^m`` |
| MoE: routed experts' and ``shared_expert``'s ``down_proj`` / ``up_proj`` | as a dense MLP's |
| ``layers.i.self_attn.v_proj`` / ``mlp.up_proj`` / ``linear_attn.norm.weight`` | ``2^-m`` |
| tied embeddings: ``model.norm`` and ``mtp.norm``'s ``(1 + w)`` | ``2^k`` (the logits read ``lm_head = embedding``) |

and, after the model is built, :func:`scale_norm_eps` multiplies the eps of every RMSNorm
that reads the residual stream by ``2^-2k`` (exactly scale-invariant then). A packed linear
is scaled through its ``scales_zeros`` half2 ``(s, -z*s)``: both halves times the power of
two, exact unless a value becomes subnormal or zero; :func:`scale_linear` counts such values
and the loader logs them. The MTP head's own residual stream (from ``mtp.fc``) is not
scaled; only its norms that read scaled tensors get their eps scaled.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from onecat.errors import OnecatError
from onecat.formats.fp16_headroom import HeadroomPlan
from onecat.runtime.layers.linear import LinearWeights

log = logging.getLogger(__name__)

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def linear_shift(plan: HeadroomPlan, name: str) -> int:
    """The power of two (exponent) by which linear ``name``'s output is scaled."""
    m = _LAYER.fullmatch(name)
    if m is None:
        return 0
    i, rel = int(m.group(1)), m.group(2)
    k = plan.residual_shift
    mlp = plan.mlp_shift.get(i, 0)
    return {
        "self_attn.o_proj": plan.attn_shift.get(i, 0) - k,
        "self_attn.v_proj": -plan.attn_shift.get(i, 0),
        "linear_attn.out_proj": plan.gdn_shift.get(i, 0) - k,
        "mlp.down_proj": mlp - k,
        "mlp.up_proj": -mlp,
        "mlp.shared_expert.down_proj": mlp - k,
        "mlp.shared_expert.up_proj": -mlp,
    }.get(rel, 0)


def expert_shift(plan: HeadroomPlan, prefix: str, which: str) -> int:
    """The exponent for routed expert projection ``which`` (gate_proj / up_proj / down_proj)
    of the experts at ``prefix`` (``model.layers.i.mlp.experts``)."""
    m = _LAYER.fullmatch(prefix)
    if m is None:
        return 0
    mlp = plan.mlp_shift.get(int(m.group(1)), 0)
    return {"down_proj": mlp - plan.residual_shift, "up_proj": -mlp}.get(which, 0)


def tensor_shift(plan: HeadroomPlan, name: str) -> int:
    """The exponent for a plain tensor ``name`` (the embedding, a GDN gated-norm weight)."""
    if name == "model.embed_tokens.weight":
        return -plan.residual_shift
    m = _LAYER.fullmatch(name)
    if m is not None and m.group(2) == "linear_attn.norm.weight":
        return -plan.gdn_shift.get(int(m.group(1)), 0)
    return 0


def _times(t: torch.Tensor, shift: int) -> tuple[torch.Tensor, int]:
    """``t * 2^shift`` in its own dtype and the count of nonzero values that lost precision
    (became subnormal in fp16 / bf16 terms, or zero). OnecatError if a value overflows."""
    if not shift or not t.is_floating_point():
        return t, 0
    out = t * (2.0**shift)
    if not bool(torch.isfinite(out).all()) and bool(torch.isfinite(t).all()):
        raise OnecatError(f"fp16 headroom: scaling a {tuple(t.shape)} tensor by 2^{shift} overflows {t.dtype}")
    lost = 0
    if shift < 0:
        tiny = torch.finfo(torch.float16).tiny  # served in fp16: its normal range matters
        lost = int(((out.abs() < tiny) & (t.abs() >= tiny)).sum())
    return out, lost


def scale_linear(weights: LinearWeights, shift: int, where: str) -> LinearWeights:
    """``weights`` whose output is times ``2^shift``: a float weight and bias scaled, or a
    packed linear's ``scales_zeros`` (both halves of each ``(s, -z*s)``) and bias."""
    if not shift:
        return weights
    if weights.is_packed:
        scales_zeros, lost = _times(weights.scales_zeros, shift)
        out = LinearWeights(qweight=weights.qweight, scales_zeros=scales_zeros, group_size=weights.group_size)
    else:
        weight, lost = _times(weights.weight, shift)
        out = LinearWeights(weight=weight)
    if weights.bias is not None:
        out.bias = _times(weights.bias, shift)[0]
    if lost:
        log.info("fp16 headroom: %s times 2^%d: %d values fell below the fp16 normal range", where, shift, lost)
    return out


def scale_tensor(t: torch.Tensor, shift: int, where: str) -> torch.Tensor:
    """Tensor ``t`` times ``2^shift`` (logs values that fell below the fp16 normal range)."""
    out, lost = _times(t, shift)
    if lost:
        log.info("fp16 headroom: %s times 2^%d: %d values fell below the fp16 normal range", where, shift, lost)
    return out


def scale_one_plus(weight: torch.Tensor, shift: int) -> torch.Tensor:
    """A ``(1 + w)`` norm weight whose output is times ``2^shift``: ``(1 + w) 2^shift - 1``
    (in fp32)."""
    return ((1.0 + weight.float()) * (2.0**shift) - 1.0).to(weight.dtype)


def scale_norm_eps(model: nn.Module, plan: HeadroomPlan, tied: bool) -> None:
    """Scale the eps of every RMSNorm of a built ``Qwen3_5ForCausalLM`` whose input the plan
    scales: the residual stream's readers (each layer's two norms, the final norm, the MTP
    head's embedding norm) by ``2^-2k``; with tied embeddings also the MTP head's hidden-state
    norm, which reads the final norm's output times ``2^k``, by ``2^2k``."""
    k = plan.residual_shift
    if not k:
        return
    factor = 2.0 ** (-2 * k)
    inner = model.model
    norms = [inner.norm]
    for layer in inner.layers:
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        norms.append(mtp.pre_fc_norm_embedding)
        if tied:
            mtp.pre_fc_norm_hidden.eps /= factor
    for norm in norms:
        norm.eps *= factor
