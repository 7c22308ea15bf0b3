"""The one ``quantization_config`` detector: what format a checkpoint's config.json declares.

The config may sit at the top level or in ``text_config`` (multimodal wrappers), under
``quantization_config`` or ``compression_config`` (older compressed-tensors); any of them
may be absent or ``null``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from onecat.errors import OnecatError
from onecat.formats.awq_gemm import check_awq_config
from onecat.formats.compressed_tensors import check_compressed_tensors_config

FLOAT = "float"
ONECAT = "onecat"
AWQ_GEMM = "awq-gemm"
COMPRESSED_TENSORS = "compressed-tensors"


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's settings: ``text_config`` when it is a dict, else ``config``."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def find_quantization_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's quantization config, or None for a float checkpoint."""
    holders = [config]
    if isinstance(config.get("text_config"), dict):
        holders.append(config["text_config"])
    for holder in holders:
        for key in ("quantization_config", "compression_config"):
            if isinstance(holder.get(key), dict):
                return holder[key]
    return None


def without_quantization_config(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` with every quantization config removed (top level and text_config)."""
    config = {k: v for k, v in config.items() if k not in ("quantization_config", "compression_config")}
    if isinstance(config.get("text_config"), dict):
        config["text_config"] = {
            k: v for k, v in config["text_config"].items()
            if k not in ("quantization_config", "compression_config")
        }
    return config


@dataclass
class SourceFormat:
    """What a checkpoint is: its kind (FLOAT, ONECAT, AWQ_GEMM, COMPRESSED_TENSORS), its
    quantization config, its declared group size and the modules it declares unquantized."""

    kind: str
    quantization_config: dict[str, Any] = field(default_factory=dict)
    group_size: int | None = None
    modules_to_not_convert: list[str] = field(default_factory=list)

    @property
    def quantized_source(self) -> bool:
        """True for the 4-bit formats onecat packs (AutoAWQ GEMM, compressed-tensors)."""
        return self.kind in (AWQ_GEMM, COMPRESSED_TENSORS)


def detect_format(config: dict[str, Any], where: str = "config.json") -> SourceFormat:
    """Recognise what ``config`` (a config.json dict) declares; OnecatError naming ``where``
    for an unsupported or invalid quantization config."""
    qc = find_quantization_config(config)
    if qc is None:
        return SourceFormat(FLOAT)
    method = str(qc.get("quant_method", "")).lower()
    if method == "onecat":
        return SourceFormat(ONECAT, qc, qc.get("group_size"),
                            list(qc.get("modules_to_not_convert") or []))
    if method == "awq":
        group = check_awq_config(qc, where)
        return SourceFormat(AWQ_GEMM, qc, group, list(qc.get("modules_to_not_convert") or []))
    if method == "compressed-tensors":
        return SourceFormat(COMPRESSED_TENSORS, qc, None, check_compressed_tensors_config(qc, where))
    raise OnecatError(
        f"{where}: quant_method {method!r} is not supported; onecat reads AutoAWQ GEMM ('awq') "
        "and compressed-tensors pack-quantized checkpoints and its own packed artifacts"
    )


def detect_source_format(config: dict[str, Any], where: str = "config.json") -> SourceFormat:
    """The 4-bit format of a checkpoint to pack: AutoAWQ GEMM or compressed-tensors;
    OnecatError for float checkpoints, packed artifacts and anything else."""
    fmt = detect_format(config, where)
    if fmt.kind == FLOAT:
        raise OnecatError(
            f"{where} has no quantization_config: this is not a quantized checkpoint. "
            "Quantize it first (`onecat quantize`), or give an AutoAWQ GEMM or "
            "compressed-tensors pack-quantized checkpoint"
        )
    if fmt.kind == ONECAT:
        raise OnecatError(f"{where}: this checkpoint is already a onecat packed artifact")
    return fmt
