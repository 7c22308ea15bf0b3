"""Tensor-parallel decode speed of onecat's runtime: TP 1 against TP N on one host (GPU).

Builds the Qwen3.5-shaped model of ``bench/e2e.py`` (its ``text_config`` and
``fill_random``: random 4-bit packed weights drawn on the GPU, group 128, no checkpoint);
at TP N every rank builds its own shard (``shard_config``) with random values, which does
not change the speed. Through the engine (scheduler, paged KV, CUDA graphs, sampling on
rank 0) it measures, per tensor-parallel size:

- decode tokens/s at the given batch sizes (128-token prompts, as bench/e2e.py),
- the all-reduce share of a decode step, two ways:
  (a) NCCL kernel time per step on rank 0 (``torch.profiler`` over CUDA-graph replays)
      over the step time measured without the profiler (the same profile gives kernel
      launches per step, the costliest kernels and the time split per step: GEMV/GEMM,
      attention/GDN, glue, communication, and host and gaps = step time - kernel time);
  (b) removal: the same decode with every all-reduce replaced by a no-op on every rank
      (graphs re-captured; numbers are wrong, the work is the same), share = 1 - t_noop / t.

    NCCL_NVLS_ENABLE=0 ONECAT_KERNEL_DIR=.ptx ONECAT_KERNEL_ARCH=70 \\
        python bench/e2e_tp.py --tp 1,2 --out results.json
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import tempfile
import time

import e2e  # bench/e2e.py: model shapes, random weights, decode timing
import torch

from onecat.runtime.config import EngineConfig
from onecat.runtime.distributed.parallel_state import tp_rank, tp_size
from onecat.runtime.engine import LLMEngine
from onecat.runtime.models.config import ModelConfig
from onecat.runtime.models.qwen3_5 import Qwen3_5ForCausalLM
from onecat.runtime.quant_plan import QuantPlan
from onecat.runtime.sharding import shard_config


def build_shard(raw: dict, device: torch.device, dtype: torch.dtype) -> Qwen3_5ForCausalLM:
    """This rank's shard of the random packed model of config ``raw`` (every rank calls it)."""
    cfg = ModelConfig.from_dict(raw)
    if tp_size() > 1:
        cfg = shard_config(cfg, tp_size())
    with torch.device(device):
        model = Qwen3_5ForCausalLM(cfg, QuantPlan(default=e2e.GROUP), dtype)
    e2e.fill_random(model, seed=tp_rank())
    return model


def drop_collectives(runner) -> None:
    """On one rank: make the all-reduces no-ops and forget the captured graphs."""
    import onecat.runtime.models.qwen3_5 as qwen3_5
    from onecat.runtime.layers.norm import add_rms_norm

    qwen3_5.all_reduce_add_rms_norm = add_rms_norm  # every all-reduce is fused with the norm after it
    runner.release_graphs()


def restore_collectives() -> None:
    """Undo :func:`drop_collectives` in this process (rank 0 outlives its engine's workers: a
    later engine here must all-reduce again, or its fresh workers wait for rank 0 forever)."""
    import onecat.runtime.models.qwen3_5 as qwen3_5
    from onecat.runtime.distributed import parallel_state

    qwen3_5.all_reduce_add_rms_norm = parallel_state.all_reduce_add_rms_norm


KERNEL_KINDS = (  # (kind, name fragments), first match wins
    ("communication", ("nccl", "all_reduce")),
    ("attention/GDN", ("gdn_", "paged_attention", "attention", "fmha", "flash")),
    ("GEMV/GEMM", ("w4a16", "gemm", "gemv", "nvjet", "cutlass", "cublas", "xmma", "splitk")),
)


def kernel_kind(name: str) -> str:
    """The time-split bucket of a GPU kernel: communication, attention/GDN, GEMV/GEMM or glue
    (norms, activations, copies, the compiled elementwise kernels, sampling)."""
    lowered = name.lower()
    return next((kind for kind, parts in KERNEL_KINDS if any(p in lowered for p in parts)), "glue")


_PROFILER = None  # this process's profiler between _profile_begin and _profile_end


def _profile_begin(runner) -> None:
    """On one rank (through ``call_all``): start ``torch.profiler`` here."""
    global _PROFILER
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    _PROFILER = profile(activities=activities)
    _PROFILER.__enter__()


def _profile_end(runner, prefix: str, steps: int, top: int) -> dict:
    """On one rank (through ``call_all``): wait for the rank's device, stop the profiler and
    write its summary to ``{prefix}.rank{N}.json`` (atomically); returns the summary."""
    global _PROFILER
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    _PROFILER.__exit__(None, None, None)
    summary = kernel_summary(_PROFILER, steps, top)
    _PROFILER = None
    path = f"{prefix}.rank{tp_rank()}.json"
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f)
    os.replace(path + ".tmp", path)
    return summary


def kernel_summary(prof, steps: int, top: int) -> dict:
    """GPU kernels of a profile over ``steps`` steps: the time split by kernel kind,
    communication (NCCL or one-shot) milliseconds per step (None if it saw none), kernel
    milliseconds and launches per step, and the ``top`` kernels by time, each as [name,
    launches per step, microseconds per step]."""
    kernels = [  # GPU kernels only (a CPU op's time includes its kernels)
        event for event in prof.key_averages()
        if "cuda" in str(getattr(event, "device_type", "")).lower() and event.device_time_total > 0
    ]
    nccl_us = sum(e.device_time_total for e in kernels if kernel_kind(e.key) == "communication")
    kernels.sort(key=lambda e: e.device_time_total, reverse=True)
    split: dict[str, float] = {}
    for e in kernels:
        kind = kernel_kind(e.key)
        split[kind] = split.get(kind, 0.0) + e.device_time_total / 1e3 / steps
    return {
        "split_ms": {kind: round(ms, 3) for kind, ms in sorted(split.items())},
        "nccl_ms": nccl_us / 1e3 / steps if nccl_us else None,
        "kernel_ms": sum(e.device_time_total for e in kernels) / 1e3 / steps,
        "launches": sum(e.count for e in kernels) / steps,
        "top": [[e.key[:90], e.count / steps, round(e.device_time_total / steps, 1)] for e in kernels[:top]],
    }


def profile_steps(engine: LLMEngine, steps: int, top: int = 12) -> dict:
    """GPU kernels of ``steps`` decode steps (``torch.profiler`` over CUDA-graph replays), on
    every rank at once: rank 0's :func:`kernel_summary`, plus under tensor parallelism
    ``per_rank``, each rank's kernel and communication milliseconds per step (a rank that
    waits longer in the collectives is the one that arrives first)."""
    ranks = engine.config.tensor_parallel_size
    call = engine.runner.call_all if ranks > 1 else (lambda fn, *args: fn(engine.runner, *args))
    with tempfile.TemporaryDirectory(prefix="e2e-tp-profile-") as tmp:
        prefix = os.path.join(tmp, "profile")
        call(_profile_begin)
        for _ in range(steps):
            engine.step()
        e2e.sync()
        result = call(_profile_end, prefix, steps, top)
        if ranks > 1:
            per_rank = []
            for rank in range(ranks):
                path = f"{prefix}.rank{rank}.json"
                deadline = time.monotonic() + 120
                while not os.path.exists(path):  # the workers write theirs after their last step
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"rank {rank} wrote no profile")
                    time.sleep(0.05)
                with open(path) as f:
                    summary = json.load(f)
                per_rank.append({"rank": rank, "kernel_ms": round(summary["kernel_ms"], 3),
                                 "communication_ms": summary["nccl_ms"], "launches": summary["launches"]})
            result["per_rank"] = per_rank
    return result


def decode(engine: LLMEngine, batch: int, args, tag: str, profile: bool) -> dict:
    """Decode ``batch`` sequences: tok/s over ``args.decode_steps`` steps, then (``profile``)
    NCCL time per step over as many profiled steps."""
    extra = args.decode_steps if profile else 0
    # prompts prefill a few per step, so the first ones decode meanwhile: no request may
    # finish inside the timed window (a smaller batch would capture a graph there)
    max_tokens = 4 * (args.decode_steps + extra) + 64
    ids = e2e.start_decoding(engine, batch, args.prompt_len, max_tokens, 1000 * batch, tag=f"{tag}-")
    engine.step()  # capture this bucket's graph
    engine.step()
    e2e.sync()
    start = time.perf_counter()
    for _ in range(args.decode_steps):
        engine.step()
    e2e.sync()
    step_s = (time.perf_counter() - start) / args.decode_steps
    result = {f"decode_b{batch}_tok_s": batch / step_s, f"step_ms_b{batch}": step_s * 1e3}
    print(f"  {tag} batch {batch}: {batch / step_s:.1f} tok/s ({step_s * 1e3:.2f} ms/step)", flush=True)
    if profile:
        try:
            prof = profile_steps(engine, extra)
        except Exception as exc:  # the profiler is a diagnostic: keep the timing
            prof, result[f"profiler_error_b{batch}"] = {"nccl_ms": None}, str(exc)
        ms = prof["nccl_ms"]
        result[f"profile_b{batch}"] = prof
        result[f"nccl_ms_per_step_b{batch}"] = ms
        result[f"allreduce_share_profiler_b{batch}"] = None if ms is None else ms / (step_s * 1e3)
        if "kernel_ms" in prof:  # what is not kernel time is the host and the gaps between kernels
            prof["split_ms"]["host and gaps"] = round(step_s * 1e3 - prof["kernel_ms"], 3)
        if "per_rank" in prof:
            print(f"  {tag} batch {batch}: per rank (kernel / communication ms per step): "
                  + ", ".join(f"rank {r['rank']} {r['kernel_ms']} / {r['communication_ms']}" for r in prof["per_rank"]),
                  flush=True)
        print(f"  {tag} batch {batch}: NCCL kernels {ms} ms/step; "
              f"{prof.get('launches')} kernels, {prof.get('kernel_ms')} ms of kernels per step; "
              f"split (ms/step) {prof.get('split_ms')}", flush=True)
    assert all(engine._sequences[rid].num_completion_tokens < max_tokens for rid in ids)
    for rid in ids:
        engine.abort_request(rid)
    return result


def bench_tp(raw: dict, tp: int, args, all_reduce: str = "custom") -> dict:
    """Decode speed (and all-reduce share) at tensor parallelism ``tp``; ``all_reduce``
    "nccl" turns the one-shot custom all-reduce off (``--disable-custom-all-reduce``)."""
    config = EngineConfig(
        model=f"random-{args.model}-tp{tp}", device=args.device, max_num_seqs=max(args.batches),
        max_model_len=1024, max_num_batched_tokens=args.prefill_len, num_kv_blocks=args.kv_blocks,
        tensor_parallel_size=tp, disable_custom_all_reduce=all_reduce == "nccl",
    )
    t0 = time.perf_counter()
    engine = LLMEngine.from_factory(config, functools.partial(build_shard, raw))
    result = {"tp": tp, "all_reduce": all_reduce if tp > 1 else None, "engine_setup_s": time.perf_counter() - t0}
    print(f"  TP{tp}: engine ready in {result['engine_setup_s']:.1f} s", flush=True)
    try:
        for batch in args.batches:
            result.update(decode(engine, batch, args, f"TP{tp}", profile=True))
        if tp > 1:
            engine.runner.call_all(drop_collectives)
            for batch in args.batches:
                timing = decode(engine, batch, args, f"TP{tp}-without-all-reduce", profile=False)
                step = result[f"step_ms_b{batch}"]
                result[f"step_ms_no_allreduce_b{batch}"] = timing[f"step_ms_b{batch}"]
                result[f"allreduce_share_removal_b{batch}"] = 1 - timing[f"step_ms_b{batch}"] / step
        result["graphs"] = sorted(engine.runner.graphs)
    finally:
        restore_collectives()
        engine.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="27b", choices=sorted(e2e.SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the real model")
    parser.add_argument("--vocab", type=int, default=None, help="smaller vocabulary (smoke runs)")
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes, in order")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--all-reduce", default="custom,nccl",
                        help="all-reduces to time at TP > 1, in order: custom (one-shot, onecat's), nccl")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--prefill-len", type=int, default=512, help="per-step token budget")
    parser.add_argument("--kv-blocks", type=int, default=512)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/e2e_tp.py needs CUDA GPUs")
    raw = e2e.text_config(args.model, args.layers)
    if args.vocab:
        raw["vocab_size"] = args.vocab
    cuda = args.device == "cuda"
    report = {
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu", "gpus": torch.cuda.device_count(),
        "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "model": args.model, "vocab": raw["vocab_size"],
        "layers": raw["num_hidden_layers"], "batches": args.batches, "runs": [],
    }
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}), flush=True)
    runs = [(tp, kind) for tp in map(int, args.tp.split(",")) for kind in (args.all_reduce.split(",") if tp > 1 else ["-"])]
    for tp, kind in runs:
        t0 = time.perf_counter()
        run = bench_tp(raw, tp, args, kind)
        run["wall_s"] = time.perf_counter() - t0
        print(json.dumps(run), flush=True)
        report["runs"].append(run)
        base = report["runs"][0]
        for batch in args.batches:
            run[f"speedup_b{batch}_vs_tp{base['tp']}"] = run[f"decode_b{batch}_tok_s"] / base[f"decode_b{batch}_tok_s"]
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
