"""A request as the engine tracks it: its tokens, how far they are computed, its cache."""

from __future__ import annotations

import enum
import time
from typing import NamedTuple

import torch

from onecat.runtime.engine.detokenizer import IncrementalDetokenizer
from onecat.runtime.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"  # queued, holds no KV blocks and no state slot
    RUNNING = "running"  # scheduled: holds KV blocks and a GDN state slot
    FINISHED = "finished"


class StateSave(NamedTuple):
    """A GDN state checkpoint taken during the next step: the state after ``boundary`` tokens
    goes to checkpoint row ``row``, published under ``key`` (``transient``: an interval
    checkpoint, which replaces the sequence's previous one)."""

    boundary: int
    row: int
    key: bytes
    transient: bool


class Sequence:
    """The prompt plus generated tokens of one request.

    ``num_computed_tokens`` counts tokens whose keys/values are in the KV cache and whose
    effect is in the GDN state; the next step computes from there (a prompt chunk, or the
    single newest token when decoding). ``block_table`` lists its KV blocks in order;
    ``state_slot`` is its GDN state slot (``fresh_slot`` asks the runner to zero it first).

    Prefix caching: ``block_hashes`` are the content hashes of its full blocks (filled lazily
    by the block manager), of which the first ``num_registered_blocks`` have been offered to
    the cache. ``checkpoint_at`` lists the block boundaries (token counts) at which its GDN
    state is to be checkpointed while its prompt is prefilled. For the next step only:
    ``restore_from`` is the checkpoint row the runner copies into ``state_slot`` before the
    forward pass (a cache hit), ``saves`` the checkpoints the step takes (at the chunk's end
    the runner copies the slot afterwards, inside it the GDN layers write the row during the
    pass); ``transient_key`` is the sequence's latest interval checkpoint.

    Speculative decoding: ``draft_token_ids`` are tokens proposed after the newest one, not
    yet part of the sequence; the next step computes them beside the pending tokens and keeps
    those the model agrees with.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer,
        generator: torch.Generator | None,
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.detokenizer = detokenizer
        self.generator = generator
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.state_slot: int | None = None
        self.fresh_slot = False
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        self.checkpoint_at: list[tuple[int, bool]] = []  # (boundary, transient)
        self.restore_from: int | None = None
        self.saves: list[StateSave] = []
        self.transient_key: bytes | None = None
        self.finish_reason: str | None = None
        self.draft_token_ids: list[int] = []
        self.queued_at = time.monotonic()  # /metrics: queue time, from here to the first scheduling
        self.scheduled_at: float | None = None  # time.monotonic() when first scheduled

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        """Generated tokens."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens not yet computed (prompt left to prefill, or the newest sampled token), plus
        the draft tokens to verify."""
        return len(self.token_ids) - self.num_computed_tokens + len(self.draft_token_ids)

    def chunk_token_ids(self, start: int, count: int) -> list[int]:
        """Token ids at positions ``start .. start + count - 1``, drafts following the sequence."""
        end = start + count
        n = len(self.token_ids)
        if end <= n:
            return self.token_ids[start:end]
        return self.token_ids[start:] + self.draft_token_ids[max(0, start - n) : end - n]

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
