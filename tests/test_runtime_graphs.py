"""The CUDA-graph decode path's bookkeeping, checked on CPU with an emulated graph.

The emulation runs the runner's real capture (static buffers, padding rows pointing at the
scratch KV block and state slot, batch and KV-length buckets, the MoE gathered-expert path)
and "replays" by running the captured forward again on the same static buffers with the
context of the capture. Logits must equal the eager engine's within 1e-4 and greedy tokens
too, but at a near tie (``runtime_helpers.assert_same_greedy_runs``); the MoE models route
with ``onecat.tiny.SeparatedRouting``, so their expert choices cannot flip.
"""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import (
    assert_same_greedy_runs,
    drain,
    emulate_graphs,
    record_logits,
    write_awq_checkpoint,
)

from onecat.pack.writer import pack_checkpoint
from onecat.runtime.config import EngineConfig
from onecat.runtime.engine import LLMEngine
from onecat.runtime.sampling_params import SamplingParams
from onecat.tiny import build_tiny_model


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe", "qwen3_5_moe-packed"])
def test_graph_decode_matches_eager(tmp_path, monkeypatch, name):
    torch.set_num_threads(1)
    family = name.removesuffix("-packed")
    path = build_tiny_model(family, tmp_path / family)
    if name.endswith("-packed"):  # packed experts: the merged per-token linears of the graph path
        write_awq_checkpoint(path, tmp_path / "awq")
        path = pack_checkpoint(tmp_path / "awq", tmp_path / "packed", show_progress=False)
    params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    prompts = {f"r{i}": list(range(5 + i, 23 + 5 * i)) for i in range(3)}
    results = []
    for graphs in (False, True):
        engine = LLMEngine(EngineConfig(model=str(path), device="cpu", kv_block_size=8, num_kv_blocks=64, max_num_seqs=8))
        if graphs:
            emulate_graphs(monkeypatch, engine)
        logits = record_logits(engine)
        engine.add_request("r0", prompts["r0"], params)
        for _ in range(3):
            engine.step()
        engine.add_request("r1", prompts["r1"], params)
        engine.add_request("r2", prompts["r2"], params)
        outs = drain(engine)
        tokens = {rid: [t for o in v for t in o.new_token_ids] for rid, v in outs.items()}
        results.append((tokens, {rid: torch.stack(rows) for rid, rows in logits.items()}))
        if graphs:  # batch buckets 1 and 2 and 4 (3 sequences + one padding row) were used
            assert {key[0] for key in engine.runner.graphs} >= {1, 4}
        stats = engine.stats()
        assert stats["free_kv_blocks"] == stats["total_kv_blocks"]
    assert_same_greedy_runs(results[0], results[1], 1e-4, label=f"{name} graphs vs eager")
