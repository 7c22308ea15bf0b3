"""Overlapped decode steps (``async_scheduling``): a step queued on the device whose
sampled tokens the host has not read yet.

The engine overlaps decode steps (:class:`OverlappedDecoding`): it queues step N+1 -- its
input tokens taken on the device from step N's sampled tokens -- before it waits for step
N's tokens, so the GPU starts step N+1 as soon as step N ends while the host turns step N's
tokens into outputs (detokenising, stop checks, scheduling, the next launch). The tokens
come back through pinned memory with an event (:class:`InFlightStep`), so waiting for them
does not wait for the work queued after them.

A step of decode entries whose rows sample on the device is launched, then the step after
it is queued behind it where the scheduler allows (``Scheduler.schedule_ahead``: same
sequences, nothing waiting) with its input tokens taken on the device, and only then does
the host wait for the first step's tokens and emit them. A sequence that finishes with
those tokens has computed one token too many, which is dropped; its blocks and slot are only
reused by work queued later, so nothing it writes is read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from onecat.kernels.workspace import to_device
from onecat.runtime.config import EngineConfig
from onecat.runtime.engine.block_manager import BlockManager
from onecat.runtime.engine.model_runner import ModelRunner, pass_name
from onecat.runtime.engine.scheduler import Scheduler
from onecat.runtime.engine.sequence import Sequence, SequenceStatus
from onecat.runtime.layers.sampler import Sampler, nonfinite_rows

if TYPE_CHECKING:
    from onecat.runtime.engine.executor import TensorParallelRunner
    from onecat.runtime.engine.llm_engine import RequestOutput, StepOutputs


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


class OverlappedDecoding:
    """The overlapped decode steps of one engine: at most one step in flight (``in_flight``).

    The engine's sampler is passed to each call (the engine reads its ``sampler`` attribute
    at every step); ``config.async_scheduling`` is read at every step too, so turning it off
    stops the overlap after the step in flight."""

    def __init__(
        self, config: EngineConfig, scheduler: Scheduler, runner: ModelRunner | TensorParallelRunner,
        block_manager: BlockManager, outputs: StepOutputs,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.runner = runner
        self.block_manager = block_manager
        self.outputs = outputs
        self.max_model_len = runner.max_model_len
        self.in_flight: InFlightStep | None = None  # a decode step whose tokens are not read yet

    def overlaps(self, scheduled: list[tuple[Sequence, int]], sampler: Sampler) -> bool:
        """True when ``scheduled`` can run as an overlapped step: decode entries only, rows
        that sample on the device (speculative steps take their own path in ``LLMEngine.step``).
        Under tensor parallelism rank 0 broadcasts the input tokens on the device
        (``TensorParallelRunner.run``)."""
        return (
            self.config.async_scheduling
            and all(count == 1 and seq.num_computed_tokens == seq.num_tokens - 1 for seq, count in scheduled)
            and all(sampler.runs_on_device(seq) for seq, _ in scheduled)
        )  # fmt: skip

    def start(self, scheduled: list[tuple[Sequence, int]], sampler: Sampler) -> list[RequestOutput]:
        """Launch ``scheduled`` (:meth:`overlaps` said yes), then :meth:`step`: queue the step
        after it and emit its tokens."""
        try:
            self.in_flight = self._launch(scheduled, None, sampler)
        except Exception as exc:
            return self.outputs.forward_failed(scheduled, exc)
        return self.step(sampler)

    def step(self, sampler: Sampler) -> list[RequestOutput]:
        """Queue the step after the one in flight where the scheduler allows, then emit the
        in-flight step's tokens."""
        current, self.in_flight = self.in_flight, None
        running = [seq for seq, _ in current.scheduled if seq.status == SequenceStatus.RUNNING]
        failed = {id(current.scheduled[row][0]) for row in current.failures}
        ahead = [seq for seq in running if not self._last_token_pending(seq) and id(seq) not in failed]
        overlap = ahead and self.config.async_scheduling
        scheduled = self.scheduler.schedule_ahead(running, ahead) if overlap else None
        if scheduled is None:
            return self._collect(current)
        for seq in ahead:
            seq.token_ids.append(0)  # holds the place of the token in flight (the device has it)
        try:
            self.in_flight = self._launch(scheduled, current, sampler)
        except Exception as exc:
            for seq in ahead:
                seq.token_ids.pop()
            outputs = self._collect(current)
            return outputs + self.outputs.forward_failed(
                [(seq, count) for seq, count in scheduled if seq.status == SequenceStatus.RUNNING], exc
            )
        return self._collect(current)

    def _launch(
        self, scheduled: list[tuple[Sequence, int]], source: InFlightStep | None, sampler: Sampler
    ) -> InFlightStep:
        """Queue the forward pass and the sampling of decode step ``scheduled``; its input
        tokens come from ``source``'s sampled tokens on the device when given."""
        inputs = None
        if source is not None:
            rows = source.rows_of([seq for seq, _ in scheduled])
            same = rows == list(range(len(source.scheduled)))
            inputs = source.tokens if same else source.tokens[to_device(rows, torch.int64, source.tokens.device)]
        sampled, logits = self.runner.run(scheduled, inputs)
        for seq, count in scheduled:
            seq.num_computed_tokens += count
        self.scheduler.commit(scheduled, register=False)  # blocks: once the tokens are known
        failures: dict[int, Exception] = {}
        try:
            tokens = sampler.sample_on_device(logits, sampled)
        except Exception:  # one request's settings broke the batch: sample row by row, fail that one
            rows = []
            for row, seq in enumerate(sampled):
                try:
                    rows.append(sampler.sample_on_device(logits[row : row + 1], [seq]))
                except Exception as exc:
                    failures[row] = exc
                    rows.append(torch.zeros(1, dtype=torch.int64, device=logits.device))
            tokens = torch.cat(rows)
        # the host reads -1 for a row whose logits are not finite (the next step's inputs
        # keep the sampled tokens: -1 is no token id)
        reported = torch.where(nonfinite_rows(logits), -1, tokens)
        return InFlightStep(scheduled, tokens, failures, reported, pass_name(self.runner))

    def _last_token_pending(self, seq: Sequence) -> bool:
        """True when the token in flight for ``seq`` will be its last (its length limits)."""
        return seq.num_completion_tokens + 1 >= seq.params.max_tokens or seq.num_tokens + 1 >= self.max_model_len

    def _collect(self, step: InFlightStep) -> list[RequestOutput]:
        """Read ``step``'s tokens and emit them (sequences that finished or were aborted
        while it ran are skipped: their token is the one too many)."""
        tokens = step.token_ids()
        outputs = []
        for row, ((seq, _), token, position) in enumerate(zip(step.scheduled, tokens, step.positions, strict=True)):
            if seq.status != SequenceStatus.RUNNING:
                continue
            if row in step.failures:
                outputs.append(self.outputs.fail(seq, step.failures[row]))
                continue
            if token < 0:
                outputs.append(self.outputs.fail(seq, self.outputs.nonfinite(seq, step.pass_name, position)))
                continue
            if position < seq.num_tokens:
                seq.token_ids[position] = token
            else:
                seq.token_ids.append(token)
            self.block_manager.register(seq)
            try:
                outputs.append(self.outputs.emit(seq, token))
            except Exception as exc:
                outputs.append(self.outputs.fail(seq, exc))
        return outputs
