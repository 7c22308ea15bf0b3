"""Whole-model CUDA graphs of decode steps: their static inputs and block tables.

A decode graph runs ``batch`` sequences of ``positions`` rows each: one row per sequence for
plain decoding, ``1 + N`` for a speculative verify pass (a sequence's pending token and its
N drafts, padded). The runner captures one per batch-size bucket (and width) at start and
replays it with the step's inputs copied into its static buffers (``ModelRunner._run_graph``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from onecat.kernels.workspace import to_device
from onecat.runtime.context import ForwardContext
from onecat.runtime.engine.draft_graph import DraftGraph


@dataclass
class DecodeRows:
    """Host-side inputs of a step's decode rows (``positions`` rows per sequence, sequence by
    sequence; see ``ModelRunner._decode_rows``)."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    kv_slots: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    state_src: list[int] = field(default_factory=list)
    state_dst: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)

    def columns(self) -> list[list[int]]:
        """The per-row inputs in ``DecodeGraph.inputs`` order."""
        return [self.ids, self.positions, self.kv_slots, self.context_lens, self.state_src, self.state_dst]


def position_major(values: list[int], positions: int) -> list[int]:
    """Rows of ``positions`` per sequence (sequence by sequence) reordered position by
    position: how the GDN state rows are laid out (each position's rows contiguous)."""
    return [v for j in range(positions) for v in values[j::positions]]


class DecodeGraph:
    """One captured decode step: static inputs, the graph, its hidden states and logits.

    ``batch`` sequences of ``positions`` rows each (1; with speculative decoding, 1 + drafts).
    The per-row inputs live in one ``[6, rows]`` tensor (one host-to-device copy per step).
    Block-table rows are written incrementally: ``rows`` mirrors what each row holds, and a
    step writes only the entries that changed (appended blocks, a new sequence in the row);
    entries past a sequence's blocks are never read (the kernel stops at the context length,
    the torch path masks them), so they need no clearing."""

    def __init__(
        self, batch: int, positions: int, width: int, device: torch.device, scratch_slot: int, scratch_block: int,
        scratch_state: int,
    ) -> None:
        self.batch, self.positions_per_seq, self.width = batch, positions, width
        rows = batch * positions
        self.scratch = (0, 0, scratch_slot, 1, scratch_state, scratch_state)  # a padding row's inputs
        self.inputs = torch.tensor([[v] * rows for v in self.scratch], dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.context_lens, self.state_src, self.state_dst = self.inputs
        self.block_tables = torch.full((rows, width), scratch_block, dtype=torch.int64, device=device)
        self.rows: list[list[int]] = [[scratch_block] for _ in range(rows)]
        self.graph = torch.cuda.CUDAGraph()
        self.hidden: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self.draft: DraftGraph | None = None  # speculative decoding: the MTP drafting after this graph

    def context(self) -> ForwardContext:
        return ForwardContext(
            slot_mapping=self.slot_mapping,
            num_decodes=self.batch * self.positions_per_seq,
            decode_block_tables=self.block_tables,
            decode_context_lens=self.context_lens,
            decode_state_slots=self.state_src,
            decode_state_dst=self.state_dst,
            decode_width=self.positions_per_seq,
            capturing_graph=True,
        )


def update_tables(graph: DecodeGraph, tables: list[list[int]]) -> None:
    """Write the block-table entries that differ from what the graph's rows hold."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[int] = []
    for i, table in enumerate(tables):
        held = graph.rows[i]
        start = len(held) if len(held) <= len(table) and table[: len(held)] == held else 0
        if start < len(table):
            rows.extend([i] * (len(table) - start))
            cols.extend(range(start, len(table)))
            values.extend(table[start:])
            graph.rows[i] = list(table)
    if values:
        device = graph.block_tables.device
        index = to_device([rows, cols], torch.int64, device)
        graph.block_tables[index[0], index[1]] = to_device(values, torch.int64, device)
