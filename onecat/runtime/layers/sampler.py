"""Token sampling for a batch of requests, batched on the logits' device (vLLM's semantics).

One call takes the logits ``[B, V]`` of B sequences and their rows (``SamplingRow``: the
request's ``SamplingParams``, its generator, its prompt + output token ids) and goes, in
order:

1. **Logits processors** (per request, ``SamplingParams.logits_processors``): each is a
   callable ``(output_token_ids, logits_row) -> logits_row``. ``output_token_ids`` is the
   list of tokens the request generated so far (read it, do not change it); ``logits_row``
   is a float32 ``[V]`` view on the logits' device (CPU or CUDA) that the callable may edit
   in place and return, or replace by a new ``[V]`` tensor that it returns. It runs every
   step the request samples, before everything below: a grammar (JSON schema, xgrammar)
   masks disallowed tokens here with ``-inf``, so they can be neither sampled nor reported
   in logprobs, as vLLM's structured-output bitmask, which is applied before its sampler.
   A processor that raises fails its own request only (``finish_reason`` "error"). This is
   the one per-request Python loop over rows; requests without processors cost nothing.
2. **Logprobs** (requests with ``logprobs`` set only): ``log_softmax`` of these logits, i.e.
   before penalties, ``min_tokens``, temperature, ``min_p`` and top-k/top-p, which is vLLM's
   default ``--logprobs-mode raw_logprobs``; the chosen token's logprob and the
   ``logprobs`` most likely tokens are reported.
3. **logit_bias** added to its tokens' logits (as vLLM, after the logprobs are taken), then
   **min_tokens**: while a request has fewer than ``min_tokens`` outputs, its stop token
   ids and EOS (unless ``ignore_eos``) are set to ``-inf``.
4. **Penalties** (vLLM / OpenAI definitions), from per-row token counts scattered over the
   token ids on the device: ``repetition_penalty`` r on every token present in the prompt
   or the output (logit > 0: divided by r, otherwise multiplied by r), then
   ``frequency_penalty * count_in_output`` and ``presence_penalty * (count_in_output > 0)``
   subtracted.
5. **Greedy** rows (temperature below 1e-5, vLLM's epsilon) take the argmax of these logits.
6. **Random** rows: logits divided by the temperature; ``min_p`` drops tokens whose
   probability is below ``min_p`` times the row's largest; top-k and top-p (nucleus) keep
   their sets; none of them ever drops the most probable token (a ``top_p`` that underflows
   to 0 in float32 leaves that one token: greedy); then one token is drawn by the exponential race ``argmax(p / q)``, q ~ Exp(1)
   (equivalent to drawing from p). Rows of requests with a ``seed`` draw their q from their
   own ``torch.Generator`` (seeded once per request), so a seeded request samples the same
   tokens whatever else is in the batch; rows without a seed share the sampler's generator.

Everything per token stays a batched tensor operation; the host receives the B chosen ids
(and, for rows that asked, their logprobs) in one transfer. Rows that need nothing from the
host after the forward pass (no processors, penalties or logprobs: :meth:`Sampler.runs_on_device`)
can also be sampled with :meth:`Sampler.sample_on_device`, which queues the same work and
returns the tokens as a device tensor without waiting for the GPU (the engine's overlapped
decode steps feed them straight into the next step).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from onecat.kernels.workspace import to_device
from onecat.runtime.sampling_params import SamplingParams

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)


class SamplingRow(Protocol):
    """What the sampler reads of one sequence (``engine.sequence.Sequence`` is one)."""

    params: SamplingParams
    generator: torch.Generator | None
    token_ids: list[int]  # prompt + generated so far
    num_prompt_tokens: int


@dataclass
class TokenLogprobs:
    """The logprobs reported for one sampled token: its own and the top alternatives
    (``(token_id, logprob)`` pairs, most likely first; ``params.logprobs`` of them)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class SamplerOutput:
    """One sampled token per row, and its logprobs where the row's request asked."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def is_greedy(params: SamplingParams) -> bool:
    """True when the request takes the argmax (temperature 0, or below vLLM's epsilon)."""
    return params.temperature < SAMPLING_EPS


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """Bool ``[rows]`` on the logits' device: True where a row holds a NaN or an inf."""
    return ~torch.isfinite(logits).all(dim=-1)


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Repetition, frequency and presence penalties on ``logits [R, V]`` (in place; returned).

    ``prompt_ids`` / ``output_ids``: each row's prompt and generated token ids; the three
    penalty tensors are ``[R]``. Token counts are scattered on the logits' device.
    """
    rows, vocab = logits.shape
    device = logits.device
    output_counts = _token_counts(output_ids, rows, vocab, device)
    output_mask = output_counts > 0
    seen = output_mask | (_token_counts(prompt_ids, rows, vocab, device) > 0)
    scale = torch.where(seen, repetition[:, None], 1.0)
    logits = torch.where(logits > 0, logits / scale, logits * scale)
    logits -= frequency[:, None] * output_counts
    logits -= presence[:, None] * output_mask
    return logits


def _token_counts(ids: list[list[int]], rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """``[rows, vocab]`` float counts of each row's token ids (one flat scatter-add)."""
    lengths = torch.tensor([len(row) for row in ids])
    flat = torch.tensor(list(itertools.chain.from_iterable(ids)), dtype=torch.long)
    row_of = torch.repeat_interleave(torch.arange(rows), lengths)
    counts = torch.zeros(rows * vocab, device=device)
    index = (row_of * vocab + flat).to(device, non_blocking=True)
    counts.index_add_(0, index, torch.ones(index.shape[0], device=device))
    return counts.view(rows, vocab)


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p (nucleus) set to -inf. The most probable
    token is always kept: a ``top_p`` that is 0 in float32 (1e-46, 5e-324) leaves just it."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = ranks >= top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf the tokens whose probability is below ``min_p`` times the row's largest
    (the largest itself always stays, whatever rounding does to the threshold)."""
    probs = logits.softmax(dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill((probs < top * min_p[:, None]) & (probs < top), float("-inf"))


class Sampler:
    """Picks the next token of each row of logits (module docstring: the steps).

    ``eos_token_ids`` are the model's end-of-sequence ids, masked while a request has fewer
    than ``min_tokens`` outputs (unless it ignores EOS).
    """

    def __init__(self, seed: int | None = None, eos_token_ids: Sequence[int] = ()) -> None:
        self._generators: dict[torch.device, torch.Generator] = {}
        self._seed = seed
        self.eos_token_ids = sorted(set(eos_token_ids))

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            gen = torch.Generator(device=device)
            gen.manual_seed(self._seed) if self._seed is not None else gen.seed()
            self._generators[device] = gen
        return self._generators[device]

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """``logits [B, V]`` and one row per logits row -> B tokens (and asked-for logprobs)."""
        if all(self._plain_greedy(row) for row in rows):  # the common decode batch: one kernel, one read
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(rows))
        logits = logits.to(torch.float32, copy=True)
        params = [row.params for row in rows]
        device = logits.device
        self._run_processors(logits, rows)

        want_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs = top = None
        if want_logprobs:
            logprobs = logits[want_logprobs].log_softmax(dim=-1)
            k = max(params[i].logprobs for i in want_logprobs)
            top = logprobs.topk(k, dim=-1) if k else None

        self._add_logit_bias(logits, rows)
        self._mask_stop_tokens(logits, rows)
        penalized = [i for i, p in enumerate(params) if p.has_penalties]
        if penalized:
            logits[penalized] = apply_penalties(
                logits[penalized],
                [rows[i].token_ids[: rows[i].num_prompt_tokens] for i in penalized],
                [rows[i].token_ids[rows[i].num_prompt_tokens :] for i in penalized],
                torch.tensor([params[i].presence_penalty for i in penalized], device=device),
                torch.tensor([params[i].frequency_penalty for i in penalized], device=device),
                torch.tensor([params[i].repetition_penalty for i in penalized], device=device),
            )

        tokens = self._choose(logits, rows)
        if not want_logprobs:
            return SamplerOutput(tokens.tolist(), [None] * len(rows))
        chosen = tokens[want_logprobs]
        chosen_logprobs = logprobs.gather(1, chosen[:, None])[:, 0]
        host = [t.cpu() for t in (tokens, chosen_logprobs, *(top or ()))]
        token_list = host[0].tolist()
        out: list[TokenLogprobs | None] = [None] * len(rows)
        top_values = host[2].tolist() if top is not None else None
        top_ids = host[3].tolist() if top is not None else None
        for j, (i, lp) in enumerate(zip(want_logprobs, host[1].tolist(), strict=True)):
            k = params[i].logprobs
            pairs = list(zip(top_ids[j][:k], top_values[j][:k], strict=True)) if k else []
            out[i] = TokenLogprobs(token_list[i], lp, pairs)
        return SamplerOutput(token_list, out)

    @staticmethod
    def runs_on_device(row: SamplingRow) -> bool:
        """True when the row's token can be drawn without the host reading anything first: no
        logits processors (they run in Python on the tokens so far), no penalties (they count
        the tokens so far on the host) and no logprobs (read back with the token)."""
        p = row.params
        return not p.logits_processors and not p.has_penalties and p.logprobs is None

    def sample_on_device(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The tokens ``[B]`` (int64, on the logits' device) of rows that :meth:`runs_on_device`,
        queued without waiting for the device: the tokens :meth:`__call__` returns (bias,
        ``min_tokens`` mask, greedy or random draw), left for the caller to read later."""
        if all(self._plain_greedy(row) for row in rows):
            return logits.argmax(dim=-1)
        logits = logits.to(torch.float32, copy=True)
        self._add_logit_bias(logits, rows)
        self._mask_stop_tokens(logits, rows)
        return self._choose(logits, rows)

    def _choose(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Greedy rows' argmax and random rows' draws (steps 5 and 6), as one device tensor."""
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, row in enumerate(rows) if not is_greedy(row.params)]
        if sampled:
            index = to_device(sampled, torch.int64, logits.device)
            tokens[index] = self._sample(logits[index], [rows[i] for i in sampled])
        return tokens

    def _plain_greedy(self, row: SamplingRow) -> bool:
        """True when the row's token is the plain argmax of its logits: greedy, and nothing
        (processors, bias, penalties, a ``min_tokens`` mask, logprobs) changes or reports them.
        The argmax of the model's fp16 logits equals that of their exact fp32 copy."""
        p = row.params
        return (
            is_greedy(p) and not p.logits_processors and not p.logit_bias and not p.has_penalties
            and p.logprobs is None
            and not (p.min_tokens and len(row.token_ids) - row.num_prompt_tokens < p.min_tokens)
        )  # fmt: skip

    @staticmethod
    def _run_processors(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        for i, row in enumerate(rows):
            processors = row.params.logits_processors
            if not processors:
                continue
            outputs = row.token_ids[row.num_prompt_tokens :]
            values = logits[i]
            for processor in processors:
                values = processor(outputs, values)
            if values is not logits[i]:
                logits[i] = values

    @staticmethod
    def _add_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        """``logit_bias`` of every row in one scatter-add (ids beyond the logits are skipped)."""
        row_index: list[int] = []
        token_index: list[int] = []
        values: list[float] = []
        vocab = logits.shape[-1]
        for i, row in enumerate(rows):
            for token, bias in row.params.logit_bias.items():
                if token < vocab:
                    row_index.append(i)
                    token_index.append(token)
                    values.append(bias)
        if row_index:
            index = to_device([row_index, token_index], torch.int64, logits.device)
            logits.index_put_(tuple(index), to_device(values, logits.dtype, logits.device), accumulate=True)

    def _mask_stop_tokens(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        """``min_tokens``: -inf on the stop ids of rows that may not stop yet."""
        row_index: list[int] = []
        token_index: list[int] = []
        for i, row in enumerate(rows):
            p = row.params
            if p.min_tokens and len(row.token_ids) - row.num_prompt_tokens < p.min_tokens:
                stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids).union(self.eos_token_ids)
                stops = [t for t in stops if t < logits.shape[-1]]
                row_index += [i] * len(stops)
                token_index += stops
        if row_index:
            index = to_device([row_index, token_index], torch.int64, logits.device)
            logits.index_put_(tuple(index), torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))

    def shared_generator(self, device: torch.device) -> torch.Generator:
        """The generator of rows without a seed on ``device``."""
        return self._shared_generator(device)

    @staticmethod
    def probabilities(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Each random row's sampling distribution ``[R, V]``: temperature, min_p, top-k and
        top-p applied to ``logits`` (fp32), then softmax (step 6 of the module docstring)."""
        device = logits.device
        logits = logits / to_device([p.temperature for p in params], torch.float32, device)[:, None]
        if any(p.min_p > 0 for p in params):
            logits = _min_p(logits, to_device([p.min_p for p in params], torch.float32, device))
        vocab = logits.shape[-1]
        if any(0 < p.top_k < vocab or p.top_p < 1 for p in params):
            top_k = to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.int64, device)
            logits = _filter(logits, top_k, to_device([p.top_p for p in params], torch.float32, device))
        return logits.softmax(dim=-1)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, min_p, top-k / top-p and one draw for each random row."""
        device = logits.device
        probs = self.probabilities(logits, [row.params for row in rows])
        q = torch.empty_like(probs)
        if any(row.generator is None for row in rows):
            q.exponential_(generator=self._shared_generator(device))
        for j, row in enumerate(rows):
            if row.generator is not None:
                q[j].exponential_(generator=row.generator)
        # a draw q of exactly 0 would make 0 / 0 = NaN, which argmax takes: such a token has
        # no probability, so it scores 0 (a kept token with q = 0 scores inf and wins, rightly)
        return probs.div_(q).nan_to_num_(nan=0.0).argmax(dim=-1)


def sample_alone(
    sampler: Sampler, row: SamplingRow, logits: torch.Tensor
) -> tuple[int, TokenLogprobs | None] | Exception:
    """The token (and logprobs) of one row sampled by itself, or the exception its sampling
    raised (the engine finds which request's settings broke a batch this way)."""
    try:
        result = sampler(logits, [row])
        return result.token_ids[0], result.logprobs[0]
    except Exception as exc:
        return exc
