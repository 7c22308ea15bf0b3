"""Speculative decoding with Qwen3.5's multi-token-prediction (MTP) head.

Configured as vLLM does: ``--speculative-config '{"method": "mtp", "num_speculative_tokens": N}'``
(N = 1..4). After every step that samples a token for a sequence, the MTP head (a one-layer
drafter shipped in the checkpoint, ``mtp.*``) proposes N draft tokens greedily; the next step
computes the sequence's pending token and the N drafts in one chunk (N + 1 positions), and
the model's logits at those positions decide how many drafts to keep:

- greedy requests keep drafts while each equals the model's argmax, then take the argmax at
  the first disagreement (or after the last draft) as a bonus token: the output is exactly
  that of decoding without speculation;
- random requests use rejection sampling against the drafter's point mass (greedy drafts):
  draft ``d`` at a position whose target distribution is ``p`` (after temperature, min_p,
  top-k, top-p) is kept with probability ``p(d)``; at the first rejection a token is drawn
  from ``p`` with ``d`` removed (renormalised), after N kept drafts one from the next
  position's ``p``. Each emitted token is then distributed exactly as ``p``.

Requests that ask for what a verify step does not reproduce per position (penalties,
logit_bias, logits processors such as a JSON grammar, logprobs, min_tokens) decode without
drafts, in the same batches.

A verify chunk runs as decode rows, one per position (its pending token, then the drafts):
attention treats each row as a sequence ending at its position, and Gated DeltaNet runs the
positions one after another, each writing its state to a row of its own (N rows per slot;
the last position writes the slot). When drafts are rejected the runner copies the state
after the last kept position into the slot (``ModelRunner.accept_drafts``): nothing is
recomputed, and the KV written past it is overwritten by later steps. A step of decode and
verify chunks only replays a decode CUDA graph of 1 + N rows per sequence. The MTP head's own
KV cache lives in one more attention layer of the paged cache, at the sequence's positions.

:class:`SpeculativeDecoding` is the engine's step when speculation is on: schedule, run
(``ModelRunner.run_hidden``), verify the drafts, commit, sample the requests that decode
without drafts, emit, draft again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from onecat.errors import OnecatError
from onecat.kernels.workspace import to_device
from onecat.runtime.engine.block_manager import BlockManager
from onecat.runtime.engine.scheduler import Scheduler
from onecat.runtime.engine.sequence import Sequence, SequenceStatus
from onecat.runtime.layers.sampler import (
    Sampler,
    TokenLogprobs,
    is_greedy,
    nonfinite_rows,
    sample_alone,
)
from onecat.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from onecat.runtime.engine.executor import TensorParallelRunner
    from onecat.runtime.engine.llm_engine import RequestOutput, StepOutputs
    from onecat.runtime.engine.model_runner import ModelRunner

MAX_SPECULATIVE_TOKENS = 4


@dataclass
class SpeculativeConfig:
    """``method`` ("mtp") and ``num_speculative_tokens`` (drafts per step, 1..4)."""

    method: str
    num_speculative_tokens: int

    @classmethod
    def parse(cls, value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """vLLM's ``--speculative-config`` value (a JSON object or a dict); None stays None."""
        if value is None:
            return None
        where = "--speculative-config"
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise OnecatError(f"{where}: not valid JSON ({exc}); e.g. '{{\"method\": \"mtp\", \"num_speculative_tokens\": 3}}'") from None
        if not isinstance(value, dict):
            raise OnecatError(f"{where}: expected a JSON object with method and num_speculative_tokens")
        unknown = set(value) - {"method", "num_speculative_tokens"}
        if unknown:
            raise OnecatError(f"{where}: unsupported field(s) {', '.join(sorted(unknown))}; onecat takes method and num_speculative_tokens")
        method = value.get("method")
        if method != "mtp":
            raise OnecatError(f"{where}: method {method!r} is not supported; onecat drafts with the checkpoint's MTP head (\"mtp\")")
        n = value.get("num_speculative_tokens")
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SPECULATIVE_TOKENS:
            raise OnecatError(f"{where}: num_speculative_tokens must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, got {n!r}")
        return cls(method, n)


def can_speculate(params: SamplingParams) -> bool:
    """True when a verify step samples this request exactly as plain decoding would."""
    return not (
        params.logits_processors or params.logit_bias or params.logprobs is not None or params.min_tokens
        or params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
    )


@dataclass
class SpeculationStats:
    """vLLM's counters: verify steps with drafts, draft tokens, accepted tokens (in total and
    per draft position)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        """One verify step of one sequence: ``proposed`` drafts checked, ``accepted`` kept."""
        if proposed == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        while len(self.accepted_per_position) < proposed:
            self.accepted_per_position.append(0)
        for i in range(accepted):
            self.accepted_per_position[i] += 1


def accept_greedy(target: list[int], drafts: list[int]) -> tuple[int, int]:
    """The model's argmax at the pending token and each draft (``len(drafts) + 1`` ids) ->
    (drafts kept, the token after them)."""
    kept = 0
    while kept < len(drafts) and drafts[kept] == target[kept]:
        kept += 1
    return kept, target[kept]


def accept_random(
    probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None
) -> tuple[int, int]:
    """Rejection sampling of greedy (point-mass) drafts: ``probs [len(drafts) + 1, V]`` are
    the target distributions at the pending token and each draft -> (drafts kept, the token
    after them), every emitted token distributed as its position's ``probs`` row."""
    device = probs.device
    if drafts:
        chosen = probs[torch.arange(len(drafts), device=device), torch.tensor(drafts, device=device)]
        draws = torch.rand(len(drafts), generator=generator, device=device)
        rejected = (draws >= chosen).tolist()
    else:
        rejected = []
    kept = rejected.index(True) if True in rejected else len(drafts)
    row = probs[kept].clone()
    if kept < len(drafts):
        row[drafts[kept]] = 0.0
        if float(row.sum()) <= 0.0:  # p was the draft's point mass: it could not be rejected
            row = probs[kept]
    token = torch.multinomial(row / row.sum(), 1, generator=generator).item()
    return kept, int(token)


def accept(
    sampler: Sampler, logits: torch.Tensor, drafts: list[int], params: SamplingParams,
    generator: torch.Generator | None, argmax: list[int] | None = None,
) -> tuple[int, int]:
    """Drafts kept and the next token for one sequence (greedy or rejection sampling);
    ``argmax``: the rows' argmax when the caller read it already (one read for a batch)."""
    if is_greedy(params):
        return accept_greedy(logits.argmax(dim=-1).tolist() if argmax is None else argmax, drafts)
    gen = generator if generator is not None else sampler.shared_generator(logits.device)
    probs = sampler.probabilities(logits.float(), [params] * logits.shape[0])
    return accept_random(probs, drafts, gen)


Pick = tuple[list[int], int, TokenLogprobs | None]
"""A sequence's verified tokens: (tokens to append, chunk start, logprobs of the first)."""


class SpeculativeDecoding:
    """The steps of an engine with speculative decoding: verify each sequence's drafts, keep
    what the model agrees with, give GDN states the position of the last kept token where a
    draft was rejected, emit the kept tokens, and draft again with the MTP head.

    The engine's sampler is passed to each call (the engine reads its ``sampler`` attribute
    at every step)."""

    def __init__(
        self, config: SpeculativeConfig, scheduler: Scheduler, runner: ModelRunner | TensorParallelRunner,
        block_manager: BlockManager, stats: SpeculationStats, outputs: StepOutputs,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.runner = runner
        self.block_manager = block_manager
        self.stats = stats
        self.outputs = outputs
        self.max_model_len = runner.max_model_len

    def step(self, sampler: Sampler) -> list[RequestOutput]:
        """One step: schedule -> run -> verify -> commit -> sample -> emit -> draft."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        try:
            hidden, firsts, all_logits = self.runner.run_hidden(scheduled)
        except Exception as exc:
            return self.outputs.forward_failed(scheduled, exc)
        logits, picks, plain, rejected = self._verify(scheduled, hidden, firsts, all_logits, sampler)
        self.runner.accept_drafts(rejected)
        self.scheduler.commit(scheduled)
        if plain:
            self._sample_plain(scheduled, logits, plain, picks, sampler)
        outputs, drafting = self._emit(scheduled, firsts, hidden, picks)
        self._draft(drafting)
        return outputs

    def _verify(
        self, scheduled: list[tuple[Sequence, int]], hidden: torch.Tensor, firsts: list[int],
        all_logits: torch.Tensor | None, sampler: Sampler,
    ) -> tuple[torch.Tensor | None, dict[int, Pick | Exception], dict[int, int], list[tuple[Sequence, int]]]:
        """Each sampling sequence's logits rows (its pending token and the drafts in its
        chunk), the drafts kept (sequences advanced past them) -> (the logits, scheduled index
        -> its :data:`Pick` or what failed, the sequences that decode without drafts (index ->
        logits row, sampled together), (sequence, drafts kept) where a draft was rejected)."""
        # logits rows: each sampling sequence's pending token and the drafts in its chunk
        rows: list[int] = []
        verified: list[int | None] = []
        for (seq, count), first in zip(scheduled, firsts, strict=True):
            end = seq.num_computed_tokens + count
            if end < seq.num_tokens:  # a prompt chunk: nothing to sample yet
                verified.append(None)
                continue
            verified.append(end - seq.num_tokens)
            rows.extend(range(first + count - 1 - verified[-1], first + count))
        logits = None
        if rows and all_logits is not None:
            logits = all_logits[to_device(rows, torch.int64, hidden.device)]
        elif rows:  # every rank computes them (tensor parallelism: lm_head is split)
            logits = self.runner.hidden_logits(rows)
        argmax, bad = [], []
        if logits is not None:  # greedy rows and non-finite rows: one read
            argmax, bad = torch.stack([logits.argmax(dim=-1), nonfinite_rows(logits).long()]).tolist()
        # index -> (tokens to append, chunk start, logprobs of the first), or what failed
        picks: dict[int, Pick | Exception] = {}
        plain: dict[int, int] = {}  # sequences that decode without drafts -> logits row, sampled together
        rejected: list[tuple[Sequence, int]] = []  # (sequence, drafts kept) where a draft was rejected
        cursor = 0
        for i, ((seq, count), checked) in enumerate(zip(scheduled, verified, strict=True)):
            start = seq.num_computed_tokens
            if checked is None:
                seq.num_computed_tokens += count
                continue
            drafts, seq.draft_token_ids = seq.draft_token_ids[:checked], []
            row = slice(cursor, cursor + checked + 1)
            cursor += checked + 1
            if any(bad[row]):
                seq.num_computed_tokens += count
                picks[i] = self.outputs.nonfinite(seq)
                continue
            if not can_speculate(seq.params):
                seq.num_computed_tokens += count
                plain[i] = row.start
                continue
            try:
                kept, token = accept(sampler, logits[row], drafts, seq.params, seq.generator, argmax[row])
            except Exception as exc:
                seq.num_computed_tokens += count
                picks[i] = exc
                continue
            self.stats.record(checked, kept)
            if kept < checked:  # the chunk ran past a rejected draft: its KV there is overwritten later
                rejected.append((seq, kept))
            seq.num_computed_tokens = start + count - checked + kept
            picks[i] = (drafts[:kept] + [token], start, None)
        return logits, picks, plain, rejected

    @staticmethod
    def _sample_plain(
        scheduled: list[tuple[Sequence, int]], logits: torch.Tensor, plain: dict[int, int],
        picks: dict[int, Pick | Exception], sampler: Sampler,
    ) -> None:
        """Sample the sequences that decode without drafts (``plain``: index -> logits row)
        together, into ``picks``; row by row when the batch raised."""
        try:
            result = sampler(logits[list(plain.values())], [scheduled[i][0] for i in plain])
            for i, token, lp in zip(plain, result.token_ids, result.logprobs, strict=True):
                picks[i] = ([token], -1, lp)
        except Exception:
            for i, row in plain.items():
                pick = sample_alone(sampler, scheduled[i][0], logits[row : row + 1])
                picks[i] = pick if isinstance(pick, Exception) else ([pick[0]], -1, pick[1])

    def _emit(
        self, scheduled: list[tuple[Sequence, int]], firsts: list[int], hidden: torch.Tensor,
        picks: dict[int, Pick | Exception],
    ) -> tuple[list[RequestOutput], list[tuple[Sequence, int, torch.Tensor, bool]]]:
        """Append each sequence's picked tokens (or fail it) -> the outputs, and what the MTP
        head reads next: (sequence, first position, hidden rows, whether to draft)."""
        outputs = []
        drafting: list[tuple[Sequence, int, torch.Tensor, bool]] = []
        for i, ((seq, count), first) in enumerate(zip(scheduled, firsts, strict=True)):
            pick = picks.get(i)
            if pick is None:  # prompt chunk: the MTP head still reads it (its KV cache)
                if self._drafts_for(seq):
                    drafting.append((seq, seq.num_computed_tokens - count, hidden[first : first + count], False))
                continue
            try:
                if isinstance(pick, Exception):
                    raise pick
                tokens, start, logprobs = pick
                committed = seq.num_tokens
                out = self._append_tokens(seq, tokens, logprobs)
            except Exception as exc:
                outputs.append(self.outputs.fail(seq, exc))
                continue
            outputs.append(out)
            if not out.finished and self._drafts_for(seq):
                last = committed - 1 + len(tokens) - 1  # position of the last token before the new one
                drafting.append((seq, start, hidden[first : first + last - start + 1], True))
        return outputs, drafting

    @staticmethod
    def _drafts_for(seq: Sequence) -> bool:
        return seq.status != SequenceStatus.FINISHED and can_speculate(seq.params)

    def _draft(self, items: list[tuple[Sequence, int, torch.Tensor, bool]]) -> None:
        """Run the MTP head over the new positions of ``items`` and store the drafts."""
        if not items:
            return
        n = self.config.num_speculative_tokens
        ready = []
        for seq, start, rows, draft in items:
            last = start + rows.shape[0] - 1
            draft = draft and self._draft_room(seq) > 0 and self.block_manager.can_grow(seq, last + n)
            if draft:
                self.block_manager.grow(seq, last + n)
            ready.append((seq, start, rows, draft))
        drafts = self.runner.propose(ready, n)
        for (seq, _, _, draft), tokens in zip(ready, drafts, strict=True):
            if draft:
                seq.draft_token_ids = tokens[: self._draft_room(seq)]

    def _draft_room(self, seq: Sequence) -> int:
        """Drafts worth verifying: a verify step emits up to drafts + 1 tokens, within the
        request's max_tokens and the model length."""
        left = seq.params.max_tokens - seq.num_completion_tokens - 1
        return min(self.config.num_speculative_tokens, left, self.max_model_len - seq.num_tokens)

    def _append_tokens(self, seq: Sequence, tokens: list[int], logprobs: TokenLogprobs | None) -> RequestOutput:
        """Append several tokens (stopping at the first that finishes the request); one output."""
        out = self.outputs.append(seq, tokens[0], logprobs)
        for token in tokens[1:]:
            if out.finished:
                break
            more = self.outputs.append(seq, token)
            out.new_token_ids += more.new_token_ids
            out.new_text += more.new_text
            out.finished, out.finish_reason = more.finished, more.finish_reason
            out.completion_tokens = more.completion_tokens
        return out
