"""How one request is sampled and when it stops (the engine <-> server contract).

Names and meanings are vLLM's: ``presence_penalty`` / ``frequency_penalty`` (OpenAI's, over
the generated tokens), ``repetition_penalty`` (over prompt and generated tokens: positive
logits divided by it, negative ones multiplied), ``min_p``, ``min_tokens`` (EOS, the stop
token ids and the stop strings do not end the output before that many tokens), ``logprobs``
(how many top alternatives to report per token besides the chosen one; up to
``MAX_LOGPROBS``, vLLM's default ``--max-logprobs``), ``logit_bias`` (token id -> a value in
[-100, 100] added to its logit after logprobs are taken). ``logits_processors`` is the
per-request hook described in ``onecat.runtime.layers.sampler`` (grammar masks use it).

The limits below are what the engine can take: counts and token ids fit int32, a seed fits
int64 (as vLLM's ``seed``), floats are finite. The server refuses anything beyond them with
a 400 before it reaches the engine; ``SamplingParams.validate`` enforces them again for
every other caller, so no request can raise inside the engine loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from onecat.runtime.errors import RequestError

MAX_INT32 = 2**31 - 1  # counts (max_tokens, top_k) and token ids
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # torch.Generator.manual_seed takes int64
MAX_STOP_STRINGS = 64  # each is searched for after every generated token
MAX_STOP_TOKEN_IDS = 1024  # each generated token is compared with them
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
MAX_LOGIT_BIAS = 1024  # entries of logit_bias (each is added at every step)
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a bias: [-100, 100]
PENALTY_LIMIT = 2.0  # presence / frequency penalties lie in [-2, 2]; repetition in (0, 2]

LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]
"""``(output_token_ids, logits_row) -> logits_row``: see ``onecat.runtime.layers.sampler``."""


def check_text(value: str, param: str) -> None:
    """Raise RequestError when ``value`` is not valid Unicode (a lone surrogate, which JSON's
    ``\\ud800`` escapes can carry, cannot be encoded, tokenised or answered)."""
    if value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(
            f"{param} is not valid Unicode: {exc.reason} at character {exc.start} "
            "(a lone UTF-16 surrogate such as \\ud800); send well-formed text",
            param=param,
        ) from None


@dataclass
class SamplingParams:
    """Sampling and stopping settings of one request.

    ``temperature`` 0 is greedy; ``top_k`` 0 is off; ``stop`` strings end the output and are
    not included in it; ``stop_token_ids`` and the model's EOS end it too (EOS unless
    ``ignore_eos``); ``seed`` makes sampling reproducible per request, whatever else is in
    the batch. Penalties, ``min_p`` and ``min_tokens`` as in vLLM (module docstring);
    ``logprobs`` None: none reported, k: the chosen token's and the k most likely ones.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    logits_processors: list[LogitsProcessor] = field(default_factory=list)

    @property
    def has_penalties(self) -> bool:
        """True when any of the three penalties changes the logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def validate(self) -> None:
        """Raise RequestError naming the first field out of range."""
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT32:
            raise RequestError(f"max_tokens must be an integer in 1..{MAX_INT32}, got {self.max_tokens!r}",
                               param="max_tokens")
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}",
                               param="temperature")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_INT32:
            raise RequestError(f"top_k must be an integer in 0..{MAX_INT32} (0 = off), got {self.top_k!r}",
                               param="top_k")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise RequestError(f"seed must be an integer in {SEED_MIN}..{SEED_MAX}, got {self.seed!r}",
                               param="seed")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}",
                               param="stop")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise RequestError("stop strings must be non-empty strings", param="stop")
            check_text(s, "stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(self.stop_token_ids)}",
                param="stop_token_ids",
            )
        if any(not _is_int(t) or not 0 <= t <= MAX_INT32 for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be integers in 0..{MAX_INT32}", param="stop_token_ids")
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be true or false, got {self.ignore_eos!r}", param="ignore_eos")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(
                f"min_tokens must be an integer in 0..max_tokens ({self.max_tokens}), got {self.min_tokens!r}",
                param="min_tokens",
            )
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p!r}", param="min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise RequestError(f"{name} must be in [-2, 2], got {value!r}", param=name)
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= PENALTY_LIMIT:
            raise RequestError(
                f"repetition_penalty must be in (0, 2] (1 = off), got {self.repetition_penalty!r}",
                param="repetition_penalty",
            )
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise RequestError(f"logprobs must be an integer in 0..{MAX_LOGPROBS}, got {self.logprobs!r}",
                               param="logprobs")
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases",
                               param="logit_bias")
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or not 0 <= token <= MAX_INT32:
                raise RequestError(f"logit_bias keys must be token ids in 0..{MAX_INT32}, got {token!r}",
                                   param="logit_bias")
            if not _is_number(bias) or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise RequestError(f"logit_bias values must be in [-100, 100], got {bias!r}", param="logit_bias")
        if not isinstance(self.logits_processors, list) or not all(map(callable, self.logits_processors)):
            raise RequestError("logits_processors must be a list of callables", param="logits_processors")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
