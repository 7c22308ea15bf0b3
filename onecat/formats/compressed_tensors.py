"""compressed-tensors ``pack-quantized`` (int4 weight-only): the one codec of its tensors and
config.

- ``PREFIX.weight_packed`` [N, K/8] int32: sequential nibbles along K (value 8c + i in bits
  4i..4i+3 of word c), each the signed value + 8;
- ``PREFIX.weight_scale`` [N, K/g];
- ``PREFIX.weight_zero_point`` [ceil(N/8), K/g] int32 (asymmetric only): sequential nibbles
  along N, signed + 8;
- ``PREFIX.weight_shape`` [2], ``PREFIX.weight_g_idx`` [K] (activation ordering: refused).

Dequantisation is ``(q_signed - zp_signed) * s``, which is ``(q - z) * s`` with the stored
unsigned nibbles; symmetric means ``z = 8``.
"""

from __future__ import annotations

from typing import Any

import torch

from onecat.errors import OnecatError
from onecat.formats.integers import scales_to_fp16

PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
"""The tensors of one compressed-tensors linear, ``PREFIX.<part>`` (the last three optional)."""

FORMAT = "pack-quantized"


def unpack_sequential_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 8C]: value 8c + i is nibble i (bits 4i..4i+3) of word c."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    nibbles = (words.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF
    return nibbles.to(torch.uint8).reshape(words.shape[0], -1)


def decode_compressed_tensors(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None = None,
    weight_shape: torch.Tensor | None = None,
    weight_g_idx: torch.Tensor | None = None,
    where: str = "compressed-tensors linear",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors ``pack-quantized`` tensors -> ``(q, zeros, scales fp16)``.

    Symmetric checkpoints (no ``weight_zero_point``) get ``z = 8``. OnecatError naming
    ``where`` on inconsistent tensors or activation ordering.
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
        trivial = torch.arange(k, device=weight_g_idx.device) // group_size
        if not torch.equal(weight_g_idx.to(torch.int64).reshape(-1), trivial):
            raise OnecatError(
                f"{where}.weight_g_idx reorders input channels (activation ordering); "
                "onecat needs plain groups: re-quantize without actorder"
            )
    q = unpack_sequential_nibbles(weight_packed)[:, :k].contiguous()
    if weight_zero_point is None:
        z = torch.full((n, groups), 8, dtype=torch.uint8, device=weight_packed.device)
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
        z = unpack_sequential_nibbles(weight_zero_point.t()).t()[:n].contiguous()
    return q, z, scales_to_fp16(weight_scale, f"{where}.weight_scale")


def check_compressed_tensors_config(qc: dict[str, Any], where: str) -> list[str]:
    """Validate a compressed-tensors ``quantization_config`` (pack-quantized, 4-bit int
    weights, no activation quantization); returns the plainly named ``ignore`` modules."""
    groups = qc.get("config_groups") or {}
    formats = {str(g.get("format") or qc.get("format", "")) for g in groups.values()}
    formats = formats or {str(qc.get("format", ""))}
    if formats != {FORMAT}:
        raise OnecatError(
            f"{where}: compressed-tensors format {sorted(formats)} is not supported; "
            f"onecat reads {FORMAT!r} (int4 weight-only) checkpoints"
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
    return [s for s in qc.get("ignore") or [] if not str(s).startswith("re:")]
