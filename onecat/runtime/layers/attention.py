"""Attention over a paged KV cache: onecat's CUDA kernels, torch as the reference path.

The cache of one layer is ``k_cache``/``v_cache`` ``[num_blocks, block_size, kv_heads,
head_dim]``; a sequence's tokens live in the blocks of its block table, token ``t`` at slot
``block_table[t // block_size] * block_size + t % block_size``. The new keys and values are
written at the context's ``slot_mapping`` first: on CUDA fp16 by the fused input kernel
(``onecat.kernels.attention_prep``, :meth:`PagedAttention.prepare_inputs`, called from the
layer's token-wise ``project``), elsewhere by each call itself. Then:

- decode tokens (one per sequence, batched): on CUDA with an fp16 cache, the paged
  decode-attention kernel (``onecat.kernels.attention``) reads each sequence's blocks in place,
  up to its own length, and its launch does not depend on the lengths or on how many blocks
  the table rows hold beyond them; elsewhere (CPU, fp32, other head sizes) gather each
  sequence's blocks, mask the slots beyond its length, and run SDPA with the query heads of
  one KV head as the "query length" axis (grouped-query attention without repeating K and V);
- prefill chunks: on CUDA with an fp16 cache and head dim 128 or 256, every chunk of the pass
  in one launch of the flash-attention prefill kernel (``onecat.kernels.flash_prefill``), which
  reads keys and values in place through the block tables (bottom-right causal offset after
  cached tokens; the query heads of a KV head share its K / V tiles); elsewhere (CPU, fp32,
  other head sizes: the reference path) one chunk at a time in torch, the query heads of each
  KV head stacked as rows (K and V never repeated) and the query rows in blocks that bound
  the memory of the scores, so that long prompts fit.

The cache may be quantized (``--kv-cache-dtype``, ``onecat.kernels.kv_cache``): ``fp8_e5m2``
(uint8 codes, the top byte of fp16) or ``int8`` (codes with an fp32 scale per token and KV head
in ``k_scale`` / ``v_scale`` ``[num_blocks, block_size, kv_heads]``). Every path writes the
encoded keys and values and reads them back decoded: the kernels in registers or shared
memory, the torch path through ``kv_cache.encode`` / ``decode``. A prompt chunk's own keys are
read as the cache holds them (the torch path round-trips its fresh keys), so prompt and decode
see the same values whichever path runs them.

With an output ``gate`` (Qwen3.5's gated attention) :meth:`PagedAttention.forward` returns
``attention * sigmoid(gate)``: the decode kernel applies it where it writes its output (no
separate elementwise kernel), the torch paths with :func:`sigmoid_gate`.

A pass of decode rows only, one per sequence, skips the input kernel on CUDA:
:meth:`PagedAttention.decode_from_qkv` runs the decode kernel's ``split_prep`` form, which
norms and rotates the queries and the new key itself and writes the new key and value into
the cache (:meth:`PagedAttention.decodes_from_qkv` says when).

Benchmarks compare the prefill kernel with torch SDPA's backends through
:func:`prompt_attention_sdpa` (no user-facing switch): inside it every prompt chunk runs one
SDPA call under the given backend, as the runtime's CUDA path did before the kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

from onecat.kernels import attention as attention_kernel
from onecat.kernels import attention_prep, flash_prefill, kv_cache
from onecat.runtime.context import ForwardContext, get_context
from onecat.runtime.layers.fusion import fused

PREFILL_SCORE_ELEMENTS = 1 << 25
"""Most attention scores one torch call may hold for a prompt chunk (its query rows are split
into blocks under it): a 2048-token chunk of a 32k-token prompt would otherwise hold 24 heads
x 2048 x 32768 fp32 scores, 6.4 GB, at once. The CUDA kernel holds no scores in memory."""

_prompt_sdpa_backend: SDPBackend | None = None
"""Set by :func:`prompt_attention_sdpa` only (benchmarks); None: the runtime's own choice."""


@contextmanager
def prompt_attention_sdpa(backend: SDPBackend | None) -> Iterator[None]:
    """Benchmarks only (``bench/e2e.py --prompt-attention``): inside, every prompt chunk, on any
    device, runs ONE torch SDPA call under ``backend`` (``sdpa_kernel([backend])``) instead of
    the flash prefill kernel or the reference path: 4-D inputs, each KV head's keys and values
    repeated for its query heads, an upper-left causal mask for a fresh chunk and the
    lower-right ``CausalBias`` after cached tokens (nothing materialised), the context's keys
    gathered from the paged cache (decoded from an 8-bit encoding): the runtime's CUDA path
    before the kernel, without its split over KV heads. A backend that cannot take the call
    raises (torch's "No available kernel") rather than falling back. None: the runtime's own
    choice. Not thread-safe: a module-wide switch for the engines of this process."""
    global _prompt_sdpa_backend
    previous, _prompt_sdpa_backend = _prompt_sdpa_backend, backend
    try:
        yield
    finally:
        _prompt_sdpa_backend = previous


@fused
def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)``: the gated attention's output gate (``gate`` of ``x``'s shape,
    or any shape holding the same elements per row)."""
    return x * torch.sigmoid(gate.reshape(x.shape))


class PagedAttention(nn.Module):
    """Scaled dot-product attention with grouped KV heads over the paged cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # int8 caches: one fp32 scale per cached token and KV head [num_blocks, block_size, kv_heads]
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None

    @property
    def kv_format(self) -> str:
        """The cache's encoding (``onecat.kernels.kv_cache.FORMATS``), from its element type."""
        return kv_cache.cache_format(self.k_cache)

    def _kernel_cache(self) -> bool:
        """True when the allocated cache is one the CUDA kernels read: fp16, or 8-bit codes."""
        cache = self.k_cache
        return cache.dim() == 4 and cache.is_contiguous() and (
            cache.dtype == torch.float16 or self.kv_format != "auto"
        )

    def fuses_inputs(self, device: torch.device, dtype: torch.dtype, rotary_dim: int) -> bool:
        """True when the layer's inputs go through :meth:`prepare_inputs` for activations of
        this device and dtype (CUDA fp16, a head shape the kernel supports, the cache fp16 or
        not allocated yet; or quantized): the keys and values are then in the cache before
        :meth:`forward`."""
        cache_fits = self.k_cache.numel() == 0 or self._kernel_cache()
        return cache_fits and attention_prep.supports(device, dtype, self.head_dim, rotary_dim)

    def prepare_inputs(
        self, qkv: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
        inv_freq: torch.Tensor, eps: float, rotary_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The fused input kernel over every row of ``qkv [T, 2*H*D + 2*KVH*D]`` (token-wise,
        see ``onecat.kernels.attention_prep``): returns q ``[T, H, D]`` normed and rotated,
        and writes keys and values at the context's ``slot_mapping`` (nothing before the cache
        exists). k and v ``[T, KVH, D]`` come back too when some rows are not decode rows
        (prompt chunks attend over their fresh keys), else None. Graph-safe: the slots are
        read on the device (the piecewise prompt graphs pass a static buffer, -1 on padding)."""
        ctx = get_context()
        tokens = qkv.shape[0]
        return attention_prep.prepare_attention_inputs(
            qkv, positions, q_weight, k_weight, inv_freq, eps, ctx.slot_mapping[:tokens], self.k_cache,
            self.v_cache, self.num_heads, self.num_kv_heads, self.head_dim, rotary_dim,
            fresh_kv=ctx.num_decodes < tokens, k_scale=self.k_scale, v_scale=self.v_scale,
        )

    def _store(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if self.k_cache.numel() == 0:
            return  # the memory-profiling pass runs before the cache exists
        shape = (-1, self.num_kv_heads, self.head_dim)
        name = self.kv_format
        for x, cache, scales in ((k, self.k_cache, self.k_scale), (v, self.v_cache, self.v_scale)):
            data, scale = kv_cache.encode(x, name)
            cache.view(shape).index_copy_(0, slot_mapping, data.to(cache.dtype))
            if scale is not None:
                scales.view(-1, self.num_kv_heads).index_copy_(0, slot_mapping, scale)

    def _gather(self, block_table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the blocks in ``block_table [..., n]``, decoded to ``dtype``:
        ``[..., n * bs, kvh, d]``."""
        shape = (*block_table.shape[:-1], -1, self.num_kv_heads, self.head_dim)
        quantized = self.kv_format == "int8"
        k = kv_cache.decode(self.k_cache[block_table], self.k_scale[block_table] if quantized else None, dtype)
        v = kv_cache.decode(self.v_cache[block_table], self.v_scale[block_table] if quantized else None, dtype)
        return k.reshape(shape), v.reshape(shape)

    def uses_decode_kernel(self) -> bool:
        """True when decode runs the paged-attention kernel: then a decode step's work and
        launches do not depend on the block-table width (CUDA graphs need not be keyed by it)."""
        return attention_kernel.supports(
            self.k_cache.device, torch.float16, self.head_dim, self.k_cache.shape[1], self.kv_format
        ) if self._kernel_cache() else False

    def decodes_from_qkv(self, qkv: torch.Tensor, rotary_dim: int) -> bool:
        """True when the current pass is decode rows only, one per sequence (no drafts), on the
        CUDA decode kernel with an allocated fp16 (or 8-bit) cache and a head shape its ``split_prep``
        form takes: then :meth:`decode_from_qkv` replaces the input kernel and the decode
        launch."""
        ctx = get_context()
        return (
            ctx.num_decodes == qkv.shape[0] > 0 and not ctx.prefills and ctx.decode_width == 1
            and self.k_cache.numel() > 0 and self.uses_decode_kernel()
            and attention_kernel.prep_fits(self.head_dim, rotary_dim)
            and attention_prep.supports(qkv.device, qkv.dtype, self.head_dim, rotary_dim)
        )  # fmt: skip

    def decode_from_qkv(
        self, qkv: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
        inv_freq: torch.Tensor, eps: float, rotary_dim: int,
    ) -> torch.Tensor:
        """A decode pass's gated attention ``[B, H, D]`` from the merged qkv projection in one
        launch (plus the split reduce): queries and the new keys normed and rotated, keys and
        values written at the context's ``slot_mapping`` (``attention.paged_decode_attention_prep``)."""
        ctx = get_context()
        rows = qkv.shape[0]
        return attention_kernel.paged_decode_attention_prep(
            qkv, positions, q_weight, k_weight, inv_freq, eps, rotary_dim, ctx.slot_mapping[:rows],
            self.k_cache, self.v_cache, ctx.decode_block_tables, ctx.decode_context_lens, self.scale, self.num_heads,
            k_scale=self.k_scale, v_scale=self.v_scale,
        )  # fmt: skip

    def _decode(self, q: torch.Tensor, ctx: ForwardContext, gate: torch.Tensor | None = None) -> torch.Tensor:
        if q.dtype == torch.float16 and self.uses_decode_kernel() and (gate is None or gate.dtype == q.dtype):
            q = q if q.stride(-1) == 1 else q.contiguous()
            return attention_kernel.paged_decode_attention(
                q, self.k_cache, self.v_cache, ctx.decode_block_tables, ctx.decode_context_lens, self.scale,
                gate=None if gate is None else gate.reshape(q.shape), k_scale=self.k_scale, v_scale=self.v_scale,
            )
        out = self._decode_torch(q, ctx)
        return out if gate is None else sigmoid_gate(out, gate)

    def _decode_torch(self, q: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Decode attention in torch: gather the table's blocks, mask, SDPA (CPU, fp32, tests)."""
        batch = q.shape[0]
        group = self.num_heads // self.num_kv_heads
        k, v = self._gather(ctx.decode_block_tables, q.dtype)  # [B, L, kvh, d]
        if ctx.decode_kv_mask is None:  # the same for every layer of this pass
            positions = torch.arange(k.shape[1], device=q.device)
            ctx.decode_kv_mask = positions[None, :] < ctx.decode_context_lens[:, None]
        valid = ctx.decode_kv_mask
        qg = q.view(batch, self.num_kv_heads, group, self.head_dim)
        out = F.scaled_dot_product_attention(
            qg,
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=valid[:, None, None, :],
            scale=self.scale,
        )
        return out.reshape(batch, self.num_heads, self.head_dim)

    def uses_prefill_kernel(self, q: torch.Tensor) -> bool:
        """True when this pass's prompt chunks run the flash-attention prefill kernel: CUDA fp16
        queries, a head dim it is built for, and an fp16 or 8-bit cache (or none yet: the memory
        profiling pass, whose chunks then read their fresh keys and values)."""
        cache = self.k_cache
        if cache.numel() == 0:
            return flash_prefill.supports(q.device, q.dtype, self.head_dim, 1)
        return (
            self._kernel_cache() and cache.device == q.device
            and flash_prefill.supports(q.device, q.dtype, self.head_dim, cache.shape[1], self.kv_format)
        )  # fmt: skip

    def _prefill_kernel(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                        ctx: ForwardContext) -> torch.Tensor:
        """Every prompt chunk of the pass in one kernel launch: ``[T, H, D]`` with the chunks'
        rows written (the others are left uninitialised). The chunk description is built once
        per pass and shared by the layers (``ctx.prefill_attention``)."""
        fresh = self.k_cache.numel() == 0
        key = (self.num_heads // self.num_kv_heads, fresh)
        batch = ctx.prefill_attention.get(key)
        if batch is None:
            chunks = ctx.prefills
            batch = ctx.prefill_attention[key] = flash_prefill.prefill_attention_batch(
                [c.start for c in chunks], [c.length for c in chunks], [c.num_past for c in chunks], key[0], q.device,
                None if fresh else [c.block_table for c in chunks],
            )  # fmt: skip
        if fresh:
            k_src, v_src = k.contiguous(), v.contiguous()
        else:
            k_src, v_src = self.k_cache, self.v_cache
        if fresh:
            return flash_prefill.flash_prefill_attention(q, k_src, v_src, batch, self.scale)
        return flash_prefill.flash_prefill_attention(q, k_src, v_src, batch, self.scale, k_scale=self.k_scale,
                                                     v_scale=self.v_scale)  # fmt: skip

    def _context_kv(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_past: int, block_table
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[num_past + L, KVH, D]`` a chunk of ``L`` tokens attends over: the
        cache's blocks after cached tokens, else the fresh ``k`` / ``v`` as the cache holds them
        (round-tripped through a quantized encoding; as given before the cache exists)."""
        total = num_past + q.shape[0]
        if num_past:
            k_all, v_all = self._gather(block_table, q.dtype)
            return k_all[:total], v_all[:total]
        if self.k_cache.numel() == 0:  # the memory-profiling pass: no cache yet
            return k, v
        return kv_cache.roundtrip(k, self.kv_format), kv_cache.roundtrip(v, self.kv_format)

    def _prefill_sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_past: int, block_table, backend: SDPBackend
    ) -> torch.Tensor:
        """One prompt chunk as one SDPA call under ``backend`` (:func:`prompt_attention_sdpa`)."""
        group = self.num_heads // self.num_kv_heads
        length = q.shape[0]
        k_all, v_all = self._context_kv(q, k, v, num_past, block_table)
        causal = (causal_lower_right if num_past else causal_upper_left)(length, k_all.shape[0])
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k_all.to(q.dtype).transpose(0, 1).repeat_interleave(group, dim=0)[None],
                v_all.to(q.dtype).transpose(0, 1).repeat_interleave(group, dim=0)[None],
                attn_mask=causal,
                scale=self.scale,
            )
        return out[0].transpose(0, 1)

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_past: int, block_table
    ) -> torch.Tensor:
        """One prompt chunk in torch (the reference path: CPU, fp32, other head sizes): its
        queries over the whole context (the cache's blocks after cached tokens, else the fresh
        ``k`` / ``v`` as the cache holds them: round-tripped through a quantized encoding)
        with an explicit causal mask, the query heads of one KV head stacked as
        rows (keys and values never repeated), in row blocks that keep the scores under
        :data:`PREFILL_SCORE_ELEMENTS`."""
        group = self.num_heads // self.num_kv_heads
        length, total = q.shape[0], num_past + q.shape[0]
        k_all, v_all = self._context_kv(q, k, v, num_past, block_table)
        keys, values = k_all.transpose(0, 1).to(q.dtype), v_all.transpose(0, 1).to(q.dtype)  # [kvh, S, d]
        queries = q.reshape(length, self.num_kv_heads, group, self.head_dim).permute(1, 2, 0, 3)
        rows = max(1, PREFILL_SCORE_ELEMENTS // (self.num_heads * total))
        columns = torch.arange(total, device=q.device)
        outputs = []
        for r0 in range(0, length, rows):
            r1 = min(r0 + rows, length)
            mask = columns[None, :] <= torch.arange(num_past + r0, num_past + r1, device=q.device)[:, None]
            block = queries[:, :, r0:r1].reshape(self.num_kv_heads, group * (r1 - r0), self.head_dim)
            out = F.scaled_dot_product_attention(block, keys, values, attn_mask=mask.repeat(group, 1), scale=self.scale)
            outputs.append(out.view(self.num_kv_heads, group, r1 - r0, self.head_dim))
        return torch.cat(outputs, dim=2).permute(2, 0, 1, 3).reshape(length, self.num_heads, self.head_dim)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, stored: bool = False,
        gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``q [T, H, D]``, ``k``/``v`` ``[T, KVH, D]`` of the flat batch -> ``[T, H, D]``.
        ``stored``: the keys and values are in the cache already (:meth:`prepare_inputs`);
        k and v are then read only for prompt chunks and may be None in a decode-only pass.
        ``gate`` (``[T, H, D]`` or ``[T, H*D]``, optional): the output is multiplied by
        ``sigmoid(gate)`` (on the decode kernel before its one rounding to fp16)."""
        ctx = get_context()
        if not stored:
            self._store(k, v, ctx.slot_mapping)
        backend = _prompt_sdpa_backend
        if ctx.prefills and backend is None and self.uses_prefill_kernel(q):
            # the chunks follow the decode rows (the runner's flat batch)
            out = self._prefill_kernel(q, k, v, ctx)
            decodes = ctx.num_decodes
            if gate is not None:
                out[decodes:] = sigmoid_gate(out[decodes:], gate[decodes:])
            if decodes:
                out[:decodes] = self._decode(q[:decodes], ctx, None if gate is None else gate[:decodes])
            return out
        outputs = []
        if ctx.num_decodes:
            decode_gate = None if gate is None else gate[: ctx.num_decodes]
            outputs.append(self._decode(q[: ctx.num_decodes], ctx, decode_gate))
        for chunk in ctx.prefills:
            part = slice(chunk.start, chunk.start + chunk.length)
            if backend is None:
                out = self._prefill(q[part], k[part], v[part], chunk.num_past, chunk.block_table)
            else:
                out = self._prefill_sdpa(q[part], k[part], v[part], chunk.num_past, chunk.block_table, backend)
            outputs.append(out if gate is None else sigmoid_gate(out, gate[part]))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
