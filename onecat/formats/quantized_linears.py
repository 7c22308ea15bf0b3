"""The quantized linears of an AutoAWQ GEMM or compressed-tensors checkpoint, as integers.

Which modules are quantized is decided per module by the tensors present (``PREFIX.qweight``
or ``PREFIX.weight_packed``), never by the config alone: third-party checkpoints leave some
modules, or some layers' experts, in fp16.
"""

from __future__ import annotations

import torch

from onecat.errors import OnecatError
from onecat.formats import awq_gemm, compressed_tensors
from onecat.formats.checkpoint import Checkpoint
from onecat.formats.quant_config import AWQ_GEMM, SourceFormat


def marker_part(fmt: SourceFormat) -> str:
    """The tensor that marks a quantized linear: ``qweight`` or ``weight_packed``."""
    return "qweight" if fmt.kind == AWQ_GEMM else "weight_packed"


def find_quantized_linears(ckpt: Checkpoint, fmt: SourceFormat) -> dict[str, list[str]]:
    """Map each quantized linear's prefix to the names of its quantization tensors."""
    marker = marker_part(fmt)
    parts = awq_gemm.PARTS if fmt.kind == AWQ_GEMM else compressed_tensors.PARTS
    found: dict[str, list[str]] = {}
    for name in ckpt.names():
        prefix, _, leaf = name.rpartition(".")
        if leaf == marker:
            found[prefix] = [f"{prefix}.{p}" for p in parts if f"{prefix}.{p}" in ckpt]
    return found


def stored_group_size(ckpt: Checkpoint, fmt: SourceFormat, prefix: str) -> int:
    """The group size of quantized linear ``prefix`` from its tensor shapes (headers only)."""
    shape = ckpt.shape
    where = f"{prefix} in {ckpt.path}"
    try:
        if fmt.kind == AWQ_GEMM:  # qweight [K, N/8], scales [K/g, N]
            return shape(f"{prefix}.qweight")[0] // shape(f"{prefix}.scales")[0]
        k = shape(f"{prefix}.weight_packed")[1] * 8  # weight_packed [N, K/8], scale [N, K/g]
        if f"{prefix}.weight_shape" in ckpt:
            k = int(ckpt.get(f"{prefix}.weight_shape").reshape(-1)[1])
        return k // shape(f"{prefix}.weight_scale")[1]
    except (KeyError, IndexError, ZeroDivisionError):
        raise OnecatError(f"{where}: its quantization tensors are missing or malformed") from None


def read_quantized_linear(
    ckpt: Checkpoint, fmt: SourceFormat, prefix: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The integers ``(q, zeros, scales)`` of the quantized linear ``prefix`` in ``ckpt``."""
    where = f"{prefix} in {ckpt.path}"
    if fmt.kind == AWQ_GEMM:
        missing = [p for p in awq_gemm.PARTS if f"{prefix}.{p}" not in ckpt]
        if missing:
            raise OnecatError(f"{where}: AWQ tensors {', '.join(missing)} are missing")
        parts = [ckpt.get(f"{prefix}.{p}") for p in awq_gemm.PARTS]
        return awq_gemm.decode_awq_gemm(*parts, where=prefix)
    if f"{prefix}.weight_scale" not in ckpt:
        raise OnecatError(f"{where}: weight_scale is missing")

    def optional(part: str) -> torch.Tensor | None:
        name = f"{prefix}.{part}"
        return ckpt.get(name) if name in ckpt else None

    return compressed_tensors.decode_compressed_tensors(
        ckpt.get(f"{prefix}.weight_packed"),
        ckpt.get(f"{prefix}.weight_scale"),
        optional("weight_zero_point"),
        optional("weight_shape"),
        optional("weight_g_idx"),
        where=prefix,
    )
