"""Writing the AutoAWQ GEMM checkpoint: shards, index, config.json and the side files.

Everything is written inside the work directory (a sibling of OUT) with atomic replaces;
the pipeline renames the work directory to OUT only when the artifact is complete.
Shards are named ``model-XXXXX-of-YYYYY.safetensors``: first the tensors outside the decoder
layers (embeddings, lm_head, final norm, ``mtp.*``, ``model.visual.*``, copied unchanged),
then one shard per decoder layer.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from onecat.quantize.shards import INDEX_NAME, CheckpointReader

REST_SHARD_BYTES = 2 << 30
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt")


def shard_name(number: int, total: int) -> str:
    """``model-00003-of-00042.safetensors`` (1-based)."""
    return f"model-{number:05d}-of-{total:05d}.safetensors"


def write_json(path: Path, data: object) -> None:
    """Write JSON atomically (temporary file, then rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write a safetensors shard atomically."""
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(tmp), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # safetensors creates files owner-only
    os.replace(tmp, path)


def plan_rest_shards(reader: CheckpointReader, rest: list[str]) -> list[list[str]]:
    """Group the non-layer tensors into shards of at most about 2 GiB (sorted by name)."""
    groups: list[list[str]] = []
    size = REST_SHARD_BYTES
    for name in sorted(rest):
        nbytes = reader.nbytes(name)
        if size + nbytes > REST_SHARD_BYTES and (not groups or groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return [g for g in groups if g]


def copy_side_files(model_dir: Path, work: Path) -> list[str]:
    """Copy tokenizer, generation config, chat template and other small non-weight files."""
    copied = []
    for path in sorted(model_dir.iterdir()):
        if (
            not path.is_file()
            or path.name.startswith(".")
            or path.name in ("config.json", INDEX_NAME)
            or path.name.endswith(WEIGHT_SUFFIXES)
        ):
            continue
        shutil.copyfile(path, work / path.name)
        copied.append(path.name)
    return copied


def write_index(work: Path, weight_map: dict[str, str]) -> None:
    """``model.safetensors.index.json`` with the total size and a sorted weight map."""
    total = sum((work / shard).stat().st_size for shard in set(weight_map.values()))
    write_json(work / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
