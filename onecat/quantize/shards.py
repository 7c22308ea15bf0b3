"""Reading a safetensors checkpoint tensor by tensor (never the whole model).

:class:`CheckpointReader` maps every tensor name to its shard (from
``model.safetensors.index.json``, or the shard headers), checks up front that every shard
exists and has a readable header, and loads single tensors through ``safe_open`` (mmap).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from onecat.errors import OnecatError

INDEX_NAME = "model.safetensors.index.json"


class CheckpointReader:
    """Lazy access to the tensors of the checkpoint in ``model_dir``."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        index = self.dir / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise OnecatError(f"{index} is not a valid safetensors index ({exc}); re-download it") from exc
            shards = sorted(set(weight_map.values()))
        else:
            shards = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if not shards:
                raise OnecatError(
                    f"{self.dir} holds no *.safetensors weights; onecat reads safetensors checkpoints"
                )
            weight_map = None
        self._handles: dict[str, object] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        found: dict[str, str] = {}
        for shard in shards:
            handle = self._open(shard)
            for name in handle.keys():
                found[name] = shard
                sl = handle.get_slice(name)
                self.shapes[name] = tuple(sl.get_shape())
                self.dtypes[name] = sl.get_dtype()
        if weight_map is not None:
            for name, shard in weight_map.items():
                if found.get(name) != shard:
                    raise OnecatError(
                        f"{self.dir / shard}: tensor {name!r} listed in {INDEX_NAME} is not in that "
                        f"shard; the checkpoint is incomplete or corrupted, re-download it"
                    )
        self.weight_map: dict[str, str] = dict(sorted(found.items()))

    def _open(self, shard: str):
        if shard not in self._handles:
            path = self.dir / shard
            if not path.is_file():
                raise OnecatError(
                    f"shard {path} is missing (listed in {INDEX_NAME}); re-download the checkpoint"
                )
            try:
                self._handles[shard] = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise OnecatError(
                    f"shard {path} is corrupted or truncated ({exc}); re-download the checkpoint"
                ) from exc
        return self._handles[shard]

    def release(self) -> None:
        """Unmap every open shard. Pages read through an mmap count in the process's RSS for
        as long as the mapping lives, so the driver releases the shards after each layer to
        keep host memory independent of depth; a shard reopens on its next read."""
        self._handles.clear()

    def names(self) -> list[str]:
        """All tensor names, sorted."""
        return list(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        """Load one tensor (CPU, its stored dtype)."""
        shard = self.weight_map.get(name)
        if shard is None:
            raise OnecatError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        try:
            return self._open(shard).get_tensor(name)
        except Exception as exc:
            raise OnecatError(
                f"shard {self.dir / shard}: cannot read tensor {name!r} ({exc}); re-download it"
            ) from exc

    def with_prefix(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every tensor whose name starts with ``prefix``, keyed by the rest of the name."""
        return {n[len(prefix) :]: self.get(n) for n in self.weight_map if n.startswith(prefix)}

    def nbytes(self, name: str) -> int:
        """Stored size of one tensor in bytes."""
        size = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I16": 2}.get(
            self.dtypes[name], 1
        )
        n = 1
        for d in self.shapes[name]:
            n *= d
        return n * size
