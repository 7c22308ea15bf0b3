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
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from onecat.errors import OnecatError
from onecat.runtime.layers.sampler import Sampler, is_greedy
from onecat.runtime.sampling_params import SamplingParams

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
