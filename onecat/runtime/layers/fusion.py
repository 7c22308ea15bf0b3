"""Fusing the small elementwise steps between the big matmuls (GPU decode).

A decode step of a 64-layer hybrid model is thousands of tiny kernels between the W4A16
matmuls (norms, gates, the conv and delta-rule updates); each costs a few microseconds even
inside a CUDA graph, which at batch 1 rivals the time the weights take to stream. Functions
decorated with :func:`fused` are pure tensor code that ``torch.compile`` turns into a few
fused kernels while the model runner captures decode CUDA graphs (:func:`compiling`), where
launches dominate. Prefill, CPU runs and ``enforce_eager`` run them as plain torch, so the
numbers do not depend on compilation beyond floating-point rounding.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import TypeVar

import torch

logger = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable)
_enabled = False
failures: list[str] = []
"""Names of fused functions whose compilation failed (they run unfused)."""


@contextlib.contextmanager
def compiling():
    """Within this block, :func:`fused` functions called on CUDA tensors run compiled."""
    global _enabled
    previous, _enabled = _enabled, True
    try:
        yield
    finally:
        _enabled = previous


def fused(fn: F) -> F:
    """Run ``fn`` compiled (dynamic shapes, one graph) on CUDA tensors inside :func:`compiling`."""
    compiled = None
    failed = False

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal compiled, failed
        if _enabled and not failed and args[0].is_cuda:
            if compiled is None:
                compiled = torch.compile(fn, dynamic=True, fullgraph=True)
            try:
                return compiled(*args, **kwargs)
            except Exception as exc:  # no working compiler here: stay correct, run eagerly
                if torch.cuda.is_current_stream_capturing():
                    raise
                failed = True
                failures.append(fn.__name__)
                logger.warning("torch.compile of %s failed (%s); running it unfused", fn.__name__, exc)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
