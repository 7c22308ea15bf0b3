"""Allocation of KV cache blocks (full-attention layers) and GDN state slots to sequences.

Both pools are free lists. A sequence holds the blocks covering its computed tokens plus
those being computed, and one state slot from its first scheduled step until it finishes,
is aborted or is preempted. One extra block and one extra slot exist beyond the pools'
sizes as scratch space for the padding rows of CUDA-graph batches; they are never handed out.
"""

from __future__ import annotations

from collections import deque

from onecat.runtime.engine.sequence import Sequence


class BlockManager:
    """``num_blocks`` KV blocks of ``block_size`` tokens each."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks not held by any sequence."""
        return len(self._free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` must add to hold its first ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """True when ``seq`` can be given blocks for ``num_tokens`` tokens now."""
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give ``seq`` the blocks it needs for ``num_tokens`` tokens (check first)."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self._free.popleft())

    def free(self, seq: Sequence) -> None:
        """Return all blocks of ``seq``."""
        self._free.extend(seq.block_table)
        seq.block_table = []


class StateSlotPool:
    """``num_slots`` per-sequence conv + recurrent state slots for the GDN layers."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))

    @property
    def num_free(self) -> int:
        """Slots not held by any sequence."""
        return len(self._free)

    def allocate(self, seq: Sequence) -> bool:
        """Give ``seq`` a slot (to be zeroed before use); False when none is free."""
        if not self._free:
            return False
        seq.state_slot = self._free.popleft()
        seq.fresh_slot = True
        return True

    def free(self, seq: Sequence) -> None:
        """Return the slot of ``seq`` (if it holds one)."""
        if seq.state_slot is not None:
            self._free.append(seq.state_slot)
            seq.state_slot = None
