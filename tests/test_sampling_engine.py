"""Sampling features inside the real engine (tiny Qwen3.5, CPU): min_tokens holds EOS back,
the logits-processor hook runs per request with its outputs, and a processor that raises
fails its own request only."""

from __future__ import annotations

import pytest
import torch

from onecat.runtime.config import EngineConfig
from onecat.runtime.engine import LLMEngine
from onecat.runtime.sampling_params import SamplingParams
from onecat.tiny import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = build_tiny_model("qwen3_5", tmp_path_factory.mktemp("sampling") / "tiny")
    return LLMEngine(EngineConfig(model=str(path), device="cpu", max_model_len=128, max_num_batched_tokens=32))


def run(engine: LLMEngine, requests: dict[str, SamplingParams]) -> dict[str, list]:
    prompt = engine.tokenizer.encode("def parse(text):")
    for rid, params in requests.items():
        engine.add_request(rid, prompt, params)
    outputs: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def test_min_tokens_holds_back_eos(engine):
    eos = engine.tokenizer.eos_token_id
    assert eos in engine.eos_token_ids
    seen: list[list[int]] = []

    def favour_eos(output_token_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        row[eos] = row.max() + 50.0
        return row

    def recording(output_token_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        seen.append(list(output_token_ids))
        return favour_eos(output_token_ids, row)

    outs = run(engine, {
        "held": SamplingParams(max_tokens=10, temperature=0, min_tokens=4, logits_processors=[recording]),
        "free": SamplingParams(max_tokens=10, temperature=0, logits_processors=[favour_eos]),
        "sampled": SamplingParams(max_tokens=10, temperature=1.0, seed=3, min_tokens=6, logits_processors=[favour_eos]),
    })
    held = [t for o in outs["held"] for t in o.new_token_ids]
    assert len(held) == 5 and held[-1] == eos and eos not in held[:4]
    assert outs["held"][-1].finish_reason == "stop"
    assert [t for o in outs["free"] for t in o.new_token_ids] == [eos]
    sampled = [t for o in outs["sampled"] for t in o.new_token_ids]
    assert len(sampled) == 7 and sampled[-1] == eos
    assert seen == [held[:i] for i in range(5)]  # the outputs so far, at every step


def test_a_raising_logits_processor_fails_its_request_only(engine):
    def broken(output_token_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        raise ValueError("grammar rejected everything")

    outs = run(engine, {
        "bad": SamplingParams(max_tokens=6, temperature=0, logits_processors=[broken]),
        "good": SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2),
    })
    assert outs["bad"][-1].finish_reason == "error" and "grammar rejected" in outs["bad"][-1].error
    good = outs["good"]
    assert good[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in good) == 6
    assert all(len(o.logprobs) == 1 and len(o.logprobs[0].top) == 2 for o in good)
    stats = engine.stats()
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]
