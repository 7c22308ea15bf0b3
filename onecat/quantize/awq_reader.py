"""Read an AutoAWQ GEMM artifact back as a float32 transformers model (for evaluation).

Every ``PREFIX.qweight`` / ``PREFIX.qzeros`` / ``PREFIX.scales`` triple is dequantised on
the CPU with :func:`onecat.formats.awq_gemm.dequantize_awq_gemm` into ``PREFIX.weight``
(``(q - z) * s`` in float32); every other tensor is kept. Per-expert MoE linears
(``...mlp.experts.E.{gate,up,down}_proj``, as AWQ checkpoints store them) are fused back
into the 3-D parameters transformers' Qwen3.5-MoE expects: ``experts.gate_up_proj``
[E, 2*I, H] (gate rows, then up rows) and ``experts.down_proj`` [E, H, I].

The float tensors go to a temporary plain checkpoint (config.json without
``quantization_config``) that transformers loads with its own key mapping, so the
multimodal wrapper keys (``model.language_model.*``) resolve as for an fp checkpoint. The
whole model is held in host memory: this is for evaluating small models on a CPU.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from onecat.errors import OnecatError
from onecat.formats import awq_gemm
from onecat.formats.checkpoint import Checkpoint
from onecat.formats.quant_config import AWQ_GEMM, detect_format, without_quantization_config

EXPERT_KEY = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def read_awq_float_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the AWQ artifact at ``path`` with quantized linears dequantised to
    float32 ``.weight`` tensors and per-expert MoE linears fused back to 3-D parameters."""
    path = Path(path)
    ckpt = Checkpoint(path)
    fmt = detect_format(ckpt.config, f"{path}/config.json")
    if fmt.kind != AWQ_GEMM:
        raise OnecatError(f"{path}/config.json: quantization_config.quant_method is not 'awq'")
    tensors: dict[str, torch.Tensor] = {}
    for name in ckpt.names():
        prefix, _, part = name.rpartition(".")
        if part in ("qzeros", "scales") and f"{prefix}.qweight" in ckpt:
            continue
        if part == "qweight":
            tensors[f"{prefix}.weight"] = _dequantize(ckpt, prefix, fmt.group_size)
        else:
            tensor = ckpt.get(name)
            tensors[name] = tensor.float() if tensor.is_floating_point() else tensor
    return _fuse_experts(path, tensors)


def _dequantize(ckpt: Checkpoint, prefix: str, group: int | None) -> torch.Tensor:
    missing = [p for p in awq_gemm.PARTS if f"{prefix}.{p}" not in ckpt]
    if missing:
        raise OnecatError(f"{ckpt.path}: {prefix} has a qweight but no {', '.join(missing)}")
    qweight, qzeros, scales = (ckpt.get(f"{prefix}.{p}") for p in awq_gemm.PARTS)
    weight = awq_gemm.dequantize_awq_gemm(qweight, qzeros, scales, where=f"{ckpt.path}: {prefix}")
    stored = qweight.shape[0] // qzeros.shape[0]
    if group and stored != group:
        raise OnecatError(
            f"{ckpt.path}: {prefix} has group size {stored}, config.json says {group}"
        )
    return weight


def _fuse_experts(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name in list(tensors):
        m = EXPERT_KEY.match(name)
        if m:
            per = experts.setdefault(m["prefix"], {}).setdefault(int(m["expert"]), {})
            per[m["proj"]] = tensors.pop(name)
    for prefix, per_expert in experts.items():
        ids = sorted(per_expert)
        if ids != list(range(len(ids))) or any(len(per_expert[e]) != 3 for e in ids):
            raise OnecatError(
                f"{path}: the experts of {prefix} are incomplete (need gate/up/down_proj for "
                f"experts 0..{len(ids) - 1}); re-create the artifact"
            )
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([per_expert[e]["gate_proj"], per_expert[e]["up_proj"]]) for e in ids]
        )
        tensors[f"{prefix}.down_proj"] = torch.stack([per_expert[e]["down_proj"] for e in ids])
    return tensors


def load_awq_as_float(path: str | Path) -> torch.nn.Module:
    """The AWQ artifact at ``path`` as a float32 ``AutoModelForCausalLM`` (dequantised)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    config = Checkpoint(path).config
    tensors = read_awq_float_tensors(path)
    with tempfile.TemporaryDirectory(prefix="onecat-awq-float-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(without_quantization_config(config), indent=2))
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            Path(tmp) / "model.safetensors",
            metadata={"format": "pt"},
        )
        del tensors
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                tmp, dtype=torch.float32, output_loading_info=True
            )
        except (OSError, ValueError, RuntimeError) as exc:
            raise OnecatError(f"{path}: cannot build the dequantised model ({exc})") from exc
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise OnecatError(
            f"{path}: the artifact lacks {len(missing)} tensors the model needs "
            f"(first: {', '.join(missing[:3])}); re-create the artifact"
        )
    return model
