"""Runs the model on a scheduled batch: caches, batch tensors, CUDA graphs, logits.

Memory: on a GPU, after the weights are loaded, one prefill of ``max_num_batched_tokens``
tokens measures the peak activation memory; what ``gpu_memory_utilization`` leaves after
that (and a reserve for sampling and graphs) is the budget of the caches, unless
``kv_cache_memory_bytes`` gives it exactly (vLLM's ``--kv-cache-memory-bytes``, on CPU too).
``onecat.runtime.capacity.plan_caches`` splits the budget (the same arithmetic ``onecat
plan`` runs): the GDN state slots (``max_num_seqs`` of them, fewer with a warning if they
would take more than half), with prefix caching GDN state checkpoints
(``block_manager.StateCheckpoints``: at most ``MAX_STATE_CHECKPOINTS`` and ``max_num_seqs``,
and at most an eighth of the budget), and the paged KV cache of the full-attention layers.
Without a budget on CPU the KV cache gets a fixed byte budget and every slot and checkpoint.
Checkpoints follow the scratch slot in the state tensors; the runner copies a
checkpoint into a sequence's slot before a step (``Sequence.restore_from``) and a slot into
a checkpoint after it when the checkpoint is at the end of the step's chunk
(``Sequence.saves``), outside any CUDA graph; a checkpoint inside a prompt chunk is written
by the GDN layers during the pass (``PrefillChunk.checkpoints``), so prompts are not cut at
checkpoint boundaries.

Inside decode graphs the small elementwise steps run fused (``layers/fusion.py``).

CUDA graphs: a step of decode tokens only replays a whole-model graph, one per batch-size
bucket (1, 2, 4, 8, 16, 32, ... up to ``max_num_seqs``), and with speculative decoding one
more per bucket with 1 + N rows per sequence (verify chunks, padded); a step with prompt tokens (decode
tokens beside them or not) replays piecewise graphs (``prompt_graphs.py``: everything but
the attention and GDN cores, per token-count bucket up to ``max_num_batched_tokens``). All
are captured at start (``warmup``); the piecewise graphs' activation memory is planned
like the prefill's. Host-to-device copies of batch metadata go through pinned memory, so
the host never waits for the GPU before the step's sampled tokens are read. With the paged decode-attention
kernel a graph serves every context length (its block table spans ``max_model_len``); the
torch attention fallback gathers the whole table, so there graphs are also keyed by a
power-of-two table width and captured on first use. Padding rows write their key/value to
a scratch block and their state to a scratch slot. MoE layers run the grouped expert op,
which routes on the GPU, so MoE decode batches of any size run as graphs too.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import math

import torch

from onecat.errors import OnecatError
from onecat.kernels import kv_cache
from onecat.kernels.workspace import to_device
from onecat.runtime import capacity
from onecat.runtime.capacity import MAX_STATE_CHECKPOINTS
from onecat.runtime.config import EngineConfig
from onecat.runtime.context import ForwardContext, PrefillChunk, set_context
from onecat.runtime.distributed.parallel_state import min_over_ranks
from onecat.runtime.engine import graph_capture
from onecat.runtime.engine.decode_graphs import (
    DecodeGraph,
    DecodeRows,
    position_major,
    update_tables,
)
from onecat.runtime.engine.draft_graph import DraftGraph
from onecat.runtime.engine.prompt_graphs import PromptGraphs, supports_prompt_graphs
from onecat.runtime.engine.sequence import Sequence
from onecat.runtime.engine.speculative import SpeculativeConfig
from onecat.runtime.layers import fusion
from onecat.runtime.layers.attention import PagedAttention
from onecat.runtime.layers.draft_head import quantized_draft_head
from onecat.runtime.models.qwen3_5 import GatedDeltaNet, Qwen3_5ForCausalLM, fold_shared_experts

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 64 << 20
"""KV cache size on CPU unless ``num_kv_blocks`` is given."""
GRAPH_RESERVE_BYTES = 512 << 20
"""GPU memory kept free for CUDA graph pools and allocator slack."""
SAMPLING_BYTES_PER_LOGIT = 16
"""GPU memory reserved for sampling per sequence and vocabulary entry (logits in fp32 and
their softmax, sort and mask temporaries)."""
MIN_GRAPH_BLOCKS = 16


def pass_name(runner: object) -> str:
    """How ``runner`` (a ModelRunner or a TensorParallelRunner) computed its last pass
    (decode graph, piecewise graphs, eager), for error reports."""
    return getattr(runner, "last_pass", "") or "forward"


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


class ModelRunner:
    """Owns the model, its KV cache and GDN states, and runs scheduled batches."""

    def __init__(self, config: EngineConfig, model: Qwen3_5ForCausalLM) -> None:
        self.model = model.eval()
        self.model_config = model.config
        self.device = model.model.embed_tokens.weight.device
        self.dtype = model.model.embed_tokens.weight.dtype
        self.block_size = config.kv_block_size
        self.kv_cache_dtype = capacity.check_kv_cache_dtype(config.kv_cache_dtype)
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.attention = [m for m in model.modules() if isinstance(m, PagedAttention)]
        self.gdn = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
        self.use_graphs = self.device.type == "cuda" and not config.enforce_eager
        speculation = SpeculativeConfig.parse(config.speculative_config)
        self.num_drafts = speculation.num_speculative_tokens if speculation else 0
        if self.num_drafts and model.mtp is not None and model.draft_head is None:
            model.draft_head = quantized_draft_head(model.lm_head)  # before memory planning: it counts
        fold_shared_experts(model)  # MoE: the shared expert joins the routed ones' grouped launches
        wanted_len = config.max_model_len or self.model_config.max_position_embeddings
        self.num_checkpoints = 0  # set by _plan_memory
        self.num_blocks, self.num_slots = self._plan_memory(config, wanted_len)
        self.num_blocks, self.num_slots, self.num_checkpoints = min_over_ranks(  # TP: all agree
            self.num_blocks, self.num_slots, self.num_checkpoints
        )
        plan = dataclasses.replace(self.cache_plan, num_blocks=self.num_blocks, num_slots=self.num_slots,
                                   num_checkpoints=self.num_checkpoints)
        capacity.check_fits(plan, config.max_model_len, tensor_parallel_size=config.tensor_parallel_size,
                            kv_cache_dtype=config.kv_cache_dtype)
        self.max_model_len = min(wanted_len, self.num_blocks * self.block_size)
        self.num_draft_rows = self.num_slots * self.num_drafts  # a GDN state row per slot and draft position
        self._allocate()
        self.graphs: dict[tuple[int, int, int], DecodeGraph] = {}
        self.prompt_graphs: PromptGraphs | None = None  # captured by warmup()
        self.graph_pool = None
        self.graph_batch_sizes = [1 << i for i in range(int(math.log2(self.num_slots)) + 1)]
        if self.graph_batch_sizes[-1] < self.num_slots:
            self.graph_batch_sizes.append(self.num_slots)
        self.last_pass = ""  # how the last pass ran, for error reports ("decode graph", ...)
        self._verified: tuple[DecodeGraph, list[Sequence]] | None = None  # the last verify graph and its sequences
        self.last_hidden = torch.empty(0)  # run_hidden's last result

    # --- memory ------------------------------------------------------------------------

    def block_bytes(self) -> int:
        """Bytes of one KV block over all full-attention layers (keys and values)."""
        return self.cache_shape().block_bytes

    def slot_bytes(self) -> int:
        """Bytes of one sequence's conv and recurrent states over all GDN layers."""
        return self.cache_shape().slot_bytes

    def cache_shape(self) -> capacity.CacheShape:
        """What a KV block and a state slot cost on this device (``capacity.plan_caches``'s input)."""
        return capacity.model_cache_shape(self.model, self.block_size, self.kv_cache_dtype, self.num_drafts)

    def _plan_memory(self, config: EngineConfig, max_len: int) -> tuple[int, int]:
        shape = self.cache_shape()
        wants_checkpoints = config.enable_prefix_caching and bool(self.gdn)
        if self.device.type != "cuda" and config.kv_cache_memory_bytes is None:
            slots = config.max_num_seqs
            per_seq_blocks = shape.blocks_for(max_len)
            self.num_checkpoints = min(slots, MAX_STATE_CHECKPOINTS) if wants_checkpoints else 0
            if not shape.block_bytes:  # only linear attention: blocks are bookkeeping
                blocks = config.num_kv_blocks or slots * per_seq_blocks
            else:
                blocks = config.num_kv_blocks or max(
                    per_seq_blocks, min(CPU_KV_CACHE_BYTES // shape.block_bytes, slots * per_seq_blocks)
                )
            plan = capacity.CachePlan(0, blocks, slots, self.num_checkpoints, slots, shape)
            self.cache_plan = dataclasses.replace(plan, budget=plan.allocated_bytes)  # no budget: what it takes
            return blocks, slots
        if self.device.type == "cuda":
            budget = self._gpu_cache_budget(config, max_len)
        else:
            budget = config.kv_cache_memory_bytes
        plan = capacity.plan_caches(budget, shape, max_num_seqs=config.max_num_seqs, max_len=max_len,
                                    prefix_caching=wants_checkpoints, num_kv_blocks=config.num_kv_blocks)
        if plan.num_slots < config.max_num_seqs:
            logger.warning(
                "GDN states of %d sequences would take %.1f GiB; serving at most %d at a time "
                "(lower --max-num-seqs to silence this)",
                config.max_num_seqs, config.max_num_seqs * shape.per_slot_bytes / 2**30, plan.num_slots,
            )
        self.cache_plan = plan
        self.num_checkpoints = plan.num_checkpoints
        return plan.num_blocks, plan.num_slots

    def _gpu_cache_budget(self, config: EngineConfig, max_len: int) -> int:
        """Bytes for the caches on this GPU: ``kv_cache_memory_bytes`` when given (refused when
        it exceeds what the weights and the runtime's reserves leave), else what
        ``gpu_memory_utilization`` leaves after them."""
        gc.collect()  # garbage in cycles would count as this model's memory
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self._profile_run(min(config.max_num_batched_tokens, max_len))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        others = total - free - torch.cuda.memory_reserved(self.device)
        sampling = config.max_num_seqs * self.model_config.vocab_size * SAMPLING_BYTES_PER_LOGIT
        # the piecewise prompt graphs keep about one pass's activations in their own pool
        prompt_graphs = peak - before if self.use_graphs and supports_prompt_graphs(self.model) else 0
        reserved = others + peak + prompt_graphs + sampling + GRAPH_RESERVE_BYTES
        if config.kv_cache_memory_bytes is not None:
            if config.kv_cache_memory_bytes > total - reserved:
                raise OnecatError(
                    f"--kv-cache-memory-bytes {config.kv_cache_memory_bytes} ({capacity.gib(config.kv_cache_memory_bytes)}) "
                    f"does not fit: the weights, activations and runtime reserves take {capacity.gib(reserved)} of "
                    f"this GPU's {capacity.gib(total)}, leaving {capacity.gib(max(0, total - reserved))}; lower it"
                )
            return config.kv_cache_memory_bytes
        usable = int(total * config.gpu_memory_utilization)
        if usable - reserved <= 0:
            raise OnecatError(capacity.no_room_message(
                reserved, usable, "the weights, activations and runtime reserves (measured)",
                tensor_parallel_size=config.tensor_parallel_size, kv_cache_dtype=config.kv_cache_dtype))
        return usable - reserved

    @torch.inference_mode()
    def _profile_run(self, num_tokens: int) -> None:
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        chunk = PrefillChunk(0, num_tokens, 0, torch.zeros(1, dtype=torch.int64, device=self.device), 0)
        set_context(ForwardContext(slot_mapping=positions, prefills=[chunk]))
        try:
            hidden = self.model(ids, positions)
            self.model.compute_logits(hidden[-self.max_num_seqs :])
        finally:
            set_context(None)

    def _allocate(self) -> None:
        cfg = self.model_config
        # one scratch block and one scratch slot beyond the pools, for CUDA-graph padding rows;
        # the state checkpoints' rows after the scratch slot
        # (--kv-cache-dtype: fp8_e5m2 stores uint8 codes, int8 stores int8 codes and an fp32
        # scale per token and KV head beside them; onecat.kernels.kv_cache)
        kv = torch.zeros(
            2, len(self.attention), self.num_blocks + 1, self.block_size,
            cfg.num_key_value_heads, cfg.head_dim, dtype=kv_cache.storage_dtype(self.kv_cache_dtype, self.dtype),
            device=self.device,
        )  # fmt: skip
        scales = None
        if capacity.kv_scale_bytes(self.kv_cache_dtype):
            scales = torch.zeros(2, len(self.attention), self.num_blocks + 1, self.block_size, cfg.num_key_value_heads,
                                 dtype=kv_cache.SCALE_DTYPE, device=self.device)  # fmt: skip
        for i, layer in enumerate(self.attention):
            layer.k_cache, layer.v_cache = kv[0, i], kv[1, i]
            layer.k_scale, layer.v_scale = (scales[0, i], scales[1, i]) if scales is not None else (None, None)
        if self.attention:
            kv_bytes = kv.numel() * kv.element_size() + (scales.numel() * scales.element_size() if scales is not None else 0)
            logger.info(
                "KV cache: %d blocks of %d tokens = %d tokens (max model len %d) in %s (%s, %s per device)",
                self.num_blocks, self.block_size, self.num_blocks * self.block_size, self.max_model_len,
                self.kv_cache_dtype, kv_cache.storage_dtype(self.kv_cache_dtype, self.dtype), capacity.gib(kv_bytes),
            )  # fmt: skip
        # the GDN states of all layers of one shape live in one tensor (layer first), so that
        # copying or zeroing rows is a few launches whatever the depth
        rows = self.num_slots + 1 + self.num_checkpoints + self.num_draft_rows
        by_shape: dict[tuple[int, ...], list[GatedDeltaNet]] = {}
        for layer in self.gdn:
            shape = (layer.conv_dim, layer.conv1d.weight.shape[1] - 1, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)
            by_shape.setdefault(shape, []).append(layer)
        self.state_groups: list[tuple[torch.Tensor, torch.Tensor]] = []
        for (conv_dim, taps, heads, dk, dv), layers in by_shape.items():
            conv = torch.zeros(len(layers), rows, conv_dim, taps, dtype=self.dtype, device=self.device)
            rec = torch.zeros(len(layers), rows, heads, dk, dv, dtype=torch.float32, device=self.device)
            for i, layer in enumerate(layers):
                layer.conv_state, layer.recurrent_state = conv[i], rec[i]
            self.state_groups.append((conv, rec))

    # --- running a batch ---------------------------------------------------------------

    def _reset_fresh_slots(self, seqs: list[Sequence]) -> None:
        fresh = [s.state_slot for s in seqs if s.fresh_slot]
        if not fresh:
            return
        index = to_device(fresh, torch.int64, self.device)
        for conv, rec in self.state_groups:
            conv.index_fill_(1, index, 0)
            rec.index_fill_(1, index, 0)
        for s in seqs:
            s.fresh_slot = False

    def _copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy GDN conv + recurrent states from row ``src`` to row ``dst`` for each pair."""
        if not pairs or not self.gdn:
            return
        src = to_device([p[0] for p in pairs], torch.int64, self.device)
        dst = to_device([p[1] for p in pairs], torch.int64, self.device)
        for conv, rec in self.state_groups:
            conv.index_copy_(1, dst, conv.index_select(1, src))
            rec.index_copy_(1, dst, rec.index_select(1, src))

    def _slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _graph_fits(self, batch: int) -> bool:
        return batch <= self.graph_batch_sizes[-1]

    @torch.inference_mode()
    def run(
        self, scheduled: list[tuple[Sequence, int]], input_tokens: torch.Tensor | None = None
    ) -> tuple[list[Sequence], torch.Tensor]:
        """Compute the scheduled tokens; returns the sequences that completed their pending
        tokens (and now need a sample) and their logits ``[n, vocab]``.

        A step of decode tokens only replays a whole-model decode graph; a step with prompt
        tokens runs one pass over all of them (piecewise graphs where a bucket fits).
        ``input_tokens`` (a step of decode entries only): their input tokens as a device
        tensor, one per entry, in place of the sequences' newest token ids (the engine's
        overlapped steps: those are still being sampled)."""
        seqs = [seq for seq, _ in scheduled]
        self._prepare_states(seqs)
        logits = None
        if self.use_graphs and all(count == 1 for _, count in scheduled) and self._graph_fits(len(seqs)):
            graph = self._run_graph(scheduled, 1, input_tokens)
            if graph is not None:
                logits, sampled = graph.logits[: len(seqs)], seqs
        if logits is None:
            sampled, logits = self._run_eager(scheduled, input_tokens)
        self._save_checkpoints(scheduled)
        return sampled, logits

    def _prepare_states(self, seqs: list[Sequence]) -> None:
        """Before a pass: prefix-cache hits get their checkpoint, new slots are zeroed."""
        self._copy_states([(s.restore_from, s.state_slot) for s in seqs if s.restore_from is not None])
        self._reset_fresh_slots(seqs)

    def _save_checkpoints(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """After a pass: the prefix-cache checkpoints at the end of a computed chunk are copied
        out of the slot (those inside a chunk were written during the pass)."""
        self._copy_states([
            (seq.state_slot, save.row) for seq, count in scheduled for save in seq.saves
            if save.boundary == seq.num_computed_tokens + count
        ])  # fmt: skip

    def _run_eager(
        self, scheduled: list[tuple[Sequence, int]], input_tokens: torch.Tensor | None = None
    ) -> tuple[list[Sequence], torch.Tensor]:
        hidden, firsts = self._forward(scheduled, input_tokens)
        done = [(seq, first + count - 1) for (seq, count), first in zip(scheduled, firsts, strict=True)
                if seq.num_computed_tokens + count == seq.num_tokens]
        rows = to_device([row for _, row in done], torch.int64, self.device)
        return [seq for seq, _ in done], self.model.compute_logits(hidden[rows])

    def _is_decode(self, seq: Sequence, count: int) -> bool:
        """A decode entry: one token, or the pending token and its drafts (speculative decoding)."""
        return count == 1 or seq.num_computed_tokens == seq.num_tokens - 1

    def _draft_row(self, seq: Sequence, position: int) -> int:
        """The GDN state row that holds ``seq``'s state after chunk position ``position`` of a
        verify pass (0: its pending token; the last verified position writes the slot itself)."""
        return self.num_slots + 1 + self.num_checkpoints + seq.state_slot * self.num_drafts + position

    def _decode_rows(self, entries: list[tuple[Sequence, int]], positions: int) -> DecodeRows:
        """The decode rows of ``entries``: ``positions`` rows per sequence, its ``count``
        tokens then padding. Row ``j`` reads the GDN state row that row ``j - 1`` wrote (the
        slot for ``j = 0``) and writes ``_draft_row(seq, j)``, or the slot at the sequence's
        last token; padding rows write a scratch KV slot and state row."""
        rows = DecodeRows()
        scratch_kv, scratch_state = self.num_blocks * self.block_size, self.num_slots
        for seq, count in entries:
            start, src = seq.num_computed_tokens, seq.state_slot
            tokens = seq.chunk_token_ids(start, count)
            for j in range(positions):
                if j < count:
                    dst = seq.state_slot if j == count - 1 else self._draft_row(seq, j)
                    rows.ids.append(tokens[j])
                    rows.positions.append(start + j)
                    rows.kv_slots.append(self._slot(seq, start + j))
                    rows.context_lens.append(start + j + 1)
                else:
                    dst = scratch_state
                    rows.ids.append(0)
                    rows.positions.append(start)
                    rows.kv_slots.append(scratch_kv)
                    rows.context_lens.append(1)
                rows.state_src.append(src)
                rows.state_dst.append(dst)
                rows.tables.append(seq.block_table)
                src = dst
        return rows

    def _forward(
        self, scheduled: list[tuple[Sequence, int]], input_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """Final hidden states ``[T, hidden]`` of every scheduled token (piecewise graphs when
        a bucket fits, else eager) and each entry's first row. Decode entries come first, each
        padded to the widest (speculative decoding: 1 + drafts rows); their rows follow each
        other. On a GPU with prompt graphs the tensor is a view of their buffer: valid until
        the next pass. ``input_tokens``: see :meth:`run` (one-token decode entries only)."""
        as_tensor = lambda values: to_device(values, torch.int64, self.device)  # noqa: E731
        decoding = [i for i, (seq, count) in enumerate(scheduled) if self._is_decode(seq, count)]
        positions_per_seq = max((scheduled[i][1] for i in decoding), default=1)
        rows = self._decode_rows([scheduled[i] for i in decoding], positions_per_seq)
        ids, positions, slots = rows.ids, rows.positions, rows.kv_slots
        firsts = [0] * len(scheduled)
        for b, i in enumerate(decoding):
            firsts[i] = b * positions_per_seq
        prefills: list[PrefillChunk] = []
        for i, (seq, count) in enumerate(scheduled):
            if i in decoding:
                continue
            start = seq.num_computed_tokens
            firsts[i] = len(ids)
            inside = tuple((save.boundary - start, save.row) for save in seq.saves if save.boundary < start + count)
            prefills.append(PrefillChunk(len(ids), count, start, as_tensor(seq.block_table), seq.state_slot, inside))
            ids.extend(seq.chunk_token_ids(start, count))
            positions.extend(range(start, start + count))
            slots.extend(self._slot(seq, p) for p in range(start, start + count))
        ctx = ForwardContext(slot_mapping=as_tensor(slots), prefills=prefills)
        if decoding:
            width = max(len(t) for t in rows.tables)
            ctx.num_decodes = len(rows.state_src)
            ctx.decode_width = positions_per_seq
            ctx.decode_block_tables = as_tensor([t + [self.num_blocks] * (width - len(t)) for t in rows.tables])
            ctx.decode_context_lens = as_tensor(rows.context_lens)
            ctx.decode_state_slots = as_tensor(position_major(rows.state_src, positions_per_seq))
            if positions_per_seq > 1:
                ctx.decode_state_dst = as_tensor(position_major(rows.state_dst, positions_per_seq))
        ids = as_tensor(ids)
        if input_tokens is not None:
            ids[: input_tokens.shape[0]] = input_tokens
        graphs = self.prompt_graphs
        kind = f"{len(prefills)} prompt chunk(s), {ctx.num_decodes} decode row(s)"
        if graphs is not None and graphs.bucket(len(ids)) is not None:
            self.last_pass = f"piecewise CUDA graphs ({kind}, bucket {graphs.bucket(len(ids))})"
            return graphs.run(ids, as_tensor(positions), ctx), firsts
        self.last_pass = f"eager ({kind})"
        set_context(ctx)
        try:
            return self.model(ids, as_tensor(positions)), firsts
        finally:
            set_context(None)

    # --- speculative decoding (the MTP head drafts, the model verifies) -----------------

    @torch.inference_mode()
    def run_hidden(
        self, scheduled: list[tuple[Sequence, int]]
    ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """Like :meth:`run`, but returns the final hidden states of every scheduled token
        (``[T, hidden]``, a copy), each entry's first row and, when a decode graph ran, the
        logits of every row (else None: the caller gets the rows it needs from
        :meth:`hidden_logits`). Speculative
        decoding verifies drafts with the logits of several rows and feeds the MTP head the
        hidden states. A verify chunk (pending token + drafts) leaves the GDN state after each
        of its positions in its own row: :meth:`accept_drafts` then puts the right one in the
        slot. A step of decode entries only replays a decode graph of ``1 + drafts`` rows per
        sequence."""
        seqs = [seq for seq, _ in scheduled]
        self._prepare_states(seqs)
        result, self._verified = None, None
        if self.use_graphs and all(self._is_decode(*entry) for entry in scheduled) and self._graph_fits(len(seqs)):
            width = 1 if all(count == 1 for _, count in scheduled) else 1 + self.num_drafts
            graph = self._run_graph(scheduled, width)
            if graph is not None:
                result = graph.hidden.clone(), [b * width for b in range(len(seqs))], graph.logits
                self._verified = (graph, seqs) if graph.draft is not None else None
        if result is None:
            hidden, firsts = self._forward(scheduled)
            result = hidden.clone(), firsts, None
        self.last_hidden = result[0]  # tensor parallel: workers draft from their own copy
        self._save_checkpoints(scheduled)
        return result

    @torch.inference_mode()
    def hidden_logits(self, rows: list[int]) -> torch.Tensor:
        """Logits ``[len(rows), vocab]`` of rows ``rows`` of the last :meth:`run_hidden`'s
        hidden states (when it returned none). Under tensor parallelism every rank computes
        them (``TensorParallelRunner.hidden_logits``): ``lm_head`` is split over the vocabulary."""
        return self.model.compute_logits(self.last_hidden[to_device(rows, torch.int64, self.device)])

    def accept_drafts(self, accepted: list[tuple[Sequence, int]]) -> None:
        """After a verify pass: each ``(seq, k)`` kept ``k`` drafts, fewer than its chunk held,
        so its slot gets the GDN state after the ``k``-th draft (position ``k`` of the chunk)."""
        self._copy_states([(self._draft_row(seq, k), seq.state_slot) for seq, k in accepted])

    @torch.inference_mode()
    def propose(self, items: list[tuple[Sequence, int, torch.Tensor, bool]], num_drafts: int) -> list[list[int]]:
        """Run the MTP head and draft tokens greedily.

        Each item ``(seq, start, hidden, draft)``: the head reads ``hidden [n, H]`` (the
        model's final hidden states at positions ``start .. start + n - 1``) with the tokens
        that follow them (``seq.token_ids[start + 1 .. start + n]``, all known), writing its
        KV cache there; if ``draft``, the last position's output yields the first draft and
        ``num_drafts - 1`` more steps feed the head its own output and draft. The sequence's
        blocks must cover ``start + n - 1 + num_drafts`` tokens. Returns the drafts per item
        (empty where ``draft`` is False). After a verify graph, its draft graph does it all
        (``draft_graph.py``)."""
        drafts = self._propose_with_graph(items, num_drafts)
        if drafts is not None:
            return drafts
        embed = self.model.model.embed_tokens
        as_tensor = lambda values: to_device(values, torch.int64, self.device)  # noqa: E731
        chunks = [(seq, list(range(start, start + h.shape[0]))) for seq, start, h, _ in items]
        hidden = torch.cat([h for _, _, h, _ in items])
        ids = [seq.token_ids[p + 1] for seq, positions in chunks for p in positions]
        out = self._run_mtp(chunks, as_tensor(ids), hidden, embed)
        drafts: list[list[int]] = [[] for _ in items]
        ends = list(itertools.accumulate(h.shape[0] for _, _, h, _ in items))
        active = [i for i, item in enumerate(items) if item[3]]
        if not active or num_drafts == 0:
            return drafts
        last = out[to_device([ends[i] - 1 for i in active], torch.int64, self.device)]
        positions = [items[i][1] + items[i][2].shape[0] - 1 for i in active]
        steps = []  # draft tokens stay on the device until the last step: one read at the end
        for step in range(num_drafts):
            steps.append(self.model.compute_draft_logits(last).argmax(dim=-1))
            if step + 1 == num_drafts:
                break
            positions = [p + 1 for p in positions]
            chunks = [(items[i][0], [p]) for i, p in zip(active, positions, strict=True)]
            last = self._run_mtp(chunks, steps[-1], last, embed)
        for i, tokens in zip(active, torch.stack(steps, dim=1).tolist(), strict=True):
            drafts[i] = tokens
        return drafts

    def _propose_with_graph(
        self, items: list[tuple[Sequence, int, torch.Tensor, bool]], num_drafts: int
    ) -> list[list[int]] | None:
        """:meth:`propose` by replaying the draft graph of the verify graph that just ran, when
        every item is one of its sequences; else None."""
        verified, self._verified = self._verified, None
        if verified is None or num_drafts != self.num_drafts:
            return None
        graph, seqs = verified
        index = {seq.state_slot: b for b, seq in enumerate(seqs)}  # (workers get copies of the sequences)
        if any(item[0].state_slot not in index for item in items):
            return None
        by_batch = {index[item[0].state_slot]: item for item in items}
        sequences = []
        for b, seq in enumerate(seqs):
            item = by_batch.get(b)
            if item is None:  # finished or not drafting: scratch rows
                sequences.append(([], 0, []))
                continue
            _, start, hidden, draft = item
            kept = hidden.shape[0]
            rows = [(seq.token_ids[p + 1], p, self._slot(seq, p), p + 1) for p in range(start, start + kept)]
            last = start + kept - 1
            chain = [(p, self._slot(seq, p), p + 1) for p in range(last + 1, last + num_drafts)] if draft else []
            sequences.append((rows, kept - 1, chain))
        draft = graph.draft
        pad = graph.batch - len(seqs)
        tables = [seq.block_table for seq in seqs for _ in range(draft.positions_per_seq)]
        update_tables(graph, tables + [[self.num_blocks]] * (pad * draft.positions_per_seq))
        drafts = draft.run(draft.host_inputs(sequences))
        return [drafts[index[item[0].state_slot]] if item[3] else [] for item in items]

    def _run_mtp(
        self, chunks: list[tuple[Sequence, list[int]]], next_ids: torch.Tensor, hidden: torch.Tensor, embed: torch.nn.Module
    ) -> torch.Tensor:
        """One pass of the MTP head over consecutive positions of each sequence (its attention
        reads and writes the head's KV layer through the sequence's block table)."""
        prefills: list[PrefillChunk] = []
        slots: list[int] = []
        positions: list[int] = []
        for seq, chunk_positions in chunks:
            prefills.append(PrefillChunk(len(positions), len(chunk_positions), chunk_positions[0],
                                         to_device(seq.block_table, torch.int64, self.device), seq.state_slot))
            positions += chunk_positions
            slots += [self._slot(seq, p) for p in chunk_positions]
        set_context(ForwardContext(slot_mapping=to_device(slots, torch.int64, self.device), prefills=prefills))
        try:
            return self.model.mtp(to_device(positions, torch.int64, self.device), hidden, embed(next_ids))
        finally:
            set_context(None)

    def warmup(self) -> None:
        """Capture the decode graphs of every batch-size bucket now (at the smallest KV
        width), so that serving does not pause to capture them when traffic first reaches
        a batch size. A no-op without CUDA graphs."""
        if not self.use_graphs:
            return
        for positions in [1] + ([1 + self.num_drafts] if self.num_drafts else []):
            for batch in self.graph_batch_sizes:
                if self._graph_for(batch, positions, 1) is None:
                    break
        if self.use_graphs and supports_prompt_graphs(self.model):
            graphs = PromptGraphs(self.model, self.max_num_batched_tokens, self.graph_pool)
            reserved = torch.cuda.memory_reserved(self.device)
            try:
                graphs.capture()
            except Exception as exc:  # stay correct: prompt passes run eagerly
                logger.warning("CUDA graph capture of prompt passes failed (%s); running them eagerly", exc)
                graphs.release()
            else:
                self.prompt_graphs, self.graph_pool = graphs, graphs.pool
                logger.info(
                    "captured prompt-pass graphs for %d token buckets (up to %d tokens): %.0f MiB",
                    len(graphs.buckets), graphs.size, (torch.cuda.memory_reserved(self.device) - reserved) / 2**20,
                )
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # what the capture stream's warm-ups freed goes back to the device

    def _graph_for(self, batch: int, positions: int, blocks: int) -> DecodeGraph | None:
        bucket = next(b for b in self.graph_batch_sizes if b >= batch)
        max_width = -(-self.max_model_len // self.block_size)
        if all(layer.uses_decode_kernel() for layer in self.attention):
            width = max_width  # the kernel's work follows the context lengths, not the width
        else:  # the torch path gathers the whole width: key graphs by a power-of-two width
            width = min(next_power_of_two(max(blocks, MIN_GRAPH_BLOCKS)), next_power_of_two(max_width))
        key = (bucket, positions, width)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(bucket, positions, width)
            except Exception as exc:  # stay correct: decode eagerly from now on
                logger.warning("CUDA graph capture failed (%s); decoding without graphs", exc)
                self.use_graphs = False
                return None
        return self.graphs[key]

    def release_graphs(self) -> None:
        """Free the captured decode graphs and their memory pool (they are captured again on
        next use). NCCL cannot be torn down while graphs that hold its collectives live."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for graph in self.graphs.values():
            graph.graph.reset()
            if graph.draft is not None:
                graph.draft.graph.reset()
        self.graphs.clear()
        if self.prompt_graphs is not None:
            self.prompt_graphs.release()
            self.prompt_graphs = None
        self.graph_pool = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _capture(self, batch: int, positions: int, width: int) -> DecodeGraph:
        graph = DecodeGraph(
            batch, positions, width, self.device,
            scratch_slot=self.num_blocks * self.block_size,
            scratch_block=self.num_blocks,
            scratch_state=self.num_slots,
        )
        def forward() -> tuple[torch.Tensor, torch.Tensor]:
            set_context(graph.context())  # fresh each time: nothing computed before is reused
            hidden = self.model(graph.input_ids, graph.positions)
            return hidden, self.model.compute_logits(hidden)

        try:
            # the warm-ups tune, load and compile kernels and allocate their workspaces
            with fusion.compiling():
                graph.hidden, graph.logits = graph_capture.capture(graph.graph, self.graph_pool, forward, warmups=2)
            self.graph_pool = graph.graph.pool()
        finally:
            set_context(None)
        if positions > 1 and self.model.mtp is not None:
            graph.draft = DraftGraph(self.model, graph.hidden, graph.block_tables, batch, positions,
                                     self.num_drafts, scratch_slot=self.num_blocks * self.block_size)
            graph.draft.capture(self.graph_pool)
        return graph

    def _run_graph(
        self, entries: list[tuple[Sequence, int]], positions: int, input_tokens: torch.Tensor | None = None
    ) -> DecodeGraph | None:
        """Replay the decode graph of ``positions`` rows per sequence for ``entries`` (decode
        entries); returns it (its ``hidden`` and ``logits`` rows follow the entries), or None
        when no graph could be captured. ``input_tokens``: see :meth:`run` (``positions`` 1)."""
        batch = len(entries)
        graph = self._graph_for(batch, positions, max(len(s.block_table) for s, _ in entries))
        if graph is None:
            return None
        rows = self._decode_rows(entries, positions)
        pad = (graph.batch - batch) * positions  # padding rows point at the scratch block and slot
        host = [column + [value] * pad for column, value in zip(rows.columns(), graph.scratch, strict=True)]
        host[4:] = [position_major(column, positions) for column in host[4:]]  # GDN state rows
        graph.inputs.copy_(to_device(host, torch.int64, graph.inputs.device))
        if input_tokens is not None:
            graph.input_ids[:batch].copy_(input_tokens)
        update_tables(graph, rows.tables + [[self.num_blocks]] * pad)
        graph.graph.replay()
        self.last_pass = f"decode CUDA graph ({graph.batch} sequences x {positions} row(s))"
        return graph
