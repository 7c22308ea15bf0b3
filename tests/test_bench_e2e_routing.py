"""``bench/e2e.py``'s random 35B-A3B-shaped model routes with ``SeparatedRouting``, so its
graph-vs-eager check can call any disagreement a bug: checked on a narrow 2-layer copy
(CPU, packed weights): the routing rows of every residual writer dequantise to exactly 0,
each router row reads one routing channel, and the experts chosen for a batch of tokens are
the tokens' codes in every layer, whatever the rest of the hidden state."""

from __future__ import annotations

import torch
from bench_helpers import load_bench

from onecat.pack.volta_layout import dequantize_volta


def load_e2e():
    return load_bench("e2e")


def test_random_moe_model_routes_with_guaranteed_margins():
    from onecat.runtime.models.config import ModelConfig
    from onecat.runtime.models.qwen3_5 import Qwen3_5ForCausalLM
    from onecat.runtime.quant_plan import QuantPlan
    from onecat.tiny import SeparatedRouting

    e2e = load_e2e()
    raw = e2e.text_config("35b-a3b", 2)
    raw.update(hidden_size=256, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
               shared_expert_intermediate_size=64, vocab_size=512, linear_num_value_heads=2,
               linear_num_key_heads=2, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    cfg = ModelConfig.from_dict(raw)
    model = Qwen3_5ForCausalLM(cfg, QuantPlan(default=64), torch.float16)
    e2e.fill_random(model)
    routing = SeparatedRouting(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size)
    params = dict(model.named_parameters())
    writers = [n for n in params if n.endswith("scales_zeros") and any(w in n for w in e2e.RESIDUAL_WRITERS)]
    assert len(writers) == 3 * cfg.num_hidden_layers
    for name in writers:
        qweight = params[name.replace("scales_zeros", "qweight")]
        sz = params[name]
        for q, s in zip(qweight.reshape(-1, *qweight.shape[-4:]), sz.reshape(-1, *sz.shape[-4:]), strict=True):
            w = dequantize_volta(q, s, 64)
            assert (w[routing.channels] == 0).all(), name
            assert (w[cfg.num_experts :] != 0).any(), name
    embed = params["model.embed_tokens.weight"].float()
    codes = routing.token_channels(cfg.vocab_size)
    for layer in range(cfg.num_hidden_layers):
        router = params[f"model.layers.{layer}.mlp.gate.weight"].float()
        assert ((router != 0).sum(-1) == 1).all()
        tokens = torch.arange(0, cfg.vocab_size, 7)
        hidden = embed[tokens].clone()  # the residual keeps the routing channels: only the rest changes
        hidden[:, cfg.num_experts :] = torch.randn(len(tokens), cfg.hidden_size - cfg.num_experts)
        chosen = (hidden @ router.t()).topk(cfg.num_experts_per_tok, dim=-1).indices.sort(-1).values
        perm = routing.permutation(layer)
        expected = torch.stack([torch.argsort(perm)[codes[t]] for t in tokens]).sort(-1).values
        assert torch.equal(chosen, expected), f"layer {layer}"
