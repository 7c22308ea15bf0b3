"""End-to-end decode / prefill speed of onecat's runtime on Qwen3.5-shaped models (GPU).

Builds Qwen3.5-27B- and 35B-A3B-shaped models at full depth with random weights generated
directly on the GPU in the packed 4-bit layout (random integers q and zero points, fp16
scales, group 128; embeddings, lm_head, router, shared-expert gate and the tiny GDN b/a
projections in fp16 as in AWQ checkpoints) -- no checkpoint, no download. Measures, through
the engine (scheduler, paged KV, GDN state slots, CUDA graphs, sampling):

- batch-1 decode tokens/s, batch-8 and batch-32 decode throughput (128-token prompts),
- prefill tokens/s of one 2048-token prompt,
- the batch-1 roofline: bytes read per decoded token (weights touched, GDN state read and
  written, KV read) over the device copy bandwidth measured in the same run,
- transformers' fp16 model of the same shape (random init on the same GPU): batch-1 decode
  through ``generate`` and the same 2048-token prefill,
- CUDA graphs against eager on the same engine (``graph_eager_*``): logits within
  :data:`GRAPH_EAGER_RTOL` of the largest, greedy tokens equal but where the eager run's top-1
  lead is within twice that (random weights: nearly flat next-token distributions). The MoE
  model routes with :class:`onecat.tiny.SeparatedRouting` (its top-k expert choice has a
  guaranteed margin), so a routing flip cannot excuse a difference. A failed check is
  printed and makes the script exit with status 1 (after writing ``--out``).

    ONECAT_KERNEL_DIR=.ptx ONECAT_KERNEL_ARCH=70 python bench/e2e.py --out results.json

``--hf-layers N`` builds transformers' model with N layers (same layer-type pattern) and
scales its per-token time to full depth linearly (said in the output).

Long prompts (issue 42, item 4; ``--long-prompts 2048,8192,32768,65536,131072``, after the
figures above or alone with ``--long-only``): per model, per KV cache dtype
(``--kv-cache-dtype auto,fp8_e5m2,int8``) an engine of batch 1 (``max_num_seqs`` 1, KV blocks
for the longest prompt plus the decode steps, chunks of ``--prefill-len``, CUDA graphs unless
``--long-eager``: the batch-1 decode graph and the piecewise prompt graphs, whose attention
cores run eagerly), and per length and prompt attention (``--prompt-attention
onecat,sdpa-flash,sdpa-mem``: onecat's flash prefill kernel, the runtime's default on CUDA;
torch SDPA's FlashAttention-2 or memory-efficient backend through the runtime's
``prompt_attention_sdpa``, one call per chunk with repeated K/V, the pre-kernel path;
``sdpa-math`` too) one greedy request: the time to its first token (prefill tok/s = length /
TTFT; best of 3 at 2k, of 2 at 8k, one run above), then ``--long-decode-steps`` decode steps
timed at that context (after 2 untimed ones), then aborted. Prompt attentions interleave per
length; every prompt is fresh (no prefix-cache hit). The SDPA backends run with the KV cache
dtypes of ``--sdpa-kv-cache-dtypes`` only (default: ``auto`` if listed, else the first of
``--kv-cache-dtype``: the base the others are compared with), the other dtypes only up to
``--kv-dtype-max-len`` tokens (to fit a device call; list them first, so that a time limit
cuts the base's longest rows rather than them). The
model is built once; each KV dtype gets a fresh engine on it. A row that fails (out of memory,
no SDPA kernel for the shapes) records its error and the run goes on. ``--memory-cap-gib``
limits torch's allocator (``set_per_process_memory_fraction``): a 128k-token prompt within a
32 GB card's memory. ``--device cpu --layers 2 --vocab 512 --long-only`` is a smoke run of the
plumbing (the torch reference path instead of the kernel; ``sdpa-mem`` does not exist on CPU).

    python bench/e2e.py --models 27b,35b-a3b --long-only --long-prompts 2048,8192,32768,65536,131072 \
        --prompt-attention onecat,sdpa-flash,sdpa-mem --kv-cache-dtype auto,fp8_e5m2,int8 --out long.json
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import time

import torch

from onecat.runtime.config import EngineConfig
from onecat.runtime.engine import LLMEngine
from onecat.runtime.layers import fusion
from onecat.runtime.layers.linear import Linear
from onecat.runtime.layers.moe import FusedExperts
from onecat.runtime.models.config import ModelConfig
from onecat.runtime.models.qwen3_5 import GatedDeltaNet, Qwen3_5ForCausalLM
from onecat.runtime.quant_plan import QuantPlan
from onecat.runtime.sampling_params import SamplingParams

GROUP = 128
DEVICE = "cuda"
GRAPH_EAGER_RTOL = 2e-2
"""Graph vs eager: largest |logit difference| over the largest |logit| (fp16: the two paths
may sum in different orders; the GPU engine tests' bound)."""

COMMON = dict(
    vocab_size=248320, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=8192,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False, hidden_act="silu",
)
SHAPES = {
    "27b": dict(
        model_type="qwen3_5_text", hidden_size=5120, num_hidden_layers=64, intermediate_size=17408,
        num_attention_heads=24, num_key_value_heads=4, linear_num_key_heads=16,
        linear_num_value_heads=48, **COMMON,
    ),
    "35b-a3b": dict(
        model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
        num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=32, num_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        **COMMON,
    ),
    # not a Qwen3.5 size: CPU smoke runs of the benchmarks' plumbing (with --vocab)
    "smoke": dict(
        model_type="qwen3_5_text", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4, **COMMON,
    ),
}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def layer_types(n: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


def text_config(name: str, layers: int | None = None) -> dict:
    raw = dict(SHAPES[name])
    if layers:
        raw["num_hidden_layers"] = layers
    raw["layer_types"] = layer_types(raw["num_hidden_layers"])
    return raw


@torch.no_grad()
def fill_random(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights in place: packed integers and fp16 scales with the dequant contract's
    ``(s, fp16(-z*s))`` pairs, small fp16 weights, zero-centred norms, GDN decays."""
    torch.manual_seed(seed)
    for name, param in model.named_parameters():
        data = param.data
        if data.dtype == torch.int32:
            data.random_(-(2**31), 2**31 - 1)
        elif name.endswith("scales_zeros"):
            s = torch.empty(data.shape[:-1], device=data.device).uniform_(0.002, 0.004)
            z = torch.randint(0, 16, s.shape, device=data.device).float()
            data[..., 0] = s.half()
            data[..., 1] = (-z * s.half().float()).half()
        elif name.endswith("A_log"):
            data.copy_(torch.empty_like(data).uniform_(1, 16).log())
        elif name.endswith("dt_bias"):
            data.fill_(1.0)
        elif "norm" in name:
            data.zero_() if not name.endswith("linear_attn.norm.weight") else data.fill_(1.0)
        else:
            data.normal_(0, 0.02)
    if isinstance(model, Qwen3_5ForCausalLM) and model.config.is_moe:
        separate_routing(model)


RESIDUAL_WRITERS = ("self_attn.o_proj", "linear_attn.out_proj", "shared_expert.down_proj", "experts.w2")


@torch.no_grad()
def separate_routing(model: Qwen3_5ForCausalLM, seed: int = 0) -> None:
    """Give the random MoE model :class:`onecat.tiny.SeparatedRouting`: routing channels in the
    embedding, those rows of every residual writer dequantising to exactly 0 (scale and
    ``-z*s`` zero), and routers that read a token's experts from its channels, so graphs and
    eager (or any two summation orders) choose the same experts."""
    from onecat.pack.volta_layout import COLUMN_LANES, TILE
    from onecat.tiny import SeparatedRouting

    cfg = model.config
    routing = SeparatedRouting(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, seed)
    columns = torch.arange(routing.channels.start, routing.channels.stop)
    embed = model.model.embed_tokens.weight
    embed.copy_(routing.embedding(embed).to(embed.dtype))
    writers = 0
    for name, param in model.named_parameters():
        if name.endswith("scales_zeros") and any(w in name for w in RESIDUAL_WRITERS):
            # [..., N/32, K/g, 32, 2] (stacked experts lead with E): rows -> (tile, lane)
            tiles = (columns // TILE).to(param.device)
            lanes = COLUMN_LANES[columns % TILE].to(param.device)
            param.view(-1, *param.shape[-4:])[:, tiles, :, lanes] = 0
            writers += 1
        elif name.endswith("mlp.gate.weight"):
            layer = int(name.split("layers.")[1].split(".")[0])
            param.copy_(routing.router(layer).to(param))
    expected = 3 * cfg.num_hidden_layers  # per layer: the mixer's output, the shared and the routed experts' down
    if writers < expected:
        raise RuntimeError(f"separate_routing cleared {writers} residual writers, expected at least {expected}")


def bytes_per_decoded_token(model: Qwen3_5ForCausalLM, context: int) -> int:
    """Bytes one batch-1 decode step must move: every weight it reads (MoE: the top-k
    experts), the embedding row, GDN states read and written, KV read over ``context``."""
    cfg = model.config
    total = 0
    for module in model.modules():
        if isinstance(module, Linear):
            total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        elif isinstance(module, FusedExperts):
            params = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
            total += params * cfg.num_experts_per_tok // cfg.num_experts
        elif isinstance(module, GatedDeltaNet):
            per_seq = module.num_v_heads * module.head_k_dim * module.head_v_dim * 4
            per_seq += module.conv_dim * 3 * 2
            total += 2 * per_seq + module.conv1d.weight.numel() * 2
    total += cfg.hidden_size * 2  # embedding row
    total += cfg.num_full_attention_layers * context * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    return total


def copy_bandwidth(gib: float = 4.0) -> float:
    """Device copy bandwidth in bytes/s (read + write), best of 10."""
    src = torch.empty(int(gib * 2**30) // 2, dtype=torch.float16, device=DEVICE)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        sync()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * gib * 2**30 / best


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def start_decoding(engine: LLMEngine, batch: int, prompt_len: int, max_tokens: int, seed: int, tag: str = "d") -> list[str]:
    """Add ``batch`` greedy requests with random ``prompt_len``-token prompts and step until
    every prompt is prefilled (all sequences decode from the next step on); their ids."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    vocab = engine.runner.model_config.vocab_size
    ids = [f"{tag}{batch}-{seed}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, random_prompt(prompt_len, vocab, seed + i), params)
    while engine.num_waiting() or any(s.num_pending_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    return ids


def timed_decode(engine: LLMEngine, batch: int, prompt_len: int, steps: int, seed: int) -> float:
    """Decode tokens/s of ``batch`` sequences over ``steps`` steps after their prefill.

    Prompts are prefilled a few per step, so the first ones decode meanwhile: their budget
    is large enough that none finishes inside the timed window (the batch would shrink and
    the window would time another batch size); they are aborted after it."""
    ids = start_decoding(engine, batch, prompt_len, 4 * steps + prompt_len + 16, seed)
    engine.step()  # first decode step of the bucket may capture its graph
    engine.step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    elapsed = time.perf_counter() - start
    assert len(engine.scheduler.running) == batch, "a sequence finished inside the timed window"
    for rid in ids:
        engine.abort_request(rid)
    return batch * steps / elapsed


def workload_requests(count: int, input_len: int, output_len: int, range_ratio: float, vocab: int,
                      seed: int, prefix_len: int = 0, prefix_share: float = 1.0) -> list[tuple[list[int], int]]:
    """``count`` (prompt, output length) pairs drawn as ``onecat bench serve``'s random dataset
    draws them: both lengths uniform in ``[floor(L * (1 - r)), ceil(L * (1 + r))]``
    (``length_range``, as vLLM's), and with ``prefix_len`` one random prefix before the prompts
    of the requests ``prefix_carriers(count, prefix_share)`` picks, as many fresh tokens before
    the others (``--random-prefix-len`` / ``--random-prefix-share``), so that the engine alone
    runs the served workload."""
    from onecat.benchmarks.datasets import length_range, prefix_carriers

    rng = torch.Generator().manual_seed(seed)
    in_low, in_high = length_range(input_len, range_ratio, minimum=1)
    out_low, out_high = length_range(output_len, range_ratio, minimum=1)
    inputs = torch.randint(in_low, in_high + 1, (count,), generator=rng).tolist()
    outputs = torch.randint(out_low, out_high + 1, (count,), generator=rng).tolist()
    prefix = random_prompt(prefix_len, vocab, seed - 1) if prefix_len else []
    carries = prefix_carriers(count, prefix_share)
    return [((prefix if shared else random_prompt(prefix_len, vocab, -(seed + 1 + i))) + random_prompt(n, vocab, seed + 1 + i), m)
            for i, (n, m, shared) in enumerate(zip(inputs, outputs, carries, strict=True))]


def timed_workload(engine: LLMEngine, requests: list[tuple[list[int], int]], concurrency: int) -> dict:
    """The engine alone on a server's closed-loop workload: at most ``concurrency`` requests
    in flight, a new one added as soon as one finishes (what ``onecat bench serve
    --max-concurrency`` does over HTTP), each (prompt, output length) of ``requests`` decoded
    greedily to exactly that length. Output tokens/s over the whole run, steps by kind and
    output tokens a step: the figures the server is compared with."""
    queue = list(enumerate(requests))
    in_flight = 0
    steps = mixed = 0
    sync()
    start = time.perf_counter()
    while queue or in_flight:
        while queue and in_flight < concurrency:
            i, (prompt, output_len) = queue.pop(0)
            params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
            engine.add_request(f"w{id(requests)}-{i}", prompt, params)
            in_flight += 1
        mixed += engine.num_waiting() > 0 or any(s.num_pending_tokens > 1 for s in engine.scheduler.running)
        steps += 1
        in_flight -= sum(out.finished for out in engine.step())
    sync()
    elapsed = time.perf_counter() - start
    tokens = sum(output_len for _, output_len in requests)
    return {"concurrency": concurrency, "requests": len(requests), "output_tok_s": tokens / elapsed,
            "steps": steps, "steps_with_prompts": mixed, "ms_per_step": elapsed * 1e3 / steps,
            "tokens_per_step": tokens / steps}


def graph_matches_eager(engine: LLMEngine, prompt_len: int, tokens: int = 8) -> dict:
    """Greedy tokens and per-step logits of one request decoded under CUDA graphs and
    eagerly: a correctness check of the graph path on the benchmarked model
    (``graph_eager_ok``; see the module docstring for the rule)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompt = random_prompt(prompt_len, engine.runner.model_config.vocab_size, 4242)
    runs = []
    graphs_on, prompt_graphs = engine.runner.use_graphs, engine.runner.prompt_graphs
    for use_graphs in (True, False):
        engine.runner.use_graphs = use_graphs
        engine.runner.prompt_graphs = prompt_graphs if use_graphs else None
        logits = []
        run = engine.runner.run

        def spy(scheduled, *args, run=run, logits=logits):
            seqs, out = run(scheduled, *args)
            if len(out):  # a prompt chunk cut at a prefix-cache checkpoint samples nothing
                logits.append(out[0].float().clone())
            return seqs, out

        engine.runner.run = spy
        engine.add_request(f"check-{use_graphs}", prompt, params)
        ids = []
        while engine.has_unfinished_requests():
            ids += [t for o in engine.step() for t in o.new_token_ids]
        engine.runner.run = run
        runs.append((ids, torch.stack(logits[: len(ids)])))
    engine.runner.use_graphs, engine.runner.prompt_graphs = graphs_on, prompt_graphs
    (graph_ids, graph_rows), (eager_ids, eager_rows) = runs
    tol = GRAPH_EAGER_RTOL * eager_rows.abs().max().item()
    problems, worst = [], 0.0
    for step, (a, b) in enumerate(zip(eager_ids, graph_ids, strict=True)):
        diff = (graph_rows[step] - eager_rows[step]).abs().max().item()
        worst = max(worst, diff)
        if not diff <= tol:
            problems.append(f"step {step}: logits differ by {diff:.3g} (tolerance {tol:.3g})")
            break
        if a != b:  # the contexts part here: compare no further
            lead = (eager_rows[step][a] - eager_rows[step][b]).item()
            if lead > 2 * tol:
                problems.append(f"step {step}: token {b} under graphs, {a} eagerly, which leads by {lead:.3g}")
            break
    return {
        "graph_eager_same_tokens": graph_ids == eager_ids,
        "graph_eager_max_logit_diff": worst,
        "graph_eager_max_logit_diff_rel": worst / eager_rows.abs().max().item(),
        "graph_eager_ok": not problems,
        "graph_eager_problems": problems,
    }


def timed_prefill(engine: LLMEngine, length: int, repeats: int = 3) -> float:
    """Prefill tokens/s of one ``length``-token prompt (best of ``repeats``)."""
    vocab = engine.runner.model_config.vocab_size
    best = math.inf
    for r in range(repeats + 1):
        engine.add_request(f"p{r}", random_prompt(length, vocab, 100 + r), SamplingParams(max_tokens=1, temperature=0.0))
        sync()
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        sync()
        if r:  # the first run warms up (kernel tuning for this M)
            best = min(best, time.perf_counter() - start)
    return length / best


def time_to_first_token(engine: LLMEngine, length: int, seed: int = 7) -> float:
    """Seconds from adding one ``length``-token prompt (drawn with ``seed``: another seed, no
    prefix-cache hit) to its first token (one run); RuntimeError when the request fails
    (e.g. non-finite logits), rather than a time for it."""
    engine.add_request(f"long{length}-{seed}", random_prompt(length, engine.runner.model_config.vocab_size, seed),
                       SamplingParams(max_tokens=1, temperature=0.0))
    sync()
    start = time.perf_counter()
    failed = []
    while engine.has_unfinished_requests():
        failed += [out.error for out in engine.step() if out.finish_reason == "error"]
    sync()
    if failed:
        raise RuntimeError(f"the time-to-first-token request failed: {failed[0]}")
    return time.perf_counter() - start


# ----- long prompts (issue 42, item 4) ------------------------------------------------------

PROMPT_ATTENTIONS = {"onecat": None, "sdpa-flash": "FLASH_ATTENTION", "sdpa-mem": "EFFICIENT_ATTENTION",
                     "sdpa-math": "MATH"}
"""``--prompt-attention`` names: onecat's own choice (the flash prefill kernel on CUDA fp16,
the torch reference path elsewhere), or one torch SDPA backend (``SDPBackend`` member)."""
LONG_WARM_UP_DECODE = 2
"""Untimed decode steps after the first token, before the timed ones."""


def parse_list(text: str, allowed, flag: str) -> list[str]:
    """Comma-separated names, each one of ``allowed``; SystemExit naming ``flag`` otherwise."""
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise SystemExit(f"{flag}: {','.join(unknown) or text!r}: choose from {', '.join(allowed)}")
    return names


def base_dtype(kv_cache_dtypes: list[str]) -> str:
    """The KV cache dtype the others are compared with: ``auto`` when listed, else the first."""
    return "auto" if "auto" in kv_cache_dtypes else kv_cache_dtypes[0]


def long_repeats(length: int) -> int:
    """Runs per row, the best kept: 3 at 2k tokens and below, 2 up to 8k, then 1."""
    return 3 if length <= 2048 else 2 if length <= 8192 else 1


def prompt_attention(name: str):
    """The runtime's switch for prompt attention ``name`` (a context manager)."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend

    from onecat.runtime.layers.attention import prompt_attention_sdpa

    backend = PROMPT_ATTENTIONS[name]
    return nullcontext() if backend is None else prompt_attention_sdpa(getattr(SDPBackend, backend))


def long_engine_config(name: str, args, kv_cache_dtype: str) -> EngineConfig:
    """Batch 1, KV blocks for the longest prompt and its decode steps (plus a spare chunk)."""
    max_len = max(args.long_prompts) + LONG_WARM_UP_DECODE + args.long_decode_steps + 16
    block = 16
    return EngineConfig(
        model=f"random-{name}", device=args.device, max_num_seqs=1, max_model_len=max_len,
        max_num_batched_tokens=args.prefill_len, kv_block_size=block,
        num_kv_blocks=-(-(max_len + args.prefill_len) // block), enforce_eager=args.long_eager or args.device != "cuda",
        kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
    )


def close_engine(engine: LLMEngine) -> None:
    """Free an engine built on a model that the next engine reuses: its graphs, and the caches
    and states it gave the model's layers (the next engine plans its memory without them)."""
    runner = engine.runner
    runner.release_graphs()
    for layer in runner.attention:
        layer.k_cache, layer.v_cache, layer.k_scale, layer.v_scale = torch.empty(0), torch.empty(0), None, None
    for layer in runner.gdn:
        layer.conv_state, layer.recurrent_state = torch.empty(0), torch.empty(0)
    engine.close()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def long_request(engine: LLMEngine, length: int, seed: int, decode_steps: int) -> dict:
    """One greedy request of a fresh ``length``-token prompt: seconds to its first token, then
    the decode tokens/s over ``decode_steps`` steps at that context (after
    ``LONG_WARM_UP_DECODE`` untimed steps; none timed when ``decode_steps`` is 0); aborted
    after. RuntimeError when the request fails in the engine."""
    rid = f"long{length}-{seed}"
    vocab = engine.runner.model_config.vocab_size
    params = SamplingParams(max_tokens=decode_steps + LONG_WARM_UP_DECODE + 8, temperature=0.0, ignore_eos=True)

    def step() -> int:
        tokens = 0
        for out in engine.step():
            if out.request_id == rid:
                if out.finish_reason == "error":
                    raise RuntimeError(f"the request failed in the engine: {out.error}")
                tokens += len(out.new_token_ids)
        return tokens

    engine.add_request(rid, random_prompt(length, vocab, seed), params)
    try:
        sync()
        start = time.perf_counter()
        while not step():
            pass
        sync()
        ttft = time.perf_counter() - start
        result = {"ttft_s": ttft, "prefill_tok_s": length / ttft}
        if decode_steps:
            for _ in range(LONG_WARM_UP_DECODE):
                step()
            sync()
            start, tokens = time.perf_counter(), 0
            for _ in range(decode_steps):
                tokens += step()
            sync()
            result.update(decode_tok_s=tokens / (time.perf_counter() - start), decode_tokens=tokens)
        return result
    finally:
        engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()


def cache_tokens_per_gib(engine: LLMEngine) -> float:
    """Tokens of context one GiB of this engine's KV cache holds (all full-attention layers)."""
    runner = engine.runner
    return runner.block_size * 2**30 / runner.block_bytes()


def bench_long(name: str, args, save) -> dict:
    """The long-prompt matrix of one model (module docstring): rows of (KV cache dtype, length,
    prompt attention) with TTFT, prefill and decode tok/s; ``save()`` after every row."""
    raw = text_config(name, args.layers)
    if args.vocab:
        raw["vocab_size"] = args.vocab
    raw["max_position_embeddings"] = max(raw["max_position_embeddings"], max(args.long_prompts) + 1024)
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    t0 = time.perf_counter()
    with torch.device(args.device):
        model = Qwen3_5ForCausalLM(ModelConfig.from_dict(raw), QuantPlan(default=GROUP), dtype)
    fill_random(model)
    sync()
    result = {"model": name, "layers": raw["num_hidden_layers"], "build_s": time.perf_counter() - t0,
              "device": args.device, "cuda_graphs": args.device == "cuda" and not args.long_eager,
              "prefill_chunk": args.prefill_len, "decode_steps": args.long_decode_steps, "engines": {}, "rows": []}
    print(f"  {name}: built in {result['build_s']:.1f} s; long prompts with CUDA graphs "
          f"{'on (batch-1 decode graph, piecewise prompt graphs)' if result['cuda_graphs'] else 'off (eager)'}",
          flush=True)
    seeds = itertools.count(5000)  # a seed per prompt: prompts of one seed share a prefix (a cache hit)
    for kv_dtype in args.kv_cache_dtypes:
        config = long_engine_config(name, args, kv_dtype)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            engine = LLMEngine.from_model(config, model)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory under --memory-cap-gib: record, go on
            result["engines"][kv_dtype] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"  {name} {kv_dtype}: engine failed: {exc}", flush=True)
            save()
            continue
        probe = torch.empty(1, model.config.num_attention_heads, model.config.head_dim, device=args.device, dtype=dtype)
        layer = engine.runner.attention[0]
        info = {"setup_s": time.perf_counter() - t0, "num_kv_blocks": engine.runner.num_blocks,
                "cache_tokens_per_gib": cache_tokens_per_gib(engine),
                "onecat_prompt_path": "flash_prefill kernel" if layer.uses_prefill_kernel(probe) else "torch reference"}
        result["engines"][kv_dtype] = info
        print(f"  {name} {kv_dtype}: engine set up in {info['setup_s']:.1f} s, {info['num_kv_blocks']} KV blocks, "
              f"{info['cache_tokens_per_gib']:.0f} tokens/GiB; onecat prompt attention: {info['onecat_prompt_path']}",
              flush=True)
        attentions = [a for a in args.prompt_attentions if a == "onecat" or kv_dtype in args.sdpa_kv_cache_dtypes]
        lengths = [n for n in args.long_prompts if kv_dtype == base_dtype(args.kv_cache_dtypes)
                   or n <= args.kv_dtype_max_len]
        for attention in attentions:  # warm-up: a fresh chunk and one after cached tokens
            try:
                with prompt_attention(attention):
                    long_request(engine, 2 * args.prefill_len + 16, next(seeds), 2)
            except Exception as exc:  # noqa: BLE001 - the rows below record it
                print(f"  {name} {kv_dtype} {attention}: warm-up failed: {exc}", flush=True)
        for length in lengths:
            for attention in attentions:
                row = {"model": name, "kv_cache_dtype": kv_dtype, "prompt_attention": attention, "length": length}
                runs = []
                if args.device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                try:
                    for r in range(long_repeats(length)):
                        with prompt_attention(attention):
                            runs.append(long_request(engine, length, next(seeds), args.long_decode_steps if r == 0 else 0))
                except Exception as exc:  # noqa: BLE001 - out of memory, no SDPA kernel: record, go on
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    free_memory()
                if runs:
                    best = min(runs, key=lambda run: run["ttft_s"])
                    row.update(ttft_s=best["ttft_s"], prefill_tok_s=best["prefill_tok_s"], runs=len(runs))
                    if "decode_tok_s" in runs[0]:
                        row["decode_tok_s"] = runs[0]["decode_tok_s"]
                if args.device == "cuda":
                    row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
                result["rows"].append(row)
                print("  " + long_row_text(row), flush=True)
                save()
        close_engine(engine)
        del engine, layer
        free_memory()
    del model
    free_memory()
    result["summary"] = long_summary(result)
    return result


def long_row_text(row: dict) -> str:
    head = f"{row['model']} {row['kv_cache_dtype']:>8} {row['prompt_attention']:>10} {row['length']:>7} tokens:"
    if "ttft_s" not in row:
        return f"{head} FAILED {row.get('error')}"
    text = f"{head} first token after {row['ttft_s'] * 1e3:8.0f} ms ({row['prefill_tok_s']:6.0f} tok/s)"
    if "decode_tok_s" in row:
        text += f", decode {row['decode_tok_s']:6.1f} tok/s"
    return text + (f" [error in a repeat: {row['error']}]" if "error" in row else "")


def long_summary(result: dict) -> dict:
    """The issue's ratios from the rows (where both sides were measured): prefill and decode at
    each length over the shortest (onecat, the base KV dtype: ``base_dtype``), onecat over each
    SDPA backend per length, each KV dtype's prefill, decode and cache capacity over the base's."""
    rows = {(r["kv_cache_dtype"], r["prompt_attention"], r["length"]): r for r in result["rows"] if "ttft_s" in r}
    summary: dict = {}
    if not result["engines"]:
        return summary
    base = base_dtype(list(result["engines"]))
    dtypes = [base] + [d for d in result["engines"] if d != base]
    lengths = sorted({r["length"] for r in result["rows"]})
    short = min(lengths)
    ref = rows.get((base, "onecat", short))
    for length in lengths:
        row = rows.get((base, "onecat", length))
        if row is None:
            continue
        if ref is not None and length != short:
            summary[f"prefill_{length}_over_{short}"] = row["prefill_tok_s"] / ref["prefill_tok_s"]
            if "decode_tok_s" in row and "decode_tok_s" in ref:
                summary[f"decode_{length}_over_{short}"] = row["decode_tok_s"] / ref["decode_tok_s"]
        for attention in PROMPT_ATTENTIONS:
            other = rows.get((base, attention, length))
            if attention != "onecat" and other is not None:
                summary[f"prefill_{length}_onecat_over_{attention}"] = row["prefill_tok_s"] / other["prefill_tok_s"]
        for kv_dtype in dtypes[1:]:
            other = rows.get((kv_dtype, "onecat", length))
            if other is not None and "decode_tok_s" in other and "decode_tok_s" in row:
                summary[f"decode_{length}_{kv_dtype}_over_{base}"] = other["decode_tok_s"] / row["decode_tok_s"]
            if other is not None:
                summary[f"prefill_{length}_{kv_dtype}_over_{base}"] = other["prefill_tok_s"] / row["prefill_tok_s"]
    for kv_dtype in dtypes[1:]:
        a, b = result["engines"][kv_dtype], result["engines"][base]
        if "cache_tokens_per_gib" in a and "cache_tokens_per_gib" in b:
            summary[f"cache_tokens_{kv_dtype}_over_{base}"] = a["cache_tokens_per_gib"] / b["cache_tokens_per_gib"]
    return summary


def bench_onecat(name: str, args, bandwidth: float) -> dict:
    cfg = ModelConfig.from_dict(text_config(name, args.layers))
    t0 = time.perf_counter()
    with torch.device(DEVICE):
        model = Qwen3_5ForCausalLM(cfg, QuantPlan(default=GROUP), torch.float16)
    fill_random(model)
    sync()
    build_s = time.perf_counter() - t0
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    engine_cfg = EngineConfig(
        model=f"random-{name}", max_num_seqs=args.max_num_seqs, max_model_len=4096,
        max_num_batched_tokens=args.prefill_len, num_kv_blocks=args.kv_blocks, enforce_eager=args.eager,
        device=DEVICE,
    )
    t0 = time.perf_counter()
    engine = LLMEngine.from_model(engine_cfg, model)
    setup_s = time.perf_counter() - t0
    print(f"  {name}: built in {build_s:.1f} s, engine set up in {setup_s:.1f} s", flush=True)
    result = {
        "model": name, "layers": cfg.num_hidden_layers, "weight_gib": weight_bytes / 2**30,
        "build_s": build_s, "engine_setup_s": setup_s,
    }
    context = args.prompt_len + args.decode_steps
    result["bytes_per_token"] = bytes_per_decoded_token(model, context)
    result["roofline_tok_s"] = bandwidth / result["bytes_per_token"]
    for batch in args.batches:
        t0 = time.perf_counter()
        result[f"decode_b{batch}_tok_s"] = timed_decode(engine, batch, args.prompt_len, args.decode_steps, 1000 * batch)
        result[f"decode_b{batch}_wall_s"] = time.perf_counter() - t0
        print(f"  {name} batch {batch}: {result[f'decode_b{batch}_tok_s']:.1f} tok/s", flush=True)
    if not args.eager:
        result.update(graph_matches_eager(engine, args.prompt_len))
    result["prefill_tok_s"] = timed_prefill(engine, args.prefill_len, args.prefill_repeats)
    print(f"  {name} prefill: {result['prefill_tok_s']:.0f} tok/s", flush=True)
    if "decode_b1_tok_s" in result:
        result["roofline_fraction_b1"] = result["decode_b1_tok_s"] / result["roofline_tok_s"]
    result["graphs"] = sorted(engine.runner.graphs)
    result["unfused_after_compile_failure"] = sorted(set(fusion.failures))
    del engine, model
    gc.collect()
    torch.cuda.empty_cache()
    return result


@torch.no_grad()
def bench_transformers(name: str, args) -> dict:
    import transformers

    layers = args.hf_layers or SHAPES[name]["num_hidden_layers"]
    raw = text_config(name, layers)
    config_cls = transformers.Qwen3_5MoeTextConfig if name == "35b-a3b" else transformers.Qwen3_5TextConfig
    config = config_cls(**{k: v for k, v in raw.items() if k != "model_type"})
    t0 = time.perf_counter()
    model_cls = transformers.Qwen3_5MoeForCausalLM if name == "35b-a3b" else transformers.Qwen3_5ForCausalLM
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)  # built in fp16 directly (a 27B fp32 model is 108 GB)
    try:
        with torch.device(DEVICE):
            model = model_cls(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    sync()
    build_s = time.perf_counter() - t0
    scale = SHAPES[name]["num_hidden_layers"] / layers
    ids = torch.tensor([random_prompt(args.prompt_len, raw["vocab_size"], 7)], device=DEVICE)

    def generate(new_tokens: int) -> float:
        sync()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        sync()
        return time.perf_counter() - start

    generate(2)  # warm-up
    steps = args.hf_decode_steps
    per_token = (generate(steps + 1) - generate(1)) / steps
    long_ids = torch.tensor([random_prompt(args.prefill_len, raw["vocab_size"], 8)], device=DEVICE)
    model(long_ids)
    sync()
    start = time.perf_counter()
    model(long_ids)
    sync()
    prefill_s = time.perf_counter() - start
    result = {
        "model": name, "hf_layers": layers, "scaled_to_full_depth": scale != 1, "build_s": build_s,
        "decode_b1_tok_s": 1 / (per_token * scale), "prefill_tok_s": args.prefill_len / (prefill_s * scale),
        "transformers": transformers.__version__,
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="27b,35b-a3b")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (smoke runs)")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=24)
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--prefill-repeats", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--kv-blocks", type=int, default=2048)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--hf-layers", type=int, default=None, help="transformers depth (scaled)")
    parser.add_argument("--hf-decode-steps", type=int, default=8)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", default=None)
    long = parser.add_argument_group("long prompts (issue 42; see the module docstring)")
    long.add_argument("--long-prompts", default="", help="prompt lengths, e.g. 2048,8192,32768,65536,131072")
    long.add_argument("--long-only", action="store_true", help="only the long-prompt matrix")
    long.add_argument("--prompt-attention", default="onecat",
                      help=f"comma-separated, of {', '.join(PROMPT_ATTENTIONS)} (torch SDPA backends: bench only)")
    long.add_argument("--kv-cache-dtype", default="auto", help="comma-separated KV cache dtypes, an engine each")
    long.add_argument("--sdpa-kv-cache-dtypes", default=None,
                      help="KV cache dtypes the SDPA prompt attentions also run with (default: auto if listed, "
                      "else the first)")
    long.add_argument("--kv-dtype-max-len", type=int, default=None,
                      help="longest prompt for the KV cache dtypes other than that one (default: all)")
    long.add_argument("--long-decode-steps", type=int, default=32, help="timed decode steps after each prompt")
    long.add_argument("--long-eager", action="store_true", help="no CUDA graphs for the long prompts")
    long.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="the engines' exact cache budget")
    long.add_argument("--memory-cap-gib", type=float, default=None,
                      help="cap torch's allocator at this many GiB (e.g. 31: a 32 GB card)")
    long.add_argument("--device", default="cuda", help="cpu: a smoke run of the long part (with --long-only)")
    long.add_argument("--vocab", type=int, default=None, help="smaller vocabulary (CPU smoke runs)")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.long_prompts = [int(n) for n in args.long_prompts.split(",") if n]
    args.prompt_attentions = parse_list(args.prompt_attention, PROMPT_ATTENTIONS, "--prompt-attention")
    from onecat.runtime.capacity import KV_CACHE_DTYPES

    args.kv_cache_dtypes = parse_list(args.kv_cache_dtype, KV_CACHE_DTYPES, "--kv-cache-dtype")
    args.sdpa_kv_cache_dtypes = (parse_list(args.sdpa_kv_cache_dtypes, KV_CACHE_DTYPES, "--sdpa-kv-cache-dtypes")
                                 if args.sdpa_kv_cache_dtypes else [base_dtype(args.kv_cache_dtypes)])
    args.kv_dtype_max_len = args.kv_dtype_max_len or max(args.long_prompts, default=0)
    if args.long_only and not args.long_prompts:
        raise SystemExit("--long-only needs --long-prompts")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/e2e.py needs a CUDA GPU (--device cpu --long-only: a smoke run of the long part)")
    if args.device != "cuda" and not args.long_only:
        raise SystemExit("--device cpu runs the long part only: add --long-only")
    if args.memory_cap_gib and args.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * 2**30 / total))
    report = {"torch": torch.__version__, "runs": [], "long": []}
    if args.device == "cuda":
        from onecat.kernels import loader

        report.update(gpu=torch.cuda.get_device_name(0), kernel_target=loader.choose_target(0),
                      memory_cap_gib=args.memory_cap_gib)
        if not args.long_only:
            report["copy_bandwidth_gb_s"] = copy_bandwidth() / 1e9
    print(json.dumps({k: v for k, v in report.items() if k not in ("runs", "long")}), flush=True)

    def save() -> None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)

    for name in args.models.split(","):
        if args.long_prompts:
            t0 = time.perf_counter()
            report["long"].append(bench_long(name, args, save))
            report["long"][-1]["wall_s"] = time.perf_counter() - t0
            print(json.dumps(report["long"][-1]["summary"]), flush=True)
            save()
        if args.long_only:
            continue
        bandwidth = report["copy_bandwidth_gb_s"] * 1e9
        t0 = time.perf_counter()
        ours = bench_onecat(name, args, bandwidth)
        ours["wall_s"] = time.perf_counter() - t0
        print(json.dumps(ours), flush=True)
        entry = {"onecat": ours}
        report["runs"].append(entry)
        save()
        if not args.skip_hf:
            t0 = time.perf_counter()
            theirs = bench_transformers(name, args)
            gc.collect()
            torch.cuda.empty_cache()
            theirs["wall_s"] = time.perf_counter() - t0
            print(json.dumps(theirs), flush=True)
            entry["transformers"] = theirs
            entry["speedup_decode_b1"] = ours["decode_b1_tok_s"] / theirs["decode_b1_tok_s"]
            entry["speedup_prefill"] = ours["prefill_tok_s"] / theirs["prefill_tok_s"]
            save()
    print(json.dumps(report, indent=2))
    failed = [(entry["onecat"]["model"], entry["onecat"]["graph_eager_problems"])
              for entry in report["runs"] if not entry["onecat"].get("graph_eager_ok", True)]
    for model, problems in failed:
        print(f"FAIL {model}: CUDA graphs and eager disagree: {'; '.join(problems)}", flush=True)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
