"""How much a quantized KV cache changes a model's predictions (``--kv-cache-dtype``), on CPU.

    python bench/kv_cache_quality.py [--family qwen3_5] [--windows 4] [--generate 512] [--out r.json]

The trained tiny Qwen3.5 checkpoints (``onecat/fixtures``, ``onecat.tiny_train``) read the
held-out pydoc topics (never trained on: ``tiny_train.heldout_text``, real English prose about
Python) in windows of the model's whole context (2048 tokens), teacher-forced: every window goes
through the CPU engine's model in chunks of ``--chunk`` tokens, each chunk attending to the
earlier ones through the paged cache (so every key and value is read back in the cache's
encoding, as a decode step reads it). For each cache dtype against the reference cache
(``auto``: the activations' dtype, fp32 on CPU, which is what fp16 KV is meant to reproduce):

- KL(p_ref || p_kv) of the next-token distributions, mean and worst over all positions;
- top-1 agreement: the share of positions whose argmax is the reference's;
- free-running greedy agreement: ``--generate`` tokens of greedy decoding (the engine's own
  prompt and decode passes, ``ignore_eos``) from the first 256 tokens of each window, the
  share of positions equal to the reference's continuation and the first that differs.

Prints one JSON object (and writes it to ``--out``); BENCHMARKS.md has the numbers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import time

import torch

from onecat.benchmarks.report import write_result_json
from onecat.runtime.config import EngineConfig
from onecat.runtime.context import ForwardContext, PrefillChunk, set_context
from onecat.runtime.engine import LLMEngine
from onecat.runtime.sampling_params import SamplingParams
from onecat.tiny_train import fixture_dir, heldout_text

DTYPES = ("auto", "fp8_e5m2", "int8")
PROMPT_TOKENS = 256


def make_engine(family: str, kv_cache_dtype: str, max_model_len: int) -> LLMEngine:
    """A CPU engine on the trained tiny ``family`` checkpoint with that cache dtype (eager, no
    prefix cache: every run starts from an empty cache)."""
    return LLMEngine(EngineConfig(model=str(fixture_dir(family)), device="cpu", max_model_len=max_model_len,
                                  max_num_seqs=1, enforce_eager=True, enable_prefix_caching=False,
                                  kv_cache_dtype=kv_cache_dtype))  # fmt: skip


@torch.inference_mode()
def teacher_forced_logits(engine: LLMEngine, ids: list[int], chunk: int) -> torch.Tensor:
    """fp32 logits ``[len(ids), vocab]`` of every position of ``ids`` read in chunks of ``chunk``
    tokens through ``engine``'s model and paged cache (blocks 0.., state slot 0, which this
    zeroes first): a later chunk reads the earlier ones' keys and values as the cache holds them."""
    runner = engine.runner
    block = runner.block_size
    if len(ids) > runner.num_blocks * block:
        raise ValueError(f"{len(ids)} tokens do not fit the engine's {runner.num_blocks * block}-token cache")
    for conv, rec in runner.state_groups:  # slot 0 starts from zero states
        conv[:, 0].zero_()
        rec[:, 0].zero_()
    table = torch.arange(math.ceil(len(ids) / block), dtype=torch.int64)
    tokens = torch.tensor(ids, dtype=torch.int64)
    out = []
    for start in range(0, len(ids), chunk):
        length = min(chunk, len(ids) - start)
        positions = torch.arange(start, start + length)
        slots = table[positions // block] * block + positions % block
        used = table[: math.ceil((start + length) / block)]
        set_context(ForwardContext(slot_mapping=slots, prefills=[PrefillChunk(0, length, start, used, 0)]))
        try:
            hidden = runner.model(tokens[start : start + length], positions)
            out.append(runner.model.compute_logits(hidden).float())
        finally:
            set_context(None)
    return torch.cat(out)


def greedy(engine: LLMEngine, prompt: list[int], tokens: int) -> list[int]:
    """``tokens`` greedy tokens after ``prompt`` (the engine's prompt and decode passes)."""
    engine.add_request("greedy", prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    out: list[int] = []
    while engine.has_unfinished_requests():
        for result in engine.step():
            out.extend(result.new_token_ids)
    return out


def compare(reference: torch.Tensor, other: torch.Tensor) -> dict:
    """KL(ref || other) per position (mean, max) and top-1 agreement of two logit rows sets."""
    log_p, log_q = reference.log_softmax(-1), other.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return {
        "kl_mean": kl.mean().item(),
        "kl_max": kl.max().item(),
        "top1_agreement": (reference.argmax(-1) == other.argmax(-1)).float().mean().item(),
    }


def run(family: str, windows: int, chunk: int, generate: int) -> dict:
    """The measurements of the module docstring for one model."""
    engines = {name: make_engine(family, name, 2048) for name in DTYPES}
    tokenizer = engines["auto"].tokenizer
    text_ids = tokenizer.encode(heldout_text(), add_special_tokens=False)
    window = engines["auto"].max_model_len
    count = min(windows, len(text_ids) // window)
    pieces = [text_ids[i * window : (i + 1) * window] for i in range(count)]
    started = time.perf_counter()
    logits = {name: [teacher_forced_logits(engines[name], ids, chunk) for ids in pieces] for name in DTYPES}
    rows = {}
    for name in DTYPES[1:]:
        ref, other = torch.cat(logits["auto"]), torch.cat(logits[name])
        rows[name] = compare(ref, other)
        assert torch.isfinite(other).all(), f"{name}: non-finite logits"
    if generate:
        continuations = {name: [greedy(engines[name], ids[:PROMPT_TOKENS], generate) for ids in pieces]
                         for name in DTYPES}  # fmt: skip
        for name in DTYPES[1:]:
            same = total = 0
            first = []
            for ref, other in zip(continuations["auto"], continuations[name], strict=True):
                same += sum(a == b for a, b in zip(ref, other, strict=True))
                total += len(ref)
                first.append(next((i for i, (a, b) in enumerate(zip(ref, other, strict=True)) if a != b), len(ref)))
            rows[name].update(greedy_agreement=same / total, first_difference=first)
    return {
        "model": f"trained tiny {family} ({fixture_dir(family).name})",
        "text": "held-out pydoc topics (onecat.tiny_train.heldout_text)",
        "reference": "--kv-cache-dtype auto (fp32 activations and cache on CPU)",
        "windows": count, "window_tokens": window, "chunk": chunk, "positions": count * window,
        "generate": generate, "prompt_tokens": PROMPT_TOKENS,
        "dtypes": rows, "seconds": round(time.perf_counter() - started, 1),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", nargs="+", default=["qwen3_5", "qwen3_5_moe"])
    parser.add_argument("--windows", type=int, default=4, help="2048-token windows of the held-out text")
    parser.add_argument("--chunk", type=int, default=128, help="tokens per teacher-forced pass")
    parser.add_argument("--generate", type=int, default=512, help="greedy tokens per window (0: none)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    result = {
        "date": datetime.date.today().isoformat(), "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "models": [run(family, args.windows, args.chunk, args.generate) for family in args.family],
    }  # fmt: skip
    print(json.dumps(result, indent=2))
    if args.out:
        write_result_json(args.out, result)


if __name__ == "__main__":
    main()
