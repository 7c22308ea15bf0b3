"""Benchmark scripts of ``bench/`` loaded as modules in tests (they are scripts, not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_bench(script: str, name: str | None = None) -> ModuleType:
    """``bench/<script>.py`` imported afresh as module ``name`` (default ``bench_<script>``)."""
    spec = importlib.util.spec_from_file_location(name or f"bench_{script}", BENCH / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
