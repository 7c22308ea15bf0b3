"""The sampling fields clients send, through the official ``openai`` client against the real
server (tiny random Qwen3.5 on CPU), streamed and not: logprobs (chat and the legacy
completions format, checked against transformers' log-softmax), n > 1, seeds beside other
requests, penalties (against a reference over transformers' logits), min_p, min_tokens,
stop strings spanning tokens, max_completion_tokens, and 400s naming out-of-range fields.

Greedy tokens are compared with transformers only where the top-1 margin exceeds ``MARGIN``
(random weights give near ties; DEVELOPMENT.md); comparisons stop at the first near tie.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_thread")]

from runtime_helpers import reference_model  # noqa: E402
from server_helpers import API_KEY, HELLO, MODEL, assert_all_free, make_engine, wait_idle  # noqa: E402

from onecat.runtime.server.launcher import BackgroundServer  # noqa: E402
from onecat.runtime.server.prompts import chat_token_ids  # noqa: E402
from onecat.tiny import build_tiny_model  # noqa: E402

MARGIN = 1e-3  # engine vs transformers logits differ by ~1e-6 (fp32, summation order)
ATOL = 1e-3
PROMPT = "def parse(text):"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model("qwen3_5", tmp_path_factory.mktemp("fields") / "tiny-qwen3_5")


@pytest.fixture(scope="module")
def server(tiny_model):
    with BackgroundServer(make_engine(tiny_model, max_num_seqs=16), api_key=API_KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(tiny_model):
    return reference_model(tiny_model)


@pytest.fixture(scope="module")
def oc(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def reference_run(reference, prompt_ids: list[int], steps: int, penalties: dict | None = None):
    """transformers' greedy continuation of ``prompt_ids`` (with vLLM's penalties when given):
    per step the chosen id, its log-softmax row (raw logits) and whether the choice is clear
    of a near tie. Stops after the first near tie."""
    ids, out = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(steps):
            logits = reference(torch.tensor([ids])).logits[0, -1].float()
            scores = logits.clone()
            if penalties:
                generated = ids[len(prompt_ids):]
                seen = torch.zeros_like(scores, dtype=torch.bool)
                seen[ids] = True
                counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=scores.numel()).float()
                r = penalties.get("repetition_penalty", 1.0)
                scores = torch.where(seen, torch.where(scores > 0, scores / r, scores * r), scores)
                scores -= penalties.get("frequency_penalty", 0.0) * counts
                scores -= penalties.get("presence_penalty", 0.0) * (counts > 0)
            top2 = scores.topk(2).values
            token = int(scores.argmax())
            out.append((token, logits.log_softmax(-1), bool(top2[0] - top2[1] > MARGIN)))
            if not out[-1][2]:
                break
            ids.append(token)
    return out


# ----- logprobs ---------------------------------------------------------------------------------


def test_chat_logprobs_match_transformers(oc, server, reference):
    tokenizer = server.async_engine.tokenizer
    fields = dict(model=MODEL, messages=HELLO, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                  extra_body={"ignore_eos": True})
    reply = oc.chat.completions.create(**fields)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 6
    assert "".join(c.token for c in content) == reply.choices[0].message.content or any(
        "\ufffd" in c.token for c in content)
    steps = reference_run(reference, chat_token_ids(tokenizer, HELLO), 6)
    for entry, (token, row, clear) in zip(content, steps, strict=False):
        if not clear:
            break
        assert entry.token == tokenizer.decode([token])
        assert entry.bytes == list(entry.token.encode())
        assert abs(entry.logprob - row[token].item()) < ATOL  # log_softmax of the raw logits
        values, ids = row.topk(3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=ATOL)
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob

    chunks = list(oc.chat.completions.create(**fields, stream=True))
    streamed = [c for chunk in chunks for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-6)


def test_completion_logprobs_legacy_format(oc):
    fields = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2,
                  extra_body={"ignore_eos": True})
    choice = oc.completions.create(**fields).choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    offset = 0
    for token, logprob, top, start in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset, strict=True):
        assert start == offset
        offset += len(token)
        assert top[token] == logprob and max(top.values()) == logprob  # greedy: the chosen is the top one
        assert 1 <= len(top) <= 3 and all(v <= 0 for v in top.values())
    if not any("\ufffd" in t for t in lp.tokens):
        assert "".join(lp.tokens) == choice.text

    chunks = list(oc.completions.create(**fields, stream=True))
    tokens, logprobs, sent = [], [], 0
    for chunk in chunks:
        c = chunk.choices[0]
        if c.logprobs and c.logprobs.tokens:
            assert c.logprobs.text_offset[0] == sent  # offsets continue across chunks
            tokens += c.logprobs.tokens
            logprobs += c.logprobs.token_logprobs
        sent += len(c.text)
    assert tokens == lp.tokens and logprobs == pytest.approx(lp.token_logprobs, abs=1e-6)


# ----- n, seed ----------------------------------------------------------------------------------


def test_n_choices_streamed_and_not(oc, server):
    prompt_tokens = len(chat_token_ids(server.async_engine.tokenizer, HELLO))
    fields = dict(model=MODEL, messages=HELLO, n=3, max_tokens=8, temperature=1.0, seed=11,
                  extra_body={"ignore_eos": True})
    reply = oc.chat.completions.create(**fields)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.prompt_tokens == prompt_tokens  # the prompt counted once
    assert reply.usage.completion_tokens == 24 and all(c.finish_reason == "length" for c in reply.choices)
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) > 1, "choices are sampled independently"

    chunks = list(oc.chat.completions.create(**fields, stream=True, stream_options={"include_usage": True}))
    streamed, roles, finishes = ["", "", ""], set(), {}
    for chunk in chunks:
        for c in chunk.choices:
            roles.add(c.index) if c.delta.role == "assistant" else None
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert roles == {0, 1, 2} and finishes == {0: "length", 1: "length", 2: "length"}
    assert streamed == texts, "seeded choices (seed + index) are reproducible"
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].usage.prompt_tokens == prompt_tokens

    completion = oc.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in completion.choices] == [0, 1] and completion.usage.completion_tokens == 8
    assert completion.choices[0].text == completion.choices[1].text  # greedy choices agree
    assert_all_free(wait_idle(server))


def test_seeded_request_is_reproducible_beside_other_requests(server):
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    seeded = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.9, top_p=0.95, seed=1234,
                  extra_body={"ignore_eos": True})

    async def other(i: int) -> None:
        stream = await client.completions.create(model=MODEL, prompt=f"x = {i} +", max_tokens=20, temperature=1.0,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for _ in stream:
            pass

    async def run() -> tuple[str, list[str]]:
        alone = (await client.completions.create(**seeded)).choices[0].text
        together = await asyncio.gather(*(other(i) for i in range(4)), client.completions.create(**seeded),
                                         *(other(i) for i in range(4, 6)), client.completions.create(**seeded))
        return alone, [together[4].choices[0].text, together[7].choices[0].text]

    alone, beside = asyncio.run(run())
    assert beside == [alone, alone]


# ----- penalties, min_p, min_tokens ---------------------------------------------------------------


PENALTIES = [  # strong enough to change this random model's greedy run (its logits are below 1)
    {"repetition_penalty": 0.5, "frequency_penalty": -1.0, "presence_penalty": -0.5},
    {"repetition_penalty": 1.2, "frequency_penalty": -2.0, "presence_penalty": 0.5},
]


@pytest.mark.parametrize("penalties", PENALTIES)
def test_penalties_follow_the_reference(oc, server, reference, penalties):
    tokenizer = server.async_engine.tokenizer
    prompt_ids = tokenizer.encode(PROMPT)
    want = reference_run(reference, prompt_ids, 10, penalties)
    plain = reference_run(reference, prompt_ids, 10)
    assert [t for t, _, _ in want] != [t for t, _, _ in plain], "the penalties change the greedy run"
    for stream in (False, True):
        response = oc.completions.create(
            model=MODEL, prompt=prompt_ids, max_tokens=10, temperature=0, logprobs=0, stream=stream,
            presence_penalty=penalties["presence_penalty"], frequency_penalty=penalties["frequency_penalty"],
            extra_body={"ignore_eos": True, "repetition_penalty": penalties["repetition_penalty"]},
        )
        choices = [c for chunk in response for c in chunk.choices] if stream else response.choices
        tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens]
        for got, (token, _, clear) in zip(tokens, want, strict=False):
            assert got == tokenizer.decode([token])
            if not clear:
                break


def test_logit_bias_steers_the_choice(oc, server):
    tokenizer = server.async_engine.tokenizer
    target = tokenizer.encode(" the")[-1]
    for stream in (False, True):
        response = oc.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0,
                                         stream=stream, logit_bias={str(target): 100}, extra_body={"ignore_eos": True})
        choices = [c for chunk in response for c in chunk.choices] if stream else response.choices
        assert [t for c in choices if c.logprobs for t in c.logprobs.tokens] == [tokenizer.decode([target])] * 4


def test_min_p_one_is_greedy(oc):
    fields = dict(model=MODEL, prompt=PROMPT, max_tokens=8)
    greedy = oc.completions.create(**fields, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    only_max = oc.completions.create(**fields, temperature=1.0, extra_body={"ignore_eos": True, "min_p": 1.0})
    assert only_max.choices[0].text == greedy


def test_min_tokens_holds_back_stop_token_ids(oc, server, reference):
    tokenizer = server.async_engine.tokenizer
    prompt_ids = tokenizer.encode(PROMPT)
    run = reference_run(reference, prompt_ids, 3)
    if len(run) < 3 or not all(clear for _, _, clear in run):
        pytest.skip("near tie in the reference run")  # cannot happen for this model and prompt
    stop_id = run[1][0]
    fields = dict(model=MODEL, prompt=prompt_ids, max_tokens=12, temperature=0)
    stops = oc.completions.create(**fields, extra_body={"stop_token_ids": [stop_id], "ignore_eos": True})
    first = [t for t, _, _ in run].index(stop_id) + 1
    assert stops.choices[0].finish_reason == "stop" and stops.usage.completion_tokens == first
    for stream in (False, True):
        held = oc.completions.create(**fields, stream=stream, logprobs=0,
                                     extra_body={"stop_token_ids": [stop_id], "ignore_eos": True, "min_tokens": 5})
        choices = [c for chunk in held for c in chunk.choices] if stream else held.choices
        tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens]
        reason = [c.finish_reason for c in choices if c.finish_reason][-1]
        assert len(tokens) >= 6, "the stop token id may end the output only after min_tokens tokens"
        assert reason == "length" and len(tokens) == 12 or tokens[-1] == tokenizer.decode([stop_id])


# ----- stop strings, max_completion_tokens -----------------------------------------------------------


def test_stop_string_spanning_tokens(oc):
    fields = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    free = oc.completions.create(**fields, logprobs=0).choices[0]
    tokens = free.logprobs.tokens
    pairs = [i for i in range(1, len(tokens) - 1)
             if tokens[i] and tokens[i + 1] and "\ufffd" not in tokens[i] + tokens[i + 1]]
    assert pairs, f"no two printable neighbouring tokens in {tokens}"
    i = pairs[0]
    stop = tokens[i][-1] + tokens[i + 1][0]  # the last character of one token, the first of the next
    want = free.text[: free.text.index(stop)]
    cut = oc.completions.create(**fields, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == want
    chunks = list(oc.completions.create(**fields, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_max_completion_tokens(oc):
    fields = dict(model=MODEL, messages=HELLO, max_completion_tokens=3, extra_body={"ignore_eos": True})
    reply = oc.chat.completions.create(**fields)
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
    chunks = list(oc.chat.completions.create(**fields, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 3


# ----- validation ---------------------------------------------------------------------------------

CHAT_400 = [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"repetition_penalty": 2.5}}, "repetition_penalty"),
    ({"extra_body": {"min_p": 1.5}}, "min_p"),
    ({"extra_body": {"min_tokens": -1}}, "min_tokens"),
    ({"max_completion_tokens": 4, "extra_body": {"min_tokens": 5}}, "min_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"logit_bias": {"five": 10}}, "logit_bias"),
    ({"logit_bias": {"100000": 10}}, "logit_bias"),  # beyond the vocabulary
]


@pytest.mark.parametrize(("fields", "param"), CHAT_400, ids=[p + str(i) for i, (_, p) in enumerate(CHAT_400)])
def test_out_of_range_chat_fields_are_400_naming_the_field(oc, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        oc.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, **fields)
    assert info.value.body["param"] == param, info.value.body


@pytest.mark.parametrize(("fields", "param"), [
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"best_of": 2}, "best_of"),
])
def test_out_of_range_completion_fields_are_400_naming_the_field(oc, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        oc.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, **fields)
    assert info.value.body["param"] == param, info.value.body


def test_choice_seeds_are_seed_plus_index_within_int64():
    from onecat.runtime.sampling_params import SEED_MAX, SEED_MIN
    from onecat.runtime.server.openai_serving import child_seed

    assert [child_seed(5, i) for i in range(3)] == [5, 6, 7]
    assert child_seed(None, 2) is None
    assert child_seed(SEED_MAX, 1) == SEED_MIN and child_seed(SEED_MAX, 0) == SEED_MAX
