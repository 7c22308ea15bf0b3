"""Showing and saving a benchmark result: the summary table (rich, vLLM's row names) and
the result JSON (vLLM's keys), written to a temporary file and renamed into place."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from onecat.benchmarks.metrics import percentile_key
from onecat.errors import OnecatError

METRIC_TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def summary_table(result: dict[str, Any], percentile_metrics: list[str], percentiles: list[float]) -> Table:
    """The run's figures as a two-column table."""
    table = Table(title="Serving Benchmark Result", show_header=False, title_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows: list[tuple[str, str]] = [
        ("Successful requests", f"{result['completed']}"),
        ("Failed requests", f"{result['failed']}"),
    ]
    if result.get("max_concurrency") is not None:
        rows.append(("Maximum request concurrency", f"{result['max_concurrency']}"))
    if result.get("request_rate") != "inf":
        rows.append(("Request rate configured (RPS)", f"{result['request_rate']:.2f}"))
    rows += [
        ("Benchmark duration (s)", f"{result['duration']:.2f}"),
        ("Total input tokens", f"{result['total_input_tokens']}"),
        ("Total generated tokens", f"{result['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{result['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{result['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{result['total_token_throughput']:.2f}"),
    ]
    for label, value in rows:
        table.add_row(label, value)
    for name in percentile_metrics:
        short, title = METRIC_TITLES[name]
        table.add_section()
        table.add_row(f"[bold]{title}[/bold]", "")
        table.add_row(f"Mean {short} (ms)", f"{result[f'mean_{name}_ms']:.2f}")
        table.add_row(f"Median {short} (ms)", f"{result[f'median_{name}_ms']:.2f}")
        for p in percentiles:
            key = percentile_key(p)
            table.add_row(f"{key.upper()} {short} (ms)", f"{result[f'{key}_{name}_ms']:.2f}")
    return table


def print_summary(result: dict[str, Any], percentile_metrics: list[str], percentiles: list[float],
                  console: Console | None = None) -> None:
    """Print the summary table and, when requests failed, the first error."""
    console = console or Console()
    console.print(summary_table(result, percentile_metrics, percentiles))
    first_error = next((e for e in result["errors"] if e), None)
    if first_error:
        console.print(f"[red]{result['failed']} request(s) failed; the first: {first_error}[/red]",
                      highlight=False, soft_wrap=True)


def write_result_json(path: str | Path, result: dict[str, Any]) -> Path:
    """Write ``result`` to ``path`` atomically (temporary file in the same directory, then
    rename): an interrupted run never leaves a truncated result behind."""
    path = Path(path)
    if not path.parent.is_dir():
        raise OnecatError(f"--result-json {path}: the directory {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
