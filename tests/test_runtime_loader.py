"""Checkpoint layouts the runtime loads, and the errors it gives for ones it cannot."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from runtime_helpers import reference_logits, reference_model, write_text_only_checkpoint

from onecat.errors import OnecatError
from onecat.runtime.context import ForwardContext, PrefillChunk, set_context
from onecat.runtime.loader import load_model
from onecat.tiny import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@torch.no_grad()
def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    chunk = PrefillChunk(0, n, 0, torch.zeros(1, dtype=torch.int64), 0)
    set_context(ForwardContext(slot_mapping=torch.arange(n), prefills=[chunk]))
    try:
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n)))
    finally:
        set_context(None)


def test_per_expert_and_text_only_layouts_load(tmp_path):
    """Per-expert 2-D expert weights, and the text-only key layout with a flat config, give
    the same model as the fused wrapper checkpoint."""
    fused = build_tiny_model("qwen3_5_moe", tmp_path / "fused", num_layers=4)
    per_expert = build_tiny_model("qwen3_5_moe", tmp_path / "per-expert", num_layers=4, fused_experts=False)
    write_text_only_checkpoint(per_expert, tmp_path / "text")
    ids = list(range(3, 40))
    expected = reference_logits(reference_model(fused), ids)
    for path in (fused, per_expert, tmp_path / "text"):
        got = prefill_logits(load_model(path, torch.device("cpu"), torch.float32), ids)
        assert (got - expected).abs().max().item() < 1e-4, path.name


def test_unsupported_and_broken_checkpoints_are_clear_errors(tmp_path):
    src = build_tiny_model("qwen3_5", tmp_path / "dense", num_layers=4)
    llama = build_tiny_model("llama", tmp_path / "llama", num_layers=1)
    with pytest.raises(OnecatError, match="model_type 'llama' is not supported"):
        load_model(llama, torch.device("cpu"), torch.float32)
    with pytest.raises(OnecatError, match="not a directory"):
        load_model(tmp_path / "missing", torch.device("cpu"), torch.float32)
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    config = json.loads((broken / "config.json").read_text())
    config["text_config"]["intermediate_size"] = 512
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(OnecatError, match="gate_proj"):
        load_model(broken, torch.device("cpu"), torch.float32)
