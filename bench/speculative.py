"""MTP speculative decoding: acceptance per draft position, and what verify steps cost.

Two kinds of run:

- ``--model qwen3_5`` / ``qwen3_5_moe``: the trained tiny fixtures (their MTP heads were
  trained; CPU or GPU). Greedy continuations of held-out text (pydoc topics never trained on)
  with N = 1..4 drafts per step: acceptance per draft position, tokens emitted per verify
  step, wall time against plain decoding, and a check that the text is the same.
- ``--model 27b`` / ``35b-a3b`` (GPU; ``bench/e2e.py``'s random packed weights plus a random
  MTP head): batch-1 decode without speculation, then with N drafts and acceptance forced to
  ``--accept`` drafts per step (random weights accept nothing by themselves; the forced
  steps pay everything a real one does, roll-back of the GDN states included). The speedup
  at N = 3 with 2 accepted is issue 14's target (>= 1.7x).

    python bench/speculative.py --model qwen3_5 --device cpu
    ONECAT_KERNEL_DIR=.ptx ONECAT_KERNEL_ARCH=70 python bench/speculative.py --model 27b --device cuda
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from onecat.runtime.config import EngineConfig
from onecat.runtime.engine import LLMEngine, speculative
from onecat.runtime.sampling_params import SamplingParams
from onecat.tiny_train import fixture_dir, heldout_text


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def heldout_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """The first ``length`` tokens of the first ``count`` held-out paragraphs long enough."""
    prompts = []
    for paragraph in heldout_text().split("\n\n"):
        ids = tokenizer.encode(paragraph, add_special_tokens=False)
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == count:
            break
    return prompts


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, device: str) -> tuple[list[list[int]], float, float]:
    """Greedy continuations, one request at a time (batch 1): (tokens, seconds, decode
    seconds). Decode seconds run from each request's first token to its last (time per
    output token after the first, as TPOT): the prompt's prefill is not in them."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs = []
    decode = 0.0
    sync(device)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
        tokens: list[int] = []
        first = None
        while engine.has_unfinished_requests():
            tokens += [t for out in engine.step() for t in out.new_token_ids]
            if first is None and tokens:
                first = time.perf_counter()
        outputs.append(tokens)
        decode += time.perf_counter() - first
    sync(device)
    return outputs, time.perf_counter() - start, decode


def bench_trained(args: argparse.Namespace) -> dict:
    def engine(n: int | None) -> LLMEngine:
        spec = None if n is None else {"method": "mtp", "num_speculative_tokens": n}
        return LLMEngine(EngineConfig(model=str(fixture_dir(args.model)), device=args.device, max_num_seqs=4,
                                      speculative_config=spec))

    plain = engine(None)
    prompts = heldout_prompts(plain.tokenizer, args.prompts, args.prompt_len)
    generate(plain, prompts[:1], 4, args.device)  # warm-up
    reference, plain_s, _ = generate(plain, prompts, args.max_tokens, args.device)
    report = {"model": args.model, "device": args.device, "prompts": len(prompts), "max_tokens": args.max_tokens,
              "plain_tok_s": len(prompts) * args.max_tokens / plain_s, "runs": []}
    print(f"{args.model}: plain decoding {report['plain_tok_s']:.1f} tok/s", flush=True)
    for n in args.drafts:
        spec = engine(n)
        generate(spec, prompts[:1], 4, args.device)
        before = spec.stats()
        outputs, seconds, _ = generate(spec, prompts, args.max_tokens, args.device)
        stats = spec.stats()
        drafts = stats["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
        accepted = stats["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        per_pos = [a - b for a, b in zip(stats["spec_decode_num_accepted_tokens_per_pos"],
                                         before["spec_decode_num_accepted_tokens_per_pos"] + [0] * n, strict=False)]
        run = {"drafts": n, "same_tokens": outputs == reference, "verify_steps": drafts,
               "acceptance_per_position": [round(a / drafts, 3) for a in per_pos],
               "tokens_per_verify_step": round(1 + accepted / drafts, 3),
               "tok_s": len(prompts) * args.max_tokens / seconds, "speedup": plain_s / seconds}
        report["runs"].append(run)
        print(json.dumps(run), flush=True)
    return report


def step_split(engine: LLMEngine, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """A second, separately timed run: mean milliseconds per verify pass (``run_hidden``) and
    per drafting (``propose``), each synchronised (so the sum exceeds the free-running step)."""
    runner = engine.runner
    spent = {"run_hidden": [], "propose": []}
    originals = {name: getattr(runner, name) for name in spent}

    def timed(name):
        def call(*a, **k):
            sync(args.device)
            start = time.perf_counter()
            result = originals[name](*a, **k)
            sync(args.device)
            spent[name].append(time.perf_counter() - start)
            return result
        return call

    for name in spent:
        setattr(runner, name, timed(name))
    try:
        generate(engine, prompts, args.max_tokens, args.device)
    finally:
        for name, fn in originals.items():
            setattr(runner, name, fn)
    return {f"{name}_ms": round(1e3 * sum(t[2:]) / max(1, len(t) - 2), 2) for name, t in spent.items()}


def host_profile(engine: LLMEngine, prompts: list[list[int]], args: argparse.Namespace) -> None:
    """Print where the host's time goes over one more run (cProfile, top functions by own time)."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    generate(engine, prompts, args.max_tokens, args.device)
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(18)
    if args.device.startswith("cuda"):  # and the GPU kernels of one more run
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as kernel_profile

        with kernel_profile(activities=[ProfilerActivity.CUDA]) as prof:
            generate(engine, prompts, args.max_tokens, args.device)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))


def bench_random(args: argparse.Namespace) -> dict:
    import e2e  # bench/e2e.py: shapes and random packed weights

    from onecat.runtime.models.config import ModelConfig
    from onecat.runtime.models.qwen3_5 import Qwen3_5ForCausalLM
    from onecat.runtime.quant_plan import QuantPlan

    cfg = ModelConfig.from_dict(e2e.text_config(args.model, args.layers))
    with torch.device(args.device):
        model = Qwen3_5ForCausalLM(cfg, QuantPlan(default=e2e.GROUP), torch.float16, mtp=True)
    e2e.fill_random(model)
    prompts = [e2e.random_prompt(args.prompt_len, cfg.vocab_size, 11 + i) for i in range(args.prompts)]
    report = {"model": args.model, "layers": cfg.num_hidden_layers,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "forced_accept": args.accept, "runs": []}

    def engine(n: int | None) -> LLMEngine:
        spec = None if n is None else {"method": "mtp", "num_speculative_tokens": n}
        config = EngineConfig(model=f"random-{args.model}", device=args.device, max_num_seqs=4, max_model_len=4096,
                              max_num_batched_tokens=256, num_kv_blocks=1024, speculative_config=spec)
        return LLMEngine.from_model(config, model)

    plain = engine(None)
    generate(plain, prompts, 8, args.device)  # warm-up
    _, plain_s, plain_decode = generate(plain, prompts, args.max_tokens, args.device)
    decode_tokens = len(prompts) * (args.max_tokens - 1)
    report["plain_tok_s"] = len(prompts) * args.max_tokens / plain_s
    report["plain_decode_tok_s"] = decode_tokens / plain_decode
    print(f"{args.model}: plain batch 1: {report['plain_tok_s']:.1f} tok/s with prefill, "
          f"{report['plain_decode_tok_s']:.1f} tok/s decode", flush=True)
    del plain
    real_accept = speculative.accept

    def forced(sampler, logits, drafts, params, generator, argmax=None):
        _, token = real_accept(sampler, logits[-1:], [], params, generator)
        return min(args.accept, len(drafts)), token

    speculative.accept = forced
    try:
        for n in args.drafts:
            spec = engine(n)
            generate(spec, prompts, 8, args.device)  # warm-up
            _, seconds, decode = generate(spec, prompts, args.max_tokens, args.device)
            run = {"drafts": n, "accepted_per_step": min(args.accept, n),
                   "tok_s": len(prompts) * args.max_tokens / seconds, "speedup": plain_s / seconds,
                   "decode_tok_s": decode_tokens / decode, "decode_speedup": plain_decode / decode,
                   **step_split(spec, prompts[:1], args)}
            report["runs"].append(run)
            print(json.dumps(run), flush=True)
            if n in args.host_profile:
                host_profile(spec, prompts[:1], args)
            del spec
    finally:
        speculative.accept = real_accept
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3_5", help="qwen3_5, qwen3_5_moe (trained), 27b, 35b-a3b (random)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--drafts", default="1,2,3,4")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--accept", type=int, default=2, help="forced accepted drafts per step (random models)")
    parser.add_argument("--host-profile", default="", help="draft counts to profile the host of (cProfile), e.g. 3")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (random models, smoke runs)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.drafts = [int(n) for n in args.drafts.split(",")]
    args.host_profile = [int(n) for n in args.host_profile.split(",") if n]
    report = bench_trained(args) if args.model.startswith("qwen3_5") else bench_random(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
