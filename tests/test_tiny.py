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


def _route(routing, layer: int, hidden: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """Qwen3.5's routing of ``hidden`` after its (1 + w) RMSNorm: the top-k experts' ids."""
    x = hidden.float()
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + norm_weight.float())).to(hidden.dtype)
    logits = torch.nn.functional.linear(normed, routing.router(layer).to(hidden.dtype))
    return logits.float().softmax(-1).topk(routing.top_k, -1).indices


@pytest.mark.parametrize("experts, top_k, hidden", [(8, 2, 128), (256, 8, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_separated_routing_holds_for_any_rest_of_the_hidden_state(experts, top_k, hidden, dtype):
    """Whatever the non-routing channels hold (here: random, up to 30x the routing values),
    every layer routes each token to its constructed experts, in any precision."""
    from onecat.tiny import SeparatedRouting

    routing, vocab = SeparatedRouting(experts, top_k, hidden), 300
    gen = torch.Generator().manual_seed(1)
    embed = routing.embedding(torch.randn(vocab, hidden, generator=gen) * 0.02)
    tokens = torch.randint(0, vocab, (64,), generator=gen)
    norm = torch.randn(hidden, generator=gen) * 0.1
    for layer, scale in enumerate((0.0, 0.1, 1.0, 30.0)):
        hidden_states = embed[tokens].clone()
        rest = torch.randn(len(tokens), hidden - experts, generator=gen) * scale
        hidden_states[:, experts:] += rest * embed.abs().max()
        chosen = _route(routing, layer, hidden_states.to(dtype), norm)
        expected = routing.experts(layer, tokens, vocab)
        assert torch.equal(chosen.sort(-1).values, expected.sort(-1).values)
    per_layer = [{tuple(e) for e in routing.experts(layer, tokens, vocab).sort(-1).values.tolist()} for layer in range(2)]
    assert len(per_layer[0]) > 8 and per_layer[0] != per_layer[1], "routing should vary by token and layer"


def test_separated_routing_rejects_too_many_experts():
    from onecat.tiny import SeparatedRouting

    with pytest.raises(ValueError, match="num_experts"):
        SeparatedRouting(128, 8, 128)


def test_tiny_moe_routes_with_separated_scores(tmp_path):
    """The tiny MoE checkpoint, run by transformers: at every layer the unchosen experts score
    exactly 0 and the chosen ones (the constructed experts) well above it."""
    from transformers import AutoModelForCausalLM

    from onecat.tiny import SeparatedRouting

    out = build_tiny_model("qwen3_5_moe", tmp_path / "moe", num_layers=4)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    cfg = model.config
    routing = SeparatedRouting(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size)
    ids = torch.randint(3, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        router_logits = model(ids, output_router_logits=True).router_logits
    k = cfg.num_experts_per_tok
    for layer, logits in enumerate(router_logits):
        scores = logits.float().sort(-1, descending=True).values
        assert (scores[:, k:] == 0).all(), f"layer {layer}: an unchosen expert scored non-zero"
        assert scores[:, k - 1].min() > 0.3, f"layer {layer}: chosen scores {scores[:, :k]}"
        chosen = logits.float().topk(k, -1).indices.sort(-1).values
        assert torch.equal(chosen, routing.experts(layer, ids[0], cfg.vocab_size).sort(-1).values)
