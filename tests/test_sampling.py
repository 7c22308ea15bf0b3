"""The batched sampler (``onecat.runtime.layers.sampler``) against small reference
implementations on known logits: penalties, min_p, min_tokens, logprobs, the per-request
logits-processor hook, seeded reproducibility beside other rows; and SamplingParams checks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from onecat.runtime.engine.detokenizer import IncrementalDetokenizer
from onecat.runtime.errors import RequestError
from onecat.runtime.layers.sampler import Sampler, apply_penalties
from onecat.runtime.sampling_params import SamplingParams

VOCAB = 64
EOS = 3
ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=ON_GPU)]


@dataclass
class Row:
    """A sequence as the sampler sees it."""

    params: SamplingParams
    token_ids: list[int] = field(default_factory=lambda: [5, 6, 7])
    num_prompt_tokens: int = 3
    generator: torch.Generator | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator(device=self.device).manual_seed(self.params.seed)


def reference_penalties(logits: list[float], prompt: list[int], output: list[int],
                        presence: float, frequency: float, repetition: float) -> list[float]:
    """vLLM's definitions, one token at a time."""
    out = []
    for token, value in enumerate(logits):
        if token in prompt or token in output:
            value = value / repetition if value > 0 else value * repetition
        count = output.count(token)
        value -= frequency * count
        value -= presence * (count > 0)
        out.append(value)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_match_the_reference(device):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, VOCAB, generator=gen) * 3).to(device)
    prompts = [[1, 2, 2, 9], [], [40, 41]]
    outputs = [[2, 5, 5, 5, 63], [7, 7], []]
    presence, frequency, repetition = [0.5, -1.0, 2.0], [0.25, 1.5, -2.0], [1.3, 0.7, 2.0]
    got = apply_penalties(
        logits.clone(), prompts, outputs,
        *(torch.tensor(v, device=device) for v in (presence, frequency, repetition)),
    )
    for i in range(3):
        want = reference_penalties(logits[i].tolist(), prompts[i], outputs[i],
                                   presence[i], frequency[i], repetition[i])
        torch.testing.assert_close(got[i].cpu(), torch.tensor(want), rtol=1e-6, atol=1e-6)


def test_greedy_follows_penalised_logits():
    logits = torch.zeros(2, VOCAB)
    logits[:, 10] = 2.0  # the favourite, already generated three times
    logits[:, 11] = 1.5
    penalised = SamplingParams(temperature=0, frequency_penalty=0.5)  # 2.0 - 1.5 = 0.5 < 1.5
    plain = SamplingParams(temperature=0)
    rows = [Row(penalised, [1, 10, 10, 10], 1), Row(plain, [1, 10, 10, 10], 1)]
    assert Sampler()(logits, rows).token_ids == [11, 10]
    repeat = Row(SamplingParams(temperature=0, repetition_penalty=1.5), [10, 2], 1)  # 10 in the prompt
    assert Sampler()(logits[:1], [repeat]).token_ids == [11]  # 2.0 / 1.5 < 1.5


@pytest.mark.parametrize("device", DEVICES)
def test_plain_greedy_batch_takes_the_first_maximum_of_fp16_logits(device):
    """A batch of plain greedy rows reads the argmax of the model's fp16 logits directly; it
    must pick what the full path picks (fp32 copy, ties to the lowest id), as must a batch
    where one row asks for something (logprobs, min_tokens) and takes the full path."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, VOCAB, generator=gen).half()
    logits[1, [7, 30, 50]] = 9.0  # a three-way tie for the top
    logits[2] = 0.0  # all equal
    plain = [Row(SamplingParams(temperature=0), device=device) for _ in range(4)]
    full = [*plain[:3], Row(SamplingParams(temperature=0, logprobs=1), device=device)]
    masked = [*plain[:3], Row(SamplingParams(temperature=0, min_tokens=5), device=device)]
    want = logits.float().argmax(-1).tolist()
    assert want[1:3] == [7, 0]
    assert Sampler()(logits.to(device), plain).token_ids == want
    assert Sampler()(logits.to(device), full).token_ids == want
    assert Sampler(eos_token_ids=[EOS])(logits.to(device), masked).token_ids[:3] == want[:3]


def test_min_p_keeps_tokens_above_the_scaled_maximum():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * (VOCAB - 4))
    logits = probs.clamp_min(1e-30).log()[None]
    seen = set()
    for seed in range(200):
        row = Row(SamplingParams(temperature=1.0, min_p=0.35, seed=seed))  # threshold 0.175
        seen.add(Sampler()(logits, [row]).token_ids[0])
    assert seen == {0, 1}


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    logits[0, 20] = 9.0
    logits[0, 30] = 8.0
    sampler = Sampler(eos_token_ids=[EOS])
    params = SamplingParams(temperature=0, min_tokens=2, max_tokens=5, stop_token_ids=[20])
    assert sampler(logits, [Row(params, [1, 2], 1)]).token_ids == [30]  # one output so far
    assert sampler(logits, [Row(params, [1, 2, 4], 1)]).token_ids == [EOS]  # two: may stop now
    ignoring = SamplingParams(temperature=0, min_tokens=2, max_tokens=5, ignore_eos=True, stop_token_ids=[20])
    assert sampler(logits, [Row(ignoring, [1], 1)]).token_ids == [EOS]  # EOS is no stop token here


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax_with_top_alternatives(device):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, VOCAB, generator=gen).to(device)
    rows = [
        Row(SamplingParams(temperature=0.7, top_k=5, logprobs=4, frequency_penalty=1.0, seed=3), device=device),
        Row(SamplingParams(temperature=0)),  # asked for none
        Row(SamplingParams(temperature=0, logprobs=0)),
    ]
    out = Sampler()(logits, rows)
    logits = logits.cpu()
    raw = logits.double().log_softmax(dim=-1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0]
    assert math.isclose(first.logprob, raw[0, first.token_id].item(), rel_tol=1e-5)
    values, ids = raw[0].topk(4)
    assert [t for t, _ in first.top] == ids.tolist()
    assert all(math.isclose(v, w, rel_tol=1e-5) for (_, v), w in zip(first.top, values.tolist(), strict=True))
    assert out.logprobs[1] is None
    last = out.logprobs[2]
    assert last.top == [] and last.token_id == int(logits[2].argmax())
    assert math.isclose(last.logprob, raw[2].max().item(), rel_tol=1e-5)


def test_logits_processor_hook_sees_outputs_and_masks():
    seen = []

    def only_even(output_token_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        seen.append(list(output_token_ids))
        row[1::2] = float("-inf")
        return row

    def replace(output_token_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        fresh = torch.full_like(row, float("-inf"))
        fresh[42] = 0.0
        return fresh

    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, VOCAB, generator=gen)
    rows = [
        Row(SamplingParams(temperature=1.0, logprobs=2, logits_processors=[only_even]), [1, 2, 9, 8], 2),
        Row(SamplingParams(temperature=0)),
        Row(SamplingParams(temperature=0.5, logits_processors=[replace])),
    ]
    for _ in range(20):
        out = Sampler()(logits, rows)
        assert out.token_ids[0] % 2 == 0 and out.token_ids[2] == 42
        assert out.token_ids[1] == int(logits[1].argmax())
        assert all(t % 2 == 0 for t, _ in out.logprobs[0].top)  # logprobs after the mask
    assert seen[0] == [9, 8]
    assert logits.isfinite().all(), "the caller's logits are not modified"


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_are_reproducible_beside_other_rows(device):
    gen = torch.Generator().manual_seed(3)
    target = torch.randn(1, VOCAB, generator=gen).to(device)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def run(batch_with: int, steps: int = 12) -> list[int]:
        row = Row(params, device=device)
        others = [Row(SamplingParams(temperature=0.8, seed=k if k % 2 else None, presence_penalty=0.1 * k),
                      device=device) for k in range(batch_with)]
        picks = []
        sampler = Sampler()
        for _ in range(steps):
            noise = torch.randn(batch_with, VOCAB, generator=gen).to(device)
            batch = torch.cat([noise[: batch_with // 2], target, noise[batch_with // 2 :]])
            rows = others[: batch_with // 2] + [row] + others[batch_with // 2 :]
            picks.append(sampler(batch, rows).token_ids[batch_with // 2])
        return picks

    alone = run(0)
    assert run(5) == alone and run(2) == alone
    assert len(set(alone)) > 1, "sampled, not greedy"
    other_seed = Row(SamplingParams(temperature=1.0, top_p=0.95, seed=1235), device=device)
    assert [Sampler()(target, [other_seed]).token_ids[0] for _ in range(12)] != alone


def test_unseeded_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (VOCAB - 3))
    logits = probs.clamp_min(1e-30).log()[None].repeat(4000, 1)
    rows = [Row(SamplingParams(temperature=1.0))] * 4000
    counts = torch.bincount(torch.tensor(Sampler(seed=0)(logits, rows).token_ids), minlength=3)
    torch.testing.assert_close(counts[:3].float() / 4000, probs[:3], atol=0.03, rtol=0)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logits_processors": [3]}, "logits_processors"),
    ],
)
def test_out_of_range_fields_name_the_field(fields, param):
    with pytest.raises(RequestError) as info:
        SamplingParams(max_tokens=16, **fields).validate()
    assert info.value.param == param


class CharTokenizer:
    """One character per token id (ord)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


@pytest.mark.parametrize(("min_tokens", "want"), [(0, "x"), (2, "x"), (3, "xa"), (4, "xaby")])
def test_stop_strings_wait_for_min_tokens(min_tokens, want):
    detok = IncrementalDetokenizer(CharTokenizer(), ["by", "ab"], min_tokens=min_tokens)
    stopped = False
    for ch in "xabyabz":
        if detok.append(ord(ch)):
            stopped = True
            break
    assert stopped and detok.text == want  # a match must end after the first min_tokens tokens


def test_stop_string_spanning_tokens():
    detok = IncrementalDetokenizer(CharTokenizer(), ["cde"])
    pieces = []
    for ch in "abcdefg":
        if detok.append(ord(ch)):
            break
        pieces.append(detok.release(final=False))
    pieces.append(detok.release(final=True))
    assert "".join(pieces) == "ab"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_vocab_batch_on_gpu():
    """32 rows of fp16 logits over Qwen3.5's 248k vocabulary mixing every feature: seeded rows
    sample as they do alone, logprobs are the fp64 log-softmax, and one call stays cheap."""
    import time

    vocab, device = 248320, "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(32, vocab, device=device, generator=gen) * 4).half()
    history = torch.randint(0, vocab, (564,), generator=torch.Generator().manual_seed(1)).tolist()

    def params(i: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=64, temperature=0 if i % 4 == 0 else 0.8, top_p=0.9 if i % 3 == 0 else 1.0,
            top_k=50 if i % 5 == 0 else 0, min_p=0.05 if i % 7 == 0 else 0.0, seed=i if i % 2 else None,
            logprobs=5 if i % 3 == 1 else None, repetition_penalty=1.1 if i % 6 == 0 else 1.0,
            frequency_penalty=0.3 if i % 8 == 1 else 0.0, min_tokens=70 if i % 9 == 0 else 0,
        )

    def rows() -> list[Row]:
        return [Row(params(i), history, 500, device=device) for i in range(32)]

    out = Sampler(eos_token_ids=[248044])(logits, rows())
    fresh = rows()
    for i in range(1, 32, 2):  # seeded rows: the same token as sampled alone
        assert Sampler()(logits[i : i + 1], [fresh[i]]).token_ids[0] == out.token_ids[i], i
    raw = logits.double().log_softmax(dim=-1)
    for i in range(1, 32, 3):
        lp = out.logprobs[i]
        assert abs(lp.logprob - raw[i, lp.token_id].item()) < 1e-4
        assert [t for t, _ in lp.top] == raw[i].topk(5).indices.tolist()
    for i in (4, 8, 16, 20, 28):  # greedy rows without penalties or min_tokens
        assert out.token_ids[i] == int(logits[i].argmax())

    sampler, batch = Sampler(eos_token_ids=[248044]), rows()
    sampler(logits, batch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        sampler(logits, batch)
    per_call = (time.perf_counter() - start) / 10
    print(f"sampler, 32 rows x {vocab} vocab, every feature: {per_call * 1e3:.2f} ms per step")
    assert per_call < 0.05


def test_logit_bias_is_added_after_logprobs():
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 1.0
    rows = [Row(SamplingParams(temperature=0, logprobs=1, logit_bias={9: 5.0, 7: -100.0})),
            Row(SamplingParams(temperature=0, logprobs=1))]
    out = Sampler()(logits, rows)
    assert out.token_ids == [9, 7]
    assert out.logprobs[0].top[0][0] == 7  # logprobs before the bias (vLLM)
    with pytest.raises(RequestError) as info:
        SamplingParams(logit_bias={3: 101.0}).validate()
    assert info.value.param == "logit_bias"
