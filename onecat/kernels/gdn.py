"""The Gated DeltaNet decode step on the GPU (``gdn_decode.cu``): one token (or, for a
speculative verify pass, a few consecutive tokens) of each sequence of a batch through the
short conv (:func:`causal_conv1d_update_`) and the gated delta rule with the gated norm after
it (:func:`gated_delta_rule_decode_`), their conv and recurrent states updated in place in the
state pools (or written to one row per token): two launches per layer (three above
:data:`WIDE_ABOVE_ROWS` decode rows, where the norm runs after the delta rule). The runtime calls them
for CUDA decode batches the kernels support and keeps its torch step
(``onecat.runtime.layers.delta_rule``) for everything else; :func:`gated_rms_norm_` is the
gated norm alone, for the rows of prompt chunks.
"""

from __future__ import annotations

import ctypes

import torch

from onecat.errors import OnecatError
from onecat.kernels.loader import get_kernel

HEAD_K_DIM = 128
"""The key head dimension the kernel is built for (Qwen3.5's)."""
HEAD_V_DIMS = (32, 64, 128)
"""The value head dimensions it has a kernel for (``gdn_decode_d<dv>``, 8 * dv threads a block)."""
WIDE_ABOVE_ROWS = 0
"""Decode passes of more rows than this (sequences x positions) whose b and a come as rows run
the wide-batch kernel ``gdn_decode_wide_d<dv>`` (blocks of 4 warps and 32 state columns, several
per SM; no norm) and then ``gdn_decode_gated_norm`` over its rows; smaller passes, and passes
whose b and a the kernel projects, run the fused ``gdn_decode_d<dv>`` (a block per value head,
norm included). H200, compute_70 PTX (``bench/gdn_decode.py``, 2026-12-01 17:40), one layer,
us: the conv launch and the delta rule as the runtime runs them for a decode-only pass,
fused (conv, then the fused kernel projecting b and a) against wide (the conv launch
projecting b and a, then wide + norm):

====================  ======  ======  ======  ======
rows                    1       4       8      32
27B (48 value heads)   9.6     19.2    29.4    109.9   fused
                       8.1     13.2    22.0    65.4    wide
35B-A3B (32 heads)     9.0     11.6    19.7    69.3    fused
                       7.8     10.9    15.9    44.7    wide
====================  ======  ======  ======  ======

and with b and a given as rows the wide kernels win too (27B 1 row: 5.8 against 6.3 us), so
every decode pass runs the wide path. The fused kernel and the threshold stay: on a V100 (80
SMs, where one block per head already keeps enough bytes in flight, see gdn_decode.cu) the
norm launch it saves may tip small passes back to it (inferred, not measured; re-time there).
The choice depends on the row count only, so a CUDA graph captures one path per batch bucket."""


def uses_wide_kernel(rows: int) -> bool:
    """Whether a decode pass of ``rows`` rows with b and a given as rows runs the wide-batch
    kernels (see :data:`WIDE_ABOVE_ROWS`)."""
    return rows > WIDE_ABOVE_ROWS


def supports(head_k_dim: int, head_v_dim: int, dtype: torch.dtype) -> bool:
    """True when :func:`gated_delta_rule_decode_` runs these head sizes and activation dtype."""
    return head_k_dim == HEAD_K_DIM and head_v_dim in HEAD_V_DIMS and dtype == torch.float16


def supports_gated_norm(head_v_dim: int, dtype: torch.dtype, weight_dtype: torch.dtype) -> bool:
    """True when :func:`gated_rms_norm_` runs this value head dim, activation and weight dtype."""
    return head_v_dim in HEAD_V_DIMS and dtype == torch.float16 and weight_dtype == torch.float32


def _ba_checks(ba: torch.Tensor | None, hidden_states: torch.Tensor | None, ba_weight: torch.Tensor | None,
               rows: int, num_v_heads: int) -> list[tuple[str, bool]]:
    """b and a come as in_proj_ba's output rows, or as its weight and input (projected in the kernel)."""
    if ba is not None:
        return [("ba", ba.dtype == torch.float16 and ba.dim() == 2 and ba.shape[0] == rows
                 and ba.shape[1] >= 2 * num_v_heads and ba.stride(1) == 1)]  # fmt: skip
    if hidden_states is None or ba_weight is None:
        return [("ba (None needs hidden_states and ba_weight)", False)]
    hidden = ba_weight.shape[-1]
    return [
        ("ba_weight", ba_weight.dtype == torch.float16 and ba_weight.is_contiguous() and ba_weight.dim() == 2
         and ba_weight.shape[0] == 2 * num_v_heads and hidden % 2 == 0),
        ("hidden_states", hidden_states.dtype == torch.float16 and hidden_states.dim() == 2
         and hidden_states.shape[0] == rows and hidden_states.shape[1] >= hidden and hidden_states.stride(1) == 1
         and hidden_states.stride(0) % 2 == 0 and hidden_states.data_ptr() % 4 == 0),
    ]  # fmt: skip


def _gated_norm_checks(z: torch.Tensor, norm_weight: torch.Tensor, rows: int, num_v_heads: int,
                       head_v_dim: int) -> list[tuple[str, bool]]:
    return [
        ("z", z.dtype == torch.float16 and z.dim() == 2 and z.shape[0] == rows
         and z.shape[1] >= num_v_heads * head_v_dim and z.stride(1) == 1),
        ("norm_weight", norm_weight.dtype == torch.float32 and norm_weight.is_contiguous()
         and norm_weight.numel() == head_v_dim),
    ]  # fmt: skip


def gated_delta_rule_decode_(
    mixed: torch.Tensor,
    ba: torch.Tensor | None,
    z: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    state: torch.Tensor,
    slots: torch.Tensor,
    num_k_heads: int,
    out: torch.Tensor | None = None,
    dst_slots: torch.Tensor | None = None,
    positions: int = 1,
    hidden_states: torch.Tensor | None = None,
    ba_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """``positions`` consecutive tokens of each of ``B`` sequences (rows ``b * positions + p``)
    through the gated delta rule and the gated norm after it; updates ``state[slots]`` in
    place, or, when ``dst_slots`` is given (int64 ``[positions, B]`` flattened, position by
    position), writes the state after token ``p`` of sequence ``b`` to
    ``state[dst_slots[p * B + b]]`` (rows that no other sequence reads).

    ``mixed`` fp16 ``[B*P, >= 2*Hk*128 + Hv*dv]`` (the short conv's output: q | k | v, rows
    may be strided), ``ba`` fp16 ``[B*P, >= 2*Hv]`` (b | a) or None: then the kernel projects
    b and a itself from ``hidden_states`` fp16 ``[B*P, >= hidden]`` (the layer's normed input,
    rows may be strided) and ``ba_weight`` fp16 ``[2*Hv, hidden]`` (in_proj_ba's weight:
    b rows, then a rows), in fp32, with no launch of its own. ``z`` fp16 ``[B*P, >= Hv*dv]``
    (the output gate, rows may be strided), ``A_log`` and ``dt_bias`` fp32 ``[Hv]``,
    ``norm_weight`` fp32 ``[dv]``, ``state`` fp32 ``[slots, Hv, 128, dv]`` contiguous,
    ``slots`` int64 ``[B]``. Returns ``norm_weight * rmsnorm(o) * silu(z)`` per value head,
    ``[B*P, Hv, dv]`` fp16, written into ``out`` when given (tests poison it). The math is
    ``gated_delta_rule_step`` with ``decay_and_rate`` token after token, then
    ``gated_rms_norm``, in fp32 with one rounding (see ``gdn_decode.cu``); above
    :data:`WIDE_ABOVE_ROWS` rows with ``ba`` given, ``o`` is rounded to fp16 into ``out`` by
    the wide-batch kernel and normed there in place by a second launch (two roundings).
    """
    where = "onecat.kernels.gdn.gated_delta_rule_decode_"
    rows = mixed.shape[0]
    batch = rows // max(positions, 1)
    _, num_v_heads, head_k_dim, head_v_dim = state.shape
    if not supports(head_k_dim, head_v_dim, mixed.dtype) or num_v_heads % num_k_heads:
        raise OnecatError(
            f"{where}: needs fp16 activations, key head dim {HEAD_K_DIM}, value head dim one of "
            f"{HEAD_V_DIMS} and value heads a multiple of key heads; got {mixed.dtype}, "
            f"{head_k_dim}, {head_v_dim}, {num_v_heads} / {num_k_heads}"
        )
    width = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
    checks = [
        ("mixed", mixed.dim() == 2 and mixed.shape[1] >= width and mixed.stride(1) == 1),
        ("positions", positions >= 1 and rows == batch * positions),
        *_ba_checks(ba, hidden_states, ba_weight, rows, num_v_heads),
        *_gated_norm_checks(z, norm_weight, rows, num_v_heads, head_v_dim),
        ("A_log", A_log.dtype == torch.float32 and A_log.is_contiguous() and A_log.numel() == num_v_heads),
        ("dt_bias", dt_bias.dtype == torch.float32 and dt_bias.is_contiguous()
         and dt_bias.numel() == num_v_heads),
        ("state", state.dtype == torch.float32 and state.is_contiguous()),
        ("slots", slots.dtype == torch.int64 and slots.is_contiguous() and slots.numel() == batch),
    ]  # fmt: skip
    if dst_slots is None and positions > 1:
        raise OnecatError(f"{where}: several positions per sequence need dst_slots (one row per position)")
    dst_slots = slots if dst_slots is None else dst_slots
    checks.append(("dst_slots", dst_slots.dtype == torch.int64 and dst_slots.is_contiguous()
                   and dst_slots.numel() == rows))
    if out is None:
        out = torch.empty(rows, num_v_heads, head_v_dim, dtype=torch.float16, device=mixed.device)
    checks.append(("out", out.dtype == torch.float16 and out.is_contiguous()
                   and tuple(out.shape) == (rows, num_v_heads, head_v_dim)))
    for name, ok in checks:
        if not ok:
            raise OnecatError(f"{where}: {name} has the wrong dtype, shape or layout (see the docstring)")
    if batch == 0:
        return out
    device_index = mixed.device.index if mixed.device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(mixed.device).cuda_stream
    if ba is not None and uses_wide_kernel(rows):  # the delta rule, then the norm in place
        args = [
            ctypes.c_void_p(mixed.data_ptr()), ctypes.c_int(mixed.stride(0)), ctypes.c_void_p(ba.data_ptr()),
            ctypes.c_int(ba.stride(0)), ctypes.c_void_p(A_log.data_ptr()), ctypes.c_void_p(dt_bias.data_ptr()),
            ctypes.c_void_p(state.data_ptr()), ctypes.c_void_p(slots.data_ptr()),
            ctypes.c_void_p(dst_slots.data_ptr()), ctypes.c_void_p(out.data_ptr()),
            ctypes.c_int(num_k_heads), ctypes.c_int(num_v_heads), ctypes.c_int(positions),
        ]  # fmt: skip
        wide = get_kernel(f"gdn_decode_wide_d{head_v_dim}", device_index)
        wide.launch((head_v_dim // 32, num_v_heads, batch), 128, stream, args)
        _launch_gated_norm(out, z, norm_weight, norm_eps, out)
        return out
    kernel = get_kernel(f"gdn_decode_d{head_v_dim}", device_index)
    if ba is None:  # the kernel projects b and a: no ba rows
        ba_args = [ctypes.c_void_p(0), ctypes.c_int(0), ctypes.c_void_p(hidden_states.data_ptr()),
                   ctypes.c_int(hidden_states.stride(0)), ctypes.c_void_p(ba_weight.data_ptr()),
                   ctypes.c_int(ba_weight.shape[1])]
    else:
        ba_args = [ctypes.c_void_p(ba.data_ptr()), ctypes.c_int(ba.stride(0)), ctypes.c_void_p(0),
                   ctypes.c_int(0), ctypes.c_void_p(0), ctypes.c_int(0)]
    args = [
        ctypes.c_void_p(mixed.data_ptr()), ctypes.c_int(mixed.stride(0)), *ba_args,
        ctypes.c_void_p(z.data_ptr()), ctypes.c_int(z.stride(0)),
        ctypes.c_void_p(A_log.data_ptr()), ctypes.c_void_p(dt_bias.data_ptr()),
        ctypes.c_void_p(norm_weight.data_ptr()), ctypes.c_float(norm_eps),
        ctypes.c_void_p(state.data_ptr()), ctypes.c_void_p(slots.data_ptr()),
        ctypes.c_void_p(dst_slots.data_ptr()), ctypes.c_void_p(out.data_ptr()),
        ctypes.c_int(num_k_heads), ctypes.c_int(num_v_heads), ctypes.c_int(positions),
    ]  # fmt: skip
    kernel.launch((num_v_heads, batch, 1), 8 * head_v_dim, stream, args)
    return out


def gated_rms_norm_(
    x: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The gated norm alone (kernel ``gdn_decode_gated_norm``), for rows the prefill kernels computed:
    ``norm_weight * rmsnorm(x) * silu(z)`` per value head, the same math as the end of
    :func:`gated_delta_rule_decode_`. ``x`` fp16 ``[T, Hv, dv]`` contiguous, ``z`` fp16
    ``[T, >= Hv*dv]`` (rows may be strided), ``norm_weight`` fp32 ``[dv]``. Returns fp16
    ``[T, Hv, dv]``, written into ``out`` when given (``x`` itself is allowed)."""
    where = "onecat.kernels.gdn.gated_rms_norm_"
    rows, num_v_heads, head_v_dim = x.shape if x.dim() == 3 else (0, 0, 0)
    checks = [
        ("x", x.dim() == 3 and x.dtype == torch.float16 and x.is_contiguous() and head_v_dim in HEAD_V_DIMS),
        *_gated_norm_checks(z, norm_weight, rows, num_v_heads, head_v_dim),
    ]  # fmt: skip
    if out is None:
        out = torch.empty_like(x)
    checks.append(("out", out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()))
    for name, ok in checks:
        if not ok:
            raise OnecatError(f"{where}: {name} has the wrong dtype, shape or layout (see the docstring)")
    if rows == 0:
        return out
    _launch_gated_norm(x, z, norm_weight, eps, out)
    return out


def _launch_gated_norm(x: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       out: torch.Tensor) -> None:
    """``gdn_decode_gated_norm`` over checked, non-empty rows (see :func:`gated_rms_norm_`)."""
    rows, num_v_heads, head_v_dim = x.shape
    device_index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    args = [
        ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(z.data_ptr()), ctypes.c_int(z.stride(0)),
        ctypes.c_void_p(norm_weight.data_ptr()), ctypes.c_float(eps), ctypes.c_void_p(out.data_ptr()),
        ctypes.c_int(num_v_heads), ctypes.c_int(head_v_dim),
    ]  # fmt: skip
    stream = torch.cuda.current_stream(x.device).cuda_stream
    get_kernel("gdn_decode_gated_norm", device_index).launch((rows, num_v_heads, 1), head_v_dim, stream, args)


CONV_KERNEL = 4
"""The short conv's kernel size :func:`causal_conv1d_update_` is built for (Qwen3.5's)."""


def conv_can_project_ba(hidden_states: torch.Tensor) -> bool:
    """Whether :func:`causal_conv1d_update_` can project b and a from these fp16 rows: its
    projection blocks read them in 128-bit steps (hidden size and row stride multiples of 8,
    16-byte aligned, unit column stride)."""
    return (
        hidden_states.dtype == torch.float16 and hidden_states.dim() == 2 and hidden_states.shape[1] % 8 == 0
        and hidden_states.stride(1) == 1 and hidden_states.stride(0) % 8 == 0 and hidden_states.data_ptr() % 16 == 0
    )  # fmt: skip


def causal_conv1d_update_(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
    dst_slots: torch.Tensor | None = None,
    positions: int = 1,
    out: torch.Tensor | None = None,
    hidden_states: torch.Tensor | None = None,
    ba_weight: torch.Tensor | None = None,
    ba_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The short conv + SiLU of ``positions`` consecutive tokens of each of ``B`` sequences
    (rows ``b * positions + p``), the step before :func:`gated_delta_rule_decode_`: reads the
    conv state of sequence ``b`` from ``conv_state[slots[b]]`` and writes the state after
    token ``p`` to ``conv_state[dst_slots[p * B + b]]`` (default: ``slots``, in place; several
    positions need ``dst_slots``).

    ``x`` fp16 ``[B*P, >= C]`` (rows may be strided, an even stride), ``conv_state`` fp16
    ``[rows, C, 3]`` contiguous, ``weight`` fp16 ``[C, 4]`` contiguous, ``slots`` int64 ``[B]``.
    Returns ``silu(conv)`` fp16 ``[B*P, C]`` contiguous (into ``out`` when given). Same math
    as ``runtime.layers.causal_conv.causal_conv1d_step`` token after token, with fp32
    accumulation and one rounding (as the prefill conv kernel).

    With ``ba_weight`` (in_proj_ba's fp16 weight ``[2*Hv, hidden]``), the same launch also
    writes ``ba_out`` fp16 ``[B*P, 2*Hv]`` contiguous = ``hidden_states [B*P, hidden]`` (rows
    may be strided) times the weight's transpose, fp32 sums rounded once: in_proj_ba's output
    for the wide-batch delta rule, without its launches.
    """
    where = "onecat.kernels.gdn.causal_conv1d_update_"
    rows, channels = x.shape[0], weight.shape[0]
    batch = rows // max(positions, 1)
    if dst_slots is None and positions > 1:
        raise OnecatError(f"{where}: several positions per sequence need dst_slots (one row per position)")
    dst_slots = slots if dst_slots is None else dst_slots
    checks = [
        ("x", x.dtype == torch.float16 and x.dim() == 2 and x.shape[1] >= channels and x.stride(1) == 1
         and x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0),
        ("positions", positions >= 1 and rows == batch * positions),
        ("weight", weight.dtype == torch.float16 and weight.is_contiguous()
         and tuple(weight.shape) == (channels, CONV_KERNEL) and channels % 2 == 0),
        ("conv_state", conv_state.dtype == torch.float16 and conv_state.is_contiguous()
         and conv_state.dim() == 3 and tuple(conv_state.shape[1:]) == (channels, CONV_KERNEL - 1)),
        ("slots", slots.dtype == torch.int64 and slots.is_contiguous() and slots.numel() == batch),
        ("dst_slots", dst_slots.dtype == torch.int64 and dst_slots.is_contiguous() and dst_slots.numel() == rows),
    ]  # fmt: skip
    if ba_weight is not None:
        checks += [
            ("ba_weight", ba_weight.dtype == torch.float16 and ba_weight.dim() == 2 and ba_weight.is_contiguous()),
            ("hidden_states", hidden_states is not None and conv_can_project_ba(hidden_states)
             and tuple(hidden_states.shape) == (rows, ba_weight.shape[1])),
            ("ba_out", ba_out is not None and ba_out.dtype == torch.float16 and ba_out.is_contiguous()
             and tuple(ba_out.shape) == (rows, ba_weight.shape[0])),
        ]  # fmt: skip
    for name, ok in checks:
        if not ok:
            raise OnecatError(f"{where}: {name} has the wrong dtype, shape or layout (see the docstring)")
    if out is None:
        out = torch.empty(rows, channels, dtype=torch.float16, device=x.device)
    if batch == 0:
        return out
    device_index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    args = [
        ctypes.c_void_p(x.data_ptr()), ctypes.c_int(x.stride(0)), ctypes.c_void_p(conv_state.data_ptr()),
        ctypes.c_void_p(weight.data_ptr()), ctypes.c_void_p(slots.data_ptr()),
        ctypes.c_void_p(dst_slots.data_ptr()), ctypes.c_void_p(out.data_ptr()), ctypes.c_int(channels),
        ctypes.c_int(positions),
    ]  # fmt: skip
    blocks = (channels + 255) // 256
    if ba_weight is None:
        args += [ctypes.c_void_p(0), ctypes.c_int(0), ctypes.c_void_p(0), ctypes.c_int(0), ctypes.c_int(0),
                 ctypes.c_void_p(0)]  # fmt: skip
    else:
        ba_cols, hidden = ba_weight.shape
        args += [
            ctypes.c_void_p(hidden_states.data_ptr()), ctypes.c_int(hidden_states.stride(0)),
            ctypes.c_void_p(ba_weight.data_ptr()), ctypes.c_int(hidden), ctypes.c_int(ba_cols),
            ctypes.c_void_p(ba_out.data_ptr()),
        ]  # fmt: skip
        blocks += ba_cols  # projection blocks: a weight row each
    stream = torch.cuda.current_stream(x.device).cuda_stream
    get_kernel("gdn_decode_conv", device_index).launch((blocks, batch, 1), 128, stream, args)
    return out
