"""What one forward pass needs to know about the batch, beyond the token ids.

The model runner builds a :class:`ForwardContext` per step and sets it here; attention and
Gated DeltaNet layers read it (nano-vllm passes its batch metadata the same way). A batch is
flat: ``T`` tokens of several sequences, one after another. The first ``num_decodes``
rows are decode tokens (batched; this part runs under CUDA graphs): one per sequence, or,
with speculative decoding, ``decode_width`` consecutive rows per sequence (its pending token
and its drafts, padded to the width). Each row has its own block table row, context length
and state rows, so attention treats every row as a sequence of its own, and Gated DeltaNet
runs the positions one after another, reading each position's state from the row the
previous one wrote. Each following sequence contributes a chunk of its prompt (a
:class:`PrefillChunk`, processed one sequence at a time).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillChunk:
    """One sequence's chunk of several tokens in the flat batch."""

    start: int  # index of its first token in the flat batch
    length: int  # tokens in this chunk
    num_past: int  # tokens of this sequence already in the KV cache / recurrent state
    block_table: torch.Tensor  # int64 [blocks covering num_past + length tokens]
    state_slot: int  # its GDN state slot
    # prefix-cache checkpoints inside the chunk: (tokens into the chunk, state row); the GDN
    # layers write the conv and recurrent states after that many tokens to that row
    checkpoints: tuple[tuple[int, int], ...] = ()


@dataclass
class ForwardContext:
    """Batch metadata of one forward pass (see the module docstring)."""

    slot_mapping: torch.Tensor  # int64 [T]: KV cache slot (block * block_size + offset) per token
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # int64 [B, blocks]
    decode_context_lens: torch.Tensor | None = None  # int64 [B]: tokens incl. the new one
    decode_state_slots: torch.Tensor | None = None  # int64 [B]: GDN state row each decode row reads (*)
    decode_state_dst: torch.Tensor | None = None  # int64 [B]: the row it writes (None: the one it reads) (*)
    # (*) with decode_width > 1, ordered position by position: all sequences' first rows, then their second...
    decode_width: int = 1  # decode rows per sequence (speculative decoding: 1 + drafts, padded)
    prefills: list[PrefillChunk] = field(default_factory=list)
    capturing_graph: bool = False  # CUDA-graph warm-up or capture: no reads of device data on the host
    decode_kv_mask: torch.Tensor | None = None  # [B, blocks * block_size], filled by the first attention layer
    # the prefill kernel's chunk description per (group, fresh keys), built by the first attention layer
    prefill_attention: dict = field(default_factory=dict)


_CONTEXT: ForwardContext | None = None


def set_context(context: ForwardContext | None) -> None:
    """Make ``context`` the batch metadata of the next forward pass (None clears it)."""
    global _CONTEXT
    _CONTEXT = context


def get_context() -> ForwardContext:
    """The current batch metadata; raises if the runner set none."""
    if _CONTEXT is None:
        raise RuntimeError("no forward context: the model runs only inside the model runner")
    return _CONTEXT
