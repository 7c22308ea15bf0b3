"""Paged decode attention on the GPU (``paged_attention.cu``): one query token per sequence
over its keys and values in the paged KV cache, read in place through the block table
(flash-decoding: a split kernel over ranges of the context, then a reduce kernel).

The launch depends on the batch size, the head configuration and the block-table width only,
never on the context lengths (they stay on the device), so a decode step that calls it can be
captured once per batch size and replayed at any context length up to the table's width.
Block-table entries at or past ``ceil(context_len / block_size)`` are never read.
With a ``gate`` (Qwen3.5's gated attention) the kernel that writes a sequence's output
multiplies it by ``sigmoid(gate)`` first (one rounding to fp16), so no separate elementwise
kernel runs before the output projection.

The cache may be fp16 or 8-bit (``--kv-cache-dtype``, ``onecat.kernels.kv_cache``): uint8
fp8_e5m2 codes, or int8 codes with fp32 scales ``[num_blocks, block_size, KVH]`` (``k_scale`` /
``v_scale``); the split kernels ``*_fp8_*`` / ``*_int8_*`` (head dims
:data:`QUANTIZED_HEAD_DIMS`) decode them in registers.

:func:`paged_decode_attention_reference` is the same computation in torch (fp32), for CPUs
and tests.
"""

from __future__ import annotations

import ctypes
import math

import torch

from onecat.errors import OnecatError
from onecat.kernels import kv_cache
from onecat.kernels.driver import PreparedLaunch
from onecat.kernels.loader import get_kernel
from onecat.kernels.workspace import stream_buffer

HEAD_DIMS = (32, 64, 128, 256)
"""Head dimensions the kernel is built for."""
QUANTIZED_HEAD_DIMS = (128, 256)
"""Head dimensions of the 8-bit cache kernels (Qwen3.5's 256, the qwen3 / llama recipes' 128)."""
_HEADS_PER_BLOCK = (1, 2, 4, 8)  # NG instances of the split kernel
_THREADS = 128  # paged_attention.cu kThreads
_CHUNK_TOKENS = 32  # kChunkTokens: the split granularity
MAX_SPLITS = 64
"""Most context ranges one sequence is cut into."""


def supports(
    device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int, kv_format: str = "auto"
) -> bool:
    """True when :func:`paged_decode_attention` runs this device, query dtype, head dim, KV
    block size (a power of two) and cache encoding (``kv_cache.FORMATS``: ``auto`` is an fp16
    cache; the 8-bit ones at :data:`QUANTIZED_HEAD_DIMS`)."""
    return (
        device.type == "cuda"
        and dtype == torch.float16
        and head_dim in (HEAD_DIMS if kv_format == "auto" else QUANTIZED_HEAD_DIMS)
        and kv_format in kv_cache.FORMATS
        and block_size > 0
        and block_size & (block_size - 1) == 0
    )


def _check_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """An int8 cache has fp32 scales ``[num_blocks, block_size, KVH]`` (contiguous, on its
    device); other caches need none."""
    if kv_cache.cache_format(k_cache) != "int8":
        return True
    return all(
        t is not None and t.dtype == kv_cache.SCALE_DTYPE and t.is_contiguous() and t.shape == k_cache.shape[:3]
        and t.device == k_cache.device
        for t in (k_scale, v_scale)
    )  # fmt: skip


FEW_KV_PAIRS = 8
"""Launches of at most this many (sequence, KV head) pairs serve two query heads a block (see
:func:`heads_per_block`)."""


def heads_per_block(group: int, kv_pairs: int) -> int:
    """Query heads one split block serves (the kernel's NG) for ``group`` query heads per KV
    head, in a launch over ``kv_pairs`` (sequence, KV head) pairs.

    A block's prep and per-token work grow with NG, and few pairs leave most of the GPU idle
    at short contexts, so up to :data:`FEW_KV_PAIRS` pairs a group of two or more takes NG = 2
    (spread over more blocks, each K / V row read by several of them, mostly from L2); more
    pairs take the smallest NG that covers the group (each K / V row read once). H200, compute_70, prep form,
    batch 1, context 192: 35B-A3B heads (16 / 2) 9.35 us at NG 2 against 14.15 at NG 8, 27B
    heads (24 / 4) 9.46 against 13.45; at 8 sequences of 1024 tokens NG 8 wins (BENCHMARKS.md,
    2026-12-02 afternoon)."""
    if kv_pairs <= FEW_KV_PAIRS and group >= 2:
        return 2
    return next((g for g in _HEADS_PER_BLOCK if g >= group), _HEADS_PER_BLOCK[-1])


def num_splits(blocks: int, context_capacity: int, device_index: int, kernel=None) -> int:
    """Context ranges per sequence: enough that ``blocks`` (sequences x KV heads x head chunks)
    times the splits fill the GPU once, at most :data:`MAX_SPLITS` and at most the 32-token
    chunks of ``context_capacity`` tokens (the block table's width)."""
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    resident = kernel.max_active_blocks(_THREADS) if kernel is not None else 2
    wanted = math.ceil(sms * resident / max(blocks, 1))
    return max(1, min(wanted, MAX_SPLITS, math.ceil(context_capacity / _CHUNK_TOKENS)))


class _Plan:
    """The two prepared launches of one (device, batch, heads, head dim, table shape, prep)."""

    def __init__(self, device_index: int, batch: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, width: int, block_size: int, splits: int | None, prep: bool = False,
                 kv_format: str = "auto") -> None:
        group = num_heads // num_kv_heads
        ng = heads_per_block(group, batch * num_kv_heads)
        chunks = math.ceil(group / ng)
        name = ("paged_attention_split_prep" if prep else "paged_attention_split") + kv_cache.KERNEL_SUFFIX[kv_format]
        split_kernel = get_kernel(f"{name}_d{head_dim}_g{ng}", device_index)
        reduce_kernel = get_kernel(f"paged_attention_reduce_d{head_dim}", device_index)
        blocks = batch * num_kv_heads * chunks
        self.splits = splits or num_splits(blocks, width * block_size, device_index, split_kernel)
        self.workspace_floats = batch * num_heads * self.splits * (head_dim + 2) if self.splits > 1 else 0
        p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        self.split = PreparedLaunch(
            split_kernel, (self.splits, num_kv_heads * chunks, batch), _THREADS,
            [p, ll, ll, p, p, p, i, p, p, p, p, i, i, i, i, ctypes.c_float, p, ll, ll,
             p, p, p, p, ctypes.c_float, i, p, ll, p, p],
        )  # fmt: skip
        self.reduce = (
            PreparedLaunch(reduce_kernel, (num_heads, batch, 1), head_dim, [p, i, p, p, p, i, i, i, p, ll, ll])
            if self.splits > 1
            else None
        )


_plans: dict[tuple, _Plan] = {}
_MAX_PLANS = 1 << 12  # eager decode makes one per table width: stay bounded


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    splits: int | None = None,
    gate: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged keys and values.

    ``q`` fp16 ``[B, H, D]`` (last dim contiguous, other strides free), ``k_cache`` and
    ``v_cache`` fp16 ``[num_blocks, block_size, KVH, D]`` contiguous (one layer's cache),
    ``block_tables`` int64 ``[B, W]`` contiguous (entries past a sequence's blocks are not
    read), ``context_lens`` int64 ``[B]`` on the device (tokens including the new one, at most
    ``W * block_size``). ``H`` must be a multiple of ``KVH``; query head ``h`` reads KV head
    ``h // (H // KVH)``. Returns ``softmax(q k^T * scale) v`` as fp16 ``[B, H, D]`` (fp32
    softmax and sums), written into ``out`` (contiguous) when given. ``splits`` overrides the
    number of context ranges per sequence (tests); by default it fills the GPU. With ``gate``
    (fp16 ``[B, H, D]``, any strides; Qwen3.5's output gate) the result is
    ``attention * sigmoid(gate)``, computed in fp32 and rounded to fp16 once.

    An 8-bit cache (``kv_cache``): ``k_cache`` / ``v_cache`` uint8 (fp8_e5m2 codes) or int8
    (codes, with ``k_scale`` / ``v_scale`` fp32 ``[num_blocks, block_size, KVH]``
    contiguous), head dim in :data:`QUANTIZED_HEAD_DIMS`; the result is the attention over the
    decoded keys and values (``kv_cache.decode``), with the same fp32 softmax and sums.
    """
    where = "onecat.kernels.attention.paged_decode_attention"
    batch, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_dim = k_cache.shape
    width = block_tables.shape[-1]
    kv_format = kv_cache.cache_format(k_cache)
    if not supports(q.device, q.dtype, head_dim, block_size, kv_format) or num_heads % num_kv_heads:
        raise OnecatError(
            f"{where}: needs CUDA fp16 queries, head dim in {HEAD_DIMS} ({QUANTIZED_HEAD_DIMS} with an "
            f"8-bit cache), a power-of-two block size and query heads a multiple of KV heads; got {q.device} "
            f"{q.dtype}, {kv_format} cache, head dim {head_dim}, block size {block_size}, {num_heads} / "
            f"{num_kv_heads} heads"
        )
    checks = [
        ("q", q.stride(2) == 1),
        ("k_cache", k_cache.dtype in (torch.float16, torch.uint8, torch.int8) and k_cache.is_contiguous()
         and cache_dim == head_dim and k_cache.data_ptr() % 16 == 0),
        ("k_scale / v_scale", _check_scales(k_cache, k_scale, v_scale)),
        ("v_cache", v_cache.dtype == k_cache.dtype and v_cache.is_contiguous() and v_cache.shape == k_cache.shape
         and v_cache.data_ptr() % 16 == 0),
        ("block_tables", block_tables.dtype == torch.int64 and block_tables.is_contiguous()
         and tuple(block_tables.shape) == (batch, width)),
        ("context_lens", context_lens.dtype == torch.int64 and context_lens.is_contiguous()
         and context_lens.numel() == batch),
        ("out", out is None or (out.dtype == torch.float16 and out.is_contiguous()
         and tuple(out.shape) == (batch, num_heads, head_dim) and out.data_ptr() % 16 == 0)),
        ("gate", gate is None or (gate.dtype == torch.float16 and gate.device == q.device
         and tuple(gate.shape) == (batch, num_heads, head_dim))),
    ]  # fmt: skip
    for name, ok in checks:
        if not ok:
            raise OnecatError(f"{where}: {name} has the wrong dtype, shape or layout (see the docstring)")
    if gate is not None and (gate.stride(2) != 1 or gate.stride(0) % 8 or gate.stride(1) % 8 or gate.data_ptr() % 16):
        gate = gate.clone(memory_format=torch.contiguous_format)  # the kernel reads 8 values per 16-byte load
    gate_ptr, gate_sb, gate_sh = (gate.data_ptr(), gate.stride(0), gate.stride(1)) if gate is not None else (0, 0, 0)
    if out is None:
        out = torch.empty(batch, num_heads, head_dim, dtype=torch.float16, device=q.device)
    if batch == 0:
        return out
    if width == 0:
        return out.zero_()
    _launch(q, (q.stride(0), q.stride(1)), k_cache, v_cache, block_tables, context_lens, scale, num_heads, out,
            splits, (gate_ptr, gate_sb, gate_sh), scales=(k_scale, v_scale))  # fmt: skip
    return out


def _launch(
    q: torch.Tensor, q_strides: tuple[int, int], k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, num_heads: int, out: torch.Tensor,
    splits: int | None, gate: tuple[int, int, int], prep: tuple | None = None,
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> None:
    """The split (or split_prep, with ``prep`` = its extra arguments) and reduce launches on
    validated inputs; ``q`` is the queries' or (prep) the qkv rows' base; ``scales`` an int8
    cache's."""
    batch, width = block_tables.shape
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    kv_format = kv_cache.cache_format(k_cache)
    device_index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    key = (device_index, batch, num_heads, num_kv_heads, head_dim, width, block_size, splits, prep is not None,
           kv_format)  # fmt: skip
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        plan = _plans[key] = _Plan(device_index, batch, num_heads, num_kv_heads, head_dim, width, block_size, splits,
                                   prep is not None, kv_format)  # fmt: skip
    scale_ptrs = [t.data_ptr() if t is not None and kv_format == "int8" else 0 for t in scales]
    stream = torch.cuda.current_stream(q.device).cuda_stream
    ws_acc = ws_ml = 0
    if plan.reduce is not None:
        ws = stream_buffer("attention-partials", q.device, stream, plan.workspace_floats, zeroed=False)
        ws_acc = ws.data_ptr()
        ws_ml = ws_acc + 4 * batch * num_heads * plan.splits * head_dim
    log2_block = block_size.bit_length() - 1
    plan.split(
        stream, q.data_ptr(), *q_strides, k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), width, context_lens.data_ptr(), out.data_ptr(), ws_acc, ws_ml,
        num_heads, num_kv_heads, log2_block, plan.splits, scale * math.log2(math.e), *gate,
        *(prep or (0, 0, 0, 0, 0.0, 0, 0, 0)), *scale_ptrs,
    )  # fmt: skip
    if plan.reduce is not None:
        plan.reduce(
            stream, context_lens.data_ptr(), width, out.data_ptr(), ws_acc, ws_ml, num_heads,
            log2_block, plan.splits, *gate,
        )  # fmt: skip


def prep_fits(head_dim: int, rotary_dim: int) -> bool:
    """Whether :func:`paged_decode_attention_prep` takes this head shape: a head dim of
    :data:`HEAD_DIMS` and a rotary dim whose half is a multiple of 8 (rotation partners sit in
    the same register of another lane)."""
    return head_dim in HEAD_DIMS and 0 <= rotary_dim <= head_dim and rotary_dim % 16 == 0


def paged_decode_attention_prep(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    rotary_dim: int,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_heads: int,
    out: torch.Tensor | None = None,
    splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """A decode step's gated attention straight from the merged qkv projection, in the split
    launch: ``onecat.kernels.attention_prep``'s work for each sequence's one new token
    (RMSNorm (1 + w) and partial RoPE of queries and keys, the key and value written to cache
    row ``slot_mapping[b]``), then :func:`paged_decode_attention` with the gate, so the step
    runs no prep launch.

    ``qkv`` fp16 ``[B, 2*H*D + 2*KVH*D]`` (per query head D query then D gate features, then
    the keys, then the values; rows may be strided, features contiguous, 16-byte aligned);
    ``positions``, ``slot_mapping`` int64 ``[B]``; the norms' weights ``[D]`` (used in fp32);
    ``inv_freq`` fp32 ``[rotary_dim / 2]`` (:func:`prep_fits`); caches, tables and context
    lengths as :func:`paged_decode_attention`, the new token counted in its context (position
    ``context_len - 1``). One row per sequence: a row must not read a key another row of the
    same call writes (speculative drafts run the two launches instead). Returns fp16
    ``[B, H, D]``: ``attention * sigmoid(gate)``, rounded once. An 8-bit cache (and an int8
    cache's ``k_scale`` / ``v_scale``) as :func:`paged_decode_attention`: the new key and value
    are written encoded (``attention_prep``'s codes and scales) and read back decoded.
    """
    where = "onecat.kernels.attention.paged_decode_attention_prep"
    batch = qkv.shape[0]
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    checks = [
        ("qkv", qkv.dtype == torch.float16 and qkv.dim() == 2 and qkv.stride(1) == 1
         and qkv.shape[1] == 2 * (num_heads + num_kv_heads) * head_dim and qkv.stride(0) % 8 == 0
         and qkv.data_ptr() % 16 == 0),
        ("head shape", prep_fits(head_dim, rotary_dim) and num_heads % num_kv_heads == 0
         and supports(qkv.device, qkv.dtype, head_dim, block_size, kv_cache.cache_format(k_cache))),
        ("positions", positions.dtype == torch.int64 and positions.shape == (batch,)),
        ("slot_mapping", slot_mapping.dtype == torch.int64 and slot_mapping.shape == (batch,)),
        ("inv_freq", inv_freq.dtype == torch.float32 and inv_freq.shape == (rotary_dim // 2,) and inv_freq.is_contiguous()),
        ("q_weight / k_weight", q_weight.shape == (head_dim,) and k_weight.shape == (head_dim,)),
        ("k_cache / v_cache", k_cache.dtype in (torch.float16, torch.uint8, torch.int8) and v_cache.dtype == k_cache.dtype
         and k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape
         and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0),
        ("k_scale / v_scale", _check_scales(k_cache, k_scale, v_scale)),
        ("block_tables", block_tables.dtype == torch.int64 and block_tables.is_contiguous()
         and block_tables.dim() == 2 and block_tables.shape[0] == batch),
        ("context_lens", context_lens.dtype == torch.int64 and context_lens.is_contiguous()
         and context_lens.numel() == batch),
        ("out", out is None or (out.dtype == torch.float16 and out.is_contiguous()
         and tuple(out.shape) == (batch, num_heads, head_dim) and out.data_ptr() % 16 == 0)),
    ]  # fmt: skip
    for name, ok in checks:
        if not ok:
            raise OnecatError(f"{where}: {name} has the wrong dtype, shape or layout (see the docstring)")
    if out is None:
        out = torch.empty(batch, num_heads, head_dim, dtype=torch.float16, device=qkv.device)
    if batch == 0:
        return out
    if block_tables.shape[1] == 0:
        return out.zero_()
    q_weight, k_weight = q_weight.float().contiguous(), k_weight.float().contiguous()
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
    prep = (positions.data_ptr(), q_weight.data_ptr(), k_weight.data_ptr(), inv_freq.data_ptr(), eps, rotary_dim,
            slot_mapping.data_ptr(), num_blocks * block_size)  # fmt: skip
    gate = (qkv.data_ptr() + 2 * head_dim, qkv.stride(0), 2 * head_dim)  # bytes: D halves in
    _launch(qkv, (qkv.stride(0), 2 * head_dim), k_cache, v_cache, block_tables, context_lens, scale, num_heads,
            out, splits, gate, prep, scales=(k_scale, v_scale))  # fmt: skip
    return out


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    gate: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`paged_decode_attention` in torch, one sequence at a time in fp32 (reads the
    context lengths on the host): the reference of the kernel's contract, any device. With
    ``gate`` ``[B, H, D]`` the fp32 result is multiplied by ``sigmoid(gate)`` before the one
    rounding to ``q.dtype``. An 8-bit cache is decoded first (``kv_cache.decode``, fp32)."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, length in enumerate(context_lens.tolist()):
        length = min(int(length), block_tables.shape[1] * block_size)
        if length <= 0:
            continue
        blocks = block_tables[b, : math.ceil(length / block_size)]
        int8 = kv_cache.cache_format(k_cache) == "int8"
        k = kv_cache.decode(k_cache[blocks], k_scale[blocks] if int8 else None, torch.float32)
        v = kv_cache.decode(v_cache[blocks], v_scale[blocks] if int8 else None, torch.float32)
        k = k.reshape(-1, num_kv_heads, head_dim)[:length]
        v = v.reshape(-1, num_kv_heads, head_dim)[:length]
        qb = q[b].float().view(num_kv_heads, group, head_dim)
        scores = torch.einsum("kgd,tkd->kgt", qb, k) * scale
        out[b] = torch.einsum("kgt,tkd->kgd", scores.softmax(-1), v).reshape(num_heads, head_dim)
    if gate is not None:
        out = out * torch.sigmoid(gate.float())
    return out.to(q.dtype)
