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


@click.group()
@click.version_option(package_name="onecat")
def main() -> None:
    """onecat: 4-bit Qwen3.5 on Tesla V100 GPUs."""


# --- quantize / eval (onecat.quantize) -----------------------------------------------


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


# --- build-kernels / tune / doctor (onecat.kernels) --------------------------------------


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
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _engine_config(artifact: str, served_model_name: str | None = None, **flags: Any) -> Any:
    from onecat.runtime.config import EngineConfig

    return EngineConfig(model=artifact, served_model_name=served_model_name, **flags)


@main.command()
@_engine_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--api-key", envvar="ONECAT_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on /v1 routes (env ONECAT_API_KEY).")
@click.option("--served-model-name", default=None, help="Model name in the API (default: the path).")
@click.option("--max-queue-len", type=int, default=512, show_default=True,
              help="Requests allowed to wait; beyond it the server answers 429.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@_friendly
def serve(artifact: str, host: str, port: int, api_key: str | None, served_model_name: str | None,
          max_queue_len: int, log_level: str, **engine_flags: Any) -> None:
    """Serve ARTIFACT (packed, AWQ or fp16/bf16 checkpoint) with an OpenAI-compatible API:
    /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics, /version."""
    from onecat.runtime.engine import LLMEngine
    from onecat.runtime.server.launcher import serve as serve_http

    engine = LLMEngine(_engine_config(artifact, served_model_name, **engine_flags))
    click.secho(f"serving {engine.model_name} on http://{host}:{port}/v1 "
                f"(max_model_len {engine.max_model_len})", fg="green", err=True)
    serve_http(engine, host=host, port=port, api_key=api_key, max_queue_len=max_queue_len,
               log_level=log_level)


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
    click.echo(text)
    click.secho(f"[{time.perf_counter() - start:.2f} s, {engine.model_name}]", fg="cyan", err=True)


if __name__ == "__main__":
    main()
