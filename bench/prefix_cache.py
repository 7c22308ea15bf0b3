"""Time to first token of requests sharing a long prefix, with and without prefix caching.

For each prefix length and repeat, three requests run one after another on the same engine,
each the shared prefix followed by its own ``--new-tokens`` tokens: A (nothing cached yet),
B (the second request: A's blocks and A's state checkpoints are cached) and C (the third: B
also checkpointed the state where the cached blocks end, the branching point). Every repeat
uses a new prefix. A prefix that ends on a multiple of the checkpoint interval (1024 tokens
by default) lets B start at its end; any other lets B start at the last multiple before it,
and C at the prefix's last full block. Reported: median TTFT (ms) of A, B and C per engine,
B's and C's speed-up, and the tokens the cache supplied.

    python bench/prefix_cache.py                                      # CPU: tiny Qwen3.5, fp32
    python bench/prefix_cache.py --model 27b --device cuda --prefix-lens 2048,2000 --out pc.json

``--model tiny`` writes the tiny random checkpoint of ``onecat.tiny`` (4 layers, hidden 128,
contexts up to 4096) to a temporary directory; ``27b`` / ``35b-a3b`` build random packed
models of those shapes on the GPU as ``bench/e2e.py`` does (``--layers`` to cut the depth).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time

import torch

from onecat.runtime.config import EngineConfig
from onecat.runtime.engine import LLMEngine
from onecat.runtime.sampling_params import SamplingParams

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def random_ids(length: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def time_to_first_token(engine: LLMEngine, request_id: str, ids: list[int]) -> tuple[float, float]:
    """Seconds from queueing ``ids`` on an idle engine to its first sampled token: wall time
    and this process's CPU time (on a shared CPU machine the latter is the stable figure)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    engine.add_request(request_id, ids, FIRST_TOKEN)
    while True:
        if any(out.request_id == request_id and out.new_token_ids for out in engine.step()):
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            break
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed, cpu


def make_engine(args, caching: bool, workdir: str) -> LLMEngine:
    settings = dict(
        device=args.device, max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=args.budget,
        num_kv_blocks=1024, enable_prefix_caching=caching,
    )
    if args.model == "tiny":
        from onecat.tiny import build_tiny_model

        path = f"{workdir}/tiny"
        if not hasattr(make_engine, "built"):
            build_tiny_model("qwen3_5", path, config_overrides={"max_position_embeddings": 4096})
            make_engine.built = True
        return LLMEngine(EngineConfig(model=path, **settings))
    from e2e import fill_random, text_config  # bench/e2e.py: model shapes, random packed weights

    from onecat.runtime.models.config import ModelConfig
    from onecat.runtime.models.qwen3_5 import Qwen3_5ForCausalLM
    from onecat.runtime.quant_plan import QuantPlan

    cfg = ModelConfig.from_dict(text_config(args.model, args.layers))
    with torch.device(args.device):
        model = Qwen3_5ForCausalLM(cfg, QuantPlan(default=128), torch.float16)
    fill_random(model)
    return LLMEngine.from_model(EngineConfig(model=f"random-{args.model}", **settings), model)


def bench(args, caching: bool, workdir: str) -> dict:
    engine = make_engine(args, caching, workdir)
    vocab = engine.runner.model_config.vocab_size
    time_to_first_token(engine, "warm-up", random_ids(64, vocab, 1))
    results = {}
    for prefix_len in args.prefix_lens:
        times: dict[str, list[float]] = {"A": [], "B": [], "C": []}
        cpu: dict[str, list[float]] = {"A": [], "B": [], "C": []}
        hits: dict[str, list[int]] = {"B": [], "C": []}
        for rep in range(args.repeats):
            prefix = random_ids(prefix_len, vocab, 1000 * prefix_len + rep)
            for i, name in enumerate("ABC"):
                before = engine.stats()["prefix_cache_hits"]
                ids = prefix + random_ids(args.new_tokens, vocab, 7 + 31 * rep + i)
                wall, used = time_to_first_token(engine, f"{prefix_len}-{rep}-{name}", ids)
                times[name].append(wall)
                cpu[name].append(used)
                if name in hits:
                    hits[name].append(engine.stats()["prefix_cache_hits"] - before)
        results[prefix_len] = {
            **{f"ttft_{name}_ms": 1000 * statistics.median(t) for name, t in times.items()},
            **{f"cpu_{name}_ms": 1000 * statistics.median(t) for name, t in cpu.items()},
            **{f"hit_{name}_tokens": statistics.median(h) for name, h in hits.items()},
        }
    engine.close()
    engine.runner.release_graphs()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the next engine plans its memory on a clean GPU
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=["tiny", "27b", "35b-a3b"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=None, help="depth of the 27b / 35b-a3b model")
    parser.add_argument("--prefix-lens", default="2048,2000", help="comma-separated shared prefix lengths")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens after the prefix, per request")
    parser.add_argument("--budget", type=int, default=2048, help="--max-num-batched-tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    args.prefix_lens = [int(v) for v in args.prefix_lens.split(",")]
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as workdir, torch.inference_mode():
        runs = {caching: bench(args, caching, workdir) for caching in (False, True)}
    print(f"{args.model} on {args.device}, {args.new_tokens} new tokens per request, "
          f"median of {args.repeats}; TTFT in ms, wall (process CPU time)")
    print(f"{'prefix':>6} {'cache':>5} {'A':>17} {'B':>17} {'C':>17} {'B hit':>6} {'C hit':>6}")
    summary = {}
    for prefix_len in args.prefix_lens:
        for caching in (False, True):
            r = runs[caching][prefix_len]
            cells = " ".join(f"{r[f'ttft_{n}_ms']:>8.1f} ({r[f'cpu_{n}_ms']:>6.1f})" for n in "ABC")
            print(f"{prefix_len:>6} {'on' if caching else 'off':>5} {cells} "
                  f"{r['hit_B_tokens']:>6} {r['hit_C_tokens']:>6}")
        off, on = runs[False][prefix_len], runs[True][prefix_len]
        speedup = {f"speedup_{n}": off[f"ttft_{n}_ms"] / on[f"ttft_{n}_ms"] for n in "BC"}
        speedup.update({f"cpu_speedup_{n}": off[f"cpu_{n}_ms"] / on[f"cpu_{n}_ms"] for n in "BC"})
        print(f"{'':>6} speed-up of the second request {speedup['speedup_B']:.1f}x "
              f"({speedup['cpu_speedup_B']:.1f}x CPU time), third {speedup['speedup_C']:.1f}x "
              f"({speedup['cpu_speedup_C']:.1f}x)")
        summary[prefix_len] = {"off": off, "on": on, **speedup}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "device": args.device, "new_tokens": args.new_tokens,
                       "results": summary}, f, indent=2)


if __name__ == "__main__":
    main()
