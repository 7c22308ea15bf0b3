"""Issue 42 item 4's benchmark pieces on the CPU: ``bench/e2e.py``'s long-prompt matrix on the
``smoke`` shape (prompt attentions through the runtime's SDPA switch, an engine per KV cache
dtype on one model, the ratios), the engine-alone workload with a shared prefix, and
``bench/serve_h200.py``'s workload strings (the long-document workload)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

from onecat.benchmarks.datasets import prefix_carriers

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load(name: str):
    sys.path.insert(0, str(BENCH))  # serve_h200 imports e2e as its neighbour
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def test_workload_requests_share_a_prefix_like_the_served_dataset():
    e2e = load("e2e")
    requests = e2e.workload_requests(6, 20, 4, 0.0, 500, seed=3, prefix_len=8, prefix_share=0.5)
    assert [len(p) for p, _ in requests] == [28] * 6 and [m for _, m in requests] == [4] * 6
    carriers = prefix_carriers(6, 0.5)
    heads = [tuple(p[:8]) for p, _ in requests]
    shared = {h for h, c in zip(heads, carriers, strict=True) if c}
    assert len(shared) == 1 and all(h not in shared for h, c in zip(heads, carriers, strict=True) if not c)
    assert len(set(heads)) == 4  # one shared head, three fresh ones
    assert e2e.workload_requests(4, 20, 4, 0.5, 500, seed=3) == e2e.workload_requests(4, 20, 4, 0.5, 500, seed=3,
                                                                                        prefix_len=0)


def test_serve_workload_strings():
    serve = load("serve_h200")
    assert serve.parse_workload("320:0.6:64") == (320, 0.6, 64, 0, 1.0)
    assert serve.parse_workload("longdoc") == (6144, 0.0, 256, 2048, 0.5)
    assert serve.parse_workload("100:0:8:32") == (100, 0.0, 8, 32, 1.0)
    assert serve.prompt_tokens("longdoc") == 8192 and serve.longest_sequence(["320:0.6:64", "longdoc"]) == 8448
    assert serve.prompts_per_run(32, 0.0, 8192) == 64 and serve.prompts_per_run(32, 0.6, 320) == 256
    for bad in ("1:2", "1:0:2:3:1.5", "1:0:2:-1", "shortdoc"):
        with pytest.raises(SystemExit, match="--workloads"):
            serve.parse_workload(bad)


def test_long_prompt_matrix_smoke():
    """The smoke shape on CPU (the torch reference path stands in for the kernel): every row of
    (KV dtype, length, prompt attention) measured, sdpa-math only with the first dtype, the
    second dtype only up to --kv-dtype-max-len, the ratios computed; a prompt attention the
    device lacks (sdpa-mem on CPU) is a failed row, not a failed run."""
    e2e = load("e2e")
    args = argparse.Namespace(
        layers=None, vocab=256, device="cpu", long_prompts=[40, 72], prefill_len=32, long_decode_steps=2,
        long_eager=False, kv_cache_memory_bytes=None, prompt_attentions=["onecat", "sdpa-math", "sdpa-mem"],
        kv_cache_dtypes=["int8", "auto"], sdpa_kv_cache_dtypes=["auto"], kv_dtype_max_len=40,
    )
    saves = []
    result = e2e.bench_long("smoke", args, lambda: saves.append(1))
    rows = {(r["kv_cache_dtype"], r["prompt_attention"], r["length"]): r for r in result["rows"]}
    assert set(rows) == {("auto", a, n) for a in args.prompt_attentions for n in (40, 72)} | {("int8", "onecat", 40)}
    assert len(saves) == len(rows)
    for key, row in rows.items():
        if key[1] == "sdpa-mem":
            assert "ttft_s" not in row and "error" in row
        else:
            assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0, row
    assert result["engines"]["auto"]["onecat_prompt_path"] == "torch reference"
    summary = result["summary"]
    assert {"prefill_72_over_40", "decode_72_over_40", "prefill_40_onecat_over_sdpa-math",
            "decode_40_int8_over_auto"} <= set(summary)
    assert summary["cache_tokens_int8_over_auto"] > 1.9  # fp32 cache on CPU: ~3.9x
