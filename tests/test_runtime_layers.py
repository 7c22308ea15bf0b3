"""Unit tests of the runtime's layers: delta rule forms, short conv, detokenizer, GPU graphs."""

from __future__ import annotations

import gc
from collections import defaultdict

import pytest
import torch

from onecat.runtime.engine.detokenizer import IncrementalDetokenizer
from onecat.runtime.layers.causal_conv import causal_conv1d_chunk, causal_conv1d_step
from onecat.runtime.layers.delta_rule import gated_delta_rule_chunked, gated_delta_rule_step


def test_chunked_delta_rule_equals_recurrence():
    """The chunked form (3 chunks, one partial, non-zero initial state, grouped heads) equals
    the token-by-token recurrence."""
    gen = torch.Generator().manual_seed(0)
    length, hk, hv, dk, dv = 150, 2, 4, 32, 16
    q, k = torch.randn(length, hk, dk, generator=gen), torch.randn(length, hk, dk, generator=gen)
    v = torch.randn(length, hv, dv, generator=gen)
    g = -torch.rand(length, hv, generator=gen)
    beta = torch.rand(length, hv, generator=gen)
    state0 = torch.randn(hv, dk, dv, generator=gen) * 0.1
    out, state = gated_delta_rule_chunked(q, k, v, g, beta, state0)
    step_state, rows = state0[None], []
    for t in range(length):
        o, step_state = gated_delta_rule_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], step_state)
        rows.append(o)
    torch.testing.assert_close(out, torch.cat(rows), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, step_state[0], atol=1e-5, rtol=1e-5)


def test_conv_chunks_and_steps_continue_each_other():
    gen = torch.Generator().manual_seed(1)
    x, weight = torch.randn(11, 6, generator=gen), torch.randn(6, 4, generator=gen)
    whole, _ = causal_conv1d_chunk(x, torch.zeros(6, 3), weight)
    first, state = causal_conv1d_chunk(x[:7], torch.zeros(6, 3), weight)
    rows = [first]
    state = state[None]
    for t in range(7, 11):
        y, state = causal_conv1d_step(x[t : t + 1], state, weight)
        rows.append(y)
    torch.testing.assert_close(torch.cat(rows), whole)


class _CharTokenizer:
    """Token id = character code; enough to test the detokenizer's bookkeeping."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_detokenizer_holds_back_possible_stop_string():
    detok = IncrementalDetokenizer(_CharTokenizer(), ["END"])
    pieces = []
    for ch in "abcEN":
        assert not detok.append(ord(ch))
        pieces.append(detok.release(final=False))
    assert "".join(pieces) == "abc"  # "EN" may start "END": held back
    assert detok.append(ord("X")) is False
    assert detok.release(final=False) == "E"  # the last len("END") - 1 characters wait
    for ch in "yEND":
        stopped = detok.append(ord(ch))
    assert stopped and detok.text == "abcENXy" and detok.release(final=True) == "NXy"


@pytest.mark.gpu
@pytest.mark.parametrize("staggered", [False, True])
def test_cuda_graph_decode_matches_eager(tmp_path, staggered):
    """Decode under CUDA graphs (fp16) computes what eager mode computes: logits within 1% of
    the largest, greedy tokens identical but at near ties (the tiny MoE routes with
    ``SeparatedRouting``, so expert choices cannot flip). ``staggered``: requests arrive
    while others decode and prompts are cut into small chunks, so steps mix graph-replayed
    decodes with eagerly run prompt chunks."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from runtime_helpers import assert_same_greedy_runs, drain, record_logits

    from onecat.runtime.config import EngineConfig
    from onecat.runtime.engine import LLMEngine
    from onecat.runtime.sampling_params import SamplingParams
    from onecat.tiny import build_tiny_model

    path = build_tiny_model("qwen3_5_moe", tmp_path / "moe")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = []
    for eager in (True, False):
        engine = LLMEngine(EngineConfig(
            model=str(path), enforce_eager=eager, max_num_seqs=8, gpu_memory_utilization=0.3,
            max_num_batched_tokens=8 if staggered else 2048,
        ))  # fmt: skip
        logits = record_logits(engine)
        early = defaultdict(list)
        for i in range(3):
            engine.add_request(f"r{i}", list(range(5 + i, 25 + 3 * i)), params)
            for _ in range(4 if staggered else 0):  # r{i} prefills and decodes before r{i+1}
                for out in engine.step():
                    early[out.request_id].append(out)
        outs = drain(engine)
        for rid, items in early.items():
            outs[rid] = items + outs.get(rid, [])
        tokens = {rid: [t for o in v for t in o.new_token_ids] for rid, v in outs.items()}
        results.append((tokens, {rid: torch.stack(rows).cpu() for rid, rows in logits.items()}))
        assert bool(engine.runner.graphs) != eager
        del engine, logits  # its KV cache holds 30% of the GPU: the next engine's plan must not see it
        gc.collect()
        torch.cuda.empty_cache()
    assert_same_greedy_runs(results[0], results[1], 1e-2, relative=True, label="CUDA graphs vs eager")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("tokens", [6, 100])
def test_folded_shared_expert_matches_the_separate_mlp(device, tokens):
    """The MoE block with its shared expert folded into the experts' spare slot (one more
    choice per token, weighted by the sigmoid gate) computes what the separate shared MLP and
    gated add compute; the shared expert's layers become views of that slot (no copy kept)."""
    from onecat.runtime.models.config import ModelConfig
    from onecat.runtime.models.qwen3_5 import SparseMoE, fold_shared_experts
    from onecat.runtime.quant_plan import QuantPlan
    from onecat.tiny import _text_kwargs

    cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", **_text_kwargs("qwen3_5_moe", 64, 4)})
    with torch.device(device):
        layer = SparseMoE(cfg, "model.layers.0.mlp", QuantPlan(default=32), torch.float16)
    gen = torch.Generator().manual_seed(5)
    for name, param in layer.named_parameters():
        if param.dtype == torch.int32:
            param.data.copy_(torch.randint(-(2**31), 2**31 - 1, param.shape, generator=gen, dtype=torch.int32))
        elif "scales_zeros" in name:
            scale = torch.rand(param.shape[:-1], generator=gen) * 0.02 + 0.01
            param.data.copy_(torch.stack([scale, -8 * scale], dim=-1).half())
        else:
            param.data.copy_((torch.randn(param.shape, generator=gen) * 0.3).half())
    x = torch.randn(tokens, cfg.hidden_size, generator=gen).half().to(device)  # 6: decode paths, 100: prompt paths
    separate = layer(x)
    assert layer.shared_slot is None and fold_shared_experts(layer) == 1 and layer.shared_slot == cfg.num_experts
    folded = layer(x)
    assert layer.shared_expert.down_proj.qweight.data_ptr() == layer.experts.w2_qweight[cfg.num_experts].data_ptr()
    rows = layer.router_rows  # router and shared gate rows in one tensor, the two layers viewing it
    assert rows.shape == (-(-(cfg.num_experts + 1) // 8) * 8, cfg.hidden_size)  # zero rows pad to a multiple of 8
    assert not rows[cfg.num_experts + 1 :].any()
    assert layer.gate.weight.data_ptr() == rows.data_ptr()
    assert layer.shared_expert_gate.weight.data_ptr() == rows[cfg.num_experts].data_ptr()
    scale = separate.float().abs().max()
    assert (folded.float() - separate.float()).abs().max() <= 5e-3 * scale, "folded vs separate shared expert"
    assert fold_shared_experts(layer) == 1, "folding again changes nothing"
    # the grouped GPU path sums a token's experts with fp32 atomics, in no fixed order
    assert (layer(x).float() - folded.float()).abs().max() <= 1e-3 * scale


def test_norm_kernel_declines_cpu_tensors():
    """On the CPU the runtime's norms stay torch (the sm_70 kernel is CUDA only)."""
    from onecat.kernels import rms_norm as norm_kernel
    from onecat.runtime.layers import norm

    x, residual, weight = torch.randn(3, 64).half(), torch.randn(3, 64).half(), torch.zeros(64)
    assert not norm_kernel.supports(x, residual, weight)
    normed, summed = norm.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, x + residual)
    assert torch.equal(normed, norm.rms_norm_math(x + residual, weight, 1e-6))


def test_norms_take_the_kernel_only_for_wide_rows(monkeypatch):
    """Rows narrower than KERNEL_MIN_HIDDEN stay on the compiled torch function even where the
    kernel would take them (it measured slower in the model there)."""
    from onecat.kernels import rms_norm as norm_kernel
    from onecat.runtime.layers import norm

    monkeypatch.setattr(norm_kernel, "supports", lambda *args: True)
    weight = torch.zeros(norm.KERNEL_MIN_HIDDEN)
    assert norm._takes_kernel(torch.zeros(2, norm.KERNEL_MIN_HIDDEN), None, weight)
    assert not norm._takes_kernel(torch.zeros(2, norm.KERNEL_MIN_HIDDEN - 8), None, weight[:-8])
