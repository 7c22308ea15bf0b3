"""The sampler never loses the most probable token (issue #43): whatever ``top_p``,
``min_p``, ``top_k`` and temperature a request sends within their ranges, including values
that are 0 in float32 (``top_p`` 1e-46, 5e-324) or round to the maximum (``min_p`` close to
1), the drawn token has nonzero probability, and settings that leave one candidate are
greedy. A property test over a grid of extreme values, several logits shapes and seeds."""

from __future__ import annotations

import itertools

import pytest
import torch

from onecat.runtime.layers.sampler import Sampler
from onecat.runtime.sampling_params import SamplingParams

VOCAB = 97
UNDERFLOWING_TOP_P = [5e-324, 1e-320, 1e-46, 1e-45 / 4, 1e-300]
TOP_P = [*UNDERFLOWING_TOP_P, 1e-7, 0.3, 1.0 - 1e-12, 1.0]
MIN_P = [0.0, 1e-300, 0.5, 1.0 - 1e-9, 1.0 - 2.0**-25, 1.0]
TOP_K = [0, 1, 2, VOCAB - 1, VOCAB, 2**31 - 1]
TEMPERATURE = [1e-5, 0.7, 1.0, 2.0, 1e4]


class Row:
    """A sequence as the sampler sees it (seeded: its own generator)."""

    def __init__(self, params: SamplingParams) -> None:
        params.validate()
        self.params = params
        self.token_ids = [5, 6, 7]
        self.num_prompt_tokens = 3
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None


def logits_cases() -> dict[str, torch.Tensor]:
    """Logits rows that stress the filters: random, a near tie at the top, a flat row, one
    dominant token, huge magnitudes, a row masked to two tokens (a grammar)."""
    gen = torch.Generator().manual_seed(0)
    random = torch.randn(VOCAB, generator=gen) * 4
    tie = random.clone()
    tie[11] = tie.max() + 1e-3
    dominant = torch.zeros(VOCAB)
    dominant[42] = 60.0
    masked = torch.full((VOCAB,), float("-inf"))
    masked[[3, 90]] = torch.tensor([1.0, 1.5])
    return {"random": random, "tie": tie, "flat": torch.zeros(VOCAB), "dominant": dominant,
            "huge": random * 1e4, "masked": masked}


LOGITS = logits_cases()


def draw(logits: torch.Tensor, params: SamplingParams, copies: int = 4) -> list[int]:
    """Tokens drawn for ``copies`` rows of the same logits (a batch, so per-row tensors vary)."""
    rows = [Row(params) for _ in range(copies)]
    return Sampler(seed=1)(logits.expand(copies, -1).clone(), rows).token_ids


@pytest.mark.parametrize("case", sorted(LOGITS))
@pytest.mark.parametrize("top_p", TOP_P)
def test_drawn_token_always_has_probability(case, top_p):
    """Over the whole grid of min_p, top_k and temperature (one batch, one row per setting):
    every drawn token is one the unfiltered distribution gives nonzero probability and one
    the filters keep, and some most probable token is always kept."""
    logits = LOGITS[case]
    allowed = set(torch.nonzero(logits.softmax(-1) > 0).flatten().tolist())
    grid = list(itertools.product(MIN_P, TOP_K, TEMPERATURE))
    for seed in (None, 7):
        params = [SamplingParams(temperature=t, top_p=top_p, min_p=m, top_k=k, seed=seed) for m, k, t in grid]
        probs = Sampler.probabilities(logits.expand(len(grid), -1).clone(), params)
        assert torch.isfinite(probs).all()
        assert torch.allclose(probs.sum(-1), torch.ones(len(grid)), atol=1e-4)
        assert (probs[:, logits == logits.max()].amax(-1) > 0).all(), "every most probable token was filtered out"
        tokens = Sampler(seed=1)(logits.expand(len(grid), -1).clone(), [Row(p) for p in params]).token_ids
        for setting, token, row in zip(grid, tokens, probs, strict=True):
            assert token in allowed and row[token] > 0, (case, top_p, setting, token)


@pytest.mark.parametrize("case", sorted(LOGITS))
@pytest.mark.parametrize(
    "fields",
    [{"top_p": p} for p in UNDERFLOWING_TOP_P] + [{"top_k": 1}, {"min_p": 1.0}, {"min_p": 1.0 - 2.0**-25}],
    ids=str,
)
def test_settings_that_leave_one_candidate_are_greedy(case, fields):
    """top_p that is 0 in float32, top_k 1 and min_p 1 act as greedy: every draw, seeded or
    not, is the argmax (the probe got token 0, ``<|endoftext|>``, 8 times instead)."""
    if case == "flat" or case == "tie" and "min_p" in fields:
        pytest.skip("no single most probable token (min_p keeps every tied maximum)")
    logits = LOGITS[case]
    greedy = int(logits.argmax())
    for seed in (None, 0, 12345):
        for temperature in (1e-5, 1.0, 3.0):
            params = SamplingParams(temperature=temperature, seed=seed, **fields)
            assert draw(logits, params) == [greedy] * 4, (seed, temperature)


def test_zero_exponential_draw_never_picks_an_impossible_token():
    """An exponential draw of exactly 0 (a uniform 0 in the race) must not make a token of
    probability 0 win through 0 / 0 = NaN."""

    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, 50] = 0.0
    params = SamplingParams(temperature=1.0, top_k=3)
    original = torch.Tensor.exponential_

    def zeros(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        original(self, *args, **kwargs)
        return self.zero_()

    torch.Tensor.exponential_ = zeros
    try:
        assert Sampler()(logits, [Row(params)]).token_ids == [50]
    finally:
        torch.Tensor.exponential_ = original
