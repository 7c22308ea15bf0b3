"""How one request is sampled and when it stops (the engine <-> server contract).

The limits below are what the engine can take: counts and token ids fit int32, a seed fits
int64 (as vLLM's ``seed``), floats are finite. The server refuses anything beyond them with
a 400 before it reaches the engine; ``SamplingParams.validate`` enforces them again for
every other caller, so no request can raise inside the engine loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from onecat.runtime.errors import RequestError

MAX_INT32 = 2**31 - 1  # counts (max_tokens, top_k) and token ids
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # torch.Generator.manual_seed takes int64
MAX_STOP_STRINGS = 64  # each is searched for after every generated token
MAX_STOP_TOKEN_IDS = 1024  # each generated token is compared with them


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
    ``ignore_eos``); ``seed`` makes sampling reproducible per request.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
