"""The GPTQ stage (``method: awq+gptq``): the rounding routine on its own, its integers in the
AutoAWQ GEMM format through the writer and ``onecat pack``'s reader, the plain-rounding
fallback for linears with too few calibration rows, and recipe / flag validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from onecat.errors import OnecatError
from onecat.formats.awq_gemm import decode_awq_gemm, pack_awq_gemm
from onecat.formats.checkpoint import Checkpoint
from onecat.formats.files import read_json
from onecat.formats.integers import dequantize, quantize_groups
from onecat.formats.quant_config import detect_source_format
from onecat.formats.quantized_linears import find_quantized_linears, read_quantized_linear
from onecat.quantize import gptq
from onecat.quantize.gptq import (
    activation_order,
    add_to_hessian,
    best_range,
    damped_inverse_factor,
    enough_rows,
    error_product_target,
    gptq_quantize,
    gptq_round,
    input_error_target,
    inverse_hessian_factor,
    permute_hessian,
    refit_scales,
    smoothed_hessian,
    unpermute_hessian,
)
from onecat.quantize.layer_search import gptq_stages
from onecat.quantize.pipeline import REPORT_NAME, quantize_model
from onecat.quantize.recipe import METHODS, load_recipe, shipped_recipes
from onecat.tiny import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

CALIB = dict(samples=4, seqlen=64, group_size=32, show_progress=False)


def hessian_from_factor(upper: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: the damped Hessian ``H = (U^T U)^-1`` back from the factor of
    :func:`inverse_hessian_factor` (``upper [..., K, K]``), in the original column order when
    ``order [..., K]`` (act order) permuted it. float32, computed in float64."""
    u = upper.double()
    h = torch.linalg.inv(u.transpose(-1, -2) @ u).float()
    if order is None:
        return h
    back = torch.argsort(order, dim=-1)
    h = h.gather(-2, back.unsqueeze(-1).expand_as(h))
    return h.gather(-1, back.unsqueeze(-2).expand_as(h))


def correlated_inputs(tokens: int, k: int, rank: int, seed: int) -> torch.Tensor:
    """Activations with a low-rank structure plus noise and a few large channels, as real
    linears see them (GPTQ's gain comes from the off-diagonal of X^T X)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, rank, generator=g) @ torch.randn(rank, k, generator=g)
    x += 0.1 * torch.randn(tokens, k, generator=g)
    x[:, :4] *= 8.0
    return x


def output_mse(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor) -> float:
    return float((x @ (wq - w).t()).pow(2).mean())


# ---- the routine -----------------------------------------------------------------------------


@pytest.mark.parametrize("group,block", [(32, 128), (64, 64), (128, 32)])
def test_gptq_lowers_output_error_against_rtn(group: int, block: int) -> None:
    n, k = 96, 256
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
    x = correlated_inputs(1024, k, rank=24, seed=1)
    h = add_to_hessian(None, x) / x.shape[0]
    q, z, s = gptq_quantize(w, h, group, block_size=block)
    gptq = output_mse(x, w, dequantize(q, z, s))
    rtn = output_mse(x, w, dequantize(*quantize_groups(w, group)))
    # measured: GPTQ leaves about 2.6% of RTN's output error on these inputs
    assert gptq < 0.25 * rtn, (gptq, rtn)


def test_scale_refit_lowers_the_damped_objective_and_keeps_the_codes() -> None:
    """The refit scales minimise the damped Hessian's objective for GPTQ's codes: it drops
    (and so does the undamped output error here), the scales stay fp16-representable and
    positive, and a row whose normal equations are singular (all codes equal the zero
    point) keeps GPTQ's scales."""
    n, k, group = 64, 256, 64
    w = torch.randn(1, n, k, generator=torch.Generator().manual_seed(2))
    x = correlated_inputs(1024, k, rank=24, seed=3)
    h = add_to_hessian(None, x) / x.shape[0]
    upper, dead = inverse_hessian_factor(h, 0.1)
    damped = hessian_from_factor(upper[None])
    q, z, s = gptq_round(w, upper[None], dead[None], group)
    q[0, 0] = z[0, 0].repeat_interleave(group)  # a row of all-zero codes: a singular system
    refit = refit_scales(w, damped, q, z, s, group, chunk_elements=5 * k)  # several row chunks

    def objective(scales, hess):  # rows 1.. (row 0's error is its whole weight)
        err = w - (q.float() - z.float().repeat_interleave(group, -1)) * scales.repeat_interleave(group, -1)
        return float(torch.einsum("bnk,bkl,bnl->", err[:, 1:], hess, err[:, 1:]))

    assert objective(refit, damped) < 0.98 * objective(s, damped)
    after, before = (output_mse(x, w[0, 1:], dequantize(q[0, 1:], z[0, 1:], sc[0, 1:])) for sc in (refit, s))
    assert after < before
    assert torch.equal(refit[0, 0], s[0, 0])
    assert (refit > 0).all() and torch.equal(refit, refit.half().float())


def test_hessian_from_factor_undoes_the_damped_factorisation_and_act_order() -> None:
    x = correlated_inputs(512, 64, rank=8, seed=4)
    h = add_to_hessian(None, x) / x.shape[0]
    damped = h + 0.1 * h.diagonal().mean() * torch.eye(64)
    order = activation_order(h)
    plain, _ = inverse_hessian_factor(h, 0.1)
    permuted, _ = inverse_hessian_factor(permute_hessian(h, order), 0.1)
    for got in (hessian_from_factor(plain), hessian_from_factor(permuted, order)):
        assert torch.allclose(got, damped, rtol=1e-4, atol=1e-4 * float(damped.abs().max()))


def test_damped_inverse_factor_keeps_the_damped_hessian_in_place() -> None:
    """The in-place variant gives inverse_hessian_factor's factor bit for bit, and the damped
    Hessian it returns (its own input, dead channel and damping raised until the factorisation
    succeeded) is what hessian_from_factor recomputes from the factor, within float rounding."""
    x = correlated_inputs(512, 64, rank=8, seed=5)
    x[:, 7] = 0.0  # a dead channel
    h = add_to_hessian(None, x) / x.shape[0]
    order = activation_order(h)
    for source, back in ((h, None), (permute_hessian(h, order), order)):
        upper, dead = inverse_hessian_factor(source, 0.1)
        work = source.clone()
        upper2, dead2, damped = damped_inverse_factor(work, 0.1)
        assert damped.data_ptr() == work.data_ptr()
        assert torch.equal(upper2, upper) and torch.equal(dead2, dead)
        expected = hessian_from_factor(upper) if back is None else hessian_from_factor(upper, back)
        got = damped if back is None else unpermute_hessian(damped, back)
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    assert torch.equal(unpermute_hessian(permute_hessian(h, order), order), h)
    with pytest.raises(TypeError):
        damped_inverse_factor(h.double(), 0.1)


def test_error_product_target_matches_input_error_target_and_restores_the_hessian() -> None:
    k, n, t = 96, 40, 1024
    x = correlated_inputs(t, k, 12, 21)
    g = torch.Generator().manual_seed(22)
    xq = x + 0.05 * torch.randn(t, k, generator=g)
    w = torch.randn(n, k, generator=g)
    h = add_to_hessian(None, xq) / t
    delta = (x - xq).t() @ xq / t
    before = h.clone()
    got = error_product_target(w, h, w @ delta, 0.5)
    assert torch.equal(h, before)  # damped for the solve, diagonal restored exactly
    damped = h + 0.5 * h.diagonal().mean() * torch.eye(k)
    expected = w.double() + w.double() @ delta.double() @ torch.linalg.inv(damped.double())
    assert torch.allclose(got.double(), expected, rtol=1e-4, atol=1e-4 * float((expected - w).abs().max()))
    assert torch.allclose(input_error_target(w, h, delta, 0.5), got, rtol=0, atol=1e-6 * float(w.abs().max()))
    assert torch.equal(error_product_target(w, torch.zeros(k, k), w @ delta, 0.5), w)  # nothing to solve against


def test_gptq_integers_are_valid_and_match_their_dequantization() -> None:
    n, k, g = 64, 192, 64
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(2)) * 0.02
    h = add_to_hessian(None, correlated_inputs(512, k, rank=16, seed=3))
    q, z, s = gptq_quantize(w, h, g)
    assert q.dtype == torch.uint8 and z.dtype == torch.uint8 and int(q.max()) <= 15 and int(z.max()) <= 15
    assert q.shape == (n, k) and z.shape == s.shape == (n, k // g)
    assert torch.equal(s.half().float(), s) and bool((s > 0).all())
    # no group collapses to a single level
    assert bool((q.reshape(n, k // g, g).amax(-1) > q.reshape(n, k // g, g).amin(-1)).all())


@pytest.mark.parametrize("block", [64, 128])
def test_act_order_with_static_groups(block: int) -> None:
    """Columns rounded by decreasing Hessian diagonal, groups kept in the original order with
    their ranges from W: with an identity Hessian that is plain rounding, integer for integer;
    on correlated inputs it compensates as well as the in-order pass."""
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(8))
    q, z, s = gptq_quantize(w, torch.eye(256), 64, damp=0.01, act_order=True, block_size=block)
    rq, rz, rs = quantize_groups(w, 64)
    assert torch.equal(q, rq) and torch.equal(z, rz) and torch.equal(s, rs)
    x = correlated_inputs(1024, 256, rank=24, seed=9)
    h = add_to_hessian(None, x) / x.shape[0]
    ordered = output_mse(x, w, dequantize(*gptq_quantize(w, h, 64, act_order=True, block_size=block)))
    rtn = output_mse(x, w, dequantize(rq, rz, rs))
    assert ordered < 0.25 * rtn, (ordered, rtn)


def test_identity_hessian_is_plain_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    """With uncorrelated, equal-variance inputs nothing can be compensated: GPTQ with the
    plain range (``RANGE_GRID = (1.0,)``) == RTN; with the range search, no group's rounding
    error exceeds RTN's, and some are lower."""
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(4))
    rq, rz, rs = quantize_groups(w, 32)
    searched = gptq_quantize(w, torch.eye(128), 32, damp=0.01)
    monkeypatch.setattr(gptq, "RANGE_GRID", (1.0,))
    q, z, s = gptq_quantize(w, torch.eye(128), 32, damp=0.01)
    assert torch.equal(q, rq) and torch.equal(z, rz) and torch.equal(s, rs)

    def group_errors(ints):
        return (dequantize(*ints) - w).pow(2).view(32, 4, 32).sum(-1)

    plain, better = group_errors((rq, rz, rs)), group_errors(searched)
    assert bool((better <= plain * (1 + 1e-5)).all()) and bool((better < plain).any())


def test_best_range_weights_the_columns() -> None:
    """A group whose one outlier column costs nothing keeps a range fitted to the others; when
    that column costs the most, the range covers it."""
    part = torch.tensor([[0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 3.0]])
    cheap = torch.tensor([1.0] * 7 + [1e-6])
    dear = torch.tensor([1e-6] * 7 + [1.0])
    s_cheap, _ = best_range(part, (1.0, 0.5, 0.25), cheap)
    s_dear, _ = best_range(part, (1.0, 0.5, 0.25), dear)
    assert float(s_cheap) < float(s_dear)
    assert torch.allclose(s_dear, torch.tensor([3.0 / 15]).half().float())


def test_dead_channels_and_smoothed_hessian() -> None:
    x = correlated_inputs(256, 64, rank=8, seed=5)
    x[:, 7] = 0.0
    s = torch.rand(64, generator=torch.Generator().manual_seed(6)) + 0.5
    h = add_to_hessian(None, x)
    torch.testing.assert_close(smoothed_hessian(h, s), add_to_hessian(None, x / s), rtol=1e-4, atol=1e-3)
    upper, dead = inverse_hessian_factor(h, 0.01)
    assert dead.nonzero().flatten().tolist() == [7] and bool(torch.isfinite(upper).all())
    q, z, s_ = gptq_quantize(torch.randn(16, 64), h, 32)
    assert not bool(dequantize(q, z, s_)[:, 7].any())  # a channel that is always 0 gets weight 0


def test_enough_rows_threshold() -> None:
    assert enough_rows(128, 512) and not enough_rows(127, 512) and not enough_rows(0, 0)


def test_writer_round_trip_of_gptq_integers() -> None:
    n, k, g = 64, 256, 128
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(7))
    q, z, s = gptq_quantize(w, add_to_hessian(None, correlated_inputs(512, k, 16, 8)), g)
    packed = pack_awq_gemm(q, z, s)
    dq, dz, ds = decode_awq_gemm(packed["qweight"], packed["qzeros"], packed["scales"])
    assert torch.equal(dq.to(torch.uint8), q) and torch.equal(dz.to(torch.uint8), z)
    assert torch.equal(ds.float(), s)


def test_input_error_target_is_the_least_squares_target() -> None:
    """W' minimises || X W^T - X~ W'^T || (undamped), is W when X~ = X, and GPTQ of W' under
    X~'s Hessian matches the full-precision outputs better than GPTQ of W."""
    k, n, t = 64, 48, 2048
    x = correlated_inputs(t, k, 16, 11)
    g = torch.Generator().manual_seed(12)
    # the inputs through an earlier quantized linear: a linear distortion plus a little noise
    xq = x @ (torch.eye(k) + 0.1 * torch.randn(k, k, generator=g) / k**0.5) + 0.01 * torch.randn(t, k, generator=g)
    w = torch.randn(n, k, generator=g)
    h = add_to_hessian(None, xq) / t
    delta = (x - xq).t() @ xq / t
    target = input_error_target(w, h, delta, 1e-9)
    expected = torch.linalg.lstsq(xq.double(), (x @ w.t()).double()).solution.t()
    assert torch.allclose(target.double(), expected, rtol=1e-3, atol=1e-3 * float(expected.abs().max()))
    same = input_error_target(w, add_to_hessian(None, x) / t, torch.zeros(k, k), 0.5)
    assert torch.equal(same, w)

    def error(wq: torch.Tensor) -> float:
        return float((x @ w.t() - xq @ wq.t()).pow(2).mean())

    plain = error(dequantize(*gptq_quantize(w, h, 32)))
    corrected = error(dequantize(*gptq_quantize(input_error_target(w, h, delta, 0.5), h, 32)))
    assert corrected < 0.7 * plain, (corrected, plain)


def test_gptq_stages_open_at_recomputed_inputs() -> None:
    keys = ["self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.experts.0.down_proj", "mlp.down_proj"]
    recomputed = {"self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"}
    assert gptq_stages(keys, recomputed) == [["self_attn.q_proj"], ["self_attn.o_proj"],
                                             ["mlp.gate_proj", "mlp.experts.0.down_proj"], ["mlp.down_proj"]]
    assert gptq_stages(keys[3:4] + keys[:1], recomputed) == [["mlp.experts.0.down_proj"], ["self_attn.q_proj"]]


# ---- in the pipeline -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"), num_layers=2)


def test_awq_gptq_artifact_reads_back_through_pack_reader(tiny_llama: Path, tmp_path: Path) -> None:
    out = quantize_model(tiny_llama, tmp_path / "gptq", method="awq+gptq", **CALIB)
    config = read_json(out / "config.json")
    assert config["quantization_config"]["version"] == "gemm"
    report = json.loads((out / REPORT_NAME).read_text())
    assert report["method"] == "awq+gptq" and report["gptq"] == {"damp": 0.5, "block_size": 128}
    rtn = sum(layer["output_mse_rtn"] for layer in report["layers"])
    awq = sum(layer["output_mse_awq"] for layer in report["layers"])
    gptq = sum(layer["output_mse_gptq"] for layer in report["layers"])
    # measured on this model: awq (smoothing, no clip under awq+gptq) 0.93 x rtn, gptq 0.16 x rtn
    assert gptq < 0.5 * awq and awq < rtn, (rtn, awq, gptq)
    for layer in report["layers"]:
        assert layer["gptq"] == {"linears": 7, "fallback_rtn": {}}

    ckpt = Checkpoint(out)
    fmt = detect_source_format(config)
    linears = find_quantized_linears(ckpt, fmt)
    assert len(linears) == 14
    for prefix in linears:
        q, z, s = read_quantized_linear(ckpt, fmt, prefix)
        assert int(q.max()) <= 15 and int(z.max()) <= 15 and s.dtype == torch.float16
        assert bool(torch.isfinite(dequantize(q, z, s)).all())


def test_sequential_inputs_lower_the_layer_error(tiny_llama: Path, tmp_path: Path) -> None:
    """``gptq.sequential`` (recomputed inputs, corrected targets) leaves less layer-output
    error than every linear against the full-precision inputs of the calibration pass."""
    errors = {}
    for sequential in (False, True):
        recipe = _recipe(tmp_path, lambda d, s=sequential: d["gptq"].update(sequential=s))
        out = quantize_model(tiny_llama, tmp_path / f"seq{sequential}", recipe=recipe, method="awq+gptq",
                             overwrite=True, **CALIB)
        report = json.loads((out / REPORT_NAME).read_text())
        errors[sequential] = sum(layer["output_mse_gptq"] for layer in report["layers"])
    assert errors[True] < 0.95 * errors[False], errors


def test_tiny_calibration_experts_fall_back_to_plain_rounding(tmp_path: Path) -> None:
    """An expert that sees fewer than K/4 calibration rows is rounded plainly and named."""
    src = build_tiny_model("qwen3_5_moe", tmp_path / "moe", num_layers=2)
    data = yaml.safe_load(shipped_recipes()["qwen3_5_moe"].read_text())
    data["search"]["clip_tokens"] = 8  # each expert runs on an 8-token sample; down_proj K = 64
    recipe = tmp_path / "few_expert_tokens.yaml"
    recipe.write_text(yaml.safe_dump(data))
    out = quantize_model(src, tmp_path / "gptq", recipe=recipe, method="awq+gptq", **CALIB)
    report = json.loads((out / REPORT_NAME).read_text())
    for layer in report["layers"]:
        fallback = layer["gptq"]["fallback_rtn"]
        assert sorted(fallback) == sorted(f"mlp.experts.{e}.down_proj" for e in range(8)), fallback
        assert all("calibration rows for 64 in-features" in why for why in fallback.values())
        assert layer["gptq"]["linears"] > 0  # attention / GDN / shared expert / expert gate+up
        assert layer["output_mse_gptq"] < layer["output_mse_rtn"]
    ckpt = Checkpoint(out)
    fmt = detect_source_format(read_json(out / "config.json"))
    assert any(p.endswith("experts.7.down_proj") for p in find_quantized_linears(ckpt, fmt))


# ---- validation ------------------------------------------------------------------------------


def _recipe(tmp_path: Path, edit) -> Path:
    data = yaml.safe_load(shipped_recipes()["llama"].read_text())
    edit(data)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    "edit,expected",
    [
        (lambda d: d.update(method="gptq"), ["'method'", "'gptq'", "awq, awq+gptq"]),
        (lambda d: d.update(gptq={"damp": 1.5}), ["gptq.damp", "(0, 1)"]),
        (lambda d: d.update(gptq={"block_size": 0}), ["gptq.block_size", "positive"]),
        (lambda d: d.update(gptq={"act_order": "yes"}), ["gptq.act_order"]),
        (lambda d: d.update(gptq={"sequential": 1}), ["gptq.sequential"]),
        (lambda d: d.update(gptq={"static_groups": True}), ["gptq.static_groups", "not a known field"]),
    ],
)
def test_recipe_gptq_fields_are_validated(tmp_path: Path, edit, expected) -> None:
    path = _recipe(tmp_path, edit)
    with pytest.raises(OnecatError) as err:
        load_recipe(path)
    for part in [str(path), *expected]:
        assert part in str(err.value), str(err.value)


def test_recipe_method_and_settings(tmp_path: Path) -> None:
    rcp = load_recipe(_recipe(tmp_path, lambda d: d.update(method="awq+gptq",
                                                           gptq={"damp": 0.05, "block_size": 64, "act_order": True})))
    assert rcp.method == "awq+gptq" and rcp.gptq.damp == 0.05 and rcp.gptq.block_size == 64 and rcp.gptq.act_order
    assert rcp.gptq.sequential and not load_recipe(_recipe(tmp_path, lambda d: d.update(
        gptq={"sequential": False}))).gptq.sequential
    for path in shipped_recipes().values():
        assert load_recipe(path).method in METHODS


def test_method_flag_overrides_recipe_and_is_validated(tiny_llama: Path, tmp_path: Path) -> None:
    from onecat.cli import main

    with pytest.raises(OnecatError, match="--method 'gptq'.*awq, awq\\+gptq"):
        quantize_model(tiny_llama, tmp_path / "x", method="gptq", **CALIB)
    recipe = _recipe(tmp_path, lambda d: d.update(method="awq+gptq"))
    out = quantize_model(tiny_llama, tmp_path / "awq", recipe=recipe, method="awq", **CALIB)
    report = json.loads((out / REPORT_NAME).read_text())
    assert report["method"] == "awq" and "output_mse_gptq" not in report["layers"][0]

    runner = CliRunner()
    bad = runner.invoke(main, ["quantize", str(tiny_llama), "--out", str(tmp_path / "c"), "--method", "gptq"])
    assert bad.exit_code != 0 and "awq+gptq" in bad.output
    rtn = runner.invoke(main, ["quantize", str(tiny_llama), "--out", str(tmp_path / "c"), "--rtn",
                               "--method", "awq+gptq"])
    assert rtn.exit_code == 1 and "--method" in rtn.output


def test_batched_and_row_sliced_gptq_gives_the_same_artifact(tmp_path: Path, monkeypatch) -> None:
    """Experts' down_proj batched, shared-input linears stacked, both cut into row slices
    under a small budget: rows are independent given their Hessian, so the bytes match."""
    from onecat.quantize import layer_search

    src = build_tiny_model("qwen3_5_moe", tmp_path / "moe", num_layers=1)
    whole = quantize_model(src, tmp_path / "whole", method="awq+gptq", **CALIB)
    monkeypatch.setattr(layer_search, "GPTQ_BATCH_BYTES", 300_000)
    sliced = quantize_model(src, tmp_path / "sliced", method="awq+gptq", **CALIB)
    shards = sorted(p.name for p in whole.glob("*.safetensors"))
    assert shards == sorted(p.name for p in sliced.glob("*.safetensors"))
    for shard in shards:
        assert (whole / shard).read_bytes() == (sliced / shard).read_bytes(), shard
