"""Automatic prefix caching (KV blocks + GDN state checkpoints) on tiny Qwen3.5 models (CPU, fp32).

The same requests run on an engine without the cache and one with it must give the same
greedy tokens and logits within ATOL. Not bit-identical: the cache makes the delta rule's
chunks end at checkpoint boundaries and skips cached prefixes, so the chunked delta rule and the
matmuls see other chunk boundaries and sum in another order (observed ~4e-7 on logits of
size O(1)); token equality is asserted only where the reference's top-1 margin exceeds
twice ATOL (``assert_same_greedy_runs``), as everywhere for random weights.
"""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import assert_same_greedy_runs, drain, record_logits
from server_helpers import capture_launches

from onecat.runtime.config import EngineConfig
from onecat.runtime.engine import LLMEngine
from onecat.runtime.engine.block_manager import (
    ROOT_HASH,
    BlockManager,
    StateCheckpoints,
    block_hash,
)
from onecat.runtime.engine.sequence import Sequence
from onecat.runtime.sampling_params import SamplingParams
from onecat.runtime.server.metrics import ServerMetrics
from onecat.tiny import build_tiny_model

ATOL = 1e-5
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    torch.set_num_threads(1)
    return build_tiny_model("qwen3_5", tmp_path_factory.mktemp("prefix") / "dense")


def tokens(seed: int, length: int) -> list[int]:
    return torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine_for(path, caching: bool, **overrides) -> LLMEngine:
    settings = dict(
        model=str(path), device="cpu", max_num_batched_tokens=16, kv_block_size=8, num_kv_blocks=96,
        max_num_seqs=8, enable_prefix_caching=caching, state_checkpoint_interval=32,
    )
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def run_waves(engine: LLMEngine, waves: list[dict[str, list[int]]]) -> tuple[dict, dict]:
    """Run each wave of requests (submitted together) to completion, one wave after another;
    returns ``(tokens, logits)`` by request id and checks that the engine is idle after."""
    logits = record_logits(engine)
    out_tokens: dict[str, list[int]] = {}
    for wave in waves:
        for rid, ids in wave.items():
            engine.add_request(rid, ids, GREEDY)
        for rid, outs in drain(engine).items():
            out_tokens[rid] = [t for o in outs for t in o.new_token_ids]
    assert_idle(engine)
    return out_tokens, {rid: torch.stack(rows) for rid, rows in logits.items()}


def assert_idle(engine: LLMEngine) -> None:
    """Every block and slot is free again (cached blocks count as free) and no checkpoint row
    is lost (each is published or free)."""
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == 0
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]
    assert stats["free_state_slots"] == stats["total_state_slots"]
    points = engine.scheduler.checkpoints
    if points is not None:
        assert len(points) + len(points._free) == points.num_rows


def shared_prefix_waves() -> list[dict[str, list[int]]]:
    prefix = tokens(0, 70)  # 8 full blocks of 8 and a partial one
    return [
        {"a": prefix + tokens(1, 6)},  # checkpoints at 32, 64 (interval) and 72 (last block)
        {"b": prefix + tokens(2, 9)},  # hits 64 tokens
        {"c": prefix + tokens(1, 6) + tokens(3, 20)},  # a's prompt continued: hits 72
        {"d": prefix + tokens(4, 3), "e": prefix + tokens(5, 12), "f": tokens(6, 40)},
        {"g": prefix + tokens(1, 6)},  # a's prompt again: hits 72 of 76 (never all)
        {"h": prefix + tokens(7, 3)},  # hits 64, checkpoints its last block (72)
        {"i": prefix + tokens(7, 3)},  # h again: hits 72 of 73, its one token runs as a decode
    ]


def test_outputs_match_without_the_cache_and_prefixes_hit(dense):
    waves = shared_prefix_waves()
    reference = run_waves(engine_for(dense, caching=False), waves)
    engine = engine_for(dense, caching=True)
    got = run_waves(engine, waves)
    assert_same_greedy_runs(reference, got, ATOL, label="prefix cache")
    # exact tokens too: the smallest top-1 margin of these runs is 3e-3 (measured), 300x ATOL
    assert got[0] == reference[0]
    stats = engine.stats()
    queries = sum(len(ids) for wave in waves for ids in wave.values())
    # b 64, c 72, d 64, e 64, g 72, h 64, i 72; a and f find nothing
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (queries, 64 + 72 + 64 + 64 + 72 + 64 + 72)


def test_restores_and_saves_beside_decode_graphs(dense, monkeypatch):
    """With (CPU-emulated) decode graphs: a hit leaving one prompt token replays the decode
    graph from the restored state, and checkpoints are taken in steps that replay graphs."""
    from runtime_helpers import emulate_graphs

    waves = shared_prefix_waves()
    reference = run_waves(engine_for(dense, caching=False), waves)
    engine = engine_for(dense, caching=True)
    emulate_graphs(monkeypatch, engine)
    got = run_waves(engine, waves)
    assert engine.runner.graphs
    assert_same_greedy_runs(reference, got, ATOL, label="prefix cache with graphs")


def test_branching_point_is_checkpointed_for_the_next_request(dense):
    """Requests sharing a 40-token prefix that no interval boundary ends: the second one
    computes it (its KV blocks are cached, the states are not) and checkpoints the state
    where the cached blocks end, the third one starts there."""
    prefix = tokens(10, 40)
    waves = [{"a": prefix + tokens(11, 3)}, {"b": prefix + tokens(12, 4)}, {"c": prefix + tokens(13, 5)}]
    engine = engine_for(dense, caching=True, state_checkpoint_interval=1024)
    got = run_waves(engine, waves)
    assert engine.stats()["prefix_cache_hits"] == 40
    assert_same_greedy_runs(run_waves(engine_for(dense, caching=False), waves), got, ATOL)


def test_eviction_under_memory_pressure_loses_only_speed(dense):
    """Few KV blocks and checkpoint rows: cached blocks and checkpoints are evicted and
    revived while requests preempt each other; outputs stay those of the uncached engine."""
    prefix = tokens(20, 50)
    waves = [
        {f"x{i}": prefix + tokens(30 + i, 5 + 3 * i) for i in range(4)},
        {f"y{i}": tokens(40 + i, 30) for i in range(3)},
        {f"z{i}": prefix + tokens(50 + i, 7) for i in range(3)},
    ]
    small = dict(num_kv_blocks=14, max_num_seqs=4)
    reference = run_waves(engine_for(dense, caching=False, **small), waves)
    engine = engine_for(dense, caching=True, **small)
    engine.runner.num_checkpoints = 2  # a tiny checkpoint pool: rows are evicted and reused
    engine.scheduler.checkpoints = StateCheckpoints(2, engine.runner.num_slots + 1)
    preempted = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (preempted.append(seq.request_id), preempt(seq))
    got = run_waves(engine, waves)
    assert preempted, "the test should preempt"
    assert engine.stats()["prefix_cache_hits"] > 0
    assert_same_greedy_runs(reference, got, ATOL, label="eviction")


def test_abort_frees_everything(dense):
    engine = engine_for(dense, caching=True)
    prefix = tokens(60, 70)
    engine.add_request("warm", prefix + tokens(61, 4), GREEDY)
    drain(engine)
    engine.add_request("decoding", prefix + tokens(63, 2), GREEDY)
    engine.add_request("mid-prefill", prefix + tokens(62, 80), GREEDY)
    for _ in range(3):
        engine.step()
    seqs = {s.request_id: s for s in engine.scheduler.running}
    assert seqs["mid-prefill"].num_computed_tokens < seqs["mid-prefill"].num_prompt_tokens
    assert seqs["decoding"].num_completion_tokens > 0
    engine.abort_request("mid-prefill")
    engine.abort_request("decoding")
    assert_idle(engine)
    engine.add_request("after", prefix + tokens(64, 3), GREEDY)  # the cache still serves
    drain(engine)
    assert_idle(engine)
    assert engine.stats()["prefix_cache_hits"] >= 3 * 64


def test_a_long_prompt_keeps_only_its_latest_interval_checkpoint(dense):
    """Interval checkpoints at 32, 64, 96 and 128 replace each other; the one at the prompt's
    last block (136) stays: two rows, whatever the prompt's length."""
    engine = engine_for(dense, caching=True)
    ids = tokens(70, 140)
    engine.add_request("long", ids, GREEDY)
    drain(engine)
    points, hashes = engine.scheduler.checkpoints, engine.block_manager.hashes(sequence(ids), 136)
    assert len(points) == 2
    assert points.lookup(hashes[128 // 8 - 1]) is not None and points.lookup(hashes[136 // 8 - 1]) is not None


def test_checkpoints_inside_a_prompt_chunk_do_not_cut_it(dense, monkeypatch):
    """A budget that fits the whole 140-token prompt: it is computed in one step (not cut at
    the checkpoints at 128 and 136, which the GDN layers write during the pass), and later
    requests starting from those checkpoints get what an engine without the cache gives."""
    ids = tokens(70, 140)
    waves = [{"a": ids}, {"b": ids[:136] + tokens(71, 5)}, {"c": ids[:130] + tokens(72, 20)}]
    reference = run_waves(engine_for(dense, caching=False, max_num_batched_tokens=256), waves)
    engine = engine_for(dense, caching=True, max_num_batched_tokens=256)
    counts = []
    run = engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda scheduled, *args: counts.append([n for _, n in scheduled]) or run(scheduled, *args))
    got = run_waves(engine, waves)
    assert counts[0] == [140]
    assert_same_greedy_runs(reference, got, ATOL, label="checkpoints inside a chunk")
    assert engine.stats()["prefix_cache_hits"] == 136 + 128


def test_disabled_cache_reuses_nothing(dense):
    engine = engine_for(dense, caching=False)
    assert engine.runner.num_checkpoints == 0 and engine.scheduler.checkpoints.num_rows == 0
    run_waves(engine, shared_prefix_waves())
    assert engine.stats()["prefix_cache_hits"] == 0
    assert engine.block_manager.num_cached == 0


def test_tensor_parallel_with_the_cache(dense):
    """TP 2 (CPU worker processes) restores and saves checkpoints on every rank."""
    waves = shared_prefix_waves()[:3]
    reference = run_waves(engine_for(dense, caching=False), waves)
    engine = engine_for(dense, caching=True, tensor_parallel_size=2)
    try:
        got = run_waves(engine, waves)
    finally:
        engine.close()
    assert engine.stats()["prefix_cache_hits"] == 64 + 72
    assert_same_greedy_runs(reference, got, 1e-4, label="TP2 prefix cache")


# --- the pieces ------------------------------------------------------------------------------


def sequence(ids: list[int]) -> Sequence:
    return Sequence("s", ids, GREEDY, detokenizer=None, generator=None)


def test_block_hashes_chain_over_the_prefix():
    ids = list(range(24))
    manager = BlockManager(8, 8)
    hashes = manager.hashes(sequence(ids), 24)
    assert len(hashes) == 3 and hashes[0] == block_hash(ROOT_HASH, ids[:8])
    assert hashes[1] == block_hash(hashes[0], ids[8:16])
    other = manager.hashes(sequence([99] + ids[1:]), 24)  # same later blocks, other first token
    assert all(a != b for a, b in zip(hashes, other, strict=True))
    assert len(manager.hashes(sequence(ids[:23]), 23)) == 2  # only full blocks


def test_blocks_are_shared_with_reference_counts_and_evicted_lru():
    manager = BlockManager(4, 2)
    a, b = sequence([1, 2, 3, 4, 5]), sequence([1, 2, 3, 4, 6])
    manager.grow(a, 5)
    a.num_computed_tokens = 4
    manager.register(a)
    assert manager.num_cached == 2 and manager.num_free == 1
    shared = manager.cached_prefix(b, 4)
    assert shared == a.block_table[:2]
    manager.take_cached(b, shared)
    manager.grow(b, 5)
    assert manager.num_free == 0
    manager.free(a)  # the shared blocks stay held by b
    assert manager.num_free == 1
    manager.free(b)
    assert manager.num_free == 4 and manager.num_cached == 2
    c = sequence([7, 8, 9, 10, 11, 12, 13, 14])
    manager.grow(c, 8)  # takes the 2 uncached blocks first, then evicts the cached ones
    assert manager.num_cached == 0 and manager.num_free == 0
    manager.free(c)
    assert manager.cached_prefix(b, 4) == []


def test_checkpoint_pool_is_lru_and_publishes_after_the_step():
    pool = StateCheckpoints(2, first_row=5)
    first, second = pool.reserve(), pool.reserve()
    assert {first, second} == {5, 6} and pool.lookup(b"a") is None
    pool.publish(b"a", first)
    pool.publish(b"b", second)
    pool.touch(b"a")
    assert pool.reserve() == second and pool.lookup(b"b") is None  # b was least recently used
    assert pool.lookup(b"a") == first


def test_metrics_report_prefix_cache_counters():
    metrics = ServerMetrics(lambda: {"prefix_cache_queries": 300, "prefix_cache_hits": 128}, "m")
    text = metrics.render().decode()
    assert 'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 300.0' in text
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 128.0' in text


def test_stats_report_the_cache(dense):
    engine = engine_for(dense, caching=True)
    engine.add_request("a", tokens(80, 70), GREEDY)
    drain(engine)
    stats = engine.stats()
    # 70 prompt + 5 computed generated tokens: 9 full blocks; checkpoints at 32 (the latest
    # interval one) and 64 (the last block); 8 rows (max_num_seqs)
    assert stats["cached_kv_blocks"] == 9
    assert (stats["state_checkpoints"], stats["total_state_checkpoints"]) == (2, 8)
    text = ServerMetrics(engine.stats).render().decode()
    assert 'onecat:kv_blocks_cached{engine="0"} 9.0' in text and 'onecat:state_checkpoints{engine="0"} 2.0' in text


def test_cli_flags(tmp_path, monkeypatch):
    """``--no-enable-prefix-caching`` turns the cache off in the embedded engine's config and
    is passed on to vLLM; the default is on and adds nothing to vLLM's arguments."""
    from click.testing import CliRunner

    from onecat.cli import main

    configs, vllm_calls = capture_launches(monkeypatch)
    runner = CliRunner()
    runner.invoke(main, ["generate", str(tmp_path), "--prompt", "x"])
    runner.invoke(main, ["generate", str(tmp_path), "--prompt", "x", "--no-enable-prefix-caching"])
    runner.invoke(main, ["serve", str(tmp_path), "--no-enable-prefix-caching"])
    assert [c.enable_prefix_caching for c in configs] == [True, False, False]
    runner.invoke(main, ["serve", str(tmp_path), "--engine", "vllm"])
    runner.invoke(main, ["serve", str(tmp_path), "--engine", "vllm", "--no-enable-prefix-caching"])
    assert [k["vllm_args"] for k in vllm_calls] == [(), ("--no-enable-prefix-caching",)]
