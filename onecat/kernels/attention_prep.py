"""The inputs of a gated full-attention layer in one launch (``attention_prep.cu``): split the
merged qkv projection into heads, RMSNorm queries and keys with the ``(1 + w)`` weight, rotate
their first ``rotary_dim`` features (partial RoPE) and write keys and values straight into
the layer's paged KV cache (fp16, or encoded as ``onecat.kernels.kv_cache`` says: fp8_e5m2
codes, or int8 codes with a scale per token and KV head), for every token of a step. It replaces the torch path's ~10 fused
elementwise kernels and two cache scatters (``runtime.models.qwen3_5.attention_inputs`` and
``PagedAttention._store``), which stay the reference and the path for CPUs, fp32 and other
head sizes. A pass of one decode row per sequence does not launch it: the decode-attention
kernel's prep form (``attention.paged_decode_attention_prep``) does the same work itself.
"""

from __future__ import annotations

import ctypes

import torch

from onecat.errors import OnecatError
from onecat.kernels import kv_cache
from onecat.kernels.loader import get_kernel

MAX_HEAD_DIM = 256
"""The largest head dimension the kernel holds in registers (8 features per lane)."""
_WARPS = 4  # attention_prep.cu kWarps: heads per block
FORMAT_CODES = {"auto": 0, "fp8_e5m2": 1, "int8": 2}
"""The kernels' ``KvFormat`` codes (w4a16_common.cuh) of the cache encodings."""


def supports(device: torch.device, dtype: torch.dtype, head_dim: int, rotary_dim: int) -> bool:
    """True when :func:`prepare_attention_inputs` runs this device, activation dtype, head dim
    (a multiple of 32 up to :data:`MAX_HEAD_DIM`) and rotary dim (even, at most the head dim)."""
    return (
        device.type == "cuda"
        and dtype == torch.float16
        and 0 < head_dim <= MAX_HEAD_DIM
        and head_dim % 32 == 0
        and 0 <= rotary_dim <= head_dim
        and rotary_dim % 2 == 0
    )


def prepare_attention_inputs(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    fresh_kv: bool = False,
    q_out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Queries ready for attention, and keys and values written into the cache.

    ``qkv`` fp16 ``[T, 2*H*D + 2*KVH*D]`` on CUDA (rows may be strided, features contiguous):
    per query head ``D`` query then ``D`` gate features, then the keys, then the values.
    ``positions`` and ``slot_mapping`` int64 ``[T]``; ``q_weight``/``k_weight`` ``[D]`` (the
    norms' zero-centred weights, any float dtype, used in fp32); ``inv_freq`` fp32
    ``[rotary_dim / 2]``. ``k_cache``/``v_cache`` ``[num_blocks, block_size, KVH, D]``
    contiguous (one layer's cache), or both empty (the memory-profiling pass before the cache
    exists: nothing is written): fp16, uint8 (fp8_e5m2 codes) or int8 (codes; then
    ``k_scale`` / ``v_scale`` fp32 ``[num_blocks, block_size, KVH]`` contiguous receive the
    scales), encoded as ``kv_cache.encode`` encodes the fp16 keys and values (bit-equal). Token ``t``'s key and value go to cache row
    ``slot_mapping[t]``; a row outside the cache (e.g. -1 for padding) writes nothing.

    Returns ``(q [T, H, D], k, v)`` fp16 contiguous: ``q`` normed and rotated (into ``q_out``
    when given); ``k`` (normed, rotated) and ``v`` ``[T, KVH, D]`` only when ``fresh_kv`` (a
    prompt chunk attends over its own fresh keys), else None. The math, with its fp16
    rounding points, is the torch reference's (see ``attention_prep.cu``). The gate is not
    touched: it stays a view of ``qkv``. No host sync and no data-dependent allocation, so
    the call can be captured in a CUDA graph (``slot_mapping`` is read on the device).
    """
    where = "onecat.kernels.attention_prep.prepare_attention_inputs"
    if not supports(qkv.device, qkv.dtype, head_dim, rotary_dim):
        raise OnecatError(
            f"{where}: needs CUDA fp16 activations, a head dim that is a multiple of 32 up to "
            f"{MAX_HEAD_DIM} and an even rotary dim no larger than it; got {qkv.device} {qkv.dtype}, "
            f"head dim {head_dim}, rotary dim {rotary_dim} (use the torch path "
            "runtime.models.qwen3_5.attention_inputs for these)"
        )
    tokens = qkv.shape[0] if qkv.dim() == 2 else -1
    width = (2 * num_heads + 2 * num_kv_heads) * head_dim
    has_cache = k_cache.numel() > 0 or v_cache.numel() > 0
    cache_shape = (k_cache.shape[2], k_cache.shape[3]) if k_cache.dim() == 4 else None
    kv_format = kv_cache.cache_format(k_cache)
    int8 = has_cache and kv_format == "int8"
    scale_ok = lambda t: (t is not None and t.dtype == kv_cache.SCALE_DTYPE and t.is_contiguous()  # noqa: E731
                          and t.shape == k_cache.shape[:3] and t.device == qkv.device)  # fmt: skip
    checks = [
        ("heads", num_heads > 0 and num_kv_heads > 0),
        ("qkv", qkv.dim() == 2 and qkv.shape[1] == width and qkv.stride(1) == 1),
        ("positions", positions.dtype == torch.int64 and positions.shape == (tokens,)
         and positions.device == qkv.device),
        ("slot_mapping", slot_mapping.dtype == torch.int64 and slot_mapping.shape == (tokens,)
         and slot_mapping.device == qkv.device),
        ("q_weight", q_weight.is_floating_point() and q_weight.shape == (head_dim,) and q_weight.device == qkv.device),
        ("k_weight", k_weight.is_floating_point() and k_weight.shape == (head_dim,) and k_weight.device == qkv.device),
        ("inv_freq", inv_freq.dtype == torch.float32 and inv_freq.shape == (rotary_dim // 2,)
         and inv_freq.device == qkv.device),
        ("k_cache", not has_cache or (k_cache.dtype in (torch.float16, torch.uint8, torch.int8)
         and k_cache.is_contiguous() and cache_shape == (num_kv_heads, head_dim) and k_cache.device == qkv.device)),
        ("v_cache", not has_cache or (v_cache.dtype == k_cache.dtype and v_cache.is_contiguous()
         and v_cache.shape == k_cache.shape and v_cache.device == qkv.device)),
        ("k_scale / v_scale (an int8 cache's fp32 [num_blocks, block_size, KVH] scales)",
         not int8 or (scale_ok(k_scale) and scale_ok(v_scale))),
        ("q_out", q_out is None or (q_out.dtype == torch.float16 and q_out.is_contiguous()
         and q_out.shape == (tokens, num_heads, head_dim) and q_out.device == qkv.device)),
    ]  # fmt: skip
    for name, ok in checks:
        if not ok:
            raise OnecatError(f"{where}: {name} has the wrong dtype, shape, layout or device (see the docstring)")
    if q_out is None:
        q_out = torch.empty(tokens, num_heads, head_dim, dtype=torch.float16, device=qkv.device)
    k_out = v_out = None
    if fresh_kv:
        k_out = torch.empty(tokens, num_kv_heads, head_dim, dtype=torch.float16, device=qkv.device)
        v_out = torch.empty_like(k_out)
    if tokens == 0:
        return q_out, k_out, v_out
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
    q_weight, k_weight = q_weight.float().contiguous(), k_weight.float().contiguous()
    num_slots = k_cache.shape[0] * k_cache.shape[1] if has_cache else 0
    pointer = lambda t: ctypes.c_void_p(t.data_ptr() if t is not None else 0)  # noqa: E731
    args = [
        pointer(qkv), ctypes.c_longlong(qkv.stride(0)), pointer(positions), pointer(q_weight),
        pointer(k_weight), pointer(inv_freq), ctypes.c_float(eps), pointer(slot_mapping),
        pointer(k_cache if has_cache else None), pointer(v_cache if has_cache else None),
        ctypes.c_longlong(num_slots), pointer(q_out), pointer(k_out), pointer(v_out),
        ctypes.c_int(num_heads), ctypes.c_int(num_kv_heads), ctypes.c_int(head_dim), ctypes.c_int(rotary_dim),
        pointer(k_scale if int8 else None), pointer(v_scale if int8 else None),
        ctypes.c_int(FORMAT_CODES[kv_format] if has_cache else 0),
    ]  # fmt: skip
    device_index = qkv.device.index if qkv.device.index is not None else torch.cuda.current_device()
    heads = num_heads + 2 * num_kv_heads
    stream = torch.cuda.current_stream(qkv.device).cuda_stream
    get_kernel("attention_prep", device_index).launch((tokens, -(-heads // _WARPS), 1), 32 * _WARPS, stream, args)
    return q_out, k_out, v_out
