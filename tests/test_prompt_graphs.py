"""Piecewise prompt passes (``engine/prompt_graphs.py``) compute what the plain pass does.

On CPU the stretches between the mixers' cores run as plain code on the static buffers
(the graphs replay the same calls on a GPU): padding to the token bucket, the buffers'
hand-over between stretches and cores, chunked prompts with cached tokens and several
prompts in one pass are checked on the trained tiny models, whose greedy tokens have
margins, so tokens must be identical and logits agree to float rounding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runtime_helpers import drain, record_logits

from onecat.runtime.config import EngineConfig
from onecat.runtime.engine import LLMEngine
from onecat.runtime.engine.prompt_graphs import PromptGraphs, prompt_buckets
from onecat.runtime.sampling_params import SamplingParams
from onecat.tiny_train import FIXTURES


def test_buckets_cover_every_pass_up_to_the_limit():
    assert prompt_buckets(2048) == [16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    assert prompt_buckets(300) == [16, 32, 64, 128, 192, 256, 300]
    assert prompt_buckets(48) == [16, 32, 48]
    assert prompt_buckets(8) == [8]


def _run(path: Path, piecewise: bool, device: str = "cpu") -> tuple[dict, dict, int]:
    """Greedy tokens and logits of a fixed set of requests; on a GPU ``piecewise`` means CUDA
    graphs (captured at start), else ``enforce_eager``."""
    engine = LLMEngine(EngineConfig(model=str(path), device=device, max_num_seqs=4, max_num_batched_tokens=48,
                                    kv_block_size=8, num_kv_blocks=96, enforce_eager=not piecewise))
    passes = []
    if piecewise:
        if device == "cpu":
            engine.runner.prompt_graphs = PromptGraphs(engine.runner.model, 48, None)
        graphs = engine.runner.prompt_graphs
        assert graphs is not None and (device == "cpu" or set(graphs.graphs) == {16, 32, 48})
        run = graphs.run
        graphs.run = lambda *args: (passes.append(args[0].shape[0]), run(*args))[1]
    logits = record_logits(engine)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun. " * 4
    ids = [t % engine.runner.model_config.vocab_size for t in engine.tokenizer.encode(text)]
    engine.add_request("long", ids[:90], params)  # two prompt-only chunks, the second with cached tokens
    engine.add_request("short", ids[3:12], params)
    outputs = drain(engine)
    engine.add_request("a", ids[5:25], params)  # two prompts in one pass, a prefix-cache hit on "long"
    engine.add_request("b", ids[:70], params)
    outputs.update(drain(engine))
    tokens = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in outputs.items()}
    return tokens, {rid: torch.stack(rows) for rid, rows in logits.items()}, len(passes)


@pytest.mark.parametrize("fixture", ["trained-qwen3_5", "trained-qwen3_5_moe"])
def test_piecewise_prompt_pass_matches_plain_pass(fixture):
    torch.set_num_threads(1)
    ref_tokens, ref_logits, _ = _run(FIXTURES / fixture, piecewise=False)
    tokens, logits, passes = _run(FIXTURES / fixture, piecewise=True)
    assert passes >= 3, "the piecewise path did not run"
    assert tokens == ref_tokens
    for rid, expected in ref_logits.items():
        torch.testing.assert_close(logits[rid], expected, atol=1e-4, rtol=1e-4, msg=f"{fixture} {rid}")


def _packed(source: Path, tmp_path: Path) -> Path:
    from runtime_helpers import write_awq_checkpoint

    from onecat.pack.writer import pack_checkpoint

    write_awq_checkpoint(source, tmp_path / "awq")
    return pack_checkpoint(tmp_path / "awq", tmp_path / "packed", show_progress=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["trained-qwen3_5", "qwen3_5_moe"])
def test_captured_prompt_graphs_match_eager_passes(name, tmp_path):
    """Real CUDA graphs (packed weights: the W4A16 and grouped-MoE kernels inside them)
    against ``enforce_eager`` on the same GPU: the fused elementwise kernels round
    differently, so logits agree to fp16 tolerance. The trained dense model's tokens have
    margins and must be identical; the MoE is the tiny random one whose routing margins are
    guaranteed (``SeparatedRouting``; a trained router can flip an expert at fp16 rounding),
    whose tokens may part only at a near tie."""
    from runtime_helpers import assert_same_greedy_runs

    from onecat.tiny import build_tiny_model

    source = FIXTURES / name if name.startswith("trained") else build_tiny_model(name, tmp_path / "fp")
    path = _packed(source, tmp_path)
    ref_tokens, ref_logits, _ = _run(path, piecewise=False, device="cuda")
    tokens, logits, passes = _run(path, piecewise=True, device="cuda")
    assert passes >= 3
    if name.startswith("trained"):
        assert tokens == ref_tokens
    assert_same_greedy_runs((ref_tokens, ref_logits), (tokens, logits), 3e-2, relative=True, label=name)
