"""Prefix caching on a GPU: 4 layers at Qwen3.5-27B's widths (random packed weights, fp16,
GDN prefill and decode kernels, paged attention kernel, CUDA graphs), with vs without the cache.

Chunk boundaries differ between the two engines (the cache ends prompt chunks at checkpoint
boundaries and skips cached prefixes), so fp16 roundings differ; logits are held to
GPU_RTOL of the request's largest logit and greedy tokens must agree but at near ties.

    pytest -q tests/test_prefix_cache_gpu.py        (ONECAT_KERNEL_ARCH=70 on a newer GPU)
"""

from __future__ import annotations

import functools

import pytest
import torch
from runtime_helpers import assert_same_greedy_runs, drain, record_logits
from test_runtime_tp import FULL_WIDTH, GPU_RTOL, random_full_width

from onecat.runtime.config import EngineConfig
from onecat.runtime.engine import LLMEngine
from onecat.runtime.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def ids(seed: int, length: int) -> list[int]:
    return torch.randint(3, 4000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(caching: bool, eager: bool) -> tuple[tuple[dict, dict], dict]:
    config = EngineConfig(
        model="random-full-width", device="cuda", max_num_batched_tokens=96, kv_block_size=16,
        num_kv_blocks=256, max_num_seqs=8, max_model_len=1024, enforce_eager=eager,
        enable_prefix_caching=caching, state_checkpoint_interval=128,
    )
    engine = LLMEngine.from_factory(config, functools.partial(random_full_width, FULL_WIDTH))
    logits = record_logits(engine)
    prefix = ids(0, 300)
    waves = [
        {"a": prefix + ids(1, 20)},
        {"b": prefix + ids(2, 33)},  # hits 256 (interval)
        {"c": prefix + ids(3, 7), "d": prefix + ids(4, 50)},  # hit 288 (b's branching point)
        {"e": prefix + ids(1, 20) + ids(5, 40)},  # a's prompt continued: hits 304 (a's last block)
        {"f": prefix + ids(6, 5)},  # hits 288, checkpoints its last block (304)
        {"g": prefix + ids(6, 5)},  # f again: hits 304 of 305; its one token replays the decode graph
    ]
    tokens: dict[str, list[int]] = {}
    for wave in waves:
        for rid, prompt in wave.items():
            engine.add_request(rid, prompt, GREEDY)
        for rid, outs in drain(engine).items():
            tokens[rid] = [t for o in outs for t in o.new_token_ids]
    stats = engine.stats()
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]
    assert stats["free_state_slots"] == stats["total_state_slots"]
    return (tokens, {rid: torch.stack(rows) for rid, rows in logits.items()}), stats


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_prefix_cache_matches_no_cache_on_gpu(eager):
    reference, _ = run(caching=False, eager=eager)
    got, stats = run(caching=True, eager=eager)
    assert stats["prefix_cache_hits"] == 256 + 288 + 288 + 304 + 288 + 304
    worst = assert_same_greedy_runs(reference, got, GPU_RTOL, relative=True, label="prefix cache GPU")
    print(f"prefix cache vs none: max |logit diff| / max |logit| = {worst:.2e}")
