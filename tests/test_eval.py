"""`onecat eval`: perplexity of fp checkpoints and AutoAWQ GEMM artifacts, and its errors."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from onecat.cli import main
from onecat.errors import OnecatError
from onecat.formats.awq_gemm import pack_awq_gemm
from onecat.quantize import evaluate as ev
from onecat.quantize.awq_reader import read_awq_float_tensors
from onecat.quantize.calibration import pydoc_text
from onecat.tiny import build_tiny_model

GROUP = 32
# Linears the test's round-to-nearest quantizes: 2-D weights inside decoder layers
# (norms, conv, router, shared_expert_gate and the tiny in_proj_a/b stay float).
QUANTIZED = re.compile(
    r"layers\.\d+\.(self_attn\.(q|k|v|o)_proj|linear_attn\.(in_proj_qkv|in_proj_z|out_proj)"
    r"|mlp\.(shared_expert\.)?(gate|up|down)_proj)\.weight$"
)
FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


@pytest.fixture(scope="module")
def tiny_dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("qwen3_5", tmp_path_factory.mktemp("tiny") / "qwen3_5", num_layers=4)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("qwen3_5_moe", tmp_path_factory.mktemp("tiny") / "moe", num_layers=4)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "eval.txt"
    path.write_text(pydoc_text()[50_000:70_000], encoding="utf-8")
    return path


def reference_ppl(model: torch.nn.Module, tokenizer, text: str, tokens: int, ctx: int) -> float:
    """Independent perplexity: transformers' own loss (labels = inputs), mean over windows."""
    ids = tokenizer(text, return_tensors="pt")["input_ids"][0][:tokens]
    losses = []
    with torch.no_grad():
        for w in range(tokens // ctx):
            window = ids[w * ctx : (w + 1) * ctx][None]
            losses.append(model(input_ids=window, labels=window).loss.item())
    return math.exp(sum(losses) / len(losses))


def rtn(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric 4-bit of weight [N, K]: (q, zeros, scales) as the
    quantized-integers contract states them."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group, group)
    wmax, wmin = w.amax(-1), w.amin(-1)
    scales = ((wmax - wmin).clamp(min=1e-5) / 15).half()
    s = scales.float()
    zeros = (-torch.round(wmin / s)).clamp(0, 15)
    q = (torch.round(w / s[..., None]) + zeros[..., None]).clamp(0, 15)
    return q.reshape(n, k).to(torch.uint8), zeros.to(torch.uint8), scales


def dequant(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // zeros.shape[1]
    z = zeros.float().repeat_interleave(group, 1)
    return (q.float() - z) * scales.float().repeat_interleave(group, 1)


def write_rtn_artifact(src: Path, out: Path) -> dict[str, torch.Tensor]:
    """Quantize ``src`` to an AutoAWQ GEMM artifact with round-to-nearest, splitting fused
    experts per expert; returns the expected float weights by checkpoint key."""
    out.mkdir()
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(shard))
    linears: dict[str, torch.Tensor] = {}
    kept: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        fused = FUSED.match(name)
        if fused and fused[2] == "gate_up_proj":
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                linears[f"{fused[1]}.{e}.gate_proj"] = t[e, :half]
                linears[f"{fused[1]}.{e}.up_proj"] = t[e, half:]
        elif fused:
            for e in range(t.shape[0]):
                linears[f"{fused[1]}.{e}.down_proj"] = t[e]
        elif QUANTIZED.search(name):
            linears[name.removesuffix(".weight")] = t
        else:
            kept[name] = t
    expected = {}
    for prefix, weight in linears.items():
        q, z, s = rtn(weight, GROUP)
        for part, packed in pack_awq_gemm(q, z, s).items():
            kept[f"{prefix}.{part}"] = packed
        expected[prefix] = dequant(q, z, s)
    save_file({k: v.contiguous() for k, v in kept.items()}, out / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": GROUP,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": ["mtp", "visual"],
    }
    (out / "config.json").write_text(json.dumps(config))
    for side in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / side).exists():
            shutil.copy(src / side, out / side)
    return expected


def test_fp_perplexity_equals_transformers_loss(tiny_dense: Path, text_file: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = ev.evaluate(tiny_dense, str(text_file), tokens=300, ctx=64, show_progress=False)
    assert (result.tokens, result.windows, result.ctx) == (256, 4, 64)
    model = AutoModelForCausalLM.from_pretrained(tiny_dense, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dense)
    expected = reference_ppl(model, tokenizer, text_file.read_text(), 256, 64)
    assert result.ppl == pytest.approx(expected, rel=1e-5)
    # A random tiny model is close to uniform over its 512-token vocabulary.
    assert 100 < result.ppl < 5000


def test_awq_moe_artifact_evaluates_as_its_dequantised_weights(
    tiny_moe: Path, text_file: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    artifact = tmp_path / "awq"
    expected = write_rtn_artifact(tiny_moe, artifact)

    # The reader dequantises every linear and fuses the per-expert ones back to 3-D.
    floats = read_awq_float_tensors(artifact)
    experts = "model.language_model.layers.0.mlp.experts"
    gate_up = torch.cat([expected[f"{experts}.3.gate_proj"], expected[f"{experts}.3.up_proj"]])
    assert torch.equal(floats[f"{experts}.gate_up_proj"][3], gate_up)
    assert torch.equal(floats[f"{experts}.down_proj"][7], expected[f"{experts}.7.down_proj"])
    q_proj = "model.language_model.layers.3.self_attn.q_proj"
    assert torch.equal(floats[f"{q_proj}.weight"], expected[q_proj])
    assert not any(k.endswith(("qweight", "qzeros", "scales")) for k in floats)

    # Independent model: the fp checkpoint with the RTN weights put in by hand.
    model = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for prefix, weight in expected.items():
            local = prefix.replace("model.language_model.", "model.")
            m = re.match(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj$", local)
            if m is None:
                params[f"{local}.weight"].copy_(weight)
            elif m[3] == "down":
                params[f"{m[1]}.down_proj"][int(m[2])].copy_(weight)
            else:
                rows = weight.shape[0]
                start = 0 if m[3] == "gate" else rows
                params[f"{m[1]}.gate_up_proj"][int(m[2]), start : start + rows].copy_(weight)
    tokenizer = AutoTokenizer.from_pretrained(tiny_moe)
    want = reference_ppl(model, tokenizer, text_file.read_text(), 128, 64)

    got = ev.evaluate(artifact, str(text_file), tokens=128, ctx=64, show_progress=False)
    fp = ev.evaluate(tiny_moe, str(text_file), tokens=128, ctx=64, show_progress=False)
    assert got.ppl == pytest.approx(want, rel=1e-5)
    assert got.ppl != pytest.approx(fp.ppl, rel=1e-4), "quantization changed nothing"


def test_cli_eval_prints_result(tiny_dense: Path, text_file: Path) -> None:
    result = CliRunner().invoke(
        main, ["eval", str(tiny_dense), "--text", str(text_file), "--tokens", "128", "--ctx", "64"]
    )
    assert result.exit_code == 0, result.output
    assert re.search(r"perplexity \d+\.\d+ .*128 tokens, 2 windows of 64", result.output)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--text", "{tmp}/missing.txt"], "missing.txt"),
        (["--text", "{text}", "--tokens", "1000000"], "fewer than --tokens 1000000"),
        (["--text", "builtin:nothing"], "unknown text source"),
        (["--text", "{text}", "--tokens", "32", "--ctx", "64"], "smaller than one window"),
        (["--text", "{text}", "--tokens", "4096", "--ctx", "4096"], "max_position_embeddings"),
    ],
)
def test_cli_eval_bad_input(
    tiny_dense: Path, text_file: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    args = [a.format(tmp=tmp_path, text=text_file) for a in args]
    result = CliRunner().invoke(main, ["eval", str(tiny_dense), *args])
    assert result.exit_code == 1
    assert message in result.output


def test_cli_eval_missing_model(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["eval", str(tmp_path / "nowhere")])
    assert result.exit_code == 1
    assert "nowhere" in result.output


def test_empty_text_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(OnecatError, match="empty"):
        ev.load_text(str(empty))


def test_jargon_missing_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(ev, "JARGON_PATHS", (tmp_path / "jargon.txt.gz",))
    with pytest.raises(OnecatError, match="apt-get install jargon-text"):
        ev.load_text("builtin:jargon")


def test_jargon_glossary_body_starts_at_first_entry() -> None:
    try:
        text = ev.load_text("builtin:jargon")
    except OnecatError as exc:
        pytest.skip(str(exc))
    assert text.startswith(":0:")
    assert len(text) > 1_000_000


def test_artifact_with_missing_awq_part_is_rejected(tiny_moe: Path, tmp_path: Path) -> None:
    artifact = tmp_path / "awq"
    write_rtn_artifact(tiny_moe, artifact)
    tensors = load_file(artifact / "model.safetensors")
    del tensors["model.language_model.layers.3.self_attn.o_proj.scales"]
    save_file(tensors, artifact / "model.safetensors")
    with pytest.raises(OnecatError, match="o_proj has a qweight but no scales"):
        read_awq_float_tensors(artifact)


def test_quantizer_rtn_artifact_evaluates(tiny_moe: Path, text_file: Path, tmp_path: Path) -> None:
    from onecat.quantize.pipeline import quantize_rtn

    artifact = quantize_rtn(tiny_moe, tmp_path / "rtn", group_size=GROUP, show_progress=False)
    got = ev.evaluate(artifact, str(text_file), tokens=128, ctx=64, show_progress=False)
    fp = ev.evaluate(tiny_moe, str(text_file), tokens=128, ctx=64, show_progress=False)
    assert math.isfinite(got.ppl)
    assert got.ppl != pytest.approx(fp.ppl, rel=1e-4), "the artifact evaluated as the fp model"
    assert got.ppl == pytest.approx(fp.ppl, rel=0.1)
