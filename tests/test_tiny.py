"""The tiny checkpoints have the structure of the real ones that the tools must handle."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from onecat.tiny import build_tiny_model


def _keys(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return index["weight_map"]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_wrapper_layout(tmp_path, family):
    out = build_tiny_model(family, tmp_path / family)
    keys = _keys(out)
    assert any(k.startswith("model.language_model.layers.3.self_attn.q_proj") for k in keys)
    assert any(k.startswith("model.language_model.layers.0.linear_attn.in_proj_qkv") for k in keys)
    assert any(k.startswith("mtp.") for k in keys)
    assert any(k.startswith("model.visual.") for k in keys)
    if family == "qwen3_5_moe":
        name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
        assert name in keys
        with safe_open(out / keys[name], "pt") as f:
            assert f.get_slice(name).get_shape() == [8, 128, 128]  # [E, 2*I, H]
        assert not any(".experts.0." in k for k in keys)


def test_fused_experts_load_identically(tmp_path):
    from transformers import AutoModelForCausalLM

    fused = build_tiny_model("qwen3_5_moe", tmp_path / "fused")
    split = build_tiny_model("qwen3_5_moe", tmp_path / "split", fused_experts=False)
    ids = torch.tensor([[5, 17, 42, 99]])
    a = AutoModelForCausalLM.from_pretrained(fused, dtype=torch.float32)(ids).logits
    b = AutoModelForCausalLM.from_pretrained(split, dtype=torch.float32)(ids).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_tokenizer_has_chat_template(tmp_path):
    from transformers import AutoTokenizer

    out = build_tiny_model("llama", tmp_path / "llama", num_layers=1)
    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok("def f(x): return x").input_ids) == "def f(x): return x"
