"""A decode step queued on the device whose sampled tokens the host has not read yet.

The engine overlaps decode steps (``LLMEngine.step``): it queues step N+1 -- its input
tokens taken on the device from step N's sampled tokens -- before it waits for step N's
tokens, so the GPU starts step N+1 as soon as step N ends while the host turns step N's
tokens into outputs (detokenising, stop checks, scheduling, the next launch). The tokens
come back through pinned memory with an event, so waiting for them does not wait for the
work queued after them.
"""

from __future__ import annotations

import torch

from onecat.runtime.engine.sequence import Sequence


class InFlightStep:
    """Step ``scheduled`` (decode entries), launched, with its sampled ``tokens`` (a device
    tensor, one per entry) on their way to the host. ``positions[i]`` is where entry ``i``'s
    token goes in its sequence's token ids (a placeholder may hold the place already: the
    next step was scheduled before this one's tokens were read). ``failures``: rows whose
    sampling raised (their token is a stand-in; the engine fails those requests). ``reported``:
    what the host reads in place of ``tokens`` (-1 where the row's logits were not finite);
    ``pass_name``: how the forward pass ran."""

    def __init__(
        self, scheduled: list[tuple[Sequence, int]], tokens: torch.Tensor, failures: dict[int, Exception] | None = None,
        reported: torch.Tensor | None = None, pass_name: str = "",
    ) -> None:
        self.scheduled = scheduled
        self.tokens = tokens
        self.failures = failures or {}
        self.pass_name = pass_name  # how the forward pass ran (error reports)
        self.positions = [seq.num_computed_tokens for seq, _ in scheduled]
        self._ready: torch.cuda.Event | None = None
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens if reported is None else reported, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = tokens if reported is None else reported

    def rows_of(self, seqs: list[Sequence]) -> list[int]:
        """The row of each of ``seqs`` (all entries of this step) in ``tokens``."""
        index = {id(seq): row for row, (seq, _) in enumerate(self.scheduled)}
        return [index[id(seq)] for seq in seqs]

    def token_ids(self) -> list[int]:
        """The sampled tokens on the host (waits for this step only, not for later work)."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()
