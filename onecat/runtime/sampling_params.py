"""How one request is sampled and when it stops (the engine <-> server contract)."""

from __future__ import annotations

from dataclasses import dataclass, field

from onecat.runtime.errors import RequestError


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
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise RequestError("stop_token_ids must be non-negative integers")
