"""Continuous batching with chunked prefill and automatic prefix caching.

Every step gets a budget of ``max_num_batched_tokens`` tokens. Running sequences go first,
in arrival order: a decoding sequence takes one token, a sequence still prefilling takes the
next chunk of its prompt that fits the budget. Then waiting sequences are admitted while
the budget, ``max_num_seqs``, free state slots and free KV blocks allow; a long prompt is
split over several steps. When KV blocks run out, the most recently admitted running
sequence is preempted: it gives back its blocks and slot and is recomputed from scratch
later (its generated tokens are kept and prefilled again with the prompt).

Prefix caching (``BlockManager.caching``): a sequence being admitted starts after the
longest prefix of its tokens -- at most all but the last, whose logits it needs -- that
ends at a block boundary where both the KV blocks are cached and (for a model with GDN
layers) a state checkpoint exists; it takes those blocks and the runner copies the
checkpoint into its slot. Checkpoints are taken while prompts are prefilled, at block
boundaries; a prompt chunk is not cut there: the GDN layers write the states at a boundary
inside the chunk to the checkpoint's row during the pass, and one at the chunk's end is
copied from the slot after it. They are taken:

- every ``checkpoint_interval`` tokens (long documents shared by later requests lose at
  most that much work). A sequence keeps only its latest one: each replaces the previous,
  so a long prompt holds one row, not one per interval, and cannot flush the pool (of
  several interval boundaries inside one chunk only the last is written);
- where the cached KV blocks of the sequence's prefix ran out of state checkpoints at
  admission (the branching point of prompts sharing a prefix: the second request sharing a
  system prompt computes it, the third and later ones skip it);
- at the last block boundary of a prompt of at least ``checkpoint_interval`` tokens (the
  next turn of a conversation, a repeated prompt). Shorter prompts skip this one, to keep
  the pool's rows for long prefixes.

Checkpoints are few (at most three per request at a time) because each is a full copy of all GDN states (~151 MB on the 27B); the pool evicts the least recently
used one. Counters ``prefix_cache_queries`` / ``prefix_cache_hits`` count tokens looked up
and tokens found, as vLLM's do.
"""

from __future__ import annotations

import time
from collections import deque

from onecat.runtime.engine.block_manager import BlockManager, StateCheckpoints, StateSlotPool
from onecat.runtime.engine.sequence import Sequence, SequenceStatus, StateSave


class Scheduler:
    """Decides which tokens of which sequences the next forward pass computes.

    ``checkpoints`` is None for a model without GDN layers (any cached KV prefix is then
    reusable as it is)."""

    def __init__(
        self,
        block_manager: BlockManager,
        slots: StateSlotPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        checkpoints: StateCheckpoints | None = None,
        checkpoint_interval: int = 1024,
    ) -> None:
        self.block_manager = block_manager
        self.slots = slots
        self.checkpoints = checkpoints
        size = block_manager.block_size
        self.checkpoint_interval = max(size, checkpoint_interval // size * size)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.steps = 0  # steps scheduled (schedule and schedule_ahead), for /metrics
        self.prompt_steps = 0  # of them, steps that compute prompt tokens
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self.slots.free(seq)
        for save in seq.saves:
            self.checkpoints.unreserve(save.row)
        seq.saves = []
        seq.restore_from = seq.transient_key = None
        seq.checkpoint_at = []

    def _preempt(self, seq: Sequence) -> None:
        self.preemptions += 1
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.draft_token_ids.clear()
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (``reason`` "stop", "length" or "abort") and free its blocks and slot."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # --- prefix cache ----------------------------------------------------------------------

    @property
    def _caching(self) -> bool:
        return self.block_manager.caching

    def _cached_prefix(self, seq: Sequence) -> tuple[list[int], int | None, int]:
        """The cached blocks ``seq`` can start from, the checkpoint row to restore (None: none
        needed or none found) and how many blocks the KV cache alone would have given."""
        blocks = self.block_manager.cached_prefix(seq, seq.num_tokens - 1)
        if self.checkpoints is None or not blocks:
            return blocks, None, len(blocks)
        for n in range(len(blocks), 0, -1):
            row = self.checkpoints.lookup(seq.block_hashes[n - 1])
            if row is not None:
                return blocks[:n], row, len(blocks)
        return [], None, len(blocks)

    def _plan_checkpoints(self, seq: Sequence, hit: int, kv_blocks: int) -> None:
        """Where the state of ``seq`` is checkpointed during its prefill (see the module
        docstring); nothing without GDN layers or prefix caching."""
        seq.checkpoint_at = []
        if not self._caching or self.checkpoints is None or not self.checkpoints.num_rows:
            return
        n, size, interval = seq.num_tokens, self.block_manager.block_size, self.checkpoint_interval
        points = {p: True for p in range(interval, n, interval)}  # boundary -> replaced by the next
        if kv_blocks * size > hit:
            points[kv_blocks * size] = False  # the KV cache goes on here, the states did not
        last = (n - 1) // size * size
        if last >= interval:
            points[last] = False
        seq.checkpoint_at = sorted((p, transient) for p, transient in points.items() if hit < p < n)

    def _plan_saves(self, seq: Sequence, count: int) -> None:
        """The checkpoint boundaries that the next ``count`` tokens of ``seq`` reach get a row
        each (reserved now, published by :meth:`commit`), unless already cached; of several
        interval boundaries only the last is taken (each would replace the one before)."""
        start = seq.num_computed_tokens
        while seq.checkpoint_at and seq.checkpoint_at[0][0] <= start:
            seq.checkpoint_at.pop(0)
        reached = []
        while seq.checkpoint_at and seq.checkpoint_at[0][0] <= start + count:
            reached.append(seq.checkpoint_at.pop(0))
        last_interval = max((p for p, transient in reached if transient), default=None)
        for boundary, transient in reached:
            if transient and boundary != last_interval:
                continue
            key = self.block_manager.hashes(seq, boundary)[-1]
            if self.checkpoints.lookup(key) is not None:
                continue
            row = self.checkpoints.reserve()
            if row is not None:
                seq.saves.append(StateSave(boundary, row, key, transient))

    def commit(self, scheduled: list[tuple[Sequence, int]], register: bool = True) -> None:
        """After a step computed ``scheduled`` (and their ``num_computed_tokens`` advanced):
        their completed full blocks enter the prefix cache (unless ``register`` is False: an
        overlapped step's tokens are not known yet, the engine registers them later) and
        their new state checkpoints become visible."""
        for seq, _ in scheduled:
            seq.restore_from = None
            for save in seq.saves:
                self.checkpoints.publish(save.key, save.row)
                if save.transient:  # an interval checkpoint replaces the sequence's previous one
                    if seq.transient_key is not None:
                        self.checkpoints.discard(seq.transient_key)
                    seq.transient_key = save.key
            seq.saves = []
            if register:
                self.block_manager.register(seq)

    # --- scheduling --------------------------------------------------------------------

    def schedule_ahead(self, seqs: list[Sequence], ahead: list[Sequence]) -> list[tuple[Sequence, int]] | None:
        """A decode step for ``ahead`` (a subset of ``seqs``, in order), scheduled while the
        step that computes their newest tokens is still on the device: one token each, at the
        position after their computed ones. ``seqs`` must be every running sequence (the
        others finish with the step in flight). None where the regular :meth:`schedule` has
        to decide instead: requests are waiting, other sequences run, a sequence would need a
        KV block that is not free (no preemption here) or reaches a state checkpoint."""
        if self.waiting or len(seqs) != len(self.running) or set(map(id, seqs)) != set(map(id, self.running)):
            return None
        if any(seq.checkpoint_at and seq.checkpoint_at[0][0] <= seq.num_computed_tokens + 1 for seq in ahead):
            return None
        needed = sum(self.block_manager.blocks_needed(seq, seq.num_computed_tokens + 1) for seq in ahead)
        if needed > self.block_manager.num_free:
            return None
        for seq in ahead:
            self.block_manager.grow(seq, seq.num_computed_tokens + 1)
        self.steps += 1
        return [(seq, 1) for seq in ahead]

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's work: ``(sequence, number of tokens to compute)`` pairs, single-token
        (decode) entries first."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        prompt = False  # whether the step computes prompt tokens (for /metrics)
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            count = min(seq.num_pending_tokens, budget)
            target = seq.num_computed_tokens + count
            while not self.block_manager.can_grow(seq, target) and self.running[-1] is not seq:
                self._preempt(self.running[-1])
            if not self.block_manager.can_grow(seq, target):
                self._preempt(seq)  # nothing left to take blocks from
                break
            self._plan_saves(seq, count)
            self.block_manager.grow(seq, seq.num_computed_tokens + count)
            scheduled.append((seq, count))
            prompt = prompt or seq.num_computed_tokens < seq.num_prompt_tokens
            budget -= count
            index += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.slots.num_free:
                break
            blocks, row, kv_blocks = self._cached_prefix(seq)
            hit = len(blocks) * self.block_manager.block_size
            count = min(seq.num_tokens - hit, budget)
            needed = -(-(hit + count) // self.block_manager.block_size) - len(blocks)
            if needed > self.block_manager.num_free_after_taking(blocks):
                break
            self.waiting.popleft()
            self.slots.allocate(seq)
            self.block_manager.take_cached(seq, blocks)
            seq.num_computed_tokens = hit
            if row is not None:
                self.checkpoints.touch(seq.block_hashes[len(blocks) - 1])
                seq.restore_from, seq.fresh_slot = row, False
            if self._caching:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += hit
            self._plan_checkpoints(seq, hit, kv_blocks)
            self._plan_saves(seq, count)
            self.block_manager.grow(seq, hit + count)
            seq.status = SequenceStatus.RUNNING
            if seq.scheduled_at is None:  # a preempted sequence keeps its first time (vLLM)
                seq.scheduled_at = time.monotonic()
            self.running.append(seq)
            scheduled.append((seq, count))
            prompt = True
            budget -= count
        scheduled.sort(key=lambda item: item[1] != 1)  # decodes first, order otherwise kept
        if scheduled:
            self.steps += 1
            self.prompt_steps += prompt
        return scheduled
