"""A checkpoint built to overflow fp16, and a one-pass forward of the runtime model.

``overflow_checkpoint`` copies the trained tiny Qwen3.5 (``onecat/fixtures/trained-qwen3_5``)
and scales a few tensors so that, in fp32, layer 1's MLP writes ~4.8e5 into the residual
stream (up_proj x 5000, down_proj x 200: ``silu(gate) * up`` ~1.6e4), layer 2's GDN output
reaches ~1.1e4 (its gated norm's weight x 6000) and layer 3's attention output ~1.1e4
(v_proj x 20000). Every scaled weight stays inside the fp16 range, so only activations
overflow. The fp32 model is still a well-defined model to compare against.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from onecat.runtime.context import ForwardContext, PrefillChunk, set_context
from onecat.tiny_train import fixture_dir

SCALED = {
    "layers.1.mlp.up_proj.weight": 5000.0,
    "layers.1.mlp.down_proj.weight": 200.0,
    "layers.2.linear_attn.norm.weight": 6000.0,
    "layers.3.self_attn.v_proj.weight": 20000.0,
}


def overflow_checkpoint(out: Path) -> Path:
    """Write the overflowing copy of the trained tiny Qwen3.5 to ``out``; returns it."""
    shutil.copytree(fixture_dir("qwen3_5"), out)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for suffix, factor in SCALED.items():
        key = next(k for k in weight_map if k.endswith(suffix))
        shard = out / weight_map[key]
        tensors = load_file(shard)
        tensors[key] = tensors[key] * factor
        save_file(tensors, shard, metadata={"format": "pt"})
    return out


@torch.inference_mode()
def forward_logits(model: torch.nn.Module, token_ids: list[int], device: torch.device) -> torch.Tensor:
    """Logits ``[T, vocab]`` (fp32) of one prompt through a loaded runtime model, one prefill
    pass with no KV cache (as the memory-profiling pass runs)."""
    ids = torch.tensor(token_ids, device=device)
    positions = torch.arange(len(token_ids), device=device)
    chunk = PrefillChunk(0, len(token_ids), 0, torch.zeros(1, dtype=torch.int64, device=device), 0)
    set_context(ForwardContext(slot_mapping=positions, prefills=[chunk]))
    try:
        return model.compute_logits(model(ids, positions)).float()
    finally:
        set_context(None)
