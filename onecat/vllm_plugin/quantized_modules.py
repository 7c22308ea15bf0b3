"""Which modules of a checkpoint are 4-bit, matched against vLLM's module names.

Real checkpoints mix quantized and fp16 linears (router, ``shared_expert_gate``, GDN
``in_proj_a``/``in_proj_b``, ``mtp.*``, sometimes whole layers), so the plugin decides per
module from the tensors themselves: a module is quantized when the checkpoint holds
``PREFIX.qweight``. Checkpoint names (``model.language_model.layers.3.mlp.gate_proj``) and
vLLM's (``language_model.model.layers.3.mlp.gate_up_proj``) differ in their prefix and in
fused modules, so both sides are reduced to a key that starts at ``layers.`` and fused vLLM
modules are expanded through the model's ``packed_modules_mapping``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from onecat.errors import OnecatError
from onecat.formats.checkpoint import Checkpoint

QWEIGHT_SUFFIX = ".qweight"


def module_key(name: str) -> str:
    """Prefix-free key of a module name: the part from ``layers.`` on (``mtp.`` kept apart),
    or the name itself (``lm_head``)."""
    head, sep, tail = name.partition("layers.")
    if not sep:
        return name.rsplit(".", 1)[-1] if name.endswith("lm_head") else name
    return ("mtp." if head.startswith("mtp") else "") + "layers." + tail


def checkpoint_tensor_names(model_dir: str | Path) -> list[str]:
    """Every tensor name of the local checkpoint ``model_dir`` (shard headers only, through
    onecat's checkpoint reader: every shard the index names must lie inside the directory)."""
    return Checkpoint(model_dir).names()


def quantized_module_keys(tensor_names: Iterable[str]) -> set[str]:
    """Keys (:func:`module_key`) of the modules that have a ``.qweight`` tensor."""
    return {
        module_key(name[: -len(QWEIGHT_SUFFIX)])
        for name in tensor_names
        if name.endswith(QWEIGHT_SUFFIX)
    }


def shard_names(prefix: str, packed_modules_mapping: Mapping[str, list[str]]) -> list[str]:
    """Checkpoint module names behind vLLM module ``prefix`` (fused modules expanded)."""
    parent, _, leaf = prefix.rpartition(".")
    shards = packed_modules_mapping.get(leaf)
    if not shards:
        return [prefix]
    return [f"{parent}.{shard}" if parent else shard for shard in shards]


def is_quantized(
    prefix: str, quantized: set[str], packed_modules_mapping: Mapping[str, list[str]]
) -> bool:
    """Whether vLLM module ``prefix`` is 4-bit; raises OnecatError when a fused module mixes
    quantized and fp16 parts (vLLM cannot load such a module as one)."""
    parts = shard_names(prefix, packed_modules_mapping)
    flags = [module_key(part) in quantized for part in parts]
    if all(flags):
        return True
    if not any(flags):
        return False
    mixed = ", ".join(
        f"{p} ({'4-bit' if f else 'fp16'})" for p, f in zip(parts, flags, strict=True)
    )
    raise OnecatError(
        f"vLLM fuses {prefix} from {mixed}, which the checkpoint stores in different "
        "precisions; re-quantize with the same recipe for all of them"
    )


def experts_quantized(prefix: str, quantized: set[str]) -> bool:
    """Whether the routed experts under vLLM module ``prefix`` (``...mlp.experts``) are 4-bit."""
    key = module_key(prefix).removesuffix(".routed_experts") + "."
    return any(name.startswith(key) for name in quantized)
