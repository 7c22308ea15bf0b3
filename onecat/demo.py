"""``make demo``: onecat end to end on a machine with no GPU and no model download.

Copies the trained tiny Qwen3.5 (``onecat/fixtures/trained-qwen3_5``, made by
``onecat/tiny_train.py``: the real architecture trained on the pydoc topics, local
tokenizer), quantizes it with AWQ, packs it into the Volta layout, serves the packed artifact
with the OpenAI-compatible server on a free loopback port, asks one chat completion with the
official ``openai`` client, prints the answer and where every artifact is, and shuts the
server down.

Run: ``python -m onecat.demo [--out demo-out]``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from onecat.errors import OnecatError

QUESTION = 'Explain: The "if" statement'
"""A question the tiny model was trained to answer (one of its pydoc topics)."""


@dataclass
class DemoResult:
    """What the demo produced: artifact paths, the answer, and step timings (seconds)."""

    model_dir: Path
    awq_dir: Path
    packed_dir: Path
    answer: str
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, float] = field(default_factory=dict)


@contextmanager
def _step(console: Console, timings: dict[str, float], name: str) -> Iterator[None]:
    """Print a step's title, run it, record and print its duration."""
    console.rule(f"[bold cyan]{name}")
    start = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - start
    console.print(f"[green]done[/] in {timings[name]:.1f} s")


def run_demo(out_dir: str | Path = "demo-out", console: Console | None = None) -> DemoResult:
    """Copy the trained tiny Qwen3.5, quantize, pack, serve and query it under ``out_dir``."""
    import openai
    import transformers

    from onecat.formats.staging import staged_directory
    from onecat.pack.writer import pack_checkpoint
    from onecat.quantize.pipeline import quantize_model
    from onecat.runtime.config import EngineConfig
    from onecat.runtime.engine import LLMEngine
    from onecat.runtime.server.launcher import BackgroundServer
    from onecat.tiny_train import fixture_dir

    transformers.logging.set_verbosity_error()  # its "slow reference kernel" notes are noise here
    console = console or Console()
    out = Path(out_dir).resolve()
    model_dir, awq_dir, packed_dir = out / "tiny-qwen3_5", out / "tiny-qwen3_5-awq", out / "tiny-qwen3_5-onecat"
    timings: dict[str, float] = {}
    console.print(
        Panel.fit(
            "onecat demo: a tiny trained Qwen3.5 (hybrid Gated DeltaNet + gated attention),\n"
            "quantized to 4 bits with AWQ, packed for Volta, served with an OpenAI API on CPU.",
            border_style="cyan",
        )
    )

    with _step(console, timings, "1/4 copy the trained tiny Qwen3.5 (pydoc topics, local tokenizer)"):
        source = fixture_dir("qwen3_5")
        if not (source / "config.json").is_file():
            raise OnecatError(
                f"the trained tiny model {source} is missing: run the demo from an onecat "
                "checkout, or train it with `python -m onecat.tiny_train --family qwen3_5`"
            )
        # Staged and marked like every output, so that a rerun replaces it (and nothing else).
        with staged_directory(model_dir, source, True, "onecat demo") as stage:
            shutil.copytree(source, stage, dirs_exist_ok=True)
        console.print(f"checkpoint: {model_dir} (from {source})")

    with _step(console, timings, "2/4 quantize (AWQ, 4 bits, group 32, 4 pydoc samples of 64 tokens)"):
        quantize_model(model_dir, awq_dir, calib="builtin:pydoc", samples=4, seqlen=64, group_size=32,
                       overwrite=True)
        console.print(f"AutoAWQ GEMM checkpoint: {awq_dir}")

    with _step(console, timings, "3/4 pack into the Volta layout"):
        pack_checkpoint(awq_dir, packed_dir, overwrite=True, show_progress=False)
        console.print(f"packed artifact: {packed_dir}")

    with _step(console, timings, "4/4 serve and ask one chat completion (openai client)"):
        engine = LLMEngine(
            EngineConfig(model=str(packed_dir), max_model_len=512, served_model_name="tiny-qwen3_5")
        )
        with BackgroundServer(engine) as server:
            console.print(f"server: {server.url}/v1 (model {engine.model_name!r})")
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
            reply = client.chat.completions.create(
                model=engine.model_name,
                messages=[{"role": "user", "content": QUESTION}],
                max_tokens=48,
                temperature=0.0,
            )
        console.print("server stopped")

    choice = reply.choices[0]
    usage = reply.usage.model_dump() if reply.usage is not None else {}
    result = DemoResult(
        model_dir, awq_dir, packed_dir, choice.message.content or "", choice.finish_reason, usage, timings
    )
    _print_summary(console, result)
    return result


def _print_summary(console: Console, result: DemoResult) -> None:
    console.rule("[bold cyan]result")
    console.print(f"[bold]question:[/] {QUESTION}")
    console.print(f"[bold]answer:[/] {result.answer!r}")
    console.print(
        f"(finish_reason {result.finish_reason}, {result.usage.get('prompt_tokens')} prompt + "
        f"{result.usage.get('completion_tokens')} completion tokens)"
    )
    console.print(
        "[yellow]A 4-layer model of 1-2M parameters trained for minutes on the pydoc topics: it "
        "recites what it read rather than reasons; the demo shows the pipeline end to end.[/]"
    )
    table = Table(title="artifacts", show_header=True)
    table.add_column("step")
    table.add_column("path")
    table.add_row("trained tiny Qwen3.5 (bf16)", str(result.model_dir))
    table.add_row("AWQ checkpoint", str(result.awq_dir))
    table.add_row("onecat packed artifact", str(result.packed_dir))
    console.print(table)
    total = sum(result.timings.values())
    console.print(f"total {total:.1f} s. Serve it yourself: onecat serve {result.packed_dir}")


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m onecat.demo``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="demo-out", help="where the artifacts go (default: demo-out)")
    args = parser.parse_args(argv)
    console = Console()
    try:
        run_demo(args.out, console)
    except OnecatError as exc:
        console.print(f"[red]error: {exc}")
        sys.exit(1)


if __name__ == "__main__":
    main()
