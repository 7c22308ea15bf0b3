"""fp16 headroom: measuring the sites, deriving the plan, folding it into the weights.

The runtime runs on CPU in fp16 here (torch's CPU fp16 ops round every activation to fp16,
the residual add included), so an overflow on a V100 shows up as non-finite logits.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from fp16_headroom_helpers import forward_logits, overflow_checkpoint
from transformers import AutoTokenizer

from onecat.errors import OnecatError
from onecat.formats.fp16_headroom import (
    CONFIG_KEY,
    FP16_MAX,
    TARGET,
    HeadroomPlan,
    derive_plan,
    plan_from_config,
    shift_for,
)
from onecat.pack.volta_layout import dequantize_volta, pack_volta
from onecat.runtime.fp16_audit import audit_token_ids, measure_peaks, startup_plan
from onecat.runtime.fp16_headroom import linear_shift, scale_linear, tensor_shift
from onecat.runtime.layers.linear import LinearWeights
from onecat.runtime.layers.norm import rms_norm_math
from onecat.runtime.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
LOGIT_ATOL = 0.1
"""fp16 against fp32 logits (peak ~13): observed 0.017 with the plan."""


@pytest.fixture(scope="module")
def overflow(tmp_path_factory):
    """(checkpoint, audit windows, measured peaks, logits peak, plan) of the overflow model."""
    path = overflow_checkpoint(tmp_path_factory.mktemp("fp16") / "overflow")
    windows = audit_token_ids(AutoTokenizer.from_pretrained(path), sequences=2, seqlen=128)
    layers, logits = measure_peaks(path, windows, CPU)
    return path, windows, layers, logits, derive_plan(layers, logits, source="test")


def test_audit_finds_every_overflowing_site(overflow):
    path, windows, layers, logits, plan = overflow
    assert [len(w) for w in windows] == [128, 128]
    by_layer = {layer["layer"]: layer for layer in layers}
    assert by_layer[0]["residual"] < 10 < FP16_MAX < by_layer[1]["residual"]
    assert by_layer[1]["down_in"] > TARGET and by_layer[2]["gdn_out"] > TARGET
    assert by_layer[3]["attn_out"] > TARGET and by_layer[0]["gdn_out"] < 10
    assert 1 < logits < 100
    k = plan.residual_shift
    assert by_layer[1]["residual"] * 2.0**-k <= TARGET < by_layer[1]["residual"] * 2.0 ** (1 - k)
    assert plan.mlp_shift[1] >= 1 and plan.gdn_shift[2] >= 1 and plan.attn_shift[3] >= 1
    assert plan.mlp_shift[0] == plan.gdn_shift[0] == 0 and not plan.unhandled


def test_fp16_overflows_without_the_plan_and_matches_fp32_with_it(overflow):
    path, windows, _, _, plan = overflow
    tokens = windows[0][:96]
    fp32 = forward_logits(load_model(path, CPU, torch.float32), tokens, CPU)
    assert bool(torch.isfinite(fp32).all())
    plain = forward_logits(load_model(path, CPU, torch.float16), tokens, CPU)
    assert not bool(torch.isfinite(plain).all())
    handled = forward_logits(load_model(path, CPU, torch.float16, headroom=plan), tokens, CPU)
    assert bool(torch.isfinite(handled).all())
    torch.testing.assert_close(handled, fp32, atol=LOGIT_ATOL, rtol=0)
    assert bool((handled.argmax(-1) == fp32.argmax(-1)).float().mean() > 0.95)
    # powers of two are exact: in fp32 the scaled model computes the same logits
    torch.testing.assert_close(forward_logits(load_model(path, CPU, torch.float32, headroom=plan), tokens, CPU),
                               fp32, atol=1e-5, rtol=1e-5)


def test_plan_in_config_json_is_applied_and_skips_the_audit(overflow, tmp_path):
    path, windows, _, _, plan = overflow
    config = json.loads((path / "config.json").read_text())
    assert plan_from_config(config) is None
    tokenizer = AutoTokenizer.from_pretrained(path)
    audited = startup_plan(path, tokenizer, CPU)
    assert audited is not None and audited.residual_shift >= plan.residual_shift
    assert audited.source == "start-up audit"
    planned = tmp_path / "planned"
    shutil.copytree(path, planned)
    (planned / "config.json").write_text(json.dumps({**config, CONFIG_KEY: plan.to_json()}))
    assert startup_plan(planned, tokenizer, CPU) is None  # the loader reads it
    logits = forward_logits(load_model(planned, CPU, torch.float16), windows[0][:64], CPU)
    assert bool(torch.isfinite(logits).all())


def test_shift_and_plan_json():
    assert shift_for(0.0) == shift_for(TARGET) == 0
    assert shift_for(TARGET * 1.01) == 1 and shift_for(TARGET * 4) == 2 and shift_for(TARGET * 4.01) == 3
    with pytest.raises(OnecatError, match="not finite"):
        shift_for(float("inf"))
    plan = derive_plan([
        {"layer": 0, "residual": 100.0, "down_in": TARGET * 3, "up": 1.0, "gate": TARGET * 2, "norm": 5.0},
        {"layer": 1, "residual": TARGET * 9, "gdn_out": 10.0},
    ], logits=TARGET * 1.5)
    assert (plan.residual_shift, plan.mlp_shift, plan.gdn_shift) == (4, {0: 2}, {1: 0})
    assert set(plan.unhandled) == {"layer 0 gate", "logits"}
    back = HeadroomPlan.from_json(json.loads(json.dumps(plan.to_json())), "x")
    assert (back.residual_shift, back.mlp_shift, back.gdn_shift) == (4, {0: 2}, {})
    assert plan_from_config({"text_config": {CONFIG_KEY: plan.to_json()}}).residual_shift == 4
    with pytest.raises(OnecatError, match="residual_shift"):
        HeadroomPlan.from_json({**plan.to_json(), "residual_shift": -1}, "config.json")
    with pytest.raises(OnecatError, match="mlp_shift"):
        HeadroomPlan.from_json({**plan.to_json(), "mlp_shift": {"a": 1}}, "config.json")
    with pytest.raises(OnecatError, match="version"):
        HeadroomPlan.from_json({"residual_shift": 1}, "config.json")


def test_which_tensors_the_plan_scales():
    plan = HeadroomPlan(residual_shift=3, mlp_shift={2: 1}, attn_shift={3: 2}, gdn_shift={1: 4})
    assert linear_shift(plan, "model.layers.2.mlp.down_proj") == -2
    assert linear_shift(plan, "model.layers.2.mlp.up_proj") == -1
    assert linear_shift(plan, "model.layers.2.mlp.gate_proj") == 0
    assert linear_shift(plan, "model.layers.3.self_attn.o_proj") == -1
    assert linear_shift(plan, "model.layers.3.self_attn.v_proj") == -2
    assert linear_shift(plan, "model.layers.3.self_attn.q_proj") == 0
    assert linear_shift(plan, "model.layers.1.linear_attn.out_proj") == 1
    assert linear_shift(plan, "model.layers.0.mlp.shared_expert.down_proj") == -3
    assert linear_shift(plan, "mtp.layers.0.mlp.down_proj") == linear_shift(plan, "lm_head") == 0
    assert tensor_shift(plan, "model.embed_tokens.weight") == -3
    assert tensor_shift(plan, "model.layers.1.linear_attn.norm.weight") == -4
    assert tensor_shift(plan, "model.norm.weight") == 0


def test_packed_scaling_is_exact(caplog):
    gen = torch.Generator().manual_seed(0)
    n, k, g = 64, 128, 32
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (n, k // g), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.01).half()  # scaled: still normal
    qweight, scales_zeros = pack_volta(q, zeros, scales)
    weights = LinearWeights(qweight=qweight, scales_zeros=scales_zeros, group_size=g)
    down = scale_linear(weights, -3, "test")
    assert torch.equal(down.qweight, qweight)
    assert torch.equal(dequantize_volta(down.qweight, down.scales_zeros, g),
                       dequantize_volta(qweight, scales_zeros, g) * 2.0**-3)
    up = scale_linear(weights, 3, "test")
    assert torch.equal(dequantize_volta(up.qweight, up.scales_zeros, g),
                       dequantize_volta(qweight, scales_zeros, g) * 8)
    with caplog.at_level("INFO", logger="onecat.runtime.fp16_headroom"):
        scale_linear(weights, -8, "tiny")  # 0.01 * 2^-8 is below the fp16 normal range
    assert "tiny times 2^-8" in caplog.text and "fell below the fp16 normal range" in caplog.text
    dense = torch.randn(8, 16, generator=gen).bfloat16()
    assert torch.equal(scale_linear(LinearWeights(weight=dense), -4, "t").weight, dense / 16)
    with pytest.raises(OnecatError, match="overflows"):
        scale_linear(LinearWeights(weight=torch.full((2, 2), 3e4, dtype=torch.float16)), 2, "t")


def test_scaled_norm_with_scaled_eps_is_unchanged():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, generator=gen) * 0.01  # small rows: eps matters
    w = torch.randn(64, generator=gen) * 0.1
    for k in (1, 4, 9):
        c = 2.0**-k
        assert torch.equal(rms_norm_math(x * c, w, 1e-6 * c * c), rms_norm_math(x, w, 1e-6))
        assert not torch.equal(rms_norm_math(x * c, w, 1e-6), rms_norm_math(x, w, 1e-6))


def test_quantize_reports_the_sites_and_pack_carries_the_plan(overflow, tmp_path, capsys):
    from onecat.pack.writer import pack_checkpoint
    from onecat.quantize.pipeline import REPORT_NAME, quantize_model
    from onecat.quantize.summary import print_summary

    path, windows, _, _, _ = overflow
    with pytest.warns(UserWarning, match="exceed the fp16 range"):
        awq = quantize_model(path, tmp_path / "awq", samples=4, seqlen=64, group_size=32, show_progress=False)
    report = json.loads((awq / REPORT_NAME).read_text())
    sites = {layer["layer"]: layer["fp16_headroom"] for layer in report["layers"]}
    assert set(sites[0]) == {"residual", "norm", "gate", "up", "down_in", "gdn_out"}
    assert set(sites[3]) == {"residual", "norm", "gate", "up", "down_in", "attn_out"}
    assert sites[0]["residual"] < 1e-3 and sites[1]["residual"] > 1 and sites[1]["down_in"] > 1 / 8
    assert sites[2]["gdn_out"] > 1 / 8 and sites[3]["attn_out"] > 1 / 8
    assert 0 < report["fp16_headroom"]["logits"] < 0.01
    plan = HeadroomPlan.from_json(report["fp16_headroom"]["plan"], "report")
    assert plan.source == "calibration" and plan.residual_shift >= 5
    assert plan.mlp_shift[1] >= 1 and plan.gdn_shift[2] >= 1 and plan.attn_shift[3] >= 1
    config = json.loads((awq / "config.json").read_text())
    assert config[CONFIG_KEY] == report["fp16_headroom"]["plan"]
    print_summary(report, awq)
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps at the terminal width
    assert "fp16" in printed and "residual stream x 2^-" in printed and "logits" in printed

    packed = pack_checkpoint(awq, tmp_path / "packed", show_progress=False)
    assert json.loads((packed / "config.json").read_text())[CONFIG_KEY] == config[CONFIG_KEY]
    tokens = windows[1][:64]
    fp32 = forward_logits(load_model(packed, CPU, torch.float32, headroom=HeadroomPlan()), tokens, CPU)
    plain = forward_logits(load_model(packed, CPU, torch.float16, headroom=HeadroomPlan()), tokens, CPU)
    assert not bool(torch.isfinite(plain).all())
    handled = forward_logits(load_model(packed, CPU, torch.float16), tokens, CPU)  # the plan from config.json
    torch.testing.assert_close(handled, fp32, atol=LOGIT_ATOL, rtol=0)
