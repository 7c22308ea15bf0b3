"""``onecat pack``: turn an AutoAWQ GEMM or compressed-tensors checkpoint into a packed
Volta-layout artifact (docs/FORMAT.md).

Each quantized linear becomes ``PREFIX.qweight`` + ``PREFIX.scales_zeros`` (Volta layout v1);
a quantized linear whose shape the layout cannot hold (N or K not a multiple of 32, group not
a multiple of 32) is dequantised to an fp16 ``PREFIX.weight`` with a warning and listed in
``modules_to_not_convert``; every other tensor is copied unchanged.
"""

from __future__ import annotations

import logging
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from onecat.errors import OnecatError
from onecat.formats.checkpoint import Checkpoint
from onecat.formats.files import write_json
from onecat.formats.integers import dequantize
from onecat.formats.quant_config import (
    SourceFormat,
    detect_source_format,
    without_quantization_config,
)
from onecat.formats.quantized_linears import (
    find_quantized_linears,
    marker_part,
    read_quantized_linear,
)
from onecat.formats.staging import (
    DEFAULT_SHARD_BYTES,
    ShardWriter,
    check_output,
    copy_side_files,
    onecat_version,
    staged_directory,
)
from onecat.pack.volta_layout import FORMAT_NAME, LAYOUT_VERSION, check_shape, pack_volta

logger = logging.getLogger(__name__)

MANIFEST_NAME = "onecat_manifest.json"


def onecat_quantization_config(group_size: int, modules_to_not_convert: list[str]) -> dict:
    """The ``quantization_config`` of a packed artifact's config.json."""
    return {
        "quant_method": "onecat",
        "format": FORMAT_NAME,
        "format_version": LAYOUT_VERSION,
        "bits": 4,
        "group_size": group_size,
        "modules_to_not_convert": modules_to_not_convert,
    }


def _work_items(ckpt: Checkpoint, linears: dict[str, list[str]]) -> list[tuple[str, str]]:
    """``("linear", prefix)`` / ``("tensor", name)`` in source shard order, each once."""
    owner = {name: prefix for prefix, names in linears.items() for name in names}
    items, seen = [], set()
    for name in sorted(ckpt.names(), key=lambda n: (ckpt.shard_of(n), n)):
        if name in owner:
            if owner[name] not in seen:
                seen.add(owner[name])
                items.append(("linear", owner[name]))
        else:
            items.append(("tensor", name))
    return items


def _pack_linear(
    ckpt: Checkpoint, fmt: SourceFormat, prefix: str, writer: ShardWriter
) -> tuple[dict[str, Any] | None, str | None]:
    """Write one quantized linear; returns (packed entry, None) or (None, reason kept fp16)."""
    q, z, s = read_quantized_linear(ckpt, fmt, prefix)
    n, k = q.shape
    group_size = k // z.shape[1]
    try:
        check_shape(n, k, group_size)
    except ValueError as exc:
        reason = str(exc)
        logger.warning("%s [%d x %d, group %d] stays fp16: %s", prefix, n, k, group_size, reason)
        writer.add(f"{prefix}.weight", dequantize(q, z, s, torch.float16))
        return None, reason
    try:
        qweight, scales_zeros = pack_volta(q, z, s)
    except ValueError as exc:
        raise OnecatError(f"{prefix} in {ckpt.path}: cannot pack it: {exc}") from None
    writer.add(f"{prefix}.qweight", qweight)
    writer.add(f"{prefix}.scales_zeros", scales_zeros)
    entry = {
        "out_features": n,
        "in_features": k,
        "group_size": group_size,
        "bias": f"{prefix}.bias" in ckpt,
    }
    return entry, None


def pack_checkpoint(
    src: str | Path,
    out: str | Path,
    *,
    overwrite: bool = False,
    show_progress: bool = True,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Pack the AutoAWQ GEMM or compressed-tensors checkpoint ``src`` into a Volta-layout
    artifact at ``out`` (see docs/FORMAT.md); returns ``out``.

    The artifact is built in a hidden sibling directory and renamed into place at the end;
    ``out`` must not exist unless ``overwrite``. Raises OnecatError on unsupported or
    inconsistent input.
    """
    src, out = Path(src), Path(out)
    check_output(out, src, overwrite=overwrite)
    ckpt = Checkpoint(src)
    fmt = detect_source_format(ckpt.config, str(src / "config.json"))
    linears = find_quantized_linears(ckpt, fmt)
    if not linears:
        raise OnecatError(
            f"{src}: the config declares {fmt.kind} but no quantized tensors were found "
            f"(*.{marker_part(fmt)}); the checkpoint is incomplete or not quantized"
        )
    packed: dict[str, dict[str, Any]] = {}
    kept: dict[str, str] = {}
    with staged_directory(out, src, overwrite, "onecat pack") as stage:
        writer = ShardWriter(stage, max_shard_bytes)
        items = _work_items(ckpt, linears)
        for kind, name in tqdm(items, desc="packing", unit="tensor", disable=not show_progress):
            if kind == "tensor":
                writer.add(name, ckpt.get(name))
                continue
            entry, reason = _pack_linear(ckpt, fmt, name, writer)
            if entry is not None:
                packed[name] = entry
            else:
                kept[name] = reason or ""
        tensors = writer.finish()

        groups = Counter(e["group_size"] for e in packed.values())
        group_size = (
            groups.most_common(1)[0][0] if groups else (fmt.group_size or 128)
        )
        skip = list(dict.fromkeys(fmt.modules_to_not_convert + sorted(kept)))
        config = without_quantization_config(ckpt.config)
        config["quantization_config"] = onecat_quantization_config(group_size, skip)
        write_json(stage / "config.json", config)
        side_files = copy_side_files(src, stage)
        manifest = {
            "format": FORMAT_NAME,
            "format_version": LAYOUT_VERSION,
            "created_by": f"onecat {onecat_version()}",
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "source": {
                "path": str(src.resolve()),
                "format": fmt.kind,
                "quantization_config": fmt.quantization_config,
            },
            "linears": packed,
            "kept_fp16": kept,
            "copied_files": side_files,
            "summary": {
                "packed_linears": len(packed),
                "kept_fp16_linears": len(kept),
                "copied_tensors": sum(1 for kind, _ in items if kind == "tensor"),
                "tensor_bytes": writer.total_bytes,
                "shards": len(set(e["file"] for e in tensors.values())),
            },
            "tensors": tensors,
        }
        write_json(stage / MANIFEST_NAME, manifest)
    return out
