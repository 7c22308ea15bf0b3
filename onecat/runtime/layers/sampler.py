"""Token sampling: greedy, or temperature with top-k and top-p, reproducible per request.

Rows of requests with a seed draw from their own ``torch.Generator`` (seeded once per
request), so a seeded request samples the same tokens whatever else is in the batch. Rows
without a seed draw together from the engine's generator.
"""

from __future__ import annotations

import torch

from onecat.runtime.sampling_params import SamplingParams


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p (nucleus) set to -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = ranks >= top_k[:, None]
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop |= (cumulative - sorted_logits.softmax(dim=-1)) >= top_p[:, None]  # keep the first
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler:
    """Picks the next token of each row of logits."""

    def __init__(self, seed: int | None = None) -> None:
        self._generators: dict[torch.device, torch.Generator] = {}
        self._seed = seed

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            gen = torch.Generator(device=device)
            gen.manual_seed(self._seed) if self._seed is not None else gen.seed()
            self._generators[device] = gen
        return self._generators[device]

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        """``logits [B, V]``, one ``params`` and generator (or None) per row -> B token ids."""
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if p.temperature > 0]
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            vocab = logits.shape[-1]
            temperature = torch.tensor([params[i].temperature for i in sampled], device=logits.device)
            top_k = torch.tensor([params[i].top_k or vocab for i in sampled], device=logits.device)
            top_p = torch.tensor([params[i].top_p for i in sampled], device=logits.device)
            probs = _filter(logits[rows] / temperature[:, None], top_k, top_p).softmax(dim=-1)
            shared = [j for j, i in enumerate(sampled) if generators[i] is None]
            if shared:
                picks = torch.multinomial(probs[shared], 1, generator=self._shared_generator(logits.device))
                tokens[rows[shared]] = picks[:, 0]
            for j, i in enumerate(sampled):
                if generators[i] is not None:
                    tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
        return tokens.tolist()
