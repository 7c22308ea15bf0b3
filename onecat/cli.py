"""The `onecat` command line. Each command parses flags and calls one library function.

Library code never imports this module. Every command turns an OnecatError into a clear
message on stderr and exit status 1.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import click

from onecat.errors import OnecatError


def _friendly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a command so that OnecatError ends it with a message and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except OnecatError as exc:
            click.secho(f"error: {exc}", fg="red", err=True)
            sys.exit(1)

    return wrapper


def _size_option(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """A click callback: a byte count as vLLM reads it (8589934592, 8G, 8GiB, ...)."""
    if value is None:
        return None
    from onecat.runtime.capacity import parse_bytes

    try:
        return parse_bytes(value, f"--{param.name.replace('_', '-')}")
    except OnecatError as exc:
        raise click.BadParameter(str(exc)) from None


def _kv_cache_dtype_option(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """A click callback: a ``--kv-cache-dtype`` of ``onecat.runtime.capacity.KV_CACHE_DTYPES``."""
    from onecat.runtime.capacity import check_kv_cache_dtype

    try:
        return check_kv_cache_dtype(value)
    except OnecatError as exc:
        raise click.BadParameter(str(exc)) from None


KV_CACHE_MEMORY_HELP = ("Exact bytes of each GPU's KV cache + GDN state pool (vLLM's flag: "
                        "--gpu-memory-utilization then does not size it): bytes, or 8G / 8GiB "
                        "(2^30), 8g / 8GB (10^9).")
KV_CACHE_DTYPE_HELP = ("KV cache element type (vLLM's names): auto (the activations' dtype, fp16 on a GPU), "
                       "fp8_e5m2 (the top byte of fp16) or int8 (a scale per token and KV head); the "
                       "8-bit ones hold about twice the tokens.")


@click.group()
@click.version_option(package_name="onecat")
def main() -> None:
    """onecat: 4-bit Qwen3.5 on Tesla V100 GPUs."""


# --- quantize / eval (onecat.quantize) -----------------------------------------------


@main.command("quantize")
@click.argument("model")
@click.option("--out", "out", required=True, type=click.Path(), help="Output directory (AutoAWQ GEMM).")
@click.option("--recipe", type=click.Path(), default=None,
              help="Recipe YAML (default: chosen by config.json's model_type).")
@click.option("--calib", default=None,
              help="Calibration text: builtin:pydoc (default), a text file or directory, "
                   "FILE.jsonl[:FIELD], FILE.parquet[:FIELD] or hf:NAME[,CONFIG][@SPLIT][:FIELD].")
@click.option("--samples", type=int, default=None, help="Calibration samples (recipe default 128).")
@click.option("--seqlen", type=int, default=None, help="Tokens per sample (recipe default 512).")
@click.option("--group-size", type=int, default=None,
              help="Quantization group size: a positive multiple of 32 (recipe default 128).")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--resume", is_flag=True, help="Finish an interrupted run into the same OUT.")
@click.option("--overwrite", is_flag=True, help="Replace an existing OUT (and any interrupted run).")
@click.option("--method", type=click.Choice(["awq", "awq+gptq"]), default=None,
              help="awq: plain rounding after smoothing; awq+gptq: GPTQ's error-compensating "
                   "rounding after smoothing, same output format (default: the recipe's method).")
@click.option("--rtn", is_flag=True, help="Plain round-to-nearest, no calibration (for comparisons).")
@_friendly
def quantize_command(model: str, out: str, recipe: str | None, calib: str | None,
                     samples: int | None, seqlen: int | None, group_size: int | None,
                     method: str | None, device: str, resume: bool, overwrite: bool,
                     rtn: bool) -> None:
    """AWQ-quantize MODEL (a local checkpoint directory or a hub id) to 4 bits, streaming one
    decoder layer at a time, into an AutoAWQ GEMM checkpoint in OUT."""
    from onecat.quantize.pipeline import quantize_model, quantize_rtn

    if rtn:
        if calib or samples or seqlen or method:
            raise OnecatError("--rtn uses no calibration: drop --calib / --samples / --seqlen / --method")
        quantize_rtn(model, out, group_size=group_size, recipe=recipe, device=device,
                     resume=resume, overwrite=overwrite)
    else:
        quantize_model(model, out, recipe=recipe, calib=calib, samples=samples, seqlen=seqlen,
                       group_size=group_size, method=method, device=device, resume=resume,
                       overwrite=overwrite)


@main.command("eval")
@click.argument("model", metavar="MODEL_OR_ARTIFACT")
@click.option(
    "--text",
    default="builtin:pydoc",
    show_default=True,
    help="Evaluation text: a UTF-8 file, builtin:pydoc or builtin:jargon (Debian jargon-text).",
)
@click.option("--tokens", default=8192, show_default=True, help="Evaluate the first N tokens.")
@click.option("--ctx", default=512, show_default=True, help="Window length L (non-overlapping).")
@_friendly
def eval_command(model: str, text: str, tokens: int, ctx: int) -> None:
    """Perplexity of an fp checkpoint or AutoAWQ GEMM artifact (dequantised on the CPU):
    the first N tokens of the text in non-overlapping windows of L tokens, each window
    scored on its own."""
    from onecat.quantize.evaluate import evaluate

    result = evaluate(model, text, tokens=tokens, ctx=ctx)
    click.echo(
        f"perplexity {result.ppl:.4f} on {text} ({result.tokens} tokens, "
        f"{result.windows} windows of {result.ctx}; model {model})"
    )


# --- pack (onecat.pack) ----------------------------------------------------------------


@main.command("pack")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.option("--out", "out", required=True, type=click.Path(), help="Artifact directory to write.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
@_friendly
def pack_command(src: str, out: str, overwrite: bool, no_progress: bool) -> None:
    """Pack an AutoAWQ GEMM or compressed-tensors 4-bit checkpoint into the Volta layout."""
    import json
    import logging

    from onecat.pack.writer import MANIFEST_NAME, pack_checkpoint

    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")
    path = pack_checkpoint(src, out, overwrite=overwrite, show_progress=not no_progress)
    summary = json.loads((path / MANIFEST_NAME).read_text())["summary"]
    click.echo(
        f"{path}: {summary['packed_linears']} linears packed, "
        f"{summary['kept_fp16_linears']} kept fp16, {summary['copied_tensors']} tensors copied, "
        f"{summary['tensor_bytes'] / 1e9:.3f} GB in {summary['shards']} shard(s)"
    )


# --- build-kernels / tune / doctor (onecat.kernels) --------------------------------------

@main.command("build-kernels")
@click.option("--arch", default="sm_70", show_default=True, help="Target GPU architecture.")
@click.option("--out", "out", required=True, type=click.Path(), help="Directory to write.")
@_friendly
def build_kernels_command(arch: str, out: str) -> None:
    """Pre-build the kernels as PTX (compute_XY) and cubins (sm_XY) for ONECAT_KERNEL_DIR."""
    from onecat.kernels.build import build_all

    for compiled in build_all(arch, out):
        click.echo(f"{compiled.program} {compiled.target}: {len(compiled.image)} bytes")
        for r in compiled.resources:
            click.echo(
                f"  {r.name}: {r.registers} registers, {r.shared_bytes} B smem, "
                f"{r.spill_stores + r.spill_loads} B spilled"
            )
    click.echo(f"wrote {out}; use it with ONECAT_KERNEL_DIR={out}")


@main.command("tune")
@click.option("--m", "ms", default="1,2,4,8,16,32,64,128,256", show_default=True,
              help="Comma-separated token counts (each tunes its M bucket).")
@click.option("--shape", "shapes", multiple=True, help="NxK to tune (default: every Qwen3.5 shape).")
@click.option("--group-size", default=128, show_default=True)
@_friendly
def tune_command(ms: str, shapes: tuple[str, ...], group_size: int) -> None:
    """Time the kernel variants on this GPU per (M bucket, N, K) and cache the winners."""
    import torch

    from onecat.kernels.shapes import sliced_shapes
    from onecat.kernels.tuning import table_path, tune_shapes

    if not torch.cuda.is_available():
        raise OnecatError("onecat tune needs a CUDA GPU (torch sees none)")
    if shapes:
        try:
            pairs = [tuple(int(v) for v in s.lower().split("x")) for s in shapes]
        except ValueError as exc:
            raise OnecatError(f"--shape takes NxK, e.g. 5120x17408; got {shapes}") from exc
    else:
        pairs = [(n, k) for _, n, k in sliced_shapes() if k % group_size == 0]
    m_values = [int(v) for v in ms.split(",")]
    from tqdm import tqdm

    results = []
    for n, k in tqdm(pairs, desc="tuning", unit="shape"):
        results += tune_shapes([(n, k)], m_values, group_size)
    for n, k, m, name, micros in results:
        click.echo(f"{n:6d}x{k:<6d} M<={m:<5d} {name:18s} {micros:9.1f} us")
    click.echo(f"{len(results)} winners saved to {table_path(0)}")


@main.command("doctor")
@click.option("--self-test", "self_test", is_flag=True,
              help="Also run every engine path (eager / CUDA graphs, prefix cache, speculative "
                   "decoding, batch 1 / 8, async scheduling) on the bundled trained tiny models "
                   "against a CPU fp32 reference: a few minutes, no download. Attach its output "
                   "to bug reports.")
@_friendly
def doctor_command(self_test: bool) -> None:
    """Check GPU, driver, torch, NVRTC and every kernel; print each problem with its fix."""
    import torch

    from onecat.kernels.doctor import diagnose

    findings = diagnose()
    cpu_only = self_test and not torch.cuda.is_available()
    problems = []
    for f in findings:
        if cpu_only and f.check == "GPU":  # the self-test runs the CPU paths instead
            click.echo(f"note {f.check}: {f.detail}; the self-test runs the CPU paths only")
            continue
        mark = click.style("ok  ", fg="green") if f.ok else click.style("FAIL", fg="red")
        click.echo(f"{mark} {f.check}: {f.detail}")
        if f.fix:
            click.echo(f"     fix: {f.fix}")
        if not f.ok:
            problems.append(f)
    click.echo(f"{len(problems)} problem(s)" if problems else "all checks passed")
    failed = bool(problems)
    if self_test:
        failed = _self_test() or failed
    if failed:
        sys.exit(1)


def _self_test() -> bool:
    """Run ``onecat.self_test`` with a line per row as it finishes, then its table; True
    when anything failed."""
    import platform
    import time

    import torch
    from rich.console import Console

    from onecat import self_test

    console = Console() if sys.stdout.isatty() else Console(width=180)  # a file: the whole table
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpus = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) or "none"
    console.print(f"self-test on {device}: onecat {_version()}, torch {torch.__version__}, "
                  f"Python {platform.python_version()}, GPUs: {gpus}")
    start = time.perf_counter()
    rows = self_test.run_self_test(device, progress=lambda row: console.print(self_test.row_line(row), markup=False))
    console.print(self_test.report_table(rows))
    failed = any(not row.ok for row in rows)
    console.print(f"{self_test.summary(rows)} in {time.perf_counter() - start:.0f} s",
                  style="red" if failed else "green")
    return failed


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("onecat")
    except PackageNotFoundError:
        return "(not installed)"


# --- serve / generate (onecat.runtime) ---------------------------------------------------


def _engine_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The engine flags shared by `serve` and `generate` (vLLM's names and defaults)."""
    options = [
        click.argument("artifact", type=click.Path(exists=True, file_okay=False)),
        click.option("--device", default="auto", show_default=True, help="cuda, cuda:N, cpu or auto."),
        click.option("--max-model-len", type=int, default=None,
                     help="Context length (prompt + output). Default: the model's, capped by memory."),
        click.option("--max-num-seqs", type=int, default=256, show_default=True,
                     help="Most sequences running at once."),
        click.option("--max-num-batched-tokens", type=int, default=2048, show_default=True,
                     help="Token budget of one engine step (chunked prefill)."),
        click.option("--gpu-memory-utilization", type=float, default=0.92, show_default=True,
                     help="Fraction of GPU memory for weights, activations and the KV cache."),
        click.option("--enforce-eager", is_flag=True, help="Do not capture CUDA graphs."),
        click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True, show_default=True,
                     help="Reuse the KV blocks and GDN states of prompt prefixes seen before."),
        click.option("--tensor-parallel-size", "-tp", type=int, default=1, show_default=True,
                     help="GPUs of this host to split the model over (per pipeline stage with "
                          "--engine vllm)."),
        click.option("--speculative-config", default=None, metavar="JSON",
                     help='Speculative decoding with the checkpoint\'s MTP head, e.g. '
                          '\'{"method": "mtp", "num_speculative_tokens": 3}\' (1-4 drafts per step).'),
        click.option("--disable-custom-all-reduce", is_flag=True,
                     help="Tensor parallelism: sum activations with NCCL only, not with onecat's "
                          "one-shot peer-to-peer kernel for small tensors."),
        click.option("--async-scheduling/--no-async-scheduling", default=True, show_default=True,
                     help="Queue the next decode step on the GPU before reading the tokens of the "
                          "one in flight (overlapped steps; also under tensor parallelism)."),
        click.option("--kv-cache-memory-bytes", default=None, metavar="SIZE", callback=_size_option,
                     help=KV_CACHE_MEMORY_HELP),
        click.option("--kv-cache-dtype", default="auto", show_default=True, callback=_kv_cache_dtype_option,
                     help=KV_CACHE_DTYPE_HELP),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _engine_config(artifact: str, served_model_name: str | None = None, **flags: Any) -> Any:
    """The EngineConfig of the engine flags, refused (as `onecat plan` would) before any weight
    loads when its exact cache budget (--kv-cache-memory-bytes) cannot hold one --max-model-len
    sequence."""
    import torch

    from onecat.runtime.config import EngineConfig
    from onecat.runtime.engine.llm_engine import resolve_device
    from onecat.runtime.plan import check_engine_config

    config = EngineConfig(model=artifact, served_model_name=served_model_name, **flags)
    dtype = torch.float16 if resolve_device(config.device).type == "cuda" else torch.float32
    check_engine_config(config, dtype)
    return config


def _server_flags_for_vllm(trust_request_chat_template: bool, max_request_body_bytes: int,
                           shutdown_timeout: float) -> tuple[str, ...]:
    """vLLM's spelling of the HTTP server flags given explicitly; a flag vLLM lacks is refused
    rather than silently dropped."""
    source = click.get_current_context().get_parameter_source
    if source("max_request_body_bytes") != click.core.ParameterSource.DEFAULT:
        raise OnecatError("--max-request-body-bytes applies to the embedded engine only: vLLM's "
                          "server has no body limit (put a reverse proxy's, e.g. nginx's "
                          "client_max_body_size, in front of it)")
    if source("structured_outputs_compile_timeout") != click.core.ParameterSource.DEFAULT:
        raise OnecatError("--structured-outputs-compile-timeout applies to the embedded engine only: "
                          "vLLM's server has no grammar compile budget")
    args: tuple[str, ...] = ("--trust-request-chat-template",) if trust_request_chat_template else ()
    if source("shutdown_timeout") != click.core.ParameterSource.DEFAULT:
        args += ("--shutdown-timeout", f"{shutdown_timeout:g}")
    return args


def _parser_flags_for_vllm(enable_auto_tool_choice: bool, tool_call_parser: str | None,
                           reasoning_parser: str | None) -> tuple[str, ...]:
    """The tool-call and reasoning flags, spelt as vLLM spells them (the same names)."""
    args: tuple[str, ...] = ("--enable-auto-tool-choice",) if enable_auto_tool_choice else ()
    if tool_call_parser is not None:
        args += ("--tool-call-parser", tool_call_parser)
    if reasoning_parser is not None:
        args += ("--reasoning-parser", reasoning_parser)
    return args


@main.command()
@_engine_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--api-key", envvar="ONECAT_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on /v1, /tokenize and /detokenize (env ONECAT_API_KEY).")
@click.option("--data-parallel-size", "-dp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Engine replicas, each in its own process on its own -tp GPUs (fewer GPUs: "
                   "replicas share them, each with its share of --gpu-memory-utilization); "
                   "one endpoint routes to the least-loaded live replica, with prefix affinity.")
@click.option("--served-model-name", default=None, help="Model name in the API (default: the path).")
@click.option("--max-queue-len", type=int, default=512, show_default=True,
              help="Requests allowed to wait; beyond it the server answers 429.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--trust-request-chat-template", is_flag=True,
              help="Let requests bring their own chat template (chat_template, "
                   "chat_template_kwargs.chat_template): it runs arbitrary Jinja on the server.")
@click.option("--max-request-body-bytes", type=click.IntRange(min=1), default=4 * 1024 * 1024,
              show_default=True, help="Largest request body accepted; beyond it the server answers 413.")
@click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Seconds running requests may finish after SIGTERM before they are ended "
                   "(new requests get 503 at once).")
@click.option("--structured-outputs-compile-timeout", type=click.FloatRange(min=0, min_open=True),
              default=10.0, show_default=True,
              help="Seconds a response_format schema or a forced tool call's grammar may take to "
                   "compile; beyond it the request gets a 400 (schema too complex).")
@click.option("--enable-auto-tool-choice", is_flag=True,
              help="Let the model decide when to call tools (tool_choice \"auto\", the default "
                   "when a request has tools); needs --tool-call-parser.")
@click.option("--tool-call-parser", default=None, metavar="NAME",
              help="The model's tool-call format, parsed into tool_calls: qwen3_coder (Qwen3.5; "
                   "alias qwen3_xml) or hermes (Qwen2.5 / Qwen3); with --engine vllm any of vLLM's.")
@click.option("--reasoning-parser", default=None, metavar="NAME",
              help="Split <think>...</think> off into reasoning_content: qwen3; with --engine "
                   "vllm any of vLLM's.")
# --engine vllm: the vLLM plugin's options (onecat.vllm_plugin, docs/VLLM.md)
@click.option("--engine", "engine_name", type=click.Choice(["onecat", "vllm"]), default="onecat",
              show_default=True,
              help="onecat: the embedded engine. vllm: vLLM's server with onecat's plugin "
                   "(several GPUs or nodes; docs/VLLM.md).")
@click.option("--pipeline-parallel-size", "-pp", type=int, default=1, show_default=True,
              help="Pipeline stages (--engine vllm).")
@click.option("--vllm-arg", "vllm_args", multiple=True, metavar="ARG",
              help="A flag passed to vLLM verbatim, e.g. --vllm-arg=--enable-expert-parallel "
                   "(repeatable; --engine vllm).")
@_friendly
def serve(artifact: str, host: str, port: int, api_key: str | None, served_model_name: str | None,
          max_queue_len: int, log_level: str, trust_request_chat_template: bool,
          max_request_body_bytes: int, shutdown_timeout: float,
          structured_outputs_compile_timeout: float, enable_auto_tool_choice: bool,
          tool_call_parser: str | None, reasoning_parser: str | None, engine_name: str,
          tensor_parallel_size: int, pipeline_parallel_size: int, vllm_args: tuple[str, ...],
          data_parallel_size: int, **engine_flags: Any) -> None:
    """Serve ARTIFACT (packed, AWQ or fp16/bf16 checkpoint) with an OpenAI-compatible API:
    /v1/models, /v1/completions, /v1/chat/completions, /tokenize, /detokenize, /health, /metrics, /version."""
    if engine_name == "vllm":
        from onecat.vllm_plugin.launcher import serve_from_onecat_flags

        if data_parallel_size != 1:
            vllm_args = ("--data-parallel-size", str(data_parallel_size), *vllm_args)

        server_args = _server_flags_for_vllm(trust_request_chat_template, max_request_body_bytes,
                                             shutdown_timeout)
        if not engine_flags.pop("enable_prefix_caching"):
            server_args += ("--no-enable-prefix-caching",)
        if engine_flags.pop("disable_custom_all_reduce"):
            server_args += ("--disable-custom-all-reduce",)
        if not engine_flags.pop("async_scheduling"):  # on: vLLM's own default decides
            server_args += ("--no-async-scheduling",)
        kv_cache_memory_bytes = engine_flags.pop("kv_cache_memory_bytes")
        if kv_cache_memory_bytes is not None:
            server_args += ("--kv-cache-memory-bytes", str(kv_cache_memory_bytes))
        kv_cache_dtype = engine_flags.pop("kv_cache_dtype")
        if kv_cache_dtype == "int8":
            raise click.UsageError("--kv-cache-dtype int8 is onecat's own cache and vLLM has no int8 KV cache: "
                                   "use --kv-cache-dtype fp8_e5m2 with --engine vllm, or --engine onecat")
        if kv_cache_dtype != "auto":
            server_args += ("--kv-cache-dtype", kv_cache_dtype)
        speculative_config = engine_flags.pop("speculative_config")
        if speculative_config is not None:
            server_args += ("--speculative-config", speculative_config)
        server_args += _parser_flags_for_vllm(enable_auto_tool_choice, tool_call_parser, reasoning_parser)
        serve_from_onecat_flags(  # replaces this process with vLLM's server
            artifact, host=host, port=port, api_key=api_key, served_model_name=served_model_name,
            log_level=log_level, vllm_args=(*server_args, *vllm_args), tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size, **engine_flags)
    if pipeline_parallel_size != 1 or vllm_args:
        raise OnecatError("--pipeline-parallel-size and --vllm-arg need --engine vllm (the "
                          "embedded engine splits a model over the GPUs of one host only)")
    from onecat.runtime.core.replicas import ReplicaSet
    from onecat.runtime.server.chat_plan import ChatOptions
    from onecat.runtime.server.launcher import log_to_stderr
    from onecat.runtime.server.launcher import serve as serve_http

    chat_options = ChatOptions(enable_auto_tool_choice, tool_call_parser, reasoning_parser)
    chat_options.check()  # before the model loads
    log_to_stderr(log_level)
    engine = ReplicaSet(_engine_config(artifact, served_model_name, tensor_parallel_size=tensor_parallel_size,
                                       **engine_flags),
                        data_parallel_size, max_queue_len=max_queue_len, log_level=log_level)
    engine.start()
    replicas = f", {data_parallel_size} replicas" if data_parallel_size > 1 else ""
    click.secho(f"serving {engine.model_name} on http://{host}:{port}/v1 "
                f"(max_model_len {engine.max_model_len}{replicas})", fg="green", err=True)
    serve_http(engine, host=host, port=port, api_key=api_key, max_queue_len=max_queue_len,
               log_level=log_level, trust_request_chat_template=trust_request_chat_template,
               max_request_body_bytes=max_request_body_bytes, shutdown_timeout=shutdown_timeout,
               chat_options=chat_options, grammar_compile_timeout=structured_outputs_compile_timeout)


@main.command()
@_engine_options
@click.option("--prompt", required=True, help="The prompt text.")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user message in the chat template.")
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=1.0, show_default=True, help="0: greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0: off.")
@click.option("--seed", type=int, default=None)
@_friendly
def generate(artifact: str, prompt: str, chat: bool, max_tokens: int, temperature: float,
             top_p: float, top_k: int, seed: int | None, **engine_flags: Any) -> None:
    """Generate a completion of --prompt offline (no server) and print it."""
    import time

    from onecat.runtime.engine import LLMEngine
    from onecat.runtime.errors import RequestError
    from onecat.runtime.sampling_params import SamplingParams
    from onecat.runtime.server.prompts import chat_token_ids

    engine = LLMEngine(_engine_config(artifact, **engine_flags))
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=seed)
    request: str | list[int] = prompt
    if chat:
        request = chat_token_ids(engine.tokenizer, [{"role": "user", "content": prompt}])
    start = time.perf_counter()
    try:
        text = engine.generate([request], params)[0]
    except RequestError as exc:
        raise OnecatError(f"{exc} (adjust --prompt, --max-tokens or --max-model-len)") from exc
    finally:
        engine.close()  # stops tensor-parallel workers and leaves the process group
    click.echo(text)
    click.secho(f"[{time.perf_counter() - start:.2f} s, {engine.model_name}]", fg="cyan", err=True)


@main.command()
@click.argument("input_path", metavar="INPUT.jsonl", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", "output_path", required=True, type=click.Path(dir_okay=False),
              help="Output JSONL (OpenAI's batch output lines), only ever appended with whole lines.")
@_engine_options
@click.option("--resume", is_flag=True,
              help="Skip the requests OUTPUT already answers and append the rest (after a killed "
                   "or interrupted run).")
@click.option("--data-parallel-size", "-dp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Engine replicas, each in its own process on its own -tp GPUs (fewer GPUs: "
                   "replicas share them, each with its share of --gpu-memory-utilization); "
                   "one endpoint routes to the least-loaded live replica, with prefix affinity.")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=None,
              help="Most requests in flight at once (default: --max-num-seqs per replica, full "
                   "engine batches).")
@click.option("--served-model-name", default=None,
              help="Model name the lines' \"model\" fields must match (default: the path).")
@click.option("--trust-request-chat-template", is_flag=True,
              help="Let lines bring their own chat template (arbitrary Jinja).")
@click.option("--enable-auto-tool-choice", is_flag=True,
              help="Let the model decide when to call tools; needs --tool-call-parser.")
@click.option("--tool-call-parser", default=None, metavar="NAME",
              help="The model's tool-call format: qwen3_coder (alias qwen3_xml) or hermes.")
@click.option("--reasoning-parser", default=None, metavar="NAME",
              help="Split <think>...</think> off into reasoning_content: qwen3.")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
@_friendly
def batch(input_path: str, output_path: str, artifact: str, resume: bool, max_concurrency: int | None,
          data_parallel_size: int, served_model_name: str | None, trust_request_chat_template: bool,
          enable_auto_tool_choice: bool, tool_call_parser: str | None, reasoning_parser: str | None,
          no_progress: bool, **engine_flags: Any) -> None:
    """Run the requests of INPUT.jsonl (OpenAI's Batch format: custom_id, method, url of
    /v1/chat/completions or /v1/completions, body) on ARTIFACT, as `onecat serve` would answer
    them, and write one output line per request to OUTPUT."""
    from rich.console import Console

    from onecat.runtime.core.replicas import ReplicaSet
    from onecat.runtime.server.batch import UNBOUNDED_QUEUE, prepare_batch, summary_table
    from onecat.runtime.server.chat_plan import ChatOptions
    from onecat.runtime.server.launcher import log_to_stderr

    chat_options = ChatOptions(enable_auto_tool_choice, tool_call_parser, reasoning_parser)
    chat_options.check()  # before the model loads
    job = prepare_batch(input_path, output_path, resume=resume)  # refusals before the model loads
    log_to_stderr("warning")
    try:
        engine = ReplicaSet(_engine_config(artifact, served_model_name, **engine_flags), data_parallel_size,
                            max_queue_len=UNBOUNDED_QUEUE, log_level="warning")
        engine.start()
    except BaseException:
        job.close()
        raise
    try:
        summary = job.run(engine, max_concurrency=max_concurrency, show_progress=not no_progress,
                          chat_options=chat_options,
                          trust_request_chat_template=trust_request_chat_template)
    finally:
        engine.close()
    Console(stderr=True).print(summary_table(summary))
    if summary.stopped:
        raise OnecatError(f"the job stopped early: {summary.stopped}; {summary.written} lines written "
                          f"to {output_path}; rerun with --resume to run the rest")
    click.secho(f"wrote {summary.written} lines to {output_path} ({summary.failed} errors): "
                f"{summary.completion_tokens} tokens generated in {summary.wall_time:.2f} s, "
                f"{summary.tokens_per_second:.2f} tok/s", fg="green" if not summary.failed else "yellow", err=True)


@main.command("plan")
@click.argument("artifact", type=click.Path(exists=True, file_okay=False))
@click.option("--gpu-memory", default=None, metavar="SIZE", callback=_size_option,
              help="Memory of one GPU, e.g. 32GiB or 16G (needed unless --kv-cache-memory-bytes "
                   "is given).")
@click.option("--tensor-parallel-size", "-tp", type=int, default=1, show_default=True,
              help="GPUs the model is split over.")
@click.option("--kv-cache-dtype", default="auto", show_default=True, callback=_kv_cache_dtype_option,
              help=KV_CACHE_DTYPE_HELP)
@click.option("--max-model-len", type=int, default=None,
              help="Context length to check (default: the model's, capped by memory, as serve).")
@click.option("--kv-cache-memory-bytes", default=None, metavar="SIZE", callback=_size_option,
              help=KV_CACHE_MEMORY_HELP)
@click.option("--gpu-memory-utilization", type=float, default=0.92, show_default=True,
              help="Fraction of GPU memory for weights, activations and caches.")
@click.option("--max-num-seqs", type=int, default=256, show_default=True)
@click.option("--max-num-batched-tokens", type=int, default=2048, show_default=True)
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True, show_default=True)
@click.option("--enforce-eager", is_flag=True, help="No CUDA graphs (their memory pool is not reserved).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@_friendly
def plan_command(artifact: str, as_json: bool, **flags: Any) -> None:
    """What ARTIFACT needs per GPU under `onecat serve`'s flags, from config.json and the
    safetensors headers alone (no GPU, no weights read): weights, runtime reserves, the KV
    cache + GDN state budget, the longest context and how many 4k / 32k sequences fit. Exits 1
    with the engine's own message when the configuration does not fit."""
    import json

    from onecat.runtime.plan import plan_artifact, report_table

    if flags["gpu_memory"] is None and flags["kv_cache_memory_bytes"] is None:
        raise OnecatError("give --gpu-memory (the memory of one GPU, e.g. 32GiB), or "
                          "--kv-cache-memory-bytes to size the caches alone")
    report = plan_artifact(artifact, **flags)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        from rich.console import Console

        Console(width=None if sys.stdout.isatty() else 120).print(report_table(report))
    if not report.fits:
        raise OnecatError(report.problem)


# --- bench (onecat.benchmarks: a client, it imports no engine) ---------------------------


@main.group("bench")
def bench() -> None:
    """Benchmarks (vllm bench's commands and flags)."""


@bench.command("serve")
@click.option("--base-url", default="http://127.0.0.1:8000", show_default=True,
              help="Server root (a trailing /v1 is accepted).")
@click.option("--endpoint", default="/v1/completions", show_default=True,
              help="/v1/completions or /v1/chat/completions.")
@click.option("--endpoint-type", type=click.Choice(["completions", "chat"]), default=None,
              help="The endpoint's API (default: from the --endpoint path).")
@click.option("--model", default=None, help="Model id (default: the first of /v1/models).")
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None,
              help="Bearer key for the server (env OPENAI_API_KEY).")
@click.option("--tokenizer", default=None,
              help="Tokenizer directory for exact prompt lengths (default: the served model's "
                   "directory when it is local; without one, random prompts are words).")
@click.option("--dataset-name", type=click.Choice(["random", "custom", "sharegpt"]), default=None,
              help="random, custom (JSONL of prompts) or sharegpt (JSON). Default: random, or "
                   "from --dataset-path's suffix (.jsonl: custom, .json: sharegpt).")
@click.option("--dataset-path", type=click.Path(), default=None, help="The dataset file.")
@click.option("--prompt-field", default="prompt", show_default=True,
              help="JSONL field holding the prompt (custom).")
@click.option("--num-prompts", type=int, default=1000, show_default=True)
@click.option("--random-input-len", type=int, default=1024, show_default=True)
@click.option("--random-output-len", type=int, default=128, show_default=True)
@click.option("--random-range-ratio", type=float, default=0.0, show_default=True,
              help="Lengths drawn from [L*(1-r), L*(1+r)].")
@click.option("--random-prefix-len", type=int, default=0, show_default=True,
              help="A random prefix of this many tokens, the same for the whole run, before each "
                   "random prompt (prompt = prefix + --random-input-len tokens).")
@click.option("--random-prefix-share", type=float, default=1.0, show_default=True,
              help="Share of the requests that carry the prefix, spread evenly; the others get as "
                   "many fresh random tokens instead (onecat's; 1.0 is vLLM's behaviour).")
@click.option("--custom-output-len", type=int, default=256, show_default=True)
@click.option("--sharegpt-output-len", type=int, default=None,
              help="Fixed output length (default: the reply's length).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--request-rate", type=float, default=float("inf"), show_default=True,
              help="Requests per second (Poisson arrivals); inf sends all at once.")
@click.option("--burstiness", type=float, default=1.0, show_default=True,
              help="Gamma shape of the arrival gaps (1: Poisson).")
@click.option("--max-concurrency", type=int, default=None, help="Most requests in flight at once.")
@click.option("--num-warmups", type=int, default=0, show_default=True)
@click.option("--ignore-eos/--no-ignore-eos", default=None,
              help="Send ignore_eos so outputs have exactly the asked length (default: on for "
                   "random).")
@click.option("--temperature", type=float, default=None,
              help="Sampling temperature sent with each request (default: the server's).")
@click.option("--top-p", type=float, default=None, help="top_p sent with each request.")
@click.option("--top-k", type=int, default=None, help="top_k sent with each request.")
@click.option("--percentile-metrics", default="ttft,tpot,itl", show_default=True,
              help="Metrics to report: ttft, tpot, itl, e2el.")
@click.option("--metric-percentiles", default="99", show_default=True,
              help="Percentiles to report, e.g. 50,90,99.")
@click.option("--result-json", type=click.Path(dir_okay=False), default=None,
              help="Write the result (vLLM's keys) to this file.")
@click.option("--no-progress", "--disable-tqdm", "no_progress", is_flag=True,
              help="Hide the progress bar.")
@_friendly
def bench_serve(no_progress: bool, **flags: Any) -> None:
    """Benchmark an OpenAI-compatible server (onecat's, vLLM's, ...) as `vllm bench serve`
    does: throughput, TTFT, TPOT and ITL of streamed requests."""
    try:
        from onecat.benchmarks.serve import BenchServeConfig, run_bench_serve
    except ModuleNotFoundError as exc:
        raise OnecatError(f"onecat bench serve needs {exc.name}: pip install 'onecat[bench]'") from None

    result = run_bench_serve(BenchServeConfig(show_progress=not no_progress, **flags))
    if result["failed"]:
        raise OnecatError(f"{result['failed']} of {result['num_prompts']} requests failed")


if __name__ == "__main__":
    main()
