"""`onecat pack` end to end on small synthetic checkpoints with the real Qwen3.5 key layout:
AutoAWQ GEMM and compressed-tensors inputs, mixed checkpoints, the artifact reader's checks,
the bit-exact way back to AWQ, atomic output, and the CLI."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from onecat.cli import main as cli_main
from onecat.errors import OnecatError
from onecat.formats.awq_gemm import decode_awq_gemm, pack_awq_gemm
from onecat.formats.checkpoint import Checkpoint
from onecat.formats.staging import copy_side_files
from onecat.pack.artifact import open_packed
from onecat.pack.unpack import unpack_artifact
from onecat.pack.volta_layout import dequantize_volta, unpack_volta
from onecat.pack.writer import pack_checkpoint
from onecat.tiny import build_tiny_model

LINEAR = re.compile(r"\.(\w+_proj|in_proj_\w+|out_proj)$")
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")


# --- synthetic quantized checkpoints ---------------------------------------------------------


def quantize_asymmetric(w: torch.Tensor, g: int):
    """AutoAWQ's min/max asymmetric quantizer: (q, z, s) in onecat's unsigned convention."""
    n, k = w.shape
    wg = w.float().reshape(n, k // g, g)
    lo, hi = wg.amin(-1), wg.amax(-1)
    s = ((hi - lo).clamp(min=1e-5) / 15).half()
    z = (-torch.round(lo / s.float())).clamp(0, 15)
    q = (torch.round(wg / s.float()[..., None]) + z[..., None]).clamp(0, 15)
    return q.reshape(n, k).to(torch.uint8), z.to(torch.uint8), s


def quantize_symmetric(w: torch.Tensor, g: int):
    """Symmetric int4 (llm-compressor style): signed q in -8..7, scale max|w| / 7."""
    n, k = w.shape
    wg = w.float().reshape(n, k // g, g)
    s = (wg.abs().amax(-1).clamp(min=1e-5) / 7).half()
    q_signed = torch.round(wg / s.float()[..., None]).clamp(-8, 7)
    return q_signed.reshape(n, k).to(torch.int8), s


def pack_sequential(values: torch.Tensor) -> torch.Tensor:
    """compressed-tensors packing, written independently: uint values [R, C] -> int32 [R, C/8],
    value 8c + i in bits 4i..4i+3 of word c."""
    v = values.to(torch.int64).reshape(values.shape[0], -1, 8)
    word = sum((v[:, :, i] & 0xF) << (4 * i) for i in range(8))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def source_linears(src: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split a tiny checkpoint into 2-D linear weights by prefix (fused experts split per
    expert, as hub AWQ checkpoints store them) and all other tensors."""
    ckpt = Checkpoint(src)
    linears, others = {}, {}
    for name in ckpt.names():
        t = ckpt.get(name)
        if name.endswith("mlp.experts.gate_up_proj"):
            base, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                linears[f"{base}{e}.gate_proj"] = t[e, :inter]
                linears[f"{base}{e}.up_proj"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                linears[f"{base}{e}.down_proj"] = t[e]
        elif name.endswith(".weight") and LINEAR.search(name[: -len(".weight")]) and "layers." in name:
            linears[name[: -len(".weight")]] = t
        else:
            others[name] = t
    return linears, others


def write_checkpoint(
    src: Path,
    out: Path,
    *,
    kind: str,
    g: int,
    symmetric: bool = False,
    keep_fp16=lambda prefix: False,
    bias_for=lambda prefix: prefix.endswith("k_proj"),
) -> dict[str, tuple]:
    """Write a quantized copy of ``src`` in ``kind`` ("awq" / "ct") format; returns the
    integers written per quantized prefix: (q, z, s) unsigned (z = 8 when symmetric)."""
    out.mkdir(parents=True)
    linears, tensors = source_linears(src)
    gen = torch.Generator().manual_seed(g)
    written, skipped = {}, []
    for prefix, w in linears.items():
        if bias_for(prefix):
            tensors[f"{prefix}.bias"] = torch.randn(w.shape[0], generator=gen).half()
        # AWQ GEMM cannot store N % 8 != 0 (in_proj_a / in_proj_b here): tools keep those fp16
        if keep_fp16(prefix) or w.shape[1] % g or (kind == "awq" and w.shape[0] % 8):
            tensors[f"{prefix}.weight"] = w.clone()
            skipped.append(prefix)
            continue
        if kind == "awq":
            q, z, s = quantize_asymmetric(w, g)
            for part, t in pack_awq_gemm(q, z, s).items():
                tensors[f"{prefix}.{part}"] = t
        elif symmetric:
            q_signed, s = quantize_symmetric(w, g)
            s = s.to(torch.bfloat16).half()  # stored as bf16 below, exactly representable
            q = (q_signed.to(torch.int16) + 8).to(torch.uint8)
            z = torch.full(s.shape, 8, dtype=torch.uint8)
            tensors[f"{prefix}.weight_packed"] = pack_sequential(q)
            tensors[f"{prefix}.weight_scale"] = s.to(torch.bfloat16)
            tensors[f"{prefix}.weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int64)
        else:
            q, z, s = quantize_asymmetric(w, g)
            tensors[f"{prefix}.weight_packed"] = pack_sequential(q)
            tensors[f"{prefix}.weight_scale"] = s
            padded = torch.zeros(-(-z.shape[0] // 8) * 8, z.shape[1], dtype=torch.uint8)
            padded[: z.shape[0]] = z  # packed along N, padded to whole words
            tensors[f"{prefix}.weight_zero_point"] = pack_sequential(padded.t().contiguous()).t().contiguous()
            tensors[f"{prefix}.weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int64)
        written[prefix] = (q, z, s)
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n].contiguous() for n in part}, out / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    if kind == "awq":
        config["quantization_config"] = {
            "quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": ["visual", "mtp", *skipped],
        }  # fmt: skip
    else:
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "format": "pack-quantized",
                "weights": {"num_bits": 4, "type": "int", "symmetric": symmetric,
                            "group_size": g, "strategy": "group"},
            }},
            "ignore": ["lm_head", "re:.*mlp.gate$"],
        }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    copy_side_files(src, out)
    return written


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    return build_tiny_model("qwen3_5_moe", tmp_path_factory.mktemp("tiny") / "moe", num_layers=4)


def all_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, name
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), name


# --- tests ------------------------------------------------------------------------------


@pytest.mark.parametrize("g", [32, 64, 128])
def test_awq_pack_and_unpack_round_trip_bit_exact(tiny_moe, tmp_path, g):
    src = tmp_path / "awq"
    written = write_checkpoint(tiny_moe, src, kind="awq", g=g)
    packed = pack_checkpoint(src, tmp_path / "packed", show_progress=False)

    art = open_packed(packed)
    assert art.quantization["quant_method"] == "onecat"
    assert art.quantization["format"] == "volta-w4" and art.quantization["format_version"] == 1
    assert art.quantization["group_size"] == g
    assert set(art.linear_prefixes()) == set(written)
    for prefix, (q, z, s) in written.items():
        lin = art.get_linear(prefix)
        assert (lin.out_features, lin.in_features, lin.group_size) == (*q.shape, g)
        q2, z2, s2 = unpack_volta(lin.qweight, lin.scales_zeros, lin.group_size)
        assert torch.equal(q2, q) and torch.equal(z2, z) and torch.equal(s2, s), prefix
        assert (lin.bias is not None) == prefix.endswith("k_proj")
    assert (packed / "tokenizer.json").is_file() and (packed / "chat_template.jinja").is_file()
    assert not (packed / "model-mtp.safetensors").exists()  # tensors are re-sharded
    assert "mtp.fc.weight" in art.tensor_names()

    back = unpack_artifact(packed, tmp_path / "back")
    source, result = all_tensors(src), all_tensors(back)
    assert set(result) == set(source)
    for name, t in source.items():
        assert_bit_equal(result[name], t, name)
    qc = json.loads((back / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "awq" and qc["version"] == "gemm" and qc["group_size"] == g


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("g", [32, 64, 128])
def test_compressed_tensors_pack(tiny_moe, tmp_path, symmetric, g):
    src = tmp_path / "ct"
    written = write_checkpoint(tiny_moe, src, kind="ct", g=g, symmetric=symmetric)
    art = open_packed(pack_checkpoint(src, tmp_path / "packed", show_progress=False))
    narrow = {p for p, (q, _, _) in written.items() if q.shape[0] % 32}  # in_proj_a / _b
    assert set(art.linear_prefixes()) == set(written) - narrow and len(narrow) == 6
    assert "lm_head" in art.quantization["modules_to_not_convert"]
    for prefix in art.linear_prefixes():
        q, z, s = written[prefix]
        lin = art.get_linear(prefix)
        q2, z2, s2 = unpack_volta(lin.qweight, lin.scales_zeros, lin.group_size)
        assert torch.equal(q2, q) and torch.equal(z2, z) and torch.equal(s2, s), prefix
        if symmetric:
            assert bool((z2 == 8).all())
    # the kernels' weight stays within one fp16 rounding of compressed-tensors' own
    # dequantisation (q_signed - zp_signed) * s
    prefix = art.linear_prefixes()[0]
    q, z, s = written[prefix]
    lin = art.get_linear(prefix)
    w = dequantize_volta(lin.qweight, lin.scales_zeros, g).double()
    ct = (q.double() - z.double().repeat_interleave(g, 1)) * s.double().repeat_interleave(g, 1)
    assert float((w - ct).abs().max()) <= float(s.double().max()) * 16 * 2**-10


@pytest.mark.parametrize("kind", ["awq", "ct"])
def test_mixed_checkpoint(tiny_moe, tmp_path, caplog, kind):
    # Layer-0 experts and the full-attention q/k/v left in fp16 (as some hub checkpoints do).
    # compressed-tensors can quantize in_proj_a / in_proj_b (N = 4); the Volta layout cannot
    # hold N = 4, so those are dequantised to fp16 with a warning. AWQ GEMM cannot store them
    # at all (N % 8), so the AWQ source already has them in fp16.
    def keep(prefix: str) -> bool:
        return ".layers.0.mlp.experts." in prefix or bool(re.search(r"self_attn\.[qkv]_proj$", prefix))

    src = tmp_path / kind
    written = write_checkpoint(tiny_moe, src, kind=kind, g=32, keep_fp16=keep)
    with caplog.at_level("WARNING"):
        packed = pack_checkpoint(src, tmp_path / "packed", show_progress=False)
    art = open_packed(packed)
    prefixes = set(art.linear_prefixes())
    narrow = {p for p in written if p.endswith(("in_proj_a", "in_proj_b"))}
    assert len(narrow) == (6 if kind == "ct" else 0)
    assert prefixes == set(written) - narrow
    assert not any(keep(p) for p in prefixes)
    manifest = json.loads((packed / "onecat_manifest.json").read_text())
    assert set(manifest["kept_fp16"]) == narrow
    skip = art.quantization["modules_to_not_convert"]
    assert narrow <= set(skip)
    if narrow:
        assert "stays fp16" in caplog.text and "in_proj_a" in caplog.text
    for prefix in narrow:  # kept modules become fp16 weights equal to (q - z) * s
        q, z, s = written[prefix]
        w = art.get_tensor(f"{prefix}.weight")
        expected = ((q.float() - z.float().repeat_interleave(32, 1)) * s.float().repeat_interleave(32, 1)).half()
        assert_bit_equal(w, expected, prefix)
    source = all_tensors(src)
    for name in ("model.language_model.layers.0.mlp.experts.3.up_proj.weight",
                 "model.language_model.layers.3.self_attn.q_proj.weight",
                 "model.language_model.layers.3.self_attn.k_proj.bias",
                 "model.language_model.layers.0.mlp.gate.weight"):  # fmt: skip
        assert_bit_equal(art.get_tensor(name), source[name], name)
    if kind == "awq":
        name = "model.language_model.layers.1.linear_attn.in_proj_b.weight"
        assert_bit_equal(art.get_tensor(name), source[name], name)
    assert "model.language_model.layers.1.mlp.experts.7.down_proj" in prefixes
    assert manifest["summary"]["packed_linears"] == len(prefixes)
    assert manifest["summary"]["kept_fp16_linears"] == len(narrow)


@pytest.fixture()
def packed_artifact(tiny_moe, tmp_path) -> Path:
    src = tmp_path / "awq"
    write_checkpoint(tiny_moe, src, kind="awq", g=64)
    return pack_checkpoint(src, tmp_path / "packed", show_progress=False)


def test_other_format_version_is_a_clear_error(packed_artifact):
    path = packed_artifact / "onecat_manifest.json"
    manifest = json.loads(path.read_text())
    manifest["format_version"] = 2
    path.write_text(json.dumps(manifest))
    with pytest.raises(OnecatError, match=r"onecat_manifest.json: format_version 2 .*re-run `onecat pack`"):
        open_packed(packed_artifact)


def test_not_an_artifact_is_a_clear_error(tiny_moe):
    with pytest.raises(OnecatError, match="not a onecat packed artifact"):
        open_packed(tiny_moe)


def test_corrupted_tensor_fails_its_checksum(packed_artifact):
    art = open_packed(packed_artifact)
    prefix = art.linear_prefixes()[0]
    name = f"{prefix}.qweight"
    entry = art.manifest["tensors"][name]
    file = packed_artifact / entry["file"]
    tensors = load_file(file)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[7] ^= 0x10  # one flipped bit, same dtype and shape
    save_file(tensors, file, metadata={"format": "pt"})

    art = open_packed(packed_artifact)  # headers still match
    with pytest.raises(OnecatError, match=rf"checksum mismatch for tensor {re.escape(name)} in .*{entry['file']}"):
        art.get_linear(prefix)
    with pytest.raises(OnecatError, match="checksum mismatch"):
        open_packed(packed_artifact).verify()


def test_missing_tensor_is_a_clear_error(packed_artifact):
    art = open_packed(packed_artifact)
    name = art.plain_tensor_names()[0]
    file = packed_artifact / art.manifest["tensors"][name]["file"]
    tensors = load_file(file)
    del tensors[name]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(OnecatError, match=rf"tensor {re.escape(name)} is missing"):
        open_packed(packed_artifact)


def test_existing_output_needs_overwrite(packed_artifact):
    src = Path(json.loads((packed_artifact / "onecat_manifest.json").read_text())["source"]["path"])
    with pytest.raises(OnecatError, match="already exists; pass --overwrite"):
        pack_checkpoint(src, packed_artifact, show_progress=False)
    (packed_artifact / "config.json").unlink()  # a damaged earlier output: --overwrite redoes it
    pack_checkpoint(src, packed_artifact, overwrite=True, show_progress=False)
    open_packed(packed_artifact).verify()
    (packed_artifact / "stale-file").write_text("x")  # not onecat's: refused, kept
    with pytest.raises(OnecatError, match="stale-file was not written by onecat"):
        pack_checkpoint(src, packed_artifact, overwrite=True, show_progress=False)
    assert (packed_artifact / "stale-file").read_text() == "x"
    assert [p.name for p in packed_artifact.parent.iterdir() if p.name.startswith(".")] == []


def test_failure_leaves_no_half_written_output(tiny_moe, tmp_path, monkeypatch):
    src = tmp_path / "awq"
    write_checkpoint(tiny_moe, src, kind="awq", g=32)
    import onecat.pack.writer as writer

    calls = {"n": 0}
    real = writer.pack_volta

    def failing(*args):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("injected failure")
        return real(*args)

    monkeypatch.setattr(writer, "pack_volta", failing)
    out = tmp_path / "packed"
    with pytest.raises(RuntimeError, match="injected"):
        pack_checkpoint(src, out, show_progress=False)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["awq"]

    # a failed --overwrite leaves the previous artifact intact
    monkeypatch.setattr(writer, "pack_volta", real)
    pack_checkpoint(src, out, show_progress=False)
    before = sorted(p.name for p in out.iterdir())
    calls["n"] = 0
    monkeypatch.setattr(writer, "pack_volta", failing)
    with pytest.raises(RuntimeError):
        pack_checkpoint(src, out, overwrite=True, show_progress=False)
    assert sorted(p.name for p in out.iterdir()) == before
    open_packed(out).verify()


def test_unsupported_sources_are_clear_errors(tiny_moe, tmp_path):
    with pytest.raises(OnecatError, match="no quantization_config"):
        pack_checkpoint(tiny_moe, tmp_path / "x", show_progress=False)
    src = tmp_path / "gptq"
    shutil.copytree(tiny_moe, src)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(OnecatError, match="quant_method 'gptq' is not supported"):
        pack_checkpoint(src, tmp_path / "x", show_progress=False)
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "version": "gemv"}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(OnecatError, match="version 'gemv' is not supported"):
        pack_checkpoint(src, tmp_path / "x", show_progress=False)
    with pytest.raises(OnecatError, match="must not be"):
        pack_checkpoint(src, src / "inside", show_progress=False)
    config["quantization_config"] = {"quant_method": "onecat", "format": "volta-w4"}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(OnecatError, match="already a onecat packed artifact"):
        pack_checkpoint(src, tmp_path / "x", show_progress=False)
    assert not (tmp_path / "x").exists()


def test_bf16_awq_scales_are_converted(tiny_moe, tmp_path):
    src = tmp_path / "awq"
    write_checkpoint(tiny_moe, src, kind="awq", g=64)
    for shard in src.glob("*.safetensors"):
        tensors = load_file(shard)
        tensors = {n: t.to(torch.bfloat16) if n.endswith(".scales") else t for n, t in tensors.items()}
        save_file(tensors, shard, metadata={"format": "pt"})
    art = open_packed(pack_checkpoint(src, tmp_path / "packed", show_progress=False))
    ckpt = Checkpoint(src)
    prefix = art.linear_prefixes()[0]
    q, z, s = decode_awq_gemm(*(ckpt.get(f"{prefix}.{p}") for p in ("qweight", "qzeros", "scales")))
    lin = art.get_linear(prefix)
    assert torch.equal(unpack_volta(lin.qweight, lin.scales_zeros, 64)[2], s)
    assert s.dtype == torch.float16


def test_cli_pack(tiny_moe, tmp_path):
    src = tmp_path / "awq"
    write_checkpoint(tiny_moe, src, kind="awq", g=128)
    out = tmp_path / "packed"
    runner = CliRunner()
    result = runner.invoke(cli_main, ["pack", str(src), "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "packed" in result.output and "kept fp16" in result.output
    open_packed(out).verify()
    again = runner.invoke(cli_main, ["pack", str(src), "--out", str(out), "--no-progress"])
    assert again.exit_code == 1 and "already exists" in again.output
    forced = runner.invoke(cli_main, ["pack", str(src), "--out", str(out), "--overwrite", "--no-progress"])
    assert forced.exit_code == 0, forced.output


@pytest.mark.slow  # runs the AWQ search on a tiny model (about 10 s)
def test_pack_output_of_onecat_quantize(tmp_path):
    pipeline = pytest.importorskip("onecat.quantize.pipeline")
    from onecat.formats.awq_gemm import dequantize_awq_gemm
    from onecat.pack.volta_layout import reference_linear

    tiny = build_tiny_model("qwen3_5", tmp_path / "tiny")
    awq = pipeline.quantize_model(tiny, tmp_path / "awq", samples=2, seqlen=32, show_progress=False)
    art = open_packed(pack_checkpoint(awq, tmp_path / "packed", show_progress=False))
    art.verify()
    ckpt = Checkpoint(awq)
    prefixes = art.linear_prefixes()
    assert prefixes == sorted(n[: -len(".qweight")] for n in ckpt.names() if n.endswith(".qweight"))
    assert any(p.endswith("mlp.down_proj") for p in prefixes)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0)).half()
    for prefix in prefixes:
        parts = [ckpt.get(f"{prefix}.{p}") for p in ("qweight", "qzeros", "scales")]
        lin = art.get_linear(prefix)
        unpacked = unpack_volta(lin.qweight, lin.scales_zeros, lin.group_size)
        for a, b in zip(unpacked, decode_awq_gemm(*parts), strict=True):
            assert torch.equal(a, b), prefix
        if lin.in_features == x.shape[1]:
            # the kernels' contract against (q - z) * s in fp64: within fp16 rounding
            y = reference_linear(x, lin.qweight, lin.scales_zeros, lin.group_size).double()
            exact = x.double() @ dequantize_awq_gemm(*parts).double().t()
            assert float((y - exact).abs().max()) < 2e-3 * (1 + float(exact.abs().max()))
    back = unpack_artifact(art.path, tmp_path / "back")
    source, result = all_tensors(awq), all_tensors(back)
    assert set(result) == set(source)
    for name, t in source.items():
        assert_bit_equal(result[name], t, name)
