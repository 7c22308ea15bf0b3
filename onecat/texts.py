"""Built-in text that needs no download: the running Python's pydoc topics.

``onecat quantize`` calibrates on it by default (``--calib builtin:pydoc``) and the runtime's
fp16 headroom audit (``onecat/runtime/fp16_audit.py``) runs a plain checkpoint over it at
start-up, so both see the same kind of text. Imports nothing of onecat: quantize and runtime
may both use it.
"""

from __future__ import annotations


def pydoc_documents() -> list[str]:
    """The pydoc topics of the running Python's standard library, sorted by key."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]
