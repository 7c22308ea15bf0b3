"""Gated DeltaNet prefill on the GPU (``gdn_prefill.cu``): the causal depthwise conv and the
chunked gated delta rule for all prompt chunks of a step at once (varlen), each sequence's
conv and recurrent states read from and written back in place into its state slot.

Why varlen (one launch per kernel for every prompt chunk of the step) and not one call per
sequence: the scan kernel's parallelism is (value-head columns x heads x sequences), and a
step that admits several short prompts would otherwise pay three launches and a metadata
copy per sequence and per layer. The metadata (:class:`PrefillBatch`) is built once per step
on the host (the runtime knows every chunk's start, length and slot as Python ints) and
shared by all GDN layers of the step.

Prefix-caching checkpoints inside a prompt chunk: a sequence may list ``(offset, row)``
pairs; its chunks are then cut at each offset, and after ``offset`` tokens its recurrent
state is also written to state row ``row`` by the scan and its conv state (the last 3 inputs)
to conv-state row ``row`` by :func:`causal_conv1d_prefill_`. The engine thus checkpoints a
long prompt's states at block boundaries without cutting the forward pass there.

Three launches per layer: ``gdn_prefill_conv`` (conv + SiLU, conv states in place),
``gdn_prefill_chunk`` (per 64-token chunk and value head: gates, normalised q/k, the decayed
Q K^T, the triangular inverse, W and U into a workspace) and ``gdn_prefill_scan`` (per 32
state columns, value head and sequence: the chunks in order, outputs and the final state).
:func:`reference_prefill` is the same algorithm in torch with the kernels' fp16 rounding
points (CPU tests use it to bound the error of those roundings against an fp64 recurrence).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from onecat.errors import OnecatError
from onecat.kernels.loader import get_kernel
from onecat.kernels.workspace import to_device

CHUNK = 64
"""Tokens per chunk (``kChunk`` in gdn_prefill.cu)."""
HEAD_K_DIM = 128
"""The key head dimension the kernels are built for (Qwen3.5's)."""
CONV_KERNEL = 4
"""The short conv's kernel size the conv kernel is built for (Qwen3.5's)."""
_COLUMNS = 32  # state columns per scan block (kCols)
_MAX_HEAD_V_DIM = 128  # U's right-hand side shares the 64x136 shared tile with k


def supports(head_k_dim: int, head_v_dim: int, conv_kernel: int, dtype: torch.dtype) -> bool:
    """True when the prefill kernels run these head sizes, conv kernel and activation dtype."""
    return (
        head_k_dim == HEAD_K_DIM
        and head_v_dim % _COLUMNS == 0
        and 0 < head_v_dim <= _MAX_HEAD_V_DIM
        and conv_kernel == CONV_KERNEL
        and dtype == torch.float16
    )


@dataclass(frozen=True)
class PrefillBatch:
    """The prompt chunks of one step: per sequence ``(first token, length, first chunk,
    state slot, chunks)`` and per chunk of at most 64 tokens ``(first token, length, sequence,
    checkpoint row or -1)``, token indices relative to the first row of the tensors handed to
    the kernels; ``checkpoints`` per sequence ``(offset, row)`` pairs (module docstring).

    ``meta`` holds both tables as one int32 device tensor (sequences first).
    """

    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    slots: tuple[int, ...]
    checkpoints: tuple[tuple[tuple[int, int], ...], ...]
    num_chunks: int
    num_tokens: int  # rows spanned: max(start + length)
    meta: torch.Tensor

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch."""
        return len(self.starts)

    @property
    def max_row(self) -> int:
        """The highest state row the kernels touch (a slot or a checkpoint row)."""
        return max([*self.slots, *(row for points in self.checkpoints for _, row in points)])

    @property
    def seqs(self) -> torch.Tensor:
        """int32 ``[num_seqs, 5]`` on the device."""
        return self.meta[: 5 * self.num_seqs].view(self.num_seqs, 5)

    @property
    def chunks(self) -> torch.Tensor:
        """int32 ``[num_chunks, 4]`` on the device."""
        return self.meta[5 * self.num_seqs :].view(self.num_chunks, 4)


def chunk_tables(
    starts: list[int] | tuple[int, ...],
    lengths: list[int] | tuple[int, ...],
    slots: list[int] | tuple[int, ...],
    checkpoints: list | tuple | None = None,
) -> tuple[list[int], list[int]]:
    """The flat sequence and chunk tables of :class:`PrefillBatch` (host lists). Raises
    OnecatError on empty or overlapping sequences, on repeated slots and on checkpoints that
    are not strictly inside their sequence, in order, on rows of their own."""
    where = "onecat.kernels.gdn_prefill"
    if not (len(starts) == len(lengths) == len(slots)) or not starts:
        raise OnecatError(f"{where}: need one start, length and slot per sequence (and at least one)")
    if len(set(slots)) != len(slots) or min(slots) < 0:
        raise OnecatError(f"{where}: state slots must be distinct and >= 0, got {list(slots)}")
    checkpoints = checkpoints or [()] * len(starts)
    rows = [row for points in checkpoints for _, row in points]
    if len(checkpoints) != len(starts) or len(set(rows) | set(slots)) != len(rows) + len(slots) or min(rows, default=0) < 0:
        raise OnecatError(f"{where}: checkpoint rows must be >= 0 and distinct from each other and the slots")
    spans = sorted(zip(starts, lengths, strict=True))
    for (s0, n0), (s1, _) in zip(spans, spans[1:], strict=False):
        if s0 + n0 > s1:
            raise OnecatError(f"{where}: sequences overlap (tokens {s0}+{n0} and {s1})")
    seqs: list[int] = []
    chunks: list[int] = []
    for index, (start, length, slot, points) in enumerate(zip(starts, lengths, slots, checkpoints, strict=True)):
        if length < 1 or start < 0:
            raise OnecatError(f"{where}: sequence {index} has start {start} and length {length}")
        offsets = [offset for offset, _ in points]
        if offsets != sorted(set(offsets)) or any(not 0 < o < length for o in offsets):
            raise OnecatError(f"{where}: sequence {index}'s checkpoint offsets {offsets} must rise inside (0, {length})")
        first = len(chunks) // 4
        ends = dict(points)
        begin = 0
        for end in [*offsets, length]:
            for offset in range(begin, end, CHUNK):
                stop = min(offset + CHUNK, end)
                chunks += [start + offset, stop - offset, index, ends.get(stop, -1) if stop < length else -1]
            begin = end
        seqs += [start, length, first, slot, len(chunks) // 4 - first]
    return seqs, chunks


_cached: PrefillBatch | None = None


def prefill_batch(
    starts: list[int] | tuple[int, ...],
    lengths: list[int] | tuple[int, ...],
    slots: list[int] | tuple[int, ...],
    device: torch.device,
    checkpoints: list | tuple | None = None,
) -> PrefillBatch:
    """The :class:`PrefillBatch` of these sequences on ``device`` (``checkpoints``: per
    sequence ``(offset, row)`` pairs, module docstring). The last one built is kept, so the
    GDN layers of one step share one host-to-device copy."""
    global _cached
    points = tuple(tuple(map(tuple, p)) for p in checkpoints) if checkpoints else ((),) * len(starts)
    key = (tuple(starts), tuple(lengths), tuple(slots), points)
    cached = _cached
    if (cached is not None and (cached.starts, cached.lengths, cached.slots, cached.checkpoints) == key
            and cached.meta.device == device):
        return cached
    seqs, chunks = chunk_tables(*key)
    meta = to_device(seqs + chunks, torch.int32, device)
    batch = PrefillBatch(*key, len(chunks) // 4, max(s + n for s, n in zip(key[0], key[1], strict=True)), meta)
    _cached = batch
    return batch


def _device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def _check(where: str, checks: list[tuple[str, bool]]) -> None:
    for name, ok in checks:
        if not ok:
            raise OnecatError(f"{where}: {name} has the wrong dtype, shape or layout (see the docstring)")


def causal_conv1d_prefill_(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    batch: PrefillBatch,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The short conv (kernel 4) + SiLU of every prefill token; conv states updated in place.

    ``x`` fp16 ``[>= batch.num_tokens, >= C]`` (rows may be strided, an even stride),
    ``conv_state`` fp16 ``[slots, C, 3]`` contiguous, ``weight`` fp16 ``[C, 4]`` contiguous.
    Returns ``silu(conv)`` fp16 ``[batch.num_tokens, C]`` contiguous (written into ``out``
    when given); the slot of each sequence then holds its last 3 inputs, and each checkpoint
    row the 3 inputs before its offset. Same math as
    ``runtime.layers.causal_conv.causal_conv1d_chunk`` (fp32 accumulation, one rounding).
    """
    where = "onecat.kernels.gdn_prefill.causal_conv1d_prefill_"
    channels = weight.shape[0]
    _check(where, [
        ("x", x.dtype == torch.float16 and x.dim() == 2 and x.shape[0] >= batch.num_tokens
         and x.shape[1] >= channels and x.stride(1) == 1 and x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0),
        ("weight", weight.dtype == torch.float16 and weight.is_contiguous()
         and tuple(weight.shape) == (channels, CONV_KERNEL) and channels % 2 == 0),
        ("conv_state", conv_state.dtype == torch.float16 and conv_state.is_contiguous()
         and conv_state.dim() == 3 and tuple(conv_state.shape[1:]) == (channels, CONV_KERNEL - 1)
         and batch.max_row < conv_state.shape[0]),
    ])  # fmt: skip
    old_state = conv_state  # a chunk starting < 3 tokens into its sequence reads a copy
    for start, slot, points in zip(batch.starts, batch.slots, batch.checkpoints, strict=True):
        for offset, row in points:  # before the kernel overwrites the slot's old inputs
            history = torch.cat([conv_state[slot], x[max(start, start + offset - 3) : start + offset, :channels].t()], 1)
            conv_state[row].copy_(history[:, -(CONV_KERNEL - 1) :])
            if offset < CONV_KERNEL - 1 and old_state is conv_state:
                old_state = conv_state.clone()
    if out is None:
        out = torch.empty(batch.num_tokens, channels, dtype=torch.float16, device=x.device)
    kernel = get_kernel("gdn_prefill_conv", _device_index(x))
    args = [
        ctypes.c_void_p(x.data_ptr()), ctypes.c_int(x.stride(0)), ctypes.c_void_p(weight.data_ptr()),
        ctypes.c_void_p(conv_state.data_ptr()), ctypes.c_void_p(old_state.data_ptr()),
        ctypes.c_void_p(batch.seqs.data_ptr()),
        ctypes.c_void_p(batch.chunks.data_ptr()), ctypes.c_void_p(out.data_ptr()), ctypes.c_int(channels),
    ]  # fmt: skip
    stream = torch.cuda.current_stream(x.device).cuda_stream
    kernel.launch((math.ceil(channels / 256), batch.num_chunks, 1), 128, stream, args)
    return out


def gated_delta_rule_prefill_(
    mixed: torch.Tensor,
    ba: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    batch: PrefillBatch,
    num_k_heads: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The chunked gated delta rule over every prefill token; ``state[slot]`` of each sequence
    is read as its initial state and overwritten with its final state.

    ``mixed`` fp16 ``[>= batch.num_tokens, >= 2*Hk*128 + Hv*dv]`` (the conv's output:
    q | k | v; rows 8-byte aligned), ``ba`` fp16 ``[>= batch.num_tokens, >= 2*Hv]`` (b | a),
    ``A_log`` and ``dt_bias`` fp32 ``[Hv]``, ``state`` fp32 ``[slots, Hv, 128, dv]`` contiguous.
    Returns ``o`` fp16 ``[batch.num_tokens, Hv, dv]`` (into ``out`` when given; rows between
    sequences are not written). The math is ``gated_delta_rule_chunked`` with
    ``decay_and_rate`` (beta kept in fp32), see ``gdn_prefill.cu`` for the precision.
    """
    where = "onecat.kernels.gdn_prefill.gated_delta_rule_prefill_"
    if state.dim() != 4:
        raise OnecatError(f"{where}: state must be [slots, Hv, 128, dv], got {tuple(state.shape)}")
    _, num_v_heads, head_k_dim, head_v_dim = state.shape
    if not supports(head_k_dim, head_v_dim, CONV_KERNEL, mixed.dtype) or num_v_heads % num_k_heads:
        raise OnecatError(
            f"{where}: needs fp16 activations, key head dim {HEAD_K_DIM}, value head dim a multiple "
            f"of {_COLUMNS} up to {_MAX_HEAD_V_DIM} and value heads a multiple of key heads; got "
            f"{mixed.dtype}, {head_k_dim}, {head_v_dim}, {num_v_heads} / {num_k_heads}"
        )
    width = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
    tokens = batch.num_tokens
    _check(where, [
        ("mixed", mixed.dim() == 2 and mixed.shape[0] >= tokens and mixed.shape[1] >= width
         and mixed.stride(1) == 1 and mixed.stride(0) % 4 == 0 and mixed.data_ptr() % 8 == 0),
        ("ba", ba.dtype == torch.float16 and ba.dim() == 2 and ba.shape[0] >= tokens
         and ba.shape[1] >= 2 * num_v_heads and ba.stride(1) == 1),
        ("A_log", A_log.dtype == torch.float32 and A_log.is_contiguous() and A_log.numel() == num_v_heads),
        ("dt_bias", dt_bias.dtype == torch.float32 and dt_bias.is_contiguous()
         and dt_bias.numel() == num_v_heads),
        ("state", state.dtype == torch.float32 and state.is_contiguous() and batch.max_row < state.shape[0]),
    ])  # fmt: skip
    if out is None:
        out = torch.empty(tokens, num_v_heads, head_v_dim, dtype=torch.float16, device=mixed.device)
    nch = batch.num_chunks
    device = mixed.device
    qk_ws = torch.empty(nch, num_k_heads, 2, CHUNK, HEAD_K_DIM, dtype=torch.float16, device=device)
    w_ws = torch.empty(nch, num_v_heads, CHUNK, HEAD_K_DIM, dtype=torch.float16, device=device)
    u_ws = torch.empty(nch, num_v_heads, CHUNK, head_v_dim, dtype=torch.float16, device=device)
    attn_ws = torch.empty(nch, num_v_heads, CHUNK, CHUNK, dtype=torch.float16, device=device)
    gamma_ws = torch.empty(nch, num_v_heads, CHUNK, dtype=torch.float32, device=device)
    index = _device_index(mixed)
    stream = torch.cuda.current_stream(device).cuda_stream
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    heads = [ctypes.c_int(num_k_heads), ctypes.c_int(num_v_heads), ctypes.c_int(head_v_dim)]
    get_kernel("gdn_prefill_chunk", index).launch((nch, num_v_heads, 1), 128, stream, [
        ptr(mixed), ctypes.c_int(mixed.stride(0)), ptr(ba), ctypes.c_int(ba.stride(0)), ptr(A_log),
        ptr(dt_bias), ptr(batch.chunks), ptr(qk_ws), ptr(w_ws), ptr(u_ws), ptr(attn_ws), ptr(gamma_ws),
        *heads,
    ])  # fmt: skip
    grid = (head_v_dim // _COLUMNS, num_v_heads, batch.num_seqs)
    get_kernel("gdn_prefill_scan", index).launch(grid, 128, stream, [
        ptr(qk_ws), ptr(w_ws), ptr(u_ws), ptr(attn_ws), ptr(gamma_ws), ptr(batch.seqs), ptr(batch.chunks),
        ptr(state), ptr(out), *heads,
    ])  # fmt: skip
    return out


def _chunks(x: torch.Tensor, pad: int) -> torch.Tensor:
    """``[L, H, ...]`` -> ``[H, N, CHUNK, ...]``, zero-padded to whole chunks."""
    x = F.pad(x.transpose(0, 1), (0, 0, 0, pad) if x.dim() == 3 else (0, pad))
    return x.reshape(x.shape[0], -1, CHUNK, *x.shape[2:])


def reference_prefill(
    mixed: torch.Tensor,
    ba: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    starts: list[int],
    lengths: list[int],
    slots: list[int],
    num_k_heads: int,
) -> torch.Tensor:
    """The kernels' algorithm in torch (any device), with their fp16 rounding points:
    updates ``state[slots]`` in place and returns ``o`` fp16 ``[max(start+length), Hv, dv]``
    (rows outside the sequences zero). For tests: it isolates the error of the fp16 cuts
    from the error of the CUDA code."""
    num_v_heads, dk, dv = state.shape[1:]
    key_dim = num_k_heads * dk
    group = num_v_heads // num_k_heads
    half = lambda t: t.half().float()  # noqa: E731
    tokens = max(s + n for s, n in zip(starts, lengths, strict=True))
    out = torch.zeros(tokens, num_v_heads, dv, dtype=torch.float16, device=mixed.device)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=mixed.device).tril()
    for start, length, slot in zip(starts, lengths, slots, strict=True):
        rows = mixed[start : start + length].float()
        pad = (-length) % CHUNK
        q = rows[:, :key_dim].view(length, num_k_heads, dk)
        k = rows[:, key_dim : 2 * key_dim].view(length, num_k_heads, dk)
        v = rows[:, 2 * key_dim : 2 * key_dim + num_v_heads * dv].view(length, num_v_heads, dv)
        q = half(q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk**-0.5)
        k = half(k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6))
        q, k = q.repeat_interleave(group, 1), k.repeat_interleave(group, 1)
        gates = ba[start : start + length].float()
        g = -A_log.float().exp() * F.softplus(gates[:, num_v_heads : 2 * num_v_heads] + dt_bias.float())
        beta = torch.sigmoid(gates[:, :num_v_heads])
        q, k, v, g, beta = (_chunks(t, pad) for t in (q, k, v, g, beta))
        gamma = g.cumsum(-1)
        decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        attn = half((q @ k.transpose(-1, -2)) * decay)
        a = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
        eye = torch.eye(CHUNK, device=mixed.device)
        t = half(torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True))
        w = half(t @ half(k * (beta * gamma.exp())[..., None]))
        u = half(t @ half(v * beta[..., None]))
        s = state[slot].float()
        o = torch.empty_like(u)
        for n in range(u.shape[1]):
            s16 = half(s)
            d = u[:, n] - w[:, n] @ s16
            to_end = (gamma[:, n, -1:] - gamma[:, n]).exp()[..., None]
            o[:, n] = (q[:, n] @ s16) * gamma[:, n].exp()[..., None] + attn[:, n] @ half(d)
            s = s * gamma[:, n, -1].exp()[:, None, None] + k[:, n].transpose(-1, -2) @ half(d * to_end)
        state[slot] = s
        out[start : start + length] = o.reshape(num_v_heads, -1, dv)[:, :length].transpose(0, 1).half()
    return out
