"""Lazy, read-only access to a Hugging Face safetensors checkpoint directory.

A checkpoint is a directory with ``config.json`` and either ``model.safetensors``, a
``*.safetensors.index.json`` weight map, or several ``*.safetensors`` shards. Tensors are read
one at a time (memory-mapped), so 27B-sized checkpoints never need to fit in memory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from onecat.errors import OnecatError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
"""Files that hold weights: never copied as side files."""

SKIPPED_SIDE_FILES = ("config.json", "onecat_manifest.json", "quant_config.json")
"""Top-level files that tools rewrite instead of copying."""


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object from ``path``; OnecatError naming the file when missing or invalid."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise OnecatError(f"{path} is missing") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise OnecatError(f"{path} is not valid JSON ({exc}); restore or re-create it") from None
    if not isinstance(data, dict):
        raise OnecatError(f"{path} must hold a JSON object")
    return data


class Checkpoint:
    """The tensors of a safetensors checkpoint, by name, read lazily from their shards."""

    def __init__(self, path: str | Path) -> None:
        """Index the shards of the checkpoint at ``path`` (reads headers only)."""
        self.path = Path(path)
        if not self.path.is_dir():
            raise OnecatError(f"{self.path} is not a directory; give a checkpoint directory")
        self.config = read_json(self.path / "config.json")
        self._shard_of = self._index()
        self._handles: dict[str, Any] = {}

    def _index(self) -> dict[str, str]:
        indexes = sorted(self.path.glob("*.safetensors.index.json"))
        if indexes:
            weight_map = read_json(indexes[0]).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise OnecatError(f"{indexes[0]} has no weight_map; the checkpoint is incomplete")
            missing = sorted({f for f in weight_map.values() if not (self.path / f).is_file()})
            if missing:
                raise OnecatError(
                    f"{indexes[0]} names shards that are missing: {', '.join(missing)}; "
                    "finish the download"
                )
            return dict(weight_map)
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            others = [p.name for p in self.path.iterdir() if p.suffix in WEIGHT_SUFFIXES]
            hint = f" (found {', '.join(others)}: only safetensors is supported)" if others else ""
            raise OnecatError(f"{self.path} holds no *.safetensors weights{hint}")
        shard_of: dict[str, str] = {}
        for shard in shards:
            with safe_open(shard, framework="pt") as f:
                for name in f.keys():
                    shard_of[name] = shard.name
        return shard_of

    def names(self) -> list[str]:
        """All tensor names, in shard order then name order."""
        return sorted(self._shard_of, key=lambda n: (self._shard_of[n], n))

    def __contains__(self, name: str) -> bool:
        return name in self._shard_of

    def shard_of(self, name: str) -> str:
        """The shard file name that holds ``name``."""
        return self._shard_of[name]

    def _handle(self, shard: str) -> Any:
        if shard not in self._handles:
            try:
                self._handles[shard] = safe_open(self.path / shard, framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise OnecatError(f"cannot read {self.path / shard}: {exc}") from None
        return self._handles[shard]

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (a CPU tensor)."""
        if name not in self._shard_of:
            raise OnecatError(f"tensor {name} is not in the checkpoint {self.path}")
        try:
            return self._handle(self._shard_of[name]).get_tensor(name)
        except OnecatError:
            raise
        except Exception as exc:
            raise OnecatError(
                f"cannot read tensor {name} from {self.path / self._shard_of[name]}: {exc}"
            ) from None

    def shape(self, name: str) -> list[int]:
        """The shape of tensor ``name`` without reading its data."""
        return list(self._handle(self._shard_of[name]).get_slice(name).get_shape())


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy the top-level non-weight files (tokenizer, chat template, generation config, ...)
    of checkpoint ``src`` to ``dst``; returns the copied names. config.json, weight files,
    weight indexes and hidden files are left out."""
    copied = []
    for item in sorted(src.iterdir()):
        name = item.name
        if (
            not item.is_file()
            or name.startswith(".")
            or name in SKIPPED_SIDE_FILES
            or name.endswith(WEIGHT_SUFFIXES)
            or name.endswith(".index.json")
        ):
            continue
        shutil.copy2(item, dst / name)
        copied.append(name)
    return copied
