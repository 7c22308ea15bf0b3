"""Where a step's time goes: GPU kernels per decode step and per prefill, host gaps (GPU).

Builds a Qwen3.5-27B- or 35B-A3B-shaped model with random packed weights (``bench/e2e.py``),
then with ``torch.profiler``:

- decode at each batch size (CUDA graphs as served): wall ms per step, GPU kernel ms per
  step (the rest is host time and gaps), kernel launches per step, the costliest kernels;
- one prefill of ``--prefill-len`` tokens: the same figures for the whole prefill.

    ONECAT_KERNEL_DIR=.ptx ONECAT_KERNEL_ARCH=70 python bench/profile_step.py --model 27b --out p.json
"""

from __future__ import annotations

import argparse
import json
import time
import zlib

import torch
from e2e import (
    fill_random,
    random_prompt,
    start_decoding,
    sync,
    text_config,
    timed_workload,
    workload_requests,
)
from e2e_tp import kernel_kind
from torch.profiler import ProfilerActivity, profile

from onecat.runtime.config import EngineConfig
from onecat.runtime.engine import LLMEngine
from onecat.runtime.models.config import ModelConfig
from onecat.runtime.models.qwen3_5 import Qwen3_5ForCausalLM
from onecat.runtime.quant_plan import QuantPlan
from onecat.runtime.sampling_params import SamplingParams


def host_summary(prof, calls: int, top: int) -> list:
    """The CPU-side operators with the most self time, per repetition (ms)."""
    ops = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    ops.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [[e.key[:80], e.count / calls, round(e.self_cpu_time_total / calls / 1e3, 3)] for e in ops[:top]]


def kernel_summary(prof, calls: int, top: int) -> dict:
    """GPU kernel figures of a profile covering ``calls`` repetitions, per repetition."""
    kernels = [
        e for e in prof.key_averages()
        if "cuda" in str(getattr(e, "device_type", "")).lower() and e.device_time_total > 0
    ]
    kernels.sort(key=lambda e: e.device_time_total, reverse=True)
    return {
        "kernel_ms": sum(e.device_time_total for e in kernels) / 1e3 / calls,
        "launches": sum(e.count for e in kernels) / calls,
        "top": [[e.key[:100], e.count / calls, round(e.device_time_total / calls, 1)] for e in kernels[:top]],
    }


def step_timeline(prof, calls: int) -> dict:
    """The kernels of the last of ``calls`` profiled repetitions in launch order, run-length
    grouped as [name, count, total us, gaps before them us], and the step's time split by
    kernel kind (``e2e_tp.kernel_kind``) with the gaps between kernels."""
    events = sorted(
        (e for e in prof.events() if "cuda" in str(getattr(e, "device_type", "")).lower() and e.time_range.elapsed_us() > 0),
        key=lambda e: e.time_range.start,
    )
    if not events:
        return {}
    step = events[len(events) - len(events) // calls :]
    runs: list[list] = []
    split = {"gaps": 0.0}
    previous_end = step[0].time_range.start
    for e in step:
        gap = max(0.0, e.time_range.start - previous_end)
        previous_end = max(previous_end, e.time_range.end)
        duration = e.time_range.elapsed_us()
        kind = kernel_kind(e.name)
        split[kind] = split.get(kind, 0.0) + duration
        split["gaps"] += gap
        name = e.name[:70]
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
            runs[-1][2] += duration
            runs[-1][3] += gap
        else:
            runs.append([name, 1, duration, gap])
    return {
        "split_us": {k: round(v, 1) for k, v in split.items()},
        "sequence": [[n, c, round(d, 1), round(g, 1)] for n, c, d, g in runs],
    }


def graph_only_ms(engine: LLMEngine, batch: int, steps: int) -> float:
    """Milliseconds per replay of the batch's decode graph replayed back to back with no host
    work between (same inputs): the step's GPU time plus what launching cannot hide. The
    difference to a served step is the host time between steps. The replays advance the batch's
    states without new tokens: its sequences are fit for timing only afterwards."""
    graph = engine.runner._graph_for(batch, 1, 1)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        graph.graph.replay()
    sync()
    return (time.perf_counter() - start) * 1e3 / steps


def timed_steps_ms(engine: LLMEngine, steps: int) -> float:
    """Wall milliseconds per engine step over ``steps`` steps."""
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    return (time.perf_counter() - start) * 1e3 / steps


def profile_decode(engine: LLMEngine, batch: int, steps: int, prompt_len: int, top: int) -> dict:
    """Wall and kernel time of ``steps`` decode steps of ``batch`` sequences, with and without
    overlapped steps (``async_scheduling``)."""
    ids = start_decoding(engine, batch, prompt_len, 5 * steps + 8, 77 * batch, tag="prof")
    for _ in range(3):
        engine.step()
    engine.config.async_scheduling = False
    sync_ms = timed_steps_ms(engine, steps)
    engine.config.async_scheduling = True
    engine.step()
    wall_ms = timed_steps_ms(engine, steps)
    graph_ms = graph_only_ms(engine, batch, steps)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    for rid in ids:
        engine.abort_request(rid)
    result = {"batch": batch, "wall_ms": wall_ms, "wall_ms_not_overlapped": sync_ms, "graph_only_ms": graph_ms,
              "tok_s": batch / wall_ms * 1e3, **kernel_summary(prof, steps, top)}
    result["host_gap_ms"] = wall_ms - result["kernel_ms"]
    result["last_step"] = step_timeline(prof, steps)
    return result


def profile_prefill(engine: LLMEngine, length: int, top: int) -> dict:
    """Wall and kernel time of one ``length``-token prefill (after one warm-up)."""
    vocab = engine.runner.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def once(tag: str) -> float:  # a new prompt each time: no prefix-cache hits
        engine.add_request(tag, random_prompt(length, vocab, zlib.crc32(tag.encode())), params)
        sync()
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        sync()
        return (time.perf_counter() - start) * 1e3

    once("warm")
    wall_ms = once("timed")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        once("profiled")
    result = {"tokens": length, "wall_ms": wall_ms, "tok_s": length / wall_ms * 1e3, **kernel_summary(prof, 1, top)}
    result["host_gap_ms"] = wall_ms - result["kernel_ms"]
    return result


def profile_mixed(engine: LLMEngine, batch: int, prompt_len: int, steps: int, top: int) -> dict:
    """Steps that decode ``batch - 1`` sequences while a new ``prompt_len``-token prompt is
    prefilled in the same step (a server's typical step): wall, kernels, launches, host ops."""
    vocab = engine.runner.model_config.vocab_size
    ids = start_decoding(engine, batch - 1, 128, 4 * steps + 64, 99 * batch, tag="mix")
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run(tag: str) -> float:  # new prompts each time: no prefix-cache hits
        sync()
        start = time.perf_counter()
        for i in range(steps):
            engine.add_request(f"{tag}{i}", random_prompt(prompt_len, vocab, zlib.crc32(f"{tag}{i}".encode())), params)
            engine.step()
        sync()
        return (time.perf_counter() - start) * 1e3 / steps

    run("warm")
    wall_ms = run("timed")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run("prof")
    for rid in ids:
        engine.abort_request(rid)
    result = {"batch": batch, "prompt_len": prompt_len, "wall_ms": wall_ms, **kernel_summary(prof, steps, top)}
    result["host_gap_ms"] = wall_ms - result["kernel_ms"]
    result["host_ops"] = host_summary(prof, steps, top)
    result["last_step"] = step_timeline(prof, steps)
    return result


def profile_workload(engine: LLMEngine, concurrency: int, top: int) -> dict:
    """``bench/serve_h200.py``'s workload (prompts of 128-512 tokens, 25-103 output tokens,
    closed loop at ``concurrency``) on the engine alone: timed, then profiled per step."""
    vocab = engine.runner.model_config.vocab_size
    timed_workload(engine, workload_requests(concurrency, 320, 64, 0.6, vocab, 1), concurrency)  # warm-up
    result = timed_workload(engine, workload_requests(2 * concurrency, 320, 64, 0.6, vocab, 2), concurrency)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        profiled = timed_workload(engine, workload_requests(concurrency, 320, 64, 0.6, vocab, 3), concurrency)
    result.update(kernel_summary(prof, profiled["steps"], top))
    result["host_gap_ms"] = result["ms_per_step"] - result["kernel_ms"]
    result["host_ops"] = host_summary(prof, profiled["steps"], top)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="27b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--mixed", default="", help="BATCH:PROMPT_LEN pairs, e.g. 32:320")
    parser.add_argument("--workload", default="", help="concurrencies of the serve workload, e.g. 32")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cfg = ModelConfig.from_dict(text_config(args.model, args.layers))
    with torch.device("cuda"):
        model = Qwen3_5ForCausalLM(cfg, QuantPlan(default=128), torch.float16)
    fill_random(model)
    batches = [int(b) for b in args.batches.split(",")]
    batches_needed = batches + [int(p.split(":")[0]) for p in filter(None, args.mixed.split(","))]
    batches_needed += [int(c) for c in filter(None, args.workload.split(","))]
    engine = LLMEngine.from_model(
        EngineConfig(model=f"random-{args.model}", max_num_seqs=max(batches_needed), max_model_len=4096,
                     max_num_batched_tokens=max(args.prefill_len, 2048), num_kv_blocks=2048, device="cuda"),
        model,
    )  # fmt: skip
    report = {"model": args.model, "layers": cfg.num_hidden_layers, "gpu": torch.cuda.get_device_name(0), "decode": [], "prefill": None}
    for batch in batches:
        report["decode"].append(profile_decode(engine, batch, args.steps, args.prompt_len, args.top))
        print(json.dumps({k: v for k, v in report["decode"][-1].items() if k != "last_step"}), flush=True)
    if args.prefill_len:
        report["prefill"] = profile_prefill(engine, args.prefill_len, args.top)
        print(json.dumps(report["prefill"]), flush=True)
    report["mixed"] = []
    for pair in filter(None, args.mixed.split(",")):
        batch, length = map(int, pair.split(":"))
        report["mixed"].append(profile_mixed(engine, batch, length, args.steps, args.top))
        print(json.dumps(report["mixed"][-1]), flush=True)
    report["workload"] = []
    for c in filter(None, args.workload.split(",")):
        report["workload"].append(profile_workload(engine, int(c), args.top))
        print(json.dumps(report["workload"][-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
