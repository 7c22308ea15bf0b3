"""A request whose logits turn non-finite ends with an error naming the step; the others
carry on, and no token is ever emitted from NaN logits (issue 40)."""

from __future__ import annotations

import logging

import pytest
import torch
from runtime_helpers import drain

from onecat.runtime.config import EngineConfig
from onecat.runtime.engine import LLMEngine
from onecat.runtime.sampling_params import SamplingParams
from onecat.tiny_train import fixture_dir

pytestmark = pytest.mark.usefixtures("one_thread")


def poison(engine: LLMEngine, victim: str, at_token: int) -> None:
    """Make the runner hand NaN logits to ``victim`` when it has ``at_token - 1`` tokens."""
    run = engine.runner.run

    def spy(scheduled, *args):
        seqs, logits = run(scheduled, *args)
        for row, seq in enumerate(seqs):
            if seq.request_id == victim and seq.num_completion_tokens == at_token - 1:
                logits = logits.clone()
                logits[row, 5] = float("nan")
        return seqs, logits

    engine.runner.run = spy


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_nonfinite_logits_end_the_request_with_an_error(async_scheduling, temperature, caplog):
    engine = LLMEngine(EngineConfig(model=str(fixture_dir("qwen3_5")), device="cpu", max_num_seqs=4,
                                    async_scheduling=async_scheduling))
    poison(engine, "victim", at_token=3)
    params = SamplingParams(max_tokens=6, temperature=temperature, ignore_eos=True, seed=1)
    prompt = engine.tokenizer.encode("def add(a, b):")
    engine.add_request("victim", prompt, params)
    engine.add_request("bystander", prompt, params)
    with caplog.at_level(logging.ERROR, logger="onecat.runtime.engine.llm_engine"):
        outputs = drain(engine)
    victim = outputs["victim"]
    assert [len(o.new_token_ids) for o in victim] == [1, 1, 0], "tokens after the NaN step"
    assert victim[-1].finished and victim[-1].finish_reason == "error"
    assert "output token 3 were not finite" in victim[-1].error and "eager" in victim[-1].error
    assert sum(len(o.new_token_ids) for o in outputs["bystander"]) == 6
    assert outputs["bystander"][-1].finish_reason == "length"
    assert any("request victim: non-finite logits" in r.getMessage() and "output token 3" in r.getMessage()
               for r in caplog.records)
    stats = engine.stats()
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]


def test_nonfinite_rows_flags_nan_and_inf():
    from onecat.runtime.layers.sampler import nonfinite_rows

    logits = torch.zeros(3, 4)
    logits[1, 2] = float("inf")
    logits[2, 0] = float("nan")
    assert nonfinite_rows(logits).tolist() == [False, True, True]
