"""Continuous batching with chunked prefill.

Every step gets a budget of ``max_num_batched_tokens`` tokens. Running sequences go first,
in arrival order: a decoding sequence takes one token, a sequence still prefilling takes the
next chunk of its prompt that fits the budget. Then waiting sequences are admitted while
the budget, ``max_num_seqs``, free state slots and free KV blocks allow; a long prompt is
split over several steps. When KV blocks run out, the most recently admitted running
sequence is preempted: it gives back its blocks and slot and is recomputed from scratch
later (its generated tokens are kept and prefilled again with the prompt).
"""

from __future__ import annotations

from collections import deque

from onecat.runtime.engine.block_manager import BlockManager, StateSlotPool
from onecat.runtime.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    """Decides which tokens of which sequences the next forward pass computes."""

    def __init__(
        self,
        block_manager: BlockManager,
        slots: StateSlotPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.block_manager = block_manager
        self.slots = slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self.slots.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
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

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's work: ``(sequence, number of tokens to compute)`` pairs, single-token
        (decode) entries first."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
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
            self.block_manager.grow(seq, target)
            scheduled.append((seq, count))
            budget -= count
            index += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            count = min(seq.num_pending_tokens, budget)
            target = seq.num_computed_tokens + count
            if not self.slots.num_free or not self.block_manager.can_grow(seq, target):
                break
            self.waiting.popleft()
            self.slots.allocate(seq)
            self.block_manager.grow(seq, target)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, count))
            budget -= count
        scheduled.sort(key=lambda item: item[1] != 1)  # decodes first, order otherwise kept
        return scheduled
