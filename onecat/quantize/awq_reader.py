"""Read an AutoAWQ GEMM artifact back as a float32 transformers model (for evaluation).

Every ``PREFIX.qweight`` / ``PREFIX.qzeros`` / ``PREFIX.scales`` triple is dequantised on
the CPU with :func:`onecat.pack.awq_gemm.dequantize_awq_gemm` into ``PREFIX.weight``
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
from safetensors import safe_open
from safetensors.torch import save_file

from onecat.errors import OnecatError
from onecat.pack.awq_gemm import dequantize_awq_gemm

AWQ_PARTS = ("qweight", "qzeros", "scales")
EXPERT_KEY = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def _shard_files(path: Path) -> list[Path]:
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if indexes:
        weight_map = json.loads(indexes[0].read_text()).get("weight_map") or {}
        shards = sorted({path / name for name in weight_map.values()})
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise OnecatError(f"{indexes[0]} names missing shards: {', '.join(missing)}")
        return shards
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise OnecatError(f"{path} holds no *.safetensors weights")
    return shards


def _check_quant_config(path: Path, config: dict) -> dict:
    quant = config.get("quantization_config") or config.get("text_config", {}).get(
        "quantization_config"
    )
    if not quant or quant.get("quant_method") != "awq":
        raise OnecatError(f"{path}/config.json: quantization_config.quant_method is not 'awq'")
    expected = {"bits": 4, "version": "gemm", "zero_point": True}
    for field, value in expected.items():
        found = quant.get(field)
        if isinstance(found, str) and isinstance(value, str):
            found = found.lower()
        if found != value:
            raise OnecatError(
                f"{path}/config.json: quantization_config.{field} is {found!r}; only AutoAWQ "
                f"GEMM with {field} = {value!r} is supported"
            )
    return quant


def read_awq_float_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the AWQ artifact at ``path`` with quantized linears dequantised to
    float32 ``.weight`` tensors and per-expert MoE linears fused back to 3-D parameters."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    quant = _check_quant_config(path, config)
    group = quant.get("group_size")
    raw: dict[str, torch.Tensor] = {}
    for shard in _shard_files(path):
        try:
            with safe_open(shard, framework="pt") as f:
                for name in f.keys():
                    raw[name] = f.get_tensor(name)
        except OnecatError:
            raise
        except Exception as exc:  # safetensors raises its own error types
            raise OnecatError(f"cannot read {shard}: {exc}; re-create the artifact") from None
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        prefix, _, part = name.rpartition(".")
        if part in ("qzeros", "scales") and f"{prefix}.qweight" in raw:
            continue
        if part == "qweight":
            tensors[f"{prefix}.weight"] = _dequantize(path, prefix, raw, group)
        else:
            tensors[name] = tensor.float() if tensor.is_floating_point() else tensor
    return _fuse_experts(path, tensors)


def _dequantize(
    path: Path, prefix: str, raw: dict[str, torch.Tensor], group: int | None
) -> torch.Tensor:
    missing = [p for p in AWQ_PARTS if f"{prefix}.{p}" not in raw]
    if missing:
        raise OnecatError(f"{path}: {prefix} has a qweight but no {', '.join(missing)}")
    qweight, qzeros, scales = (raw[f"{prefix}.{p}"] for p in AWQ_PARTS)
    k, n8 = qweight.shape
    if qzeros.shape[1] != n8 or scales.shape != (qzeros.shape[0], 8 * n8) or k % qzeros.shape[0]:
        raise OnecatError(
            f"{path}: {prefix} has inconsistent AWQ shapes: qweight {tuple(qweight.shape)}, "
            f"qzeros {tuple(qzeros.shape)}, scales {tuple(scales.shape)}"
        )
    if group and k // qzeros.shape[0] != group:
        raise OnecatError(
            f"{path}: {prefix} has group size {k // qzeros.shape[0]}, config.json says {group}"
        )
    return dequantize_awq_gemm(qweight, qzeros, scales)


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


def _strip_quant_config(config: dict) -> dict:
    config = dict(config)
    config.pop("quantization_config", None)
    if isinstance(config.get("text_config"), dict):
        config["text_config"] = dict(config["text_config"])
        config["text_config"].pop("quantization_config", None)
    return config


def load_awq_as_float(path: str | Path) -> torch.nn.Module:
    """The AWQ artifact at ``path`` as a float32 ``AutoModelForCausalLM`` (dequantised)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    tensors = read_awq_float_tensors(path)
    with tempfile.TemporaryDirectory(prefix="onecat-awq-float-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(_strip_quant_config(config), indent=2))
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
