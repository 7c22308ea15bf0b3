"""Overlapped decode steps (``async_scheduling``): the engine queues step N+1 on the device,
its input tokens taken there from step N's samples, before it reads step N's tokens.

On CPU the same code runs (the "device" is synchronous), so these tests check its
bookkeeping: the same outputs as synchronous steps, the extra token of a sequence that
finished with the step in flight dropped, aborts while a step is in flight, and nothing
leaked. Tiny random models (CPU, fp32): runs are compared by logits within a tolerance, with
tokens allowed to part only at a near tie (``assert_same_greedy_runs``).
"""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import assert_same_greedy_runs, drain, record_logits

from onecat.runtime.config import EngineConfig
from onecat.runtime.engine import LLMEngine
from onecat.runtime.sampling_params import SamplingParams
from onecat.tiny import build_tiny_model

ATOL = 1e-4

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("overlap")
    return {name: build_tiny_model(name, root / name) for name in ("qwen3_5", "qwen3_5_moe")}


def make_engine(path, overlap: bool, **overrides) -> LLMEngine:
    settings = dict(model=str(path), device="cpu", max_num_batched_tokens=32, kv_block_size=8, num_kv_blocks=96,
                    max_num_seqs=8, async_scheduling=overlap)  # fmt: skip
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def count_overlapped(engine: LLMEngine) -> list[int]:
    """Count the forward passes whose input tokens came from the device (a one-item list)."""
    count = [0]
    run = engine.runner.run

    def spy(scheduled, input_tokens=None):
        count[0] += input_tokens is not None
        return run(scheduled, input_tokens)

    engine.runner.run = spy
    return count


def run_requests(engine: LLMEngine, waves: list[dict[str, tuple[list[int], SamplingParams]]]) -> tuple[dict, dict]:
    """Submit each wave after two steps of the one before, drain; ``(tokens, logits)`` by id."""
    logits = record_logits(engine)
    outputs: dict[str, list] = {}
    for wave in waves:
        for rid, (ids, params) in wave.items():
            engine.add_request(rid, ids, params)
        for _ in range(2):
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)
    for rid, outs in drain(engine).items():
        outputs.setdefault(rid, []).extend(outs)
    assert_idle(engine)
    tokens = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in outputs.items()}
    for rid, outs in outputs.items():
        assert outs[-1].finished and all(not o.finished for o in outs[:-1]), rid
        assert outs[-1].completion_tokens == len(tokens[rid]), rid
    # a sequence that finished with a step in flight computed one row too many: not an output
    return tokens, {rid: torch.stack(logits[rid][: len(tokens[rid])]) for rid in tokens}


def assert_idle(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == 0
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]
    assert stats["free_state_slots"] == stats["total_state_slots"]


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_overlapped_steps_give_the_synchronous_outputs(models, name):
    greedy = dict(temperature=0.0, ignore_eos=True)
    first = [t for o in drain_one(make_engine(models[name], overlap=False), prompt(3, 9), 12) for t in o.new_token_ids]
    waves = [
        {
            "long": (prompt(1, 20), SamplingParams(max_tokens=14, **greedy)),
            "short": (prompt(2, 5), SamplingParams(max_tokens=3, **greedy)),
            # stops on its 4th token (a stop token): its step in flight is wasted, not emitted
            "stop": (prompt(3, 9), SamplingParams(max_tokens=12, stop_token_ids=[first[3]], **greedy)),
        },
        {"late": (prompt(4, 12), SamplingParams(max_tokens=9, **greedy))},
    ]
    reference = run_requests(make_engine(models[name], overlap=False), waves)
    engine = make_engine(models[name], overlap=True)
    overlapped = count_overlapped(engine)
    got = run_requests(engine, waves)
    assert_same_greedy_runs(reference, got, ATOL, label=name)
    assert overlapped[0] >= 10, "decode steps did not overlap"
    stop = got[0]["stop"]
    if stop == reference[0]["stop"]:  # (a near tie may have changed the path before it)
        assert stop[-1] == first[3] and len(stop) == first.index(first[3]) + 1


def drain_one(engine: LLMEngine, ids: list[int], max_tokens: int) -> list:
    engine.add_request("probe", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return drain(engine)["probe"]


def test_abort_while_a_step_is_in_flight(models):
    engine = make_engine(models["qwen3_5"], overlap=True)
    logits = record_logits(engine)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine.add_request("a", prompt(5, 6), params)
    engine.add_request("b", prompt(6, 6), params)
    outputs: dict[str, list[int]] = {"a": [], "b": []}
    while engine._overlapped.in_flight is None or len(outputs["a"]) < 3:
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    engine.abort_request("a")  # its token in flight is never emitted
    for rid, outs in drain(engine).items():
        outputs[rid] += [t for o in outs for t in o.new_token_ids]
    assert len(outputs["b"]) == 10 and 3 <= len(outputs["a"]) < 10
    assert_idle(engine)
    alone = run_requests(make_engine(models["qwen3_5"], overlap=False), [{"b": (prompt(6, 6), params)}])
    got = ({"b": outputs["b"]}, {"b": torch.stack(logits["b"])})
    assert_same_greedy_runs(alone, got, ATOL, label="the request beside the aborted one")


def test_sampled_rows_with_host_settings_fall_back_to_synchronous_steps(models):
    """Penalties and logprobs need the host between steps: those batches do not overlap, and
    the engine still serves them beside overlapping ones."""
    engine = make_engine(models["qwen3_5"], overlap=True)
    overlapped = count_overlapped(engine)
    engine.add_request("pen", prompt(7, 6), SamplingParams(max_tokens=6, temperature=0.0, presence_penalty=0.5))
    engine.add_request("lp", prompt(8, 6), SamplingParams(max_tokens=6, temperature=0.0, logprobs=2))
    out = drain(engine)
    assert overlapped[0] == 0
    assert all(o.logprobs and len(o.logprobs[0].top) == 2 for o in out["lp"])
    engine.add_request("plain", prompt(9, 6), SamplingParams(max_tokens=8, temperature=0.7, seed=3))
    assert sum(len(o.new_token_ids) for o in drain(engine)["plain"]) == 8
    assert overlapped[0] > 0
    assert_idle(engine)


def test_turning_overlap_off_stops_it_after_the_step_in_flight(models):
    engine = make_engine(models["qwen3_5"], overlap=True)
    overlapped = count_overlapped(engine)
    engine.add_request("a", prompt(10, 6), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    while engine._overlapped.in_flight is None:
        engine.step()
    engine.config.async_scheduling = False
    before = overlapped[0]
    tokens = [t for o in drain(engine)["a"] for t in o.new_token_ids]
    assert overlapped[0] == before, "a step was still queued ahead with async_scheduling off"
    assert engine._overlapped.in_flight is None and tokens
    assert_idle(engine)
