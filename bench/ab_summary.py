"""Summarise interleaved A/B e2e runs (``bench/ab_prepare.sh``): per model and figure, every
run of each side and the ratio of the medians (side / base), for every side that is not base
(``new`` and one per ``AB_PATCHES`` patch).

    python bench/ab_summary.py OUT_DIR        # reads OUT_DIR/e2e_{side}_{round}.json
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

FIGURE = re.compile(r"decode_b\d+_tok_s|prefill_tok_s|roofline_fraction_b1")
"""The figures of a run compared: decode tok/s at every batch size run, prefill tok/s and the
batch-1 roofline fraction."""


def collect(out_dir: Path) -> dict[tuple[str, str, str], list[float]]:
    """``(side, model, figure) -> values`` over every run file in ``out_dir``."""
    values: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for path in sorted(out_dir.glob("e2e_*_*.json")):
        side = path.stem.split("_")[1]
        for run in json.loads(path.read_text())["runs"]:
            result = run["onecat"]
            for figure, value in result.items():
                if FIGURE.fullmatch(figure):
                    values[(side, result["model"], figure)].append(value)
    return values


def _fmt(value: float) -> str:
    return f"{value:.4f}" if value < 1 else f"{value:.1f}"


def summary(values: dict[tuple[str, str, str], list[float]]) -> list[str]:
    """One line per (side, model, figure) that the side and base both measured."""
    lines = []
    for (side, model, figure), new in sorted(values.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        base = values.get(("base", model, figure))
        if side == "base" or not base:
            continue
        ratio = statistics.median(new) / statistics.median(base)
        lines.append(
            f"{model:8s} {figure:20s} {side} {' '.join(_fmt(v) for v in new):24s} "
            f"base {' '.join(_fmt(v) for v in base):24s} {side}/base {ratio:.3f}"
        )
    return lines


def main() -> None:
    """Print the summary of the directory given on the command line."""
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    lines = summary(collect(Path(sys.argv[1])))
    print("\n".join(lines) if lines else f"no paired e2e runs in {sys.argv[1]}")


if __name__ == "__main__":
    main()
