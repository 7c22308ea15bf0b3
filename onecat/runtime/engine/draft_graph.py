"""The MTP head's drafting as one CUDA graph, replayed after a verify graph (speculative decoding).

Drafting eagerly costs more than the head's GPU work: per draft step a pass of the head
(fusion, one attention decoder layer, ``lm_head``, argmax) is ~60 kernel launches, and three
steps took 7.2 ms on the 27B shape against a 9.4 ms decode step (H200, compute_70 PTX). So a
verify graph of ``B`` sequences x ``K = 1 + N`` rows gets a draft graph that does, in one
replay:

1. one pass of the head over the verify rows: row ``j`` of a sequence reads the model's
   hidden state at position ``start + j`` (the verify graph's static output, no copy) and
   the token at ``start + j + 1`` (a kept draft or the new token), writing the head's KV there;
   rows past the kept ones, and sequences that draft nothing, are pointed at the scratch KV
   slot and leave no trace;
2. per sequence, the output row of its last kept position gives the first draft (``lm_head``
   and argmax on the GPU);
3. ``N - 1`` more passes of one row per sequence, each reading the previous pass's output and
   draft, at the next position.

All rows are decode rows (the attention kernel reads each row's blocks up to its own
position), so nothing depends on how many drafts were kept except the inputs: one int64
buffer holds them all (one host-to-device copy), and the drafts ``[B, N]`` come back in one
read.
"""

from __future__ import annotations

import torch

from onecat.kernels.workspace import to_device
from onecat.runtime.context import ForwardContext, set_context
from onecat.runtime.engine import graph_capture
from onecat.runtime.layers import fusion
from onecat.runtime.models.qwen3_5 import Qwen3_5ForCausalLM


class DraftGraph:
    """Static inputs, the captured drafting of a verify graph's sequences, and its drafts.

    ``hidden [B*K, H]`` and ``tables [B*K, W]`` are the verify graph's static buffers (its
    final hidden states and block tables, row ``b*K + j``)."""

    def __init__(
        self, model: Qwen3_5ForCausalLM, hidden: torch.Tensor, tables: torch.Tensor, batch: int,
        positions: int, num_drafts: int, scratch_slot: int,
    ) -> None:
        self.model, self.hidden, self.tables = model, hidden, tables
        self.batch, self.positions_per_seq, self.num_drafts = batch, positions, num_drafts
        rows, chain = batch * positions, (num_drafts - 1) * batch
        self.scratch_slot = scratch_slot
        self.inputs = torch.zeros(4 * rows + 3 * chain + batch, dtype=torch.int64, device=hidden.device)
        self.first = self.inputs[: 4 * rows].view(4, rows)  # ids, positions, KV slots, context lengths
        self.chain = self.inputs[4 * rows : 4 * rows + 3 * chain].view(3, num_drafts - 1, batch)  # positions, slots, lengths
        self.pick = self.inputs[4 * rows + 3 * chain :]  # the row of each sequence's last kept position
        self.graph = torch.cuda.CUDAGraph()
        self.drafts: torch.Tensor | None = None

    def forward(self) -> torch.Tensor:
        """The drafting on the static buffers: drafts ``[B, N]`` (what the graph captures)."""
        mtp, embed = self.model.mtp, self.model.model.embed_tokens
        ids, positions, slots, lengths = self.first
        try:
            set_context(ForwardContext(slot_mapping=slots, num_decodes=ids.shape[0], decode_block_tables=self.tables,
                                       decode_context_lens=lengths, capturing_graph=True))
            last = mtp(positions, self.hidden, embed(ids))[self.pick]
            tables = self.tables[:: self.positions_per_seq].contiguous()
            steps = []
            for i in range(self.num_drafts):
                steps.append(self.model.compute_draft_logits(last).argmax(dim=-1))
                if i + 1 == self.num_drafts:
                    break
                set_context(ForwardContext(slot_mapping=self.chain[1, i], num_decodes=self.batch,
                                           decode_block_tables=tables, decode_context_lens=self.chain[2, i],
                                           capturing_graph=True))
                last = mtp(self.chain[0, i], last, embed(steps[-1]))
        finally:
            set_context(None)
        return torch.stack(steps, dim=1)

    def capture(self, pool: object) -> None:
        """Warm up (kernel tuning, compilation) and capture into ``pool`` on one side stream."""
        with fusion.compiling():
            self.drafts = graph_capture.capture(self.graph, pool, self.forward, warmups=2)

    def host_inputs(self, sequences: list[tuple[list[tuple[int, int, int, int]], int, list[tuple[int, int, int]]]]) -> list[int]:
        """The flat input buffer's values. Per sequence slot of the graph (padding included):
        its first-pass rows ``(token, position, KV slot, context length)`` (up to K, the rest
        scratch), the index of its last kept row, and its chain rows ``(position, KV slot,
        context length)`` (N - 1, or none: scratch)."""
        k, n = self.positions_per_seq, self.num_drafts
        first: list[list[int]] = [[], [], [], []]
        chain: list[list[list[int]]] = [[[] for _ in range(n - 1)] for _ in range(3)]
        pick = []
        scratch_first = (0, 0, self.scratch_slot, 1)
        scratch_chain = (0, self.scratch_slot, 1)
        for b in range(self.batch):
            rows, last, steps = sequences[b] if b < len(sequences) else ([], 0, [])
            for j in range(k):
                for column, value in zip(first, rows[j] if j < len(rows) else scratch_first, strict=True):
                    column.append(value)
            pick.append(b * k + last)
            for i in range(n - 1):
                for c, value in enumerate(steps[i] if i < len(steps) else scratch_chain):
                    chain[c][i].append(value)
        flat = [v for column in first for v in column]
        flat += [v for column in chain for step in column for v in step]
        return flat + pick

    def run(self, host: list[int]) -> list[list[int]]:
        """Copy the inputs, replay, and read the drafts ``[B][N]`` back (one device read)."""
        self.inputs.copy_(to_device(host, torch.int64, self.inputs.device))
        self.graph.replay()
        return self.drafts.tolist()
