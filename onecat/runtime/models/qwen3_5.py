"""Qwen3.5 (dense 27B and MoE 35B-A3B): a hybrid of Gated DeltaNet and gated attention.

Layer ``i`` mixes tokens with Gated DeltaNet (``linear_attention``) or with gated softmax
attention (``full_attention``, every fourth layer in the released models), then applies a
SwiGLU MLP or a mixture of experts with a shared expert. Norms are RMSNorms with a
zero-centred weight, ``x_hat * (1 + w)``.

Module and parameter names follow the text-only checkpoint layout (``model.layers.N....``);
each :class:`Linear` lists the checkpoint linears it merges in ``sources`` for the loader.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from onecat.errors import OnecatError
from onecat.kernels import gdn as gdn_kernel
from onecat.kernels import gdn_prefill
from onecat.kernels.moe import (
    append_shared_expert,
    moe_route,
    moe_router,
    moe_router_norm,
    router_fits,
    router_norm_fits,
)
from onecat.runtime.context import ForwardContext, PrefillChunk, get_context
from onecat.runtime.distributed.parallel_state import (
    all_gather,
    all_reduce_add_rms_norm,
    tp_rank,
    tp_size,
)
from onecat.runtime.layers.attention import PagedAttention, sigmoid_gate
from onecat.runtime.layers.causal_conv import causal_conv1d_chunk, causal_conv1d_step
from onecat.runtime.layers.delta_rule import gated_delta_rule_chunked, gated_delta_rule_step
from onecat.runtime.layers.expert_parallel import routed_experts
from onecat.runtime.layers.fusion import fused
from onecat.runtime.layers.linear import Linear
from onecat.runtime.layers.norm import (
    GatedRMSNorm,
    RMSNorm,
    gated_rms_norm,
    gated_rms_norm_math,
    rms_norm_math,
)
from onecat.runtime.layers.rotary import PartialRotaryEmbedding, apply_partial_rope
from onecat.runtime.models.config import ModelConfig
from onecat.runtime.quant_plan import QuantPlan


def merged_linear(
    plan: QuantPlan,
    sources: list[str],
    in_features: int,
    output_sizes: list[int],
    dtype: torch.dtype,
    *,
    bias: bool = False,
) -> Linear:
    """A :class:`Linear` merging ``sources`` (in order), packed when the plan allows it."""
    group = plan.group_size(sources, output_sizes, in_features)
    layer = Linear(in_features, output_sizes, bias=bias, group_size=group, dtype=dtype)
    layer.sources = sources
    return layer


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


def _padded_rows_loader(rows: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """A ``weight_loader`` that copies a ``[rows, ...]`` tensor into the first rows of a
    parameter padded with more (the tied embedding under tensor parallelism), and zeroes the
    rest."""

    def load(param: torch.Tensor, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != (rows, *param.shape[1:]):
            raise OnecatError(f"embed_tokens: expected shape {(rows, *param.shape[1:])}, got "
                              f"{tuple(loaded.shape)}; config.json does not match the weights")
        param.data[:rows].copy_(loaded)
        param.data[rows:].zero_()

    return load


class DecodeQKV(NamedTuple):
    """What :meth:`GatedAttention.project` hands the core in a decode pass that the decode
    kernel prepares itself (``PagedAttention.decodes_from_qkv``): the merged projection and
    the rows' positions."""

    qkv: torch.Tensor
    positions: torch.Tensor


class GatedAttention(nn.Module):
    """Softmax attention whose output is gated per feature by ``sigmoid(gate)``.

    ``q_proj`` yields, head by head, ``head_dim`` query rows then ``head_dim`` gate rows.
    Queries and keys get a per-head RMSNorm, then partial RoPE. In a pass of decode rows only
    the gate goes to the core, whose decode-attention kernel applies it as it writes its
    output; otherwise (prompt passes and their piecewise graphs) :meth:`finish` applies it.
    """

    def __init__(self, cfg: ModelConfig, prefix: str, plan: QuantPlan, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = d = cfg.head_dim
        q_size, kv_size = 2 * self.num_heads * d, self.num_kv_heads * d
        self.qkv_proj = merged_linear(
            plan,
            [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"],
            cfg.hidden_size,
            [q_size, kv_size, kv_size],
            dtype,
            bias=cfg.attention_bias,
        )
        self.o_proj = merged_linear(
            plan, [f"{prefix}.o_proj"], self.num_heads * d, [cfg.hidden_size], dtype, bias=cfg.attention_bias
        )
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.rotary = PartialRotaryEmbedding(int(d * cfg.partial_rotary_factor), cfg.rope_theta)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, d**-0.5)

    def project(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Token-wise part before the core: ((q, k, v, gate), ()) of ``x [T, hidden]`` in a
        pass of decode rows only (the core gates its output), else ((q, k, v), (gate,)).

        On CUDA fp16 with a supported head shape one kernel prepares q and writes the step's
        keys and values into the KV cache (``PagedAttention.prepare_inputs``); k and v are
        then the fresh rows only when the step has prompt rows (else None), and the gate is
        a ``[T, H, D]`` view of the projection. Elsewhere the torch path
        (:func:`attention_inputs`) runs and the core writes the cache."""
        qkv = self.qkv_proj(x)
        if self.attn.decodes_from_qkv(qkv, self.rotary.rotary_dim):  # the core does it all
            return (DecodeQKV(qkv, positions),), ()
        if self.attn.fuses_inputs(qkv.device, qkv.dtype, self.rotary.rotary_dim):
            q, k, v = self.attn.prepare_inputs(
                qkv, positions, self.q_norm.weight, self.k_norm.weight, self.rotary.inv_freq,
                self.q_norm.eps, self.rotary.rotary_dim,
            )
            d = self.head_dim
            gate = qkv[:, : 2 * self.num_heads * d].view(qkv.shape[0], self.num_heads, 2 * d)[..., d:]
        else:
            q, k, v, gate = attention_inputs(
                qkv, positions, self.q_norm.weight, self.k_norm.weight,
                self.rotary.inv_freq, self.q_norm.eps, self.num_heads, self.num_kv_heads,
                self.head_dim, self.rotary.rotary_dim,
            )
        ctx = get_context()
        if ctx.num_decodes == x.shape[0] and not ctx.prefills:
            return (q, k, v, gate), ()
        return (q, k, v), (gate,)

    def core(
        self, q: torch.Tensor | DecodeQKV, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
        gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The part that mixes tokens of a sequence (reads the batch context): ``[T, H, D]``,
        times ``sigmoid(gate)`` when the gate is given (a :class:`DecodeQKV`: the decode
        kernel prepares its inputs itself and applies the gate)."""
        if isinstance(q, DecodeQKV):
            return self.attn.decode_from_qkv(
                q.qkv, q.positions, self.q_norm.weight, self.k_norm.weight, self.rotary.inv_freq,
                self.q_norm.eps, self.rotary.rotary_dim,
            )  # fmt: skip
        stored = self.attn.fuses_inputs(q.device, q.dtype, self.rotary.rotary_dim)  # by project
        return self.attn(q, k, v, stored=stored, gate=gate)

    def finish(self, out: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """Token-wise part after the core: the gate (unless the core applied it) and the
        output projection -> ``[T, hidden]`` (``gate`` ``[T, H*D]``, or ``[T, H, D]`` from
        the fused path)."""
        gated = out if gate is None else sigmoid_gate(out, gate)
        return self.o_proj(gated.reshape(gated.shape[0], -1))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` at ``positions [T]`` -> ``[T, hidden]``."""
        inputs, carry = self.project(positions, x)
        return self.finish(self.core(*inputs), *carry)


@fused
def attention_inputs(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the merged projection into per-head q (normed, rotated), gate, k (normed,
    rotated) and v: ``[T, H, D]``, ``[T, H*D]``, ``[T, KVH, D]``, ``[T, KVH, D]``."""
    tokens = qkv.shape[0]
    q_size, kv_size = 2 * num_heads * head_dim, num_kv_heads * head_dim
    q_gate, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q_gate = q_gate.reshape(tokens, num_heads, 2 * head_dim)
    q, gate = q_gate[..., :head_dim], q_gate[..., head_dim:]
    q = apply_partial_rope(positions, rms_norm_math(q, q_norm, eps), inv_freq, rotary_dim)
    k = k.reshape(tokens, num_kv_heads, head_dim)
    k = apply_partial_rope(positions, rms_norm_math(k, k_norm, eps), inv_freq, rotary_dim)
    return q, k, v.reshape(tokens, num_kv_heads, head_dim), gate.reshape(tokens, -1)


class DepthwiseConv(nn.Module):
    """Holds the short convolution's weight ``[channels, kernel]`` (``[C, 1, K]`` on disk)."""

    def __init__(self, channels: int, kernel: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(channels, kernel, dtype=dtype)
        self.weight.weight_loader = lambda param, loaded, shard=None: param.data.copy_(
            loaded.reshape(param.shape)
        )


class GatedDeltaNet(nn.Module):
    """Linear attention with the gated delta rule (see ``layers/delta_rule.py``).

    ``in_proj_qkv`` gives q, k (per key head) and v (per value head), concatenated; a
    depthwise causal conv (kernel 4) with SiLU runs over that concatenation. The decay is
    ``g = -exp(A_log) * softplus(a + dt_bias)`` and the learning rate ``beta = sigmoid(b)``,
    both in fp32. The output is ``out_proj(norm(o) * silu(z))`` per value head; the gated
    norm belongs to ``core`` (the decode kernel applies it as it writes ``o``), so ``finish``
    is ``out_proj`` alone.

    Per sequence the layer carries a conv state ``[C, K-1]`` and a recurrent state
    ``[H_v, d_k, d_v]`` (fp32) in the slot the scheduler gave it; the runner allocates
    ``conv_state`` and ``recurrent_state`` for all slots.
    """

    def __init__(self, cfg: ModelConfig, prefix: str, plan: QuantPlan, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_k_heads = cfg.linear_num_key_heads
        self.num_v_heads = cfg.linear_num_value_heads
        self.head_k_dim = cfg.linear_key_head_dim
        self.head_v_dim = cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        hidden = cfg.hidden_size
        self.in_proj_qkvz = merged_linear(
            plan,
            [f"{prefix}.in_proj_qkv", f"{prefix}.in_proj_z"],
            hidden,
            [self.conv_dim, self.value_dim],
            dtype,
        )
        self.in_proj_ba = merged_linear(
            plan,
            [f"{prefix}.in_proj_b", f"{prefix}.in_proj_a"],
            hidden,
            [self.num_v_heads, self.num_v_heads],
            dtype,
        )
        self.conv1d = DepthwiseConv(self.conv_dim, cfg.linear_conv_kernel_dim, dtype)
        self.A_log = _param(self.num_v_heads, dtype=torch.float32)
        self.dt_bias = _param(self.num_v_heads, dtype=torch.float32)
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = merged_linear(plan, [f"{prefix}.out_proj"], self.value_dim, [hidden], dtype)
        self.conv_state = torch.empty(0)  # [slots, C, K-1], set by the model runner
        self.recurrent_state = torch.empty(0)  # [slots, H_v, d_k, d_v] fp32

    def _split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        shape = mixed.shape[:-1]
        return (
            q.reshape(*shape, self.num_k_heads, self.head_k_dim),
            k.reshape(*shape, self.num_k_heads, self.head_k_dim),
            v.reshape(*shape, self.num_v_heads, self.head_v_dim),
        )

    def _states(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.conv_state.numel() == 0:  # memory-profiling pass: no states yet
            n = slots.shape[0]
            conv = torch.zeros(n, self.conv_dim, self.conv1d.weight.shape[1] - 1, device=slots.device)
            rec = torch.zeros(n, self.num_v_heads, self.head_k_dim, self.head_v_dim, device=slots.device)
            return conv, rec
        return self.conv_state[slots], self.recurrent_state[slots]

    def _save_states(self, slots: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor) -> None:
        if self.conv_state.numel():
            self.conv_state.index_copy_(0, slots, conv.to(self.conv_state.dtype))
            self.recurrent_state.index_copy_(0, slots, rec)

    def _decode_in_place(
        self, mixed: torch.Tensor, ba: torch.Tensor, z: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
        positions: int = 1,
    ) -> torch.Tensor:
        """Decode tokens on the GPU (``positions`` consecutive rows per sequence): the sm_70
        conv-update kernel, then the delta-rule kernel, which also applies the gated norm; both
        read the states from rows ``src`` and write them to rows ``dst`` (no gather and
        scatter). When ``ba`` is the layer input (see :meth:`project`), b and a are projected
        by the fused delta-rule kernel, or for the wide-batch one by the conv launch."""
        hidden, weight = (ba, self.in_proj_ba.weight) if self._is_layer_input(ba) else (None, None)
        project = {}
        if hidden is not None and gdn_kernel.uses_wide_kernel(mixed.shape[0]):
            # the wide-batch delta rule reads b and a as rows: the conv launch projects them
            # (in_proj_ba does for rows its 128-bit loads cannot read)
            if gdn_kernel.conv_can_project_ba(hidden):
                ba = torch.empty(mixed.shape[0], weight.shape[0], dtype=weight.dtype, device=mixed.device)
                project = {"hidden_states": hidden, "ba_weight": weight, "ba_out": ba}
            else:
                ba = self.in_proj_ba(hidden)
            hidden = weight = None
        conv_out = gdn_kernel.causal_conv1d_update_(
            mixed, self.conv_state, self.conv1d.weight, src, dst, positions=positions, **project
        )
        return gdn_kernel.gated_delta_rule_decode_(
            conv_out, None if hidden is not None else ba, z, self.A_log, self.dt_bias, self.norm.weight,
            self.norm.eps, self.recurrent_state, src, self.num_k_heads, dst_slots=dst, positions=positions,
            hidden_states=hidden, ba_weight=weight,
        )

    def _uses_decode_kernel(self, mixed: torch.Tensor) -> bool:
        return (
            mixed.is_cuda and self.conv_state.numel() > 0 and self.conv1d.weight.shape[1] == gdn_kernel.CONV_KERNEL
            and gdn_kernel.supports(self.head_k_dim, self.head_v_dim, mixed.dtype)
            and self.norm.weight.dtype == torch.float32
        )

    def _decode(
        self, mixed: torch.Tensor, ba: torch.Tensor, z: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
    ) -> torch.Tensor:
        """One decode token per row, states read from rows ``src`` and written to ``dst``:
        the gated norm's output ``[B, Hv, dv]``."""
        if self._uses_decode_kernel(mixed):
            return self._decode_in_place(mixed, ba, z, src, dst)
        if self._is_layer_input(ba):
            ba = self.in_proj_ba(ba)
        b, a = ba.split(self.num_v_heads, dim=-1)
        dims = (self.num_k_heads, self.head_k_dim, self.num_v_heads, self.head_v_dim)
        out, conv_state, rec_state = gated_deltanet_decode(
            mixed, b, a, z, self.conv_state, self.recurrent_state, src,
            self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight, self.norm.eps, *dims,
        )
        self._save_states(dst, conv_state, rec_state)
        return out

    def _decode_rows(self, mixed: torch.Tensor, ba: torch.Tensor, z: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The step's decode rows: with ``decode_width`` rows per sequence (speculative
        decoding), position by position, each reading the state rows the previous one wrote."""
        n, width = ctx.num_decodes, ctx.decode_width
        src = ctx.decode_state_slots
        dst = src if ctx.decode_state_dst is None else ctx.decode_state_dst
        if width == 1:
            return self._decode(mixed[:n], ba[:n], z[:n], src, dst)
        batch = n // width  # rows are sequence by sequence, state rows position by position
        if self._uses_decode_kernel(mixed):  # all positions in one conv and one delta-rule launch
            return self._decode_in_place(mixed[:n], ba[:n], z[:n], src[:batch], dst, positions=width)
        outputs = [
            self._decode(mixed[j:n:width], ba[j:n:width], z[j:n:width], src[j * batch : (j + 1) * batch],
                         dst[j * batch : (j + 1) * batch])
            for j in range(width)
        ]
        return torch.stack(outputs, dim=1).reshape(n, *outputs[0].shape[1:])

    def _kernel_projects_ba(self, x: torch.Tensor) -> bool:
        """True when this pass's rows are all decode rows the decode kernels run and
        in_proj_ba is a plain fp16 weight: the kernels then compute b and a from ``x`` (two
        dot products per value head and row: in the fused delta-rule kernel, or in the conv
        launch before the wide-batch one) and in_proj_ba's launches are skipped. Its width must
        differ from ``x``'s, which tells :meth:`core` which one it got."""
        ba = self.in_proj_ba
        if ba.is_packed or ba.bias is not None or ba.weight.dtype != torch.float16 or ba.in_features == ba.out_features:
            return False
        ctx = get_context()
        rows = x.shape[0]
        return ctx.num_decodes == rows and not ctx.prefills and self._uses_decode_kernel(x)

    def _is_layer_input(self, ba: torch.Tensor) -> bool:
        """Whether ``project`` handed the layer input in ``ba``'s place (see :meth:`_kernel_projects_ba`)."""
        return ba.shape[-1] != self.in_proj_ba.out_features

    def project(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Token-wise part before the core: ((mixed, ba, z), ()) of ``x [T, hidden]``
        (positions unused: the state carries order). In a pass of decode rows only on the
        decode kernel, ``ba`` is ``x`` itself and the kernel projects b and a (a prompt pass,
        whose graphs are captured without decode rows, always gets in_proj_ba's output)."""
        mixed, z = self.in_proj_qkvz(x).split(self.in_proj_qkvz.output_sizes, dim=-1)
        return (mixed, x if self._kernel_projects_ba(x) else self.in_proj_ba(x), z), ()

    def core(self, mixed: torch.Tensor, ba: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Conv, delta rule and gated norm over the batch's sequences, states read and written
        in their slots: ``[T, Hv, dv]``, ready for ``out_proj``. Decode rows come first, then
        the prompt chunks, one after another. ``ba`` is in_proj_ba's output or, in a pass of
        decode rows only, the layer input (see :meth:`project`)."""
        ctx = get_context()
        outputs = []
        if ctx.num_decodes:
            outputs.append(self._decode_rows(mixed, ba, z, ctx))
        if ctx.prefills:
            first, end = ctx.prefills[0].start, ctx.prefills[-1].start + ctx.prefills[-1].length
            if mixed.is_cuda and gdn_prefill.supports(
                self.head_k_dim, self.head_v_dim, self.conv1d.weight.shape[1], mixed.dtype
            ):
                raw = self._prefill_in_place(mixed, ba, ctx.prefills)
            else:
                b, a = ba.split(self.num_v_heads, dim=-1)
                raw = torch.cat(self._prefill_torch(mixed, a, b, ctx.prefills))
            outputs.append(self._gated_norm(raw, z[first:end]))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _gated_norm(self, raw: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``norm(raw) * silu(z)`` per value head for prompt rows: one kernel on CUDA fp16 (in
        place), else torch."""
        if raw.is_cuda and gdn_kernel.supports_gated_norm(self.head_v_dim, raw.dtype, self.norm.weight.dtype):
            return gdn_kernel.gated_rms_norm_(raw, z, self.norm.weight, self.norm.eps, out=raw)
        return gated_rms_norm(raw, z.reshape(raw.shape), self.norm.weight, self.norm.eps)

    def finish(self, core: torch.Tensor) -> torch.Tensor:
        """Token-wise part after the core: the output projection -> ``[T, hidden]``."""
        return self.out_proj(core.reshape(core.shape[0], -1))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``."""
        inputs, carry = self.project(positions, x)
        return self.finish(self.core(*inputs), *carry)

    def _prefill_in_place(self, mixed: torch.Tensor, ba: torch.Tensor, prefills: list[PrefillChunk]) -> torch.Tensor:
        """All prompt chunks of the step on the GPU at once (they follow each other in the
        batch): the sm_70 conv and chunked delta-rule kernels, which read and write the conv
        and recurrent states in their slots (``kernels/gdn_prefill.cu``)."""
        first, end = prefills[0].start, prefills[-1].start + prefills[-1].length
        slots = [chunk.state_slot for chunk in prefills]
        checkpoints = [chunk.checkpoints for chunk in prefills]
        conv_state, rec_state = self.conv_state, self.recurrent_state
        if conv_state.numel() == 0:  # memory-profiling pass: scratch states
            slots, checkpoints = list(range(len(prefills))), None
            conv_state, rec_state = self._states(torch.tensor(slots, device=mixed.device))
            conv_state = conv_state.to(mixed.dtype)
        batch = gdn_prefill.prefill_batch(
            [chunk.start - first for chunk in prefills], [chunk.length for chunk in prefills], slots, mixed.device,
            checkpoints,
        )
        conv_out = gdn_prefill.causal_conv1d_prefill_(mixed[first:end], conv_state, self.conv1d.weight, batch)
        return gdn_prefill.gated_delta_rule_prefill_(
            conv_out, ba[first:end], self.A_log, self.dt_bias, rec_state, batch, self.num_k_heads
        )

    def _prefill_torch(
        self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, prefills: list[PrefillChunk]
    ) -> list[torch.Tensor]:
        """Prompt chunks one sequence at a time in torch (CPU, fp32, other head sizes); a chunk
        with checkpoints inside runs as pieces between them, each checkpoint saving the states."""
        dims = (self.num_k_heads, self.head_k_dim, self.num_v_heads, self.head_v_dim)
        outputs = []
        for chunk in prefills:
            slot = torch.tensor([chunk.state_slot], device=mixed.device)
            conv_state, rec_state = self._states(slot)
            conv_state, rec_state = conv_state[0], rec_state[0]
            begin = 0
            for end, row in [*chunk.checkpoints, (chunk.length, chunk.state_slot)]:
                part = slice(chunk.start + begin, chunk.start + end)
                mixed_c, conv_state = causal_conv1d_chunk(mixed[part], conv_state, self.conv1d.weight)
                q, k, v = split_heads(mixed_c, *dims)
                g, beta = decay_and_rate(a[part], b[part], self.A_log, self.dt_bias)
                out, rec_state = gated_delta_rule_chunked(q, k, v, g, beta, rec_state)
                self._save_states(torch.tensor([row], device=mixed.device), conv_state[None], rec_state[None])
                outputs.append(out.to(mixed.dtype))
                begin = end
        return outputs


def split_heads(
    mixed: torch.Tensor, num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv output ``[T, 2*Hk*dk + Hv*dv]`` as q, k ``[T, Hk, dk]`` and v ``[T, Hv, dv]``."""
    key_dim = num_k_heads * head_k_dim
    q, k, v = mixed.split([key_dim, key_dim, num_v_heads * head_v_dim], dim=-1)
    tokens = mixed.shape[0]
    return (
        q.reshape(tokens, num_k_heads, head_k_dim),
        k.reshape(tokens, num_k_heads, head_k_dim),
        v.reshape(tokens, num_v_heads, head_v_dim),
    )


def decay_and_rate(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32) and ``beta = sigmoid(b)``."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), torch.sigmoid(b)


@fused
def gated_deltanet_decode(
    mixed: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    z: torch.Tensor,
    conv_states: torch.Tensor,
    rec_states: torch.Tensor,
    slots: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    num_k_heads: int,
    head_k_dim: int,
    num_v_heads: int,
    head_v_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token of ``B`` sequences through the GDN core: conv step, delta-rule step and the
    gated norm with ``z [B, Hv*dv]``, reading the sequences' states from their ``slots`` of
    the state buffers. Returns the normed output ``[B, Hv, dv]`` and the new conv and
    recurrent states ``[B, ...]`` (the caller writes them back)."""
    conv_out, conv_state = causal_conv1d_step(mixed, conv_states[slots], conv_weight)
    q, k, v = split_heads(conv_out, num_k_heads, head_k_dim, num_v_heads, head_v_dim)
    g, beta = decay_and_rate(a, b, A_log, dt_bias)
    out, rec_state = gated_delta_rule_step(q, k, v, g, beta, rec_states[slots])
    out = out.to(mixed.dtype)
    return gated_rms_norm_math(out, z.reshape(out.shape), norm_weight, norm_eps), conv_state, rec_state


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up merged."""

    def __init__(self, hidden: int, intermediate: int, prefix: str, plan: QuantPlan, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = merged_linear(
            plan, [f"{prefix}.gate_proj", f"{prefix}.up_proj"], hidden, [intermediate] * 2, dtype
        )
        self.down_proj = merged_linear(plan, [f"{prefix}.down_proj"], intermediate, [hidden], dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``."""
        return self.down_proj(self.gate_up_proj.silu_mul(x))

    def forward_with_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward(norm(all_reduce(x) + residual))`` and the new residual (what
        :meth:`DecoderLayer.end` needs, as :meth:`SparseMoE.forward_with_norm` gives)."""
        h, residual = all_reduce_add_rms_norm(x, residual, norm.weight, norm.eps)
        return self(h), residual


@fused
def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (fp32), the top ``top_k``, weights renormalised to sum to 1."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), expert_ids


@fused
def add_gated(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + sigmoid(gate) * y``."""
    return x + torch.sigmoid(gate) * y


class SparseMoE(nn.Module):
    """Top-k routed experts (softmax router, renormalised top-k weights) plus a shared expert
    scaled by ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, cfg: ModelConfig, prefix: str, plan: QuantPlan, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.gate = merged_linear(plan, [f"{prefix}.gate"], hidden, [cfg.num_experts], dtype)
        expert_sources = [
            f"{prefix}.experts.{e}.{which}"
            for e in range(cfg.num_experts)
            for which in ("gate_proj", "up_proj", "down_proj")
        ]
        group = plan.group_size(expert_sources, [cfg.moe_intermediate_size], hidden)
        if group is not None and plan.group_size(expert_sources, [hidden], cfg.moe_intermediate_size) is None:
            group = None
        foldable = group is not None and cfg.shared_expert_intermediate_size == cfg.moe_intermediate_size
        self.experts = routed_experts(
            cfg.num_experts, hidden, cfg.moe_intermediate_size, group_size=group, dtype=dtype,
            spare_slots=int(foldable),
        )  # fmt: skip
        self.shared_slot: int | None = None  # set by fold_shared_expert
        self.router_rows: torch.Tensor | None = None  # [E+1 padded to 8k, H]: router and shared gate rows, when folded
        self.experts.prefix = f"{prefix}.experts"
        self.shared_expert = MLP(
            hidden, cfg.shared_expert_intermediate_size, f"{prefix}.shared_expert", plan, dtype
        )
        self.shared_expert_gate = merged_linear(plan, [f"{prefix}.shared_expert_gate"], hidden, [1], dtype)

    def fold_shared_expert(self) -> bool:
        """After loading: copy the shared expert into the experts' spare slot (its layers then
        view it), so that it runs as one more choice of every token, weighted by its sigmoid
        gate, inside the same grouped launches (no separate MLP and gated add). Needs a spare
        slot (packed experts, no tensor parallelism, equal intermediate sizes) and the shared
        expert packed like the experts; otherwise it stays separate. Returns whether it is folded."""
        if self.shared_slot is None and self.experts.fold_in(
            self.experts.num_experts, self.shared_expert.gate_up_proj, self.shared_expert.down_proj
        ):
            self.shared_slot = self.experts.num_experts
            self._stack_router_rows()
        return self.shared_slot is not None

    def _stack_router_rows(self) -> None:
        """Keep the router's rows and the shared gate's row in one tensor (the two layers then
        view it), so that a batch above the one-launch router's size projects both with one GEMM
        and routes with one kernel (``moe_route`` with the shared expert). The ``E+1`` rows are
        padded with zero rows to a multiple of 8, so that cuBLAS writes aligned logit rows (the
        257-row stack took an ``align1`` kernel and a split-K reduce launch): 35B-A3B decode
        +0.6-0.7% at batches 16-32 on the H200 (BENCHMARKS.md 2026-12-02)."""
        if not self._plain_router():
            return
        gate, shared_gate = self.gate, self.shared_expert_gate
        rows = gate.weight.shape[0] + 1
        pad = gate.weight.new_zeros(-rows % 8, gate.weight.shape[1])
        stacked = torch.cat([gate.weight.data, shared_gate.weight.data.reshape(1, -1), pad])
        gate.weight.data, shared_gate.weight.data = stacked[: rows - 1], stacked[rows - 1 : rows]
        self.router_rows = stacked

    def _plain_router(self) -> bool:
        """Whether the router and the shared gate are plain fp16 weights without bias."""
        gate, shared_gate = self.gate, self.shared_expert_gate
        return not (gate.is_packed or shared_gate.is_packed or gate.bias is not None or shared_gate.bias is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``. On CUDA the routing is one kernel (``moe_route``:
        the same softmax / top-k / renormalisation, ties lowest index first); for decode
        batches one kernel also computes the router's and the shared gate's projections
        (``moe_router``). A folded shared expert (:meth:`fold_shared_expert`) is one more
        choice per token: the whole block is then the router and the grouped MoE op (above
        the one-launch router's batch: one GEMM of both projections and one routing kernel)."""
        gate, shared_gate, slot = self.gate, self.shared_expert_gate, self.shared_slot
        if self._plain_router() and router_fits(x, gate.weight, shared_gate.weight):  # decode: one launch
            weights, expert_ids, shared_logit = moe_router(
                x, gate.weight, shared_gate.weight, self.top_k, -1 if slot is None else slot
            )
        elif self.router_rows is not None and x.is_cuda:  # folded: slot is set
            logits = F.linear(x, self.router_rows)[:, : gate.weight.shape[0] + 1]
            weights, expert_ids = moe_route(logits, self.top_k, slot)
            shared_logit = None
        else:
            logits, shared_logit = gate(x), shared_gate(x)
            weights, expert_ids = moe_route(logits, self.top_k) if logits.is_cuda else route(logits, self.top_k)
            if slot is not None:
                weights, expert_ids = append_shared_expert(weights, expert_ids, shared_logit, slot)
        return self._experts(x, weights, expert_ids, shared_logit)

    def forward_with_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward(norm(all_reduce(x) + residual))`` and the new residual ``all_reduce(x) +
        residual`` (what :meth:`DecoderLayer.end` needs). For decode batches at one rank the
        residual add and the norm run inside the router's launch (``moe_router_norm``): no norm
        launch of its own."""
        gate, shared_gate, slot = self.gate, self.shared_expert_gate, self.shared_slot
        if tp_size() == 1 and self._plain_router() and router_norm_fits(
            x, residual, norm.weight, gate.weight, shared_gate.weight
        ):
            weights, expert_ids, shared_logit, h, residual = moe_router_norm(
                x, residual, norm.weight, norm.eps, gate.weight, shared_gate.weight, self.top_k,
                -1 if slot is None else slot,
            )  # fmt: skip
            return self._experts(h, weights, expert_ids, shared_logit), residual
        h, residual = all_reduce_add_rms_norm(x, residual, norm.weight, norm.eps)
        return self(h), residual

    def _experts(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, shared_logit: torch.Tensor | None
    ) -> torch.Tensor:
        """The routed experts on ``x`` (the shared expert among them when folded, else added
        gated by ``sigmoid(shared_logit)``)."""
        routed = self.experts(x, expert_ids, weights)
        return routed if self.shared_slot is not None else add_gated(routed, shared_logit, self.shared_expert(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (GDN or gated attention), then MLP or MoE."""

    def __init__(
        self, cfg: ModelConfig, index: int, plan: QuantPlan, dtype: torch.dtype, prefix: str | None = None,
        layer_type: str | None = None,
    ) -> None:
        super().__init__()
        prefix = prefix or f"model.layers.{index}"
        self.layer_type = layer_type or cfg.layer_types[index]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, f"{prefix}.linear_attn", plan, dtype)
        else:
            self.self_attn = GatedAttention(cfg, f"{prefix}.self_attn", plan, dtype)
        if cfg.is_moe:
            self.mlp = SparseMoE(cfg, f"{prefix}.mlp", plan, dtype)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, f"{prefix}.mlp", plan, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer on the flat batch. ``x`` is the previous layer's output before its
        all-reduce (tensor parallelism) and residual add, both fused with this layer's first
        norm; returns (output, residual) alike."""
        inputs, carry, residual = self.begin(positions, x, residual)
        return self.end(self.mixer.core(*inputs), carry, residual)

    @property
    def mixer(self) -> GatedDeltaNet | GatedAttention:
        """The token mixer: Gated DeltaNet or gated attention."""
        return self.linear_attn if self.layer_type == "linear_attention" else self.self_attn

    def begin(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], torch.Tensor]:
        """Everything token-wise before the mixer's core: (core inputs, what ``end`` needs
        besides the core output, residual)."""
        if residual is None:  # the embedding (or the MTP head's fc output): whole on every rank
            residual, h = x, self.input_layernorm(x)
        else:  # the previous layer's MLP / MoE output: summed over the ranks here
            norm = self.input_layernorm
            h, residual = all_reduce_add_rms_norm(x, residual, norm.weight, norm.eps)
        inputs, carry = self.mixer.project(positions, h)
        return inputs, carry, residual

    def end(
        self, core: torch.Tensor, carry: tuple[torch.Tensor, ...], residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything token-wise after the mixer's core: (output before its all-reduce and the
        residual add, residual)."""
        # tensor parallel: the MLP / MoE sums the ranks' row-parallel parts, fused with the add
        # and the norm (a MoE decode pass runs both inside its router's launch)
        out = self.mixer.finish(core, *carry)
        return self.mlp.forward_with_norm(out, residual, self.post_attention_layernorm)


class Qwen3_5Model(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, cfg: ModelConfig, plan: QuantPlan, dtype: torch.dtype) -> None:
        super().__init__()
        rows = cfg.vocab_size
        if cfg.tie_word_embeddings and cfg.vocab_partitions > 1:  # lm_head slices are views of it
            rows = cfg.lm_head_rows * cfg.vocab_partitions
        self.embed_tokens = nn.Embedding(rows, cfg.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        if rows != cfg.vocab_size:
            self.embed_tokens.weight.weight_loader = _padded_rows_loader(cfg.vocab_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, plan, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token ids ``[T]`` -> final hidden states ``[T, hidden]``."""
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return all_reduce_add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]


class Qwen3_5ForCausalLM(nn.Module):
    """The language model and its (untied by default) output projection.

    Under tensor parallelism (``cfg.vocab_partitions`` N > 1) ``lm_head`` is vocab parallel,
    as vLLM's ``ParallelLMHead``: rank ``r`` (``tp_rank()``) holds rows ``r * R .. (r + 1) *
    R - 1`` of the vocabulary (``R = cfg.lm_head_rows``, equal on every rank; rows past the
    vocabulary are zero padding), computes those logits, and one all-gather assembles the
    full rows on every rank, the padding cut off: the same dot products as one rank's
    ``lm_head``, each read by one rank only. A 4-bit ``lm_head`` is split the same way (whole
    32-row tiles). With tied embeddings the embedding stays whole on every rank (any rank
    looks up any token; splitting it would cost a masked lookup and one more all-reduce per
    pass) and, padded to ``N * R`` rows, ``lm_head``'s weight is a view of this rank's rows of
    it: no bytes of its own, as at one rank.
    """

    def __init__(self, cfg: ModelConfig, plan: QuantPlan, dtype: torch.dtype, *, mtp: bool = False) -> None:
        """``mtp``: also build the multi-token-prediction head (``mtp.*``) for speculative decoding."""
        super().__init__()
        self.config = cfg
        self.model = Qwen3_5Model(cfg, plan, dtype)
        rows = cfg.lm_head_rows
        if cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, rows, dtype=dtype)
            embedding = self.model.embed_tokens.weight
            if cfg.vocab_partitions == 1:
                self.lm_head.weight = embedding
            else:  # a view of this rank's rows: a buffer, so that loading skips it
                del self.lm_head.weight
                self.lm_head.register_buffer("weight", embedding.detach().narrow(0, tp_rank() * rows, rows),
                                             persistent=False)
            self.lm_head.sources = []
        else:  # packed exactly when one rank's whole lm_head would be
            whole = plan.group_size(["lm_head"], [cfg.vocab_size], cfg.hidden_size) is not None
            self.lm_head = merged_linear(plan if whole else QuantPlan(), ["lm_head"], cfg.hidden_size, [rows], dtype)
        self.mtp = MtpHead(cfg, plan, dtype) if mtp else None
        self.draft_head: Linear | None = None  # speculative decoding: a 4-bit copy of lm_head (layers/draft_head.py)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the flat batch (see ``onecat.runtime.context``)."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` of the given hidden states (under tensor parallelism every
        rank must call it: the logits are gathered)."""
        return self._whole_vocabulary(self.lm_head(hidden))

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP drafter's logits: through ``draft_head`` when set, else ``lm_head`` (a
        draft head is made from this rank's ``lm_head`` rows and gathered the same way)."""
        return self._whole_vocabulary((self.draft_head or self.lm_head)(hidden))

    def _whole_vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's logits ``[N, R]`` -> every rank's, ``[N, vocab]`` (a no-op at one rank)."""
        cfg = self.config
        if cfg.vocab_partitions == 1:
            return logits
        logits = all_gather(logits)
        if logits.shape[-1] != cfg.vocab_size:  # padding rows of the last slices
            logits = logits[..., : cfg.vocab_size].contiguous()
        return logits


class MtpHead(nn.Module):
    """Qwen3.5's multi-token-prediction head (``mtp.*``), a drafter for speculative decoding.

    At position ``t`` it reads the model's final (normed) hidden state ``h[t]`` and the
    embedding of token ``t+1``: ``fc([norm_e(embed(x[t+1])) ; norm_h(h[t])])``, one
    full-attention decoder layer (``mtp.layers.0``, with its own KV cache, at position ``t``;
    an MLP or a MoE like the model's), then ``mtp.norm``. The model's ``lm_head`` turns the
    result into logits for token ``t+2``. Drafting further, the head reads its own output in
    place of ``h`` (as vLLM's MTP proposer does).
    """

    def __init__(self, cfg: ModelConfig, plan: QuantPlan, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(hidden, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(hidden, cfg.rms_norm_eps)
        self.fc = merged_linear(plan, ["mtp.fc"], 2 * hidden, [hidden], dtype)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, 0, plan, dtype, prefix="mtp.layers.0", layer_type="full_attention")]
        )
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
        """``hidden [T, H]`` at ``positions [T]`` and the next tokens' embeddings -> ``[T, H]`` (normed)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        x, residual = self.layers[0](positions, x, None)
        return all_reduce_add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]


def fold_shared_experts(model: nn.Module) -> int:
    """:meth:`SparseMoE.fold_shared_expert` on every MoE block of a loaded model; returns how
    many were folded."""
    return sum(m.fold_shared_expert() for m in model.modules() if isinstance(m, SparseMoE))
