"""Writing checkpoint directories safely: staging directories and sharded safetensors output.

An output directory is built in a hidden sibling (``.NAME.tmp-PID``) and renamed into place
only when complete, so a failure or interruption never leaves a directory that looks finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from onecat.errors import OnecatError

DEFAULT_SHARD_BYTES = 2 * 1024**3
"""Shards close once they reach this size (a single larger tensor gets its own shard)."""

SAFETENSORS_DTYPES = {
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes as safetensors stores them (row-major, little-endian)."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy()).hexdigest()


def check_output_path(out: Path, src: Path, overwrite: bool) -> None:
    """OnecatError if ``out`` exists without ``overwrite``, or would overwrite ``src``."""
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise OnecatError(f"output {out} must not be (or lie inside) the source {src}")
    if out.exists() and not overwrite:
        raise OnecatError(f"{out} already exists; pass --overwrite to replace it")


@contextlib.contextmanager
def staged_directory(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a fresh staging directory next to ``out``; on success it replaces ``out``.

    On any exception the staging directory is removed and ``out`` is left as it was.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise OnecatError(f"{out} already exists; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir()
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        os.replace(out, old)
    os.replace(stage, out)
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()


class ShardWriter:
    """Collects tensors into safetensors shards with an HF ``model.safetensors.index.json``,
    recording dtype, shape, shard and sha256 of each tensor."""

    def __init__(self, directory: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        """Write shards into ``directory``, each up to ``max_shard_bytes``."""
        self.directory = Path(directory)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.entries: dict[str, dict[str, Any]] = {}
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue ``tensor`` under ``name`` (written when its shard is full or at finish)."""
        if name in self.entries:
            raise OnecatError(f"tensor {name} would be written twice; the source is inconsistent")
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise OnecatError(f"tensor {name} has dtype {tensor.dtype}, which is not supported")
        tensor = tensor.detach().contiguous()
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self.entries[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "sha256": tensor_sha256(tensor),
        }
        self._pending[name] = tensor
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        index = len(self._shards) + 1
        path = self.directory / f"shard-{index:05d}.safetensors"
        save_file(self._pending, path, metadata={"format": "pt"})
        path.chmod(0o666 & ~_UMASK)  # safetensors creates 0600 files; honour the umask
        self._shards.append(list(self._pending))
        self._pending = {}
        self._pending_bytes = 0

    def finish(self) -> dict[str, dict[str, Any]]:
        """Write the last shard and the index; returns ``{name: {file, dtype, shape, sha256}}``."""
        if self._pending or not self._shards:
            self._flush()
        count = len(self._shards)
        weight_map = {}
        for i, names in enumerate(self._shards, start=1):
            final = f"model-{i:05d}-of-{count:05d}.safetensors"
            os.replace(self.directory / f"shard-{i:05d}.safetensors", self.directory / final)
            for name in names:
                weight_map[name] = final
                self.entries[name]["file"] = final
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        write_json(self.directory / "model.safetensors.index.json", index)
        return self.entries


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON with a trailing newline."""
    path.write_text(json.dumps(data, indent=2) + "\n")
