"""Readers of 4-bit checkpoints: AutoAWQ GEMM and compressed-tensors ``pack-quantized``.

Both are turned into onecat's integers (DEVELOPMENT.md, "Quantized integers"):
``q [N, K]`` uint8 0..15, ``zeros [N, K/g]`` uint8 0..15, ``scales [N, K/g]`` fp16, value
``(q - z) * s``.

- AutoAWQ GEMM: ``PREFIX.qweight`` [K, N/8], ``PREFIX.qzeros`` [K/g, N/8] (int32, packed along N
  in the order 0,2,4,6,1,3,5,7), ``PREFIX.scales`` [K/g, N]; see :mod:`onecat.pack.awq_gemm`.
- compressed-tensors ``pack-quantized``: ``PREFIX.weight_packed`` [N, K/8] int32 (sequential
  nibbles along K, each the signed value + 8), ``PREFIX.weight_scale`` [N, K/g],
  ``PREFIX.weight_zero_point`` [N/8, K/g] int32 (asymmetric only; sequential nibbles along N,
  signed + 8), ``PREFIX.weight_shape`` [2]. Dequant is ``(q_signed - zp_signed) * s``, which
  is ``(q - z) * s`` with the stored unsigned nibbles; symmetric means ``z = 8``.

Which modules are quantized is decided per module by the tensors present (``PREFIX.qweight``
or ``PREFIX.weight_packed``), never by the config alone: third-party checkpoints leave some
modules, or some layers' experts, in fp16.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from onecat.errors import OnecatError
from onecat.pack.awq_gemm import AWQ_ORDER
from onecat.pack.checkpoint import Checkpoint
from onecat.pack.volta_layout import pack_volta

logger = logging.getLogger(__name__)

AWQ_GEMM = "awq-gemm"
COMPRESSED_TENSORS = "compressed-tensors"

_AWQ_PARTS = ("qweight", "qzeros", "scales")
_CT_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


@dataclass
class SourceFormat:
    """What a quantized checkpoint is: its kind, its quantization_config and the modules it
    declares unquantized."""

    kind: str
    quantization_config: dict[str, Any]
    modules_to_not_convert: list[str] = field(default_factory=list)


def _quantization_config(config: dict[str, Any]) -> dict[str, Any] | None:
    for holder in (config, config.get("text_config") or {}):
        for key in ("quantization_config", "compression_config"):
            if isinstance(holder.get(key), dict):
                return holder[key]
    return None


def detect_source_format(config: dict[str, Any], where: str = "config.json") -> SourceFormat:
    """Recognise the 4-bit format of a checkpoint from its config; OnecatError otherwise."""
    qc = _quantization_config(config)
    if qc is None:
        raise OnecatError(
            f"{where} has no quantization_config: this is not a quantized checkpoint. "
            "Quantize it first (`onecat quantize`), or give an AutoAWQ GEMM or "
            "compressed-tensors pack-quantized checkpoint"
        )
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise OnecatError(
                f"{where}: AWQ version {version!r} is not supported; onecat reads AutoAWQ "
                "'gemm' checkpoints (re-export with version='gemm')"
            )
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        if bits != 4:
            raise OnecatError(f"{where}: AWQ with {bits} bits is not supported; onecat needs 4")
        skip = list(qc.get("modules_to_not_convert") or [])
        return SourceFormat(AWQ_GEMM, qc, skip)
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        formats = {str(g.get("format") or qc.get("format", "")) for g in groups.values()}
        formats = formats or {str(qc.get("format", ""))}
        if formats != {"pack-quantized"}:
            raise OnecatError(
                f"{where}: compressed-tensors format {sorted(formats)} is not supported; "
                "onecat reads 'pack-quantized' (int4 weight-only) checkpoints"
            )
        for name, group in groups.items():
            weights = group.get("weights") or {}
            if int(weights.get("num_bits", 4)) != 4 or weights.get("type", "int") != "int":
                raise OnecatError(
                    f"{where}: config group {name!r} quantizes weights to "
                    f"{weights.get('num_bits')}-bit {weights.get('type')}; onecat needs 4-bit int"
                )
            if group.get("input_activations"):
                raise OnecatError(
                    f"{where}: config group {name!r} also quantizes activations; onecat runs "
                    "weight-only (W4A16) checkpoints"
                )
        skip = [s for s in qc.get("ignore") or [] if not str(s).startswith("re:")]
        return SourceFormat(COMPRESSED_TENSORS, qc, skip)
    if method == "onecat":
        raise OnecatError(f"{where}: this checkpoint is already a onecat packed artifact")
    raise OnecatError(
        f"{where}: quant_method {method!r} is not supported; onecat packs AutoAWQ GEMM ('awq') "
        "and compressed-tensors pack-quantized checkpoints"
    )


def find_quantized_linears(ckpt: Checkpoint, fmt: SourceFormat) -> dict[str, list[str]]:
    """Map each quantized linear's prefix to the names of its quantization tensors."""
    marker, parts = (
        ("qweight", _AWQ_PARTS) if fmt.kind == AWQ_GEMM else ("weight_packed", _CT_PARTS)
    )
    found: dict[str, list[str]] = {}
    for name in ckpt.names():
        prefix, _, leaf = name.rpartition(".")
        if leaf == marker:
            found[prefix] = [f"{prefix}.{p}" for p in parts if f"{prefix}.{p}" in ckpt]
    return found


def scales_to_fp16(scales: torch.Tensor, where: str) -> torch.Tensor:
    """Scales in fp16; OnecatError if a non-zero scale becomes 0 or inf in fp16, a warning
    when the conversion rounds (bf16 / fp32 sources)."""
    if scales.dtype == torch.float16:
        return scales
    s32 = scales.to(torch.float32)
    s16 = s32.to(torch.float16)
    lost = ((s16 == 0) & (s32 != 0)) | (~torch.isfinite(s16) & torch.isfinite(s32))
    if bool(lost.any()):
        raise OnecatError(
            f"{where}: {int(lost.sum())} {scales.dtype} scales fall outside the fp16 range; "
            "this checkpoint cannot run in fp16 on a V100"
        )
    changed = s16.to(torch.float32) != s32
    if bool(changed.any()):
        rel = ((s16.to(torch.float32) - s32).abs() / s32.abs().clamp_min(1e-30)).max()
        logger.debug("%s: %s scales rounded to fp16 (max relative change %.2e)", where,
                     scales.dtype, float(rel))
    return s16


def decode_awq_gemm(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, where: str = "AWQ linear"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ GEMM tensors -> ``(q [N, K], zeros [N, K/g], scales [N, K/g] fp16)``."""
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dtype != torch.int32 or t.dim() != 2:
            raise OnecatError(
                f"{where}.{name} must be a 2-D int32 tensor, got {t.dtype} {tuple(t.shape)} "
                "(fused 3-D experts must be stored per expert)"
            )
    k, n8 = qweight.shape
    groups = qzeros.shape[0]
    if (
        qzeros.shape[1] != n8
        or scales.dim() != 2
        or tuple(scales.shape) != (groups, 8 * n8)
        or groups == 0
        or k % groups
    ):
        raise OnecatError(
            f"{where}: inconsistent AWQ GEMM shapes qweight {tuple(qweight.shape)}, qzeros "
            f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)} (expected [K, N/8], "
            "[K/g, N/8], [K/g, N])"
        )
    q = _unpack_awq_words(qweight).t().contiguous()
    z = _unpack_awq_words(qzeros).t().contiguous()
    return q, z, scales_to_fp16(scales.t().contiguous(), f"{where}.scales")


_AWQ_CHANNEL_NIBBLE = torch.argsort(torch.tensor(AWQ_ORDER))  # channel offset -> nibble


def _unpack_awq_words(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 8C] in AutoAWQ's order (nibble i holds 8c + AWQ_ORDER[i]);
    the same result as :func:`onecat.pack.awq_gemm.unpack_int4_columns`, vectorised."""
    nibbles = _unpack_sequential_nibbles(words).reshape(words.shape[0], -1, 8)
    return nibbles.index_select(-1, _AWQ_CHANNEL_NIBBLE).reshape(words.shape[0], -1)


def _unpack_sequential_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 8C]: value 8c + i is nibble i (bits 4i..4i+3) of word c."""
    b = words.contiguous().reshape(-1).view(torch.uint8).reshape(words.shape[0], -1)  # bytes
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(words.shape[0], -1)


def decode_compressed_tensors(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None = None,
    weight_shape: torch.Tensor | None = None,
    weight_g_idx: torch.Tensor | None = None,
    where: str = "compressed-tensors linear",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors ``pack-quantized`` tensors -> ``(q, zeros, scales fp16)``.

    Symmetric checkpoints (no ``weight_zero_point``) get ``z = 8``.
    """
    if weight_packed.dtype != torch.int32 or weight_packed.dim() != 2:
        raise OnecatError(
            f"{where}.weight_packed must be 2-D int32, got {weight_packed.dtype} "
            f"{tuple(weight_packed.shape)} (fused 3-D experts must be stored per expert)"
        )
    if weight_shape is not None:
        n, k = (int(v) for v in weight_shape.reshape(-1).tolist())
    else:
        n, k = weight_packed.shape[0], weight_packed.shape[1] * 8
    if weight_scale.dim() != 2 or weight_scale.shape[0] != n or weight_packed.shape[0] != n:
        raise OnecatError(
            f"{where}: weight_scale {tuple(weight_scale.shape)} / weight_packed "
            f"{tuple(weight_packed.shape)} do not match weight_shape [{n}, {k}]"
        )
    groups = weight_scale.shape[1]
    if groups == 0 or k % groups or weight_packed.shape[1] * 8 < k:
        raise OnecatError(
            f"{where}: weight_scale {tuple(weight_scale.shape)} does not split {k} inputs "
            "into equal groups"
        )
    group_size = k // groups
    if weight_g_idx is not None:
        trivial = torch.arange(k) // group_size
        if not torch.equal(weight_g_idx.to(torch.int64).reshape(-1), trivial):
            raise OnecatError(
                f"{where}.weight_g_idx reorders input channels (activation ordering); "
                "onecat needs plain groups: re-quantize without actorder"
            )
    q = _unpack_sequential_nibbles(weight_packed)[:, :k].contiguous()
    if weight_zero_point is None:
        z = torch.full((n, groups), 8, dtype=torch.uint8)
    else:
        if weight_zero_point.dtype != torch.int32 or weight_zero_point.dim() != 2 or (
            weight_zero_point.shape[1] != groups or weight_zero_point.shape[0] * 8 < n
        ):
            raise OnecatError(
                f"{where}.weight_zero_point {weight_zero_point.dtype} "
                f"{tuple(weight_zero_point.shape)} is not int32 [ceil(N/8), K/g] = "
                f"[{(n + 7) // 8}, {groups}]"
            )
        # packed along N: transpose so that rows become packed words
        z = _unpack_sequential_nibbles(weight_zero_point.t()).t()[:n].contiguous()
    return q, z, scales_to_fp16(weight_scale, f"{where}.weight_scale")


def read_quantized_linear(
    ckpt: Checkpoint, fmt: SourceFormat, prefix: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The integers ``(q, zeros, scales)`` of the quantized linear ``prefix`` in ``ckpt``."""
    where = f"{prefix} in {ckpt.path}"
    if fmt.kind == AWQ_GEMM:
        missing = [p for p in _AWQ_PARTS if f"{prefix}.{p}" not in ckpt]
        if missing:
            raise OnecatError(f"{where}: AWQ tensors {', '.join(missing)} are missing")
        parts = [ckpt.get(f"{prefix}.{p}") for p in _AWQ_PARTS]
        return decode_awq_gemm(*parts, where=prefix)
    if f"{prefix}.weight_scale" not in ckpt:
        raise OnecatError(f"{where}: weight_scale is missing")

    def optional(part: str) -> torch.Tensor | None:
        name = f"{prefix}.{part}"
        return ckpt.get(name) if name in ckpt else None

    return decode_compressed_tensors(
        ckpt.get(f"{prefix}.weight_packed"),
        ckpt.get(f"{prefix}.weight_scale"),
        optional("weight_zero_point"),
        optional("weight_shape"),
        optional("weight_g_idx"),
        where=prefix,
    )


def dequantize_exact(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``fp16((q - z) * s)`` [N, K]: the weight of a module kept unpacked."""
    n, k = q.shape
    groups = zeros.shape[1]
    w = q.reshape(n, groups, k // groups).to(torch.float32) - zeros.to(torch.float32)[..., None]
    return (w * scales.to(torch.float32)[..., None]).reshape(n, k).to(torch.float16)


def _pack(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        return pack_volta(q, z, s)
    except ValueError as exc:
        raise OnecatError(f"cannot pack into the Volta layout: {exc}") from None


def awq_to_volta(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack AutoAWQ GEMM tensors on the fly: ``(qweight [N/32, K/32, 32, 4] int32,
    scales_zeros [N/32, K/g, 32, 2] fp16)``. For runtimes that load AWQ checkpoints directly."""
    return _pack(*decode_awq_gemm(qweight, qzeros, scales))


def compressed_tensors_to_volta(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None = None,
    weight_shape: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack compressed-tensors ``pack-quantized`` tensors on the fly into the Volta layout."""
    return _pack(
        *decode_compressed_tensors(weight_packed, weight_scale, weight_zero_point, weight_shape)
    )
