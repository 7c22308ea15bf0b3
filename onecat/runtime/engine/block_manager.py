"""KV cache blocks (full-attention layers), GDN state slots and the prefix cache over both.

KV blocks carry reference counts. A block whose tokens are all computed can be *cached*: it is
registered under its content hash (SHA-256 of its parent block's hash and its own token ids,
so a hash names the whole prefix up to the block's end) and another sequence whose tokens
start the same way takes it instead of computing it again. A block nobody holds is free; a
free cached block keeps its contents and can be revived by a lookup until it is handed out
again. Free blocks are handed out uncached ones first, then cached ones least recently freed
first (a sequence frees its blocks last block first, so a prefix outlives its tails).

GDN layers have no per-token cache: their conv + recurrent state after a prefix is one
fixed-size tensor per layer (~151 MB per sequence on the 27B). :class:`StateCheckpoints` keeps
a bounded pool of copies of such states taken at block boundaries, keyed like the KV block
that ends there, evicted least recently used. A prefix is reusable only up to a boundary
where both its KV blocks and a state checkpoint exist.

One extra block and one extra state slot exist beyond the pools' sizes as scratch space for
the padding rows of CUDA-graph batches; they are never handed out. Checkpoint rows follow the
scratch slot in the state tensors (``StateCheckpoints.first_row``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from onecat.runtime.engine.sequence import Sequence

ROOT_HASH = b"onecat-prefix-v1"
"""Parent hash of a sequence's first block."""


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """Content hash of a full block: SHA-256 over its parent's hash and its token ids (a
    cryptographic hash, so crafted prompts cannot collide with another user's prefix)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class BlockManager:
    """``num_blocks`` KV blocks of ``block_size`` tokens each, with reference counts and (when
    ``caching``) a content-hash index of computed full blocks."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._refs = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_blocks))  # free, no cached contents
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free, cached, LRU first

    @property
    def num_free(self) -> int:
        """Blocks not held by any sequence (cached ones included: they are revivable but can
        be handed out)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (held or free)."""
        return len(self._by_hash)

    # --- hashing and lookup ----------------------------------------------------------------

    def hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """Hashes of the full blocks among the first ``num_tokens`` tokens of ``seq`` (computed
        once per block and kept on the sequence: its tokens are only ever appended)."""
        full = min(num_tokens, seq.num_tokens) // self.block_size
        self._extend_hashes(seq, full)
        return seq.block_hashes[:full]

    def _extend_hashes(self, seq: Sequence, full: int) -> None:
        hashes = seq.block_hashes
        while len(hashes) < full:
            start = len(hashes) * self.block_size
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(block_hash(parent, seq.token_ids[start : start + self.block_size]))

    def cached_prefix(self, seq: Sequence, max_tokens: int) -> list[int]:
        """The cached blocks the first ``max_tokens`` tokens of ``seq`` start with (in order)."""
        if not self.caching:
            return []
        blocks = []
        for h in self.hashes(seq, max_tokens):
            block = self._by_hash.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_free_after_taking(self, blocks: list[int]) -> int:
        """Free blocks left once ``blocks`` (cached ones, possibly free now) are taken."""
        return self.num_free - sum(1 for b in blocks if self._refs[b] == 0)

    # --- allocation ------------------------------------------------------------------------

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` must add to hold its first ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """True when ``seq`` can be given blocks for ``num_tokens`` tokens now."""
        return self.blocks_needed(seq, num_tokens) <= self.num_free

    def take_cached(self, seq: Sequence, blocks: list[int]) -> None:
        """Start the (empty) block table of ``seq`` with the cached ``blocks``."""
        assert not seq.block_table
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        seq.block_table = list(blocks)
        seq.num_registered_blocks = len(blocks)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give ``seq`` the blocks it needs for ``num_tokens`` tokens (check first)."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self._allocate())

    def _allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:  # evict the least recently freed cached block
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of[block]]
            self._hash_of[block] = None
        self._refs[block] = 1
        return block

    def register(self, seq: Sequence) -> None:
        """Enter the newly completed full blocks of ``seq`` (its computed tokens) into the
        cache. A block whose content another block already holds stays unregistered (it is
        freed as uncached)."""
        # (speculative decoding commits kept drafts before they join the token ids)
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if not self.caching or full <= seq.num_registered_blocks:
            return  # most steps: a decode token that did not complete a block
        self._extend_hashes(seq, full)
        hashes = seq.block_hashes
        for i in range(seq.num_registered_blocks, full):
            block = seq.block_table[i]
            if hashes[i] not in self._by_hash and self._hash_of[block] is None:
                self._by_hash[hashes[i]] = block
                self._hash_of[block] = hashes[i]
        seq.num_registered_blocks = full

    def free(self, seq: Sequence) -> None:
        """Drop the references of ``seq`` to its blocks, last block first."""
        for block in reversed(seq.block_table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if self._hash_of[block] is None:
                    self._free.append(block)
                else:
                    self._evictable[block] = None
        seq.block_table = []
        seq.num_registered_blocks = 0


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


class StateCheckpoints:
    """A bounded pool of GDN state copies, each the state after a prefix that ends at a block
    boundary, keyed by the hash of the prefix's last block and evicted least recently used.

    Rows are numbered from ``first_row`` in the runner's state tensors. A row is *reserved*
    when a step will write it (the scheduler picks the row and the runner copies the state
    there after the forward pass) and *published* under its hash once that step has run, so
    no lookup can return a row before it holds its state. A restore copies a row into the
    sequence's own slot at the start of the step that admits the sequence, before any save of
    that step, so evicting a row in the same step is harmless.
    """

    def __init__(self, num_rows: int, first_row: int) -> None:
        self.num_rows = num_rows
        self.first_row = first_row
        self._by_hash: OrderedDict[bytes, int] = OrderedDict()  # published, LRU first
        self._free: deque[int] = deque(range(first_row, first_row + num_rows))

    def __len__(self) -> int:
        return len(self._by_hash)

    def lookup(self, key: bytes) -> int | None:
        """The row holding the state after the prefix whose last block hashes to ``key``."""
        return self._by_hash.get(key)

    def touch(self, key: bytes) -> None:
        """Mark ``key``'s checkpoint as just used."""
        self._by_hash.move_to_end(key)

    def reserve(self) -> int | None:
        """A row for a new checkpoint (evicting the least recently used one); None when the
        pool has no rows."""
        if self._free:
            return self._free.popleft()
        if not self._by_hash:
            return None
        _, row = self._by_hash.popitem(last=False)
        return row

    def publish(self, key: bytes, row: int) -> None:
        """The reserved ``row`` now holds the state after ``key``'s prefix."""
        old = self._by_hash.pop(key, None)
        if old is not None and old != row:  # the same prefix checkpointed twice: keep one
            self._free.append(old)
        self._by_hash[key] = row

    def discard(self, key: bytes) -> None:
        """Drop ``key``'s checkpoint (if still there); its row becomes free."""
        row = self._by_hash.pop(key, None)
        if row is not None:
            self._free.append(row)

    def unreserve(self, row: int) -> None:
        """Give back a reserved row whose step did not run."""
        self._free.append(row)
