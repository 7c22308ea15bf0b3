"""The embedded runtime against transformers on tiny Qwen3.5 models (CPU, fp32).

Tolerance: engine logits match transformers' logits (same weights; quantized models use the
kernels' dequantised weights in transformers) within 1e-4 absolute (logits are O(1); the
observed difference is ~1e-6, from summation order). Greedy tokens are identical.
"""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import (
    drain,
    record_logits,
    reference_logits,
    reference_model,
    write_awq_checkpoint,
)

from onecat.pack.writer import pack_checkpoint
from onecat.runtime.config import EngineConfig
from onecat.runtime.engine import LLMEngine
from onecat.runtime.errors import RequestError
from onecat.runtime.sampling_params import SamplingParams
from onecat.tiny import build_tiny_model

ATOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (checkpoint path, transformers reference) for float, AWQ and packed models."""
    root = tmp_path_factory.mktemp("runtime")
    torch.set_num_threads(1)
    dense = build_tiny_model("qwen3_5", root / "dense")
    moe = build_tiny_model("qwen3_5_moe", root / "moe")
    dense_deq = write_awq_checkpoint(dense, root / "dense-awq")
    moe_deq = write_awq_checkpoint(moe, root / "moe-awq")
    pack_checkpoint(root / "moe-awq", root / "moe-packed", show_progress=False)
    dense_ref, moe_ref = reference_model(dense), reference_model(moe)
    return {
        "dense": (dense, dense_ref),
        "moe": (moe, moe_ref),
        "dense-awq": (root / "dense-awq", reference_model(dense, dense_deq)),
        "moe-packed": (root / "moe-packed", reference_model(moe, moe_deq)),
    }


def make_engine(path, **overrides) -> LLMEngine:
    settings = dict(model=str(path), device="cpu", max_num_batched_tokens=16, kv_block_size=8, num_kv_blocks=96)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def check_against_reference(engine_logits, outputs, prompts, reference) -> None:
    for rid, tokens in prompts.items():
        generated = [t for out in outputs[rid] for t in out.new_token_ids]
        assert len(generated) == GREEDY.max_tokens and outputs[rid][-1].finish_reason == "length"
        ref = reference_logits(reference, tokens + generated[:-1])[len(tokens) - 1 :]
        got = torch.stack(engine_logits[rid])
        assert got.shape == ref.shape
        diff = (got - ref).abs().max().item()
        assert diff < ATOL, f"{rid}: logits differ by {diff}"
        # teacher-forced: a token other than the reference's argmax only at a near tie
        lead = ref.max(-1).values - ref[torch.arange(len(generated)), generated]
        assert (lead <= 2 * ATOL).all(), f"{rid}: greedy tokens {generated} vs {ref.argmax(-1).tolist()}"


@pytest.mark.parametrize("name", ["dense", "moe", "dense-awq", "moe-packed"])
def test_batched_chunked_interleaved_requests_match_transformers(models, name):
    """Two requests start together (one prefilled in 16-token chunks over 8-token KV
    blocks), a third joins mid-decode; every sampled position matches transformers."""
    path, reference = models[name]
    engine = make_engine(path)
    logits = record_logits(engine)
    prompts = {"long": prompt(1, 37), "short": prompt(2, 5), "late": prompt(3, 23)}
    engine.add_request("long", prompts["long"], GREEDY)
    engine.add_request("short", prompts["short"], GREEDY)
    outputs = {}
    for _ in range(4):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert outputs["short"], "the short request should be decoding while the long one prefills"
    engine.add_request("late", prompts["late"], GREEDY)
    for rid, outs in drain(engine).items():
        outputs.setdefault(rid, []).extend(outs)
    check_against_reference(logits, outputs, prompts, reference)
    stats = engine.stats()
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]
    assert stats["free_state_slots"] == stats["total_state_slots"]


def test_single_request_matches_transformers_generate(models):
    """Greedy decoding equals transformers' own generate (its recurrent decode path)."""
    path, reference = models["dense"]
    engine = make_engine(path, max_num_batched_tokens=64)
    tokens = prompt(4, 20)
    engine.add_request("a", tokens, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    generated = [t for out in drain(engine)["a"] for t in out.new_token_ids]
    with torch.no_grad():
        expected = reference.generate(
            torch.tensor([tokens]), max_new_tokens=8, do_sample=False, min_new_tokens=8
        )[0, len(tokens) :].tolist()
    assert generated == expected


def test_preemption_recomputes_and_keeps_outputs(models):
    """With too few KV blocks for all requests, sequences are preempted and recomputed; the
    greedy outputs equal an unconstrained run."""
    path, _ = models["dense"]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    results, prompt_steps = [], []
    for blocks in (96, 12):
        engine = make_engine(path, num_kv_blocks=blocks, max_num_batched_tokens=64)
        preempted = []
        preempt = engine.scheduler._preempt
        engine.scheduler._preempt = lambda seq, log=preempted, real=preempt: (
            log.append(seq.request_id),
            real(seq),
        )
        for i in range(3):
            engine.add_request(f"r{i}", prompt(10 + i, 30), params)
        outs = drain(engine)
        results.append({rid: [t for o in v for t in o.new_token_ids] for rid, v in outs.items()})
        stats = engine.stats()
        assert stats["free_kv_blocks"] == blocks
        assert bool(preempted) == (blocks == 12)
        assert stats["num_preemptions"] == len(preempted)
        # every step counted; those with prompt chunks (three prompts, recomputed ones too) apart
        assert stats["steps_total"] >= 10 and 1 <= stats["prompt_steps_total"] < stats["steps_total"]
        prompt_steps.append(stats["prompt_steps_total"])
    assert results[0] == results[1]
    assert prompt_steps[1] > prompt_steps[0]  # the preempted prompts were computed again


def test_abort_frees_blocks_and_slots(models):
    path, _ = models["dense"]
    engine = make_engine(path)
    engine.add_request("a", prompt(5, 30), SamplingParams(max_tokens=20, temperature=0.0))
    engine.add_request("b", prompt(6, 10), SamplingParams(max_tokens=20, temperature=0.0))
    engine.step()
    engine.step()
    before = engine.stats()
    assert before["free_kv_blocks"] < before["total_kv_blocks"]
    engine.abort_request("a")
    after = engine.stats()
    assert after["running"] == 1 and after["free_state_slots"] == after["total_state_slots"] - 1
    held_by_b = len(engine._sequences["b"].block_table)
    assert held_by_b and after["free_kv_blocks"] == after["total_kv_blocks"] - held_by_b
    engine.abort_request("a")  # unknown / finished ids are ignored
    drain(engine)
    final = engine.stats()
    assert final["free_kv_blocks"] == final["total_kv_blocks"]
    assert final["free_state_slots"] == final["total_state_slots"]


def test_seeded_sampling_is_reproducible_in_any_batch(models):
    path, _ = models["moe"]
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=50, top_p=0.9, seed=7, ignore_eos=True)
    engine = make_engine(path)
    engine.add_request("alone", prompt(8, 12), params)
    alone = [t for o in drain(engine)["alone"] for t in o.new_token_ids]
    engine.add_request("other", prompt(9, 17), SamplingParams(max_tokens=8, temperature=1.0))
    engine.add_request("again", prompt(8, 12), params)
    again = [t for o in drain(engine)["again"] for t in o.new_token_ids]
    assert alone == again
    engine.add_request("seed8", prompt(8, 12), SamplingParams(**{**params.__dict__, "seed": 8}))
    assert [t for o in drain(engine)["seed8"] for t in o.new_token_ids] != alone


def test_stop_strings_and_stop_tokens(models):
    path, _ = models["dense"]
    engine = make_engine(path)
    ids = engine.tokenizer.encode("def parse(text):\n    return")
    free_run = engine.generate([ids], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    stop = free_run[5:8]
    assert len(free_run) > 10 and stop
    engine.add_request("s", ids, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))
    outs = drain(engine)["s"]
    assert outs[-1].finish_reason == "stop"
    streamed = "".join(o.new_text for o in outs)
    assert streamed == free_run[: free_run.index(stop)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine.add_request("t", ids, greedy)
    tokens = [t for o in drain(engine)["t"] for t in o.new_token_ids]
    engine.add_request("u", ids, SamplingParams(**{**greedy.__dict__, "stop_token_ids": [tokens[2]]}))
    outs = drain(engine)["u"]
    first = tokens.index(tokens[2])
    assert outs[-1].finish_reason == "stop" and outs[-1].completion_tokens == first + 1


def test_bad_requests_raise_request_error(models):
    path, _ = models["dense"]
    engine = make_engine(path, max_model_len=64)
    assert engine.max_model_len == 64
    with pytest.raises(RequestError, match="prompt has 64 tokens"):
        engine.add_request("a", prompt(1, 64), SamplingParams())
    with pytest.raises(RequestError, match="max_tokens 10 is too large"):
        engine.add_request("b", prompt(1, 60), SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="temperature"):
        engine.add_request("c", prompt(1, 5), SamplingParams(temperature=-1))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("d", [], SamplingParams())
    assert not engine.has_unfinished_requests()


def test_model_without_full_attention_layers_serves(tmp_path):
    """A hybrid config whose layers are all linear attention (no KV cache at all) plans its
    memory and generates: KV blocks are then bookkeeping only (no division by their size)."""
    import json

    from onecat.runtime.models.config import ModelConfig
    from onecat.runtime.models.qwen3_5 import Qwen3_5ForCausalLM
    from onecat.runtime.quant_plan import QuantPlan

    raw = json.loads((build_tiny_model("qwen3_5", tmp_path / "dense") / "config.json").read_text())
    text = raw["text_config"]
    text["layer_types"] = ["linear_attention"] * text["num_hidden_layers"]
    model = Qwen3_5ForCausalLM(ModelConfig.from_dict(raw), QuantPlan(), torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.rand(param.shape, generator=generator).add(1).log())
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    engine = LLMEngine.from_model(EngineConfig(model="linear-only", device="cpu", max_num_seqs=4), model)
    assert engine.runner.num_blocks > 0 and not engine.runner.attention
    engine.add_request("r", prompt(1, 12), GREEDY)
    outputs = drain(engine)["r"]
    assert sum(len(o.new_token_ids) for o in outputs) == GREEDY.max_tokens
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
