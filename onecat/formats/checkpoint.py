"""The one reader of Hugging Face safetensors checkpoint directories.

A checkpoint is a directory with ``config.json`` and either a ``*.safetensors.index.json``
weight map or ``*.safetensors`` shards. Opening one reads the shard headers only (names,
dtypes, shapes) and checks that every shard the index names lies inside the directory
(:func:`~onecat.formats.files.contained_file`), exists, and holds the tensors the index says;
tensors are then read one at a time through ``safe_open`` (memory-mapped), so 27B-sized
checkpoints never need to fit in memory.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from onecat.errors import OnecatError
from onecat.formats.files import contained_file, read_checkpoint_json

INDEX_NAME = "model.safetensors.index.json"

WEIGHT_SUFFIXES = (
    ".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt",
)
"""Files that hold weights (of any framework): never copied as side files."""

DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2,
               "BF16": 2, "I16": 2, "U16": 2}
"""Bytes per element of the safetensors dtypes wider than one byte."""


def open_safetensors(path: Path) -> Any:
    """``safe_open`` the file at ``path``; OnecatError naming it when it is unreadable."""
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own error types
        raise OnecatError(
            f"shard {path} is corrupted or truncated ({exc}); re-download or re-create it"
        ) from None


def find_index(path: Path) -> Path | None:
    """The checkpoint's weight-map index: ``model.safetensors.index.json``, else the first
    ``*.safetensors.index.json``, else None."""
    if (path / INDEX_NAME).is_file():
        return path / INDEX_NAME
    indexes = sorted(path.glob("*.safetensors.index.json"))
    return indexes[0] if indexes else None


class Checkpoint:
    """The tensors of a safetensors checkpoint, by name, read lazily from their shards."""

    def __init__(self, path: str | Path) -> None:
        """Index the shards of the checkpoint at ``path`` (reads headers only)."""
        self.path = Path(path)
        if not self.path.is_dir():
            raise OnecatError(f"{self.path} is not a directory; give a checkpoint directory")
        self._handles: dict[str, Any] = {}
        self._shard_of: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        self._sorted_names: list[str] | None = None
        self._index()

    @functools.cached_property
    def config(self) -> dict[str, Any]:
        """config.json of the checkpoint."""
        return read_checkpoint_json(self.path, "config.json")

    def _file(self, ref: object, where: str, entry: str) -> Path:
        return contained_file(self.path, ref, where=where, entry=entry)

    def _index(self) -> None:
        index = find_index(self.path)
        listed: dict[str, str] | None = None
        if index is not None:
            weight_map = read_checkpoint_json(self.path, index.name).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise OnecatError(f"{index} has no weight_map; the checkpoint is incomplete")
            checked: set[object] = set()
            for name, ref in weight_map.items():
                if ref not in checked:
                    self._file(ref, str(index), f"weight_map[{name!r}]")
                    checked.add(ref)
            listed = dict(weight_map)
            shards = sorted(set(listed.values()))
            missing = [s for s in shards if not (self.path / s).is_file()]
            if missing:
                raise OnecatError(
                    f"{index} names shards that are missing: {', '.join(missing)}; finish or "
                    "re-download the checkpoint"
                )
        else:
            shards = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not shards:
                others = [p.name for p in self.path.iterdir() if p.name.endswith(WEIGHT_SUFFIXES)]
                hint = f" (found {', '.join(others)}: only safetensors is supported)" if others else ""
                raise OnecatError(f"{self.path} holds no *.safetensors weights{hint}")
            for shard in shards:
                self._file(shard, str(self.path), "shard")
        for shard in shards:
            handle = self._handle(shard)
            for name in handle.keys():
                sl = handle.get_slice(name)
                self._shard_of[name] = shard
                self.shapes[name] = tuple(sl.get_shape())
                self.dtypes[name] = sl.get_dtype()
        for name, shard in (listed or {}).items():
            if self._shard_of.get(name) != shard:
                raise OnecatError(
                    f"{self.path / shard}: tensor {name!r} listed in {index.name} is not in that "
                    "shard; the checkpoint is incomplete or corrupted, re-download it"
                )

    def _handle(self, shard: str) -> Any:
        if shard not in self._handles:
            self._handles[shard] = open_safetensors(self.path / shard)
        return self._handles[shard]

    def release(self) -> None:
        """Unmap every open shard (a shard reopens on its next read). Pages read through an
        mmap count in the process's RSS while the mapping lives; streaming readers release
        after each layer to keep host memory independent of depth."""
        self._handles.clear()

    def names(self) -> list[str]:
        """All tensor names, sorted."""
        if self._sorted_names is None:
            self._sorted_names = sorted(self._shard_of)
        return list(self._sorted_names)

    def __contains__(self, name: str) -> bool:
        return name in self._shard_of

    def shard_of(self, name: str) -> str:
        """The shard file name that holds ``name``."""
        return self._shard_of[name]

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (a CPU tensor in its stored dtype)."""
        shard = self._shard_of.get(name)
        if shard is None:
            raise OnecatError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        handle = self._handle(shard)
        try:
            return handle.get_tensor(name)
        except Exception as exc:
            raise OnecatError(
                f"shard {self.path / shard}: cannot read tensor {name!r} ({exc}); re-download it"
            ) from None

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name`` without reading its data."""
        return self.shapes[name]

    def nbytes(self, name: str) -> int:
        """Stored size of tensor ``name`` in bytes."""
        count = 1
        for dim in self.shapes[name]:
            count *= dim
        return count * DTYPE_BYTES.get(self.dtypes[name], 1)

    def with_prefix(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every tensor whose name starts with ``prefix``, keyed by the rest of the name."""
        return {n[len(prefix):]: self.get(n) for n in self.names() if n.startswith(prefix)}

    def load_all(self) -> dict[str, torch.Tensor]:
        """Every tensor of the checkpoint (for small models only)."""
        return {name: self.get(name) for name in self.names()}
