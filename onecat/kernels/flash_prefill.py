"""Flash-attention prefill on the GPU (``flash_prefill.cu``): the causal attention of every
prompt chunk of a step in one launch, keys and values read in place from the paged KV cache.

A chunk of ``L`` new tokens after ``P`` cached tokens (a prefix-cache hit, or an earlier chunk
of the same prompt) attends with the bottom-right causal offset: its query ``i`` sees keys
``0 .. P + i``. The chunks of a step are ragged (each has its own ``L`` and ``P``) and run in
one launch; the query heads of one KV head share each K / V tile (grouped-query attention
without repeating K and V). wmma m16n16k16 tensor cores, fp32 online softmax; head dim 128
or 256 (Qwen3.5's). The cache may be 8-bit (``--kv-cache-dtype``, ``onecat.kernels.kv_cache``:
uint8 fp8_e5m2 codes, or int8 codes with fp32 scales per token and KV head): the kernels
``flash_prefill_{fp8,int8}_*`` decode each K / V tile into the fp16 shared-memory tile. The
kernel file's header comment has the layout and thread mapping.

:class:`PrefillAttentionBatch` (:func:`prefill_attention_batch`) describes a step's chunks
once; every attention layer of the step reuses it. :func:`flash_prefill_reference` is the
same contract in torch (fp32, any device): the CPU path and the tests' reference.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from onecat.errors import OnecatError
from onecat.kernels import kv_cache
from onecat.kernels.attention import supports as paged_cache_supported
from onecat.kernels.driver import PreparedLaunch
from onecat.kernels.loader import get_kernel
from onecat.kernels.workspace import to_device

HEAD_DIMS = (128, 256)
"""Head dimensions the kernel is built for."""
ROWS = 64
"""(token, query head) rows per block (``kRows``)."""
KEYS = 64
"""Keys per tile (``kKeys``)."""
_THREADS = 256
VARIANTS = ("r16", "r32")
"""Kernel variants (``flash_prefill_<variant>_d<D>``): the rows each warp holds in the P V
product, 16 (warps of 16 rows x D/2 columns) or 32 (32 rows x D/4 columns: fewer shared-memory
fragment loads per tensor-core op). Identical results; they differ in speed only."""
DEFAULT_VARIANT = "r16"
"""The variant the runtime runs (the faster on the H200: BENCHMARKS.md, 2026-12-03)."""


def shared_bytes(head_dim: int) -> int:
    """Dynamic shared memory of one block: the Q and K/V tiles (fp16, rows padded by 8), the
    fp32 score tile (64 x 80) and 64 row factors. 88,320 bytes at head dim 256 (a V100 gives a
    block up to 96 KB)."""
    return 2 * ROWS * (head_dim + 8) * 2 + ROWS * 80 * 4 + ROWS * 4


def supports(
    device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int, kv_format: str = "auto"
) -> bool:
    """True when :func:`flash_prefill_attention` runs this device, query dtype, head dim, KV
    block size and cache encoding (``kv_cache.FORMATS``): the paged cache the decode kernel
    reads (``attention.supports``), at head dims 128 and 256."""
    return head_dim in HEAD_DIMS and paged_cache_supported(device, dtype, head_dim, block_size, kv_format)


def work_items(lengths: tuple[int, ...] | list[int], past: tuple[int, ...] | list[int], group: int) -> list[tuple[int, int]]:
    """The kernel's work items ``(sequence, row tile)``: a sequence of ``L`` tokens has
    ``ceil(L * group / ROWS)`` tiles of :data:`ROWS` (token, head) rows; heaviest first (most
    keys to walk: ``P`` plus the tile's last token + 1), so the longest blocks start first."""
    items = []
    for s, (length, p) in enumerate(zip(lengths, past, strict=True)):
        for tile in range(math.ceil(length * group / ROWS)):
            last = min(length - 1, ((tile + 1) * ROWS - 1) // group)
            items.append((p + last + 1, s, tile))
    items.sort(key=lambda item: -item[0])
    return [(s, tile) for _, s, tile in items]


@dataclass(frozen=True)
class PrefillAttentionBatch:
    """The prompt chunks of one step for :func:`flash_prefill_attention`: per sequence its
    first row in the flat batch, its length ``L`` and its cached tokens ``P``; ``group`` query
    heads per KV head; ``meta`` holds, on the device, int32 ``[S, 4]`` (start, L, P, table
    offset) then the work items ``[N, 2]``; ``tables`` the sequences' block tables one after
    another (int64, on the device), or None when keys and values come fresh (not from a
    cache: every ``P`` is 0)."""

    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    past: tuple[int, ...]
    table_lengths: tuple[int, ...]
    group: int
    num_items: int
    meta: torch.Tensor
    tables: torch.Tensor | None

    @property
    def num_seqs(self) -> int:
        """Sequences (chunks) in the batch."""
        return len(self.starts)

    @property
    def num_rows(self) -> int:
        """Rows of the flat batch the chunks span: ``max(start + L)``."""
        return max(s + n for s, n in zip(self.starts, self.lengths, strict=True))

    @property
    def seqs(self) -> torch.Tensor:
        """int32 ``[S, 4]`` on the device."""
        return self.meta[: 4 * self.num_seqs].view(self.num_seqs, 4)

    @property
    def items(self) -> torch.Tensor:
        """int32 ``[N, 2]`` on the device."""
        return self.meta[4 * self.num_seqs :].view(self.num_items, 2)


def prefill_attention_batch(
    starts: list[int] | tuple[int, ...],
    lengths: list[int] | tuple[int, ...],
    past: list[int] | tuple[int, ...],
    group: int,
    device: torch.device,
    tables: list[torch.Tensor] | None = None,
) -> PrefillAttentionBatch:
    """Describe a step's prompt chunks (host lists; one small copy to ``device``).

    ``tables``: each sequence's block table (int64, 1-D, on ``device``), or None when the keys
    and values are the fresh ``[T, KVH, D]`` rows of the chunks themselves (no cache; every
    ``past`` must then be 0). Raises OnecatError on empty, negative or overlapping chunks."""
    where = "onecat.kernels.flash_prefill"
    if not (len(starts) == len(lengths) == len(past)) or not starts:
        raise OnecatError(f"{where}: need one start, length and past count per sequence (and at least one)")
    if group < 1:
        raise OnecatError(f"{where}: group must be >= 1, got {group}")
    if any(n < 1 for n in lengths) or any(s < 0 for s in starts) or any(p < 0 for p in past):
        raise OnecatError(f"{where}: chunks need length >= 1, start >= 0, past >= 0; got {list(starts)}, "
                          f"{list(lengths)}, {list(past)}")  # fmt: skip
    spans = sorted(zip(starts, lengths, strict=True))
    for (s0, n0), (s1, _) in zip(spans, spans[1:], strict=False):
        if s0 + n0 > s1:
            raise OnecatError(f"{where}: chunks overlap (rows {s0}+{n0} and {s1})")
    if tables is None:
        if any(past):
            raise OnecatError(f"{where}: chunks after cached tokens need block tables")
        table_lengths, offsets, flat = (0,) * len(starts), [0] * len(starts), None
    else:
        if len(tables) != len(starts) or any(t.dtype != torch.int64 or t.dim() != 1 for t in tables):
            raise OnecatError(f"{where}: need one 1-D int64 block table per sequence")
        table_lengths = tuple(int(t.numel()) for t in tables)
        offsets = [sum(table_lengths[:i]) for i in range(len(tables))]
        flat = torch.cat([t.to(device) for t in tables]) if len(tables) > 1 else tables[0].to(device).contiguous()
    items = work_items(lengths, past, group)
    seq_rows = [v for row in zip(starts, lengths, past, offsets, strict=True) for v in row]
    meta = to_device(seq_rows + [v for item in items for v in item], torch.int32, device)
    return PrefillAttentionBatch(tuple(starts), tuple(lengths), tuple(past), table_lengths, group, len(items), meta,
                                 flat)  # fmt: skip


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PrefillAttentionBatch,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    where = "onecat.kernels.flash_prefill.flash_prefill_attention"
    kv_format = kv_cache.cache_format(k)
    if kv_format != "auto" and batch.tables is None:
        raise OnecatError(f"{where}: an 8-bit ({kv_format}) k / v is a paged cache: the batch needs block tables")
    if kv_format == "int8" and not all(
        t is not None and t.dtype == kv_cache.SCALE_DTYPE and t.is_contiguous() and t.shape == k.shape[:3]
        and t.device == k.device for t in (k_scale, v_scale)
    ):  # fmt: skip
        raise OnecatError(f"{where}: an int8 cache needs k_scale / v_scale fp32 [num_blocks, block_size, KVH] "
                          "contiguous on its device")  # fmt: skip
    if q.dim() != 3 or k.dim() != (4 if batch.tables is not None else 3):
        raise OnecatError(f"{where}: q must be [T, H, D] and k / v [blocks, block_size, KVH, D] (or [T, KVH, D] "
                          f"without tables); got {tuple(q.shape)} and {tuple(k.shape)}")  # fmt: skip
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[-2]
    if num_heads != num_kv_heads * batch.group or k.shape[-1] != head_dim or v.shape != k.shape:
        raise OnecatError(f"{where}: {num_heads} query heads, {num_kv_heads} KV heads and group {batch.group} "
                          f"do not agree, or k / v / q head dims differ")  # fmt: skip
    if batch.num_rows > q.shape[0]:
        raise OnecatError(f"{where}: the chunks span {batch.num_rows} rows, q has {q.shape[0]}")
    if batch.tables is not None:
        block_size = k.shape[1]
        short = [s for s, (n, p, w) in enumerate(zip(batch.lengths, batch.past, batch.table_lengths, strict=True))
                 if w * block_size < n + p]  # fmt: skip
        if short:
            raise OnecatError(f"{where}: the block tables of sequences {short} hold fewer than their tokens")
    elif batch.num_rows > k.shape[0]:
        raise OnecatError(f"{where}: the chunks span {batch.num_rows} rows, the fresh k / v have {k.shape[0]}")


def flash_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: PrefillAttentionBatch,
    scale: float,
    out: torch.Tensor | None = None,
    variant: str = DEFAULT_VARIANT,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of every chunk of ``batch`` in one launch.

    ``q`` fp16 ``[T, H, D]`` (features contiguous, token and head strides multiples of 8,
    16-byte aligned), rows ``start .. start + L - 1`` of each chunk. ``k`` / ``v``: one layer's
    paged cache fp16 ``[num_blocks, block_size, KVH, D]`` contiguous, read through the batch's
    tables (key ``j`` of a sequence at row ``table[j // bs] * bs + j % bs``), or, for a batch
    without tables, the chunks' own keys and values ``[T, KVH, D]`` contiguous. ``H = KVH *
    group``; query head ``h`` reads KV head ``h // group``. Returns fp16 ``[T, H, D]`` (``out``
    when given: features contiguous, strides as q's): the chunks' rows hold
    ``softmax(q k^T * scale + causal) v`` (fp32 softmax and sums, P rounded to fp16 for the
    P V product), the other rows are left as they were. ``variant``: one of :data:`VARIANTS`.

    An 8-bit paged cache (``kv_cache``): ``k`` / ``v`` uint8 (fp8_e5m2 codes) or int8 (codes,
    with ``k_scale`` / ``v_scale`` fp32 ``[num_blocks, block_size, KVH]`` contiguous); each
    tile is decoded to fp16 (fp8 exactly, int8 as ``fp16(q * s)``) before the same math.
    """
    where = "onecat.kernels.flash_prefill.flash_prefill_attention"
    if variant not in VARIANTS:
        raise OnecatError(f"{where}: variant must be one of {VARIANTS}, got {variant!r}")
    block_size = k.shape[1] if k.dim() == 4 else 1
    kv_format = kv_cache.cache_format(k)
    if not supports(q.device, q.dtype, q.shape[-1], block_size, kv_format):
        raise OnecatError(f"{where}: needs CUDA fp16 queries, head dim in {HEAD_DIMS} and a power-of-two block size; "
                          f"got {q.device} {q.dtype}, head dim {q.shape[-1]}, block size {block_size}, "
                          f"{kv_format} cache")  # fmt: skip
    _check_inputs(q, k, v, batch, k_scale, v_scale)
    head_dim = q.shape[2]
    aligned = lambda t: (t.stride(-1) == 1 and t.stride(0) % 8 == 0 and t.stride(1) % 8 == 0  # noqa: E731
                         and t.data_ptr() % 16 == 0)  # fmt: skip
    if not aligned(q):
        q = q.contiguous()
    checks = [
        ("k / v", k.dtype == v.dtype and k.dtype in (torch.float16, torch.uint8, torch.int8)
         and k.is_contiguous() and v.is_contiguous()
         and k.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0 and k.device == v.device == q.device),
        ("out", out is None or (out.dtype == torch.float16 and out.shape == q.shape and aligned(out))),
    ]  # fmt: skip
    for name, ok in checks:
        if not ok:
            raise OnecatError(f"{where}: {name} has the wrong dtype, shape or layout (see the docstring)")
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float16, device=q.device)
    device_index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    name = f"flash_prefill{kv_cache.KERNEL_SUFFIX[kv_format]}_{variant}_d{head_dim}"
    launch = _launch(device_index, name, head_dim, batch.num_items * k.shape[-2])
    int8 = kv_format == "int8"
    stream = torch.cuda.current_stream(q.device).cuda_stream
    launch(
        stream, q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(),
        0 if batch.tables is None else batch.tables.data_ptr(), batch.seqs.data_ptr(), batch.items.data_ptr(),
        out.data_ptr(), out.stride(0), out.stride(1), k.shape[-2], batch.group, block_size.bit_length() - 1,
        scale * math.log2(math.e), k_scale.data_ptr() if int8 else 0, v_scale.data_ptr() if int8 else 0,
    )  # fmt: skip
    return out


_launches: dict[tuple[int, str, int], PreparedLaunch] = {}
_MAX_LAUNCHES = 1 << 12  # one per (device, kernel, grid): stay bounded


def _launch(device_index: int, name: str, head_dim: int, blocks: int) -> PreparedLaunch:
    key = (device_index, name, blocks)
    launch = _launches.get(key)
    if launch is None:
        if len(_launches) >= _MAX_LAUNCHES:
            _launches.clear()
        p, ll, i = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int
        kernel = get_kernel(name, device_index)
        launch = _launches[key] = PreparedLaunch(
            kernel, (blocks, 1, 1), _THREADS, [p, ll, ll, p, p, p, p, p, p, ll, ll, i, i, i, ctypes.c_float, p, p],
            shared=shared_bytes(head_dim),
        )  # fmt: skip
    return launch


def flash_prefill_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PrefillAttentionBatch, scale: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`flash_prefill_attention` in torch, one sequence at a time in fp32 (any device;
    the keys gathered through the batch's tables and decoded, ``kv_cache.decode``, fp32): the
    contract's reference. Rows outside the chunks are zero; the result has ``q``'s dtype."""
    _check_inputs(q, k, v, batch, k_scale, v_scale)
    int8 = kv_cache.cache_format(k) == "int8"
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, group = k.shape[-2], batch.group
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    offset = 0
    for s, (start, length, past) in enumerate(zip(batch.starts, batch.lengths, batch.past, strict=True)):
        total = past + length
        if batch.tables is None:
            keys, values = k[start : start + length], v[start : start + length]
        else:
            block_size = k.shape[1]
            table = batch.tables[offset : offset + math.ceil(total / block_size)].to(k.device)
            keys = kv_cache.decode(k[table], k_scale[table] if int8 else None, torch.float32)
            values = kv_cache.decode(v[table], v_scale[table] if int8 else None, torch.float32)
            keys = keys.reshape(-1, num_kv_heads, head_dim)[:total]
            values = values.reshape(-1, num_kv_heads, head_dim)[:total]
        offset += batch.table_lengths[s]
        qs = q[start : start + length].float().view(length, num_kv_heads, group, head_dim)
        scores = torch.einsum("lkgd,tkd->kglt", qs, keys.float()) * scale
        visible = torch.arange(total, device=q.device)[None, :] <= (past + torch.arange(length, device=q.device))[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start : start + length] = torch.einsum("kglt,tkd->lkgd", probs, values.float()).reshape(
            length, num_heads, head_dim
        )
    return out.to(q.dtype)
