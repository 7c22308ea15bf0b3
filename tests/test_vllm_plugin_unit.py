"""The vLLM plugin's pure parts, without vLLM: tensor-parallel slicing of the packed
layout, AWQ repacking, per-module quantization detection, the version pin and the
``onecat serve --engine vllm`` launcher."""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path

import pytest
import torch

from onecat.errors import OnecatError
from onecat.formats.awq_gemm import dequantize_awq_gemm, pack_awq_gemm
from onecat.pack.partitions import check_expert_partition, check_partition
from onecat.pack.repack import awq_to_volta
from onecat.pack.volta_layout import pack_volta, slice_volta
from onecat.vllm_plugin import version as vllm_version
from onecat.vllm_plugin.launcher import (
    check_vllm_in,
    serve_with_vllm,
    vllm_environment,
    vllm_serve_command,
)
from onecat.vllm_plugin.quantized_modules import (
    checkpoint_tensor_names,
    experts_quantized,
    is_quantized,
    module_key,
    quantized_module_keys,
)
from onecat.vllm_plugin.tp_slicing import slice_volta_part

QWEN3_5_PACKED_MODULES = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
    "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
    "in_proj_ba": ["in_proj_b", "in_proj_a"],
}


def random_ints(n: int, k: int, g: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    z = torch.randint(0, 16, (n, k // g), dtype=torch.uint8, generator=gen)
    s = (torch.rand(n, k // g, generator=gen) * 0.01 + 1e-4).half()
    return q, z, s


def assert_packed_equal(got, expected):
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


# --- tensor-parallel slicing -------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("g", [32, 64, 128])
def test_slice_part_equals_packing_the_slice(world_size, g):
    """Each half of a packed linear, sliced for rank r, equals packing rank r's integers."""
    n, k = 512, 1024
    q, z, s = random_ints(n, k, g, seed=world_size * 1000 + g)
    qweight, scales_zeros = pack_volta(q, z, s)
    for rank in range(world_size):
        cols = slice(rank * n // world_size, (rank + 1) * n // world_size)
        expected = pack_volta(q[cols], z[cols], s[cols])
        got = tuple(
            slice_volta_part(t, part, g, "out", rank, world_size)
            for t, part in ((qweight, "qweight"), (scales_zeros, "scales_zeros"))
        )
        assert_packed_equal(got, expected)
        assert_packed_equal(got, slice_volta(qweight, scales_zeros, g, "out", rank, world_size))

        ks = slice(rank * k // world_size, (rank + 1) * k // world_size)
        gs = slice(rank * (k // g) // world_size, (rank + 1) * (k // g) // world_size)
        expected = pack_volta(q[:, ks].contiguous(), z[:, gs].contiguous(), s[:, gs].contiguous())
        got = tuple(
            slice_volta_part(t, part, g, "in", rank, world_size)
            for t, part in ((qweight, "qweight"), (scales_zeros, "scales_zeros"))
        )
        assert_packed_equal(got, expected)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_merged_column_slices_match_vllm_narrowing(world_size):
    """Merged layers (GDN in_proj_qkvz = q, k, v, z; gate_up; q/k/v): vLLM narrows every
    part of the packed checkpoint by ``rank * size/32/world`` tiles along dim 0 and stacks
    the parts; the result must be the packed rank slice of every part, concatenated."""
    g, k = 64, 256
    part_sizes = [256, 256, 512, 512]  # key_dim, key_dim, value_dim, value_dim (tiny GDN)
    parts = [random_ints(n, k, g, seed=n + i) for i, n in enumerate(part_sizes)]
    packed = [pack_volta(*p) for p in parts]
    for rank in range(world_size):
        loaded_q, loaded_sz, ints = [], [], []
        for (q, z, s), (pq, psz), n in zip(parts, packed, part_sizes, strict=True):
            tiles = n // 32 // world_size  # vLLM: shard_size // packed_factor (32)
            loaded_q.append(pq.narrow(0, rank * tiles, tiles))
            loaded_sz.append(psz.narrow(0, rank * tiles, tiles))
            rows = slice(rank * n // world_size, (rank + 1) * n // world_size)
            ints.append((q[rows], z[rows], s[rows]))
        expected = pack_volta(*(torch.cat(t) for t in zip(*ints, strict=True)))
        assert_packed_equal((torch.cat(loaded_q), torch.cat(loaded_sz)), expected)


def test_slice_part_refuses_splits_across_tiles_or_groups():
    # Qwen3.5-35B-A3B expert down_proj: K = 512 at g128 splits at most 4 ways.
    q, z, s = random_ints(64, 512, 128, seed=7)
    qweight, scales_zeros = pack_volta(q, z, s)
    slice_volta_part(scales_zeros, "scales_zeros", 128, "in", 3, 4)
    with pytest.raises(ValueError, match="in_features 512 with group size 128 cannot be split 8"):
        slice_volta_part(qweight, "qweight", 128, "in", 0, 8)
    with pytest.raises(ValueError, match="in_features 512 with group size 128 cannot be split 8"):
        slice_volta_part(scales_zeros, "scales_zeros", 128, "in", 0, 8)
    with pytest.raises(ValueError, match="out_features 64 cannot be split 4 ways"):
        slice_volta_part(qweight, "qweight", 128, "out", 1, 4)
    with pytest.raises(ValueError, match="rank 4 is not in 0..3"):
        slice_volta_part(qweight, "qweight", 128, "out", 4, 4)
    with pytest.raises(ValueError, match="part must be"):
        slice_volta_part(qweight, "weight", 128, "out", 0, 2)


def test_partition_checks_name_layer_and_fix():
    check_partition("layers.3.self_attn.qkv_proj", [1536, 256, 256], 5120, 128)  # 27B, TP 4
    with pytest.raises(OnecatError, match=r"qkv_proj.*output part 48 .*--tensor-parallel-size"):
        check_partition("layers.3.self_attn.qkv_proj", [96, 48, 48], 256, 128)
    # 27B down_proj: K = 17408 = 136 groups of 128, so TP 16 would cut a group
    with pytest.raises(OnecatError, match=r"down_proj.*input slice 1088 .*group size 128"):
        check_partition("layers.0.mlp.down_proj", [5120], 17408 // 16, 128)
    check_expert_partition("layers.0.mlp.experts", 2048, 128, 128)  # 35B-A3B at TP 4
    with pytest.raises(OnecatError, match=r"layers\.0\.mlp\.experts.*expert-parallel"):
        check_expert_partition("layers.0.mlp.experts", 2048, 64, 128)  # TP 8


# --- AWQ repacking -----------------------------------------------------------------------


@pytest.mark.parametrize("g", [32, 128])
def test_awq_repack_equals_packing_the_integers(g):
    n, k = 96, 256
    q, z, s = random_ints(n, k, g, seed=g + 5)
    awq = pack_awq_gemm(q, z, s)
    assert_packed_equal(awq_to_volta(awq["qweight"], awq["qzeros"], awq["scales"]), pack_volta(q, z, s))
    dense = dequantize_awq_gemm(awq["qweight"], awq["qzeros"], awq["scales"], torch.float32)
    expected = (q.float() - z.float().repeat_interleave(g, 1)) * s.float().repeat_interleave(g, 1)
    assert torch.equal(dense, expected)


# --- which modules are 4-bit --------------------------------------------------------------


def test_module_keys_match_checkpoint_and_vllm_names():
    ckpt = [
        "model.language_model.layers.0.linear_attn.in_proj_qkv.qweight",
        "model.language_model.layers.0.linear_attn.in_proj_z.qweight",
        "model.language_model.layers.0.linear_attn.in_proj_b.weight",
        "model.language_model.layers.0.linear_attn.in_proj_a.weight",
        "model.language_model.layers.3.self_attn.q_proj.qweight",
        "model.language_model.layers.3.self_attn.k_proj.qweight",
        "model.language_model.layers.3.self_attn.v_proj.weight",
        "model.language_model.layers.1.mlp.experts.0.gate_proj.qweight",
        "model.language_model.layers.1.mlp.shared_expert.gate_proj.qweight",
        "model.language_model.layers.1.mlp.shared_expert.up_proj.qweight",
        "mtp.layers.0.mlp.gate_proj.qweight",
        "lm_head.weight",
    ]
    keys = quantized_module_keys(ckpt)
    assert module_key("language_model.model.layers.0.linear_attn.in_proj_qkv") == (
        "layers.0.linear_attn.in_proj_qkv"
    )
    assert module_key("mtp.layers.0.mlp.gate_proj") == "mtp.layers.0.mlp.gate_proj"
    m = QWEN3_5_PACKED_MODULES
    assert is_quantized("language_model.model.layers.0.linear_attn.in_proj_qkvz", keys, m)
    assert not is_quantized("language_model.model.layers.0.linear_attn.in_proj_ba", keys, m)
    assert is_quantized("model.layers.1.mlp.shared_expert.gate_up_proj", keys, m)
    assert not is_quantized("model.layers.0.mlp.gate_up_proj", keys, m)  # mtp's is not layer 0's
    assert not is_quantized("model.layers.1.mlp.gate", keys, m)
    assert experts_quantized("model.layers.1.mlp.experts", keys)
    assert not experts_quantized("model.layers.2.mlp.experts", keys)
    with pytest.raises(OnecatError, match=r"qkv_proj.*v_proj \(fp16\)"):
        is_quantized("model.layers.3.self_attn.qkv_proj", keys, m)


def _write_safetensors_header(path: Path, names: list[str]) -> None:
    header = {name: {"dtype": "F16", "shape": [1], "data_offsets": [2 * i, 2 * i + 2]}
              for i, name in enumerate(names)}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(2 * len(names)))


def test_safetensors_names_and_missing_files(tmp_path):
    _write_safetensors_header(tmp_path / "a.safetensors", ["x.qweight", "x.scales_zeros"])
    _write_safetensors_header(tmp_path / "b.safetensors", ["y.weight"])
    assert checkpoint_tensor_names(tmp_path) == ["x.qweight", "x.scales_zeros", "y.weight"]
    with pytest.raises(OnecatError, match="not a directory"):
        checkpoint_tensor_names(tmp_path / "a.safetensors.d")
    (tmp_path / "c").mkdir()
    with pytest.raises(OnecatError, match="no \\*.safetensors"):
        checkpoint_tensor_names(tmp_path / "c")


# --- version pin and launcher -------------------------------------------------------------


def test_version_range():
    assert vllm_version.is_supported("0.32.0") and vllm_version.is_supported("0.32.3rc1+cu126")
    assert not vllm_version.is_supported("0.31.2") and not vllm_version.is_supported("0.33.0")
    assert vllm_version.check_vllm_version("0.32.1") == "0.32.1"
    with pytest.raises(OnecatError, match=r"supports vLLM >=0.32,<0.33, but vLLM 0.33.0"):
        vllm_version.check_vllm_version("0.33.0")
    with pytest.raises(OnecatError, match="cannot read the vLLM version"):
        vllm_version.check_vllm_version("nightly")


def test_missing_vllm_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(vllm_version, "installed_vllm_version", lambda: None)
    with pytest.raises(OnecatError, match="vLLM is not installed"):
        vllm_version.check_vllm_version()


def test_serve_command_translates_flags():
    argv = vllm_serve_command(
        "/models/q35-packed", python="/venv/bin/python", port=8100, tensor_parallel_size=4,
        pipeline_parallel_size=2, max_model_len=32768, gpu_memory_utilization=0.9,
        max_num_seqs=16, enforce_eager=True, served_model_name="q35",
        extra_args=["--enable-expert-parallel"],
    )
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(argv)
    for piece in ("--model /models/q35-packed", "--port 8100", "--dtype half",
                  "--tensor-parallel-size 4", "--pipeline-parallel-size 2",
                  "--max-model-len 32768", "--gpu-memory-utilization 0.9",
                  "--max-num-seqs 16", "--served-model-name q35"):
        assert piece in joined
    assert argv[-2:] == ["--enforce-eager", "--enable-expert-parallel"]
    assert "--api-key" not in argv and "--max-num-batched-tokens" not in argv
    with pytest.raises(OnecatError, match="--tensor-parallel-size must be at least 1"):
        vllm_serve_command("m", tensor_parallel_size=0)


def test_vllm_environment_keeps_plugin_allowed():
    assert "VLLM_PLUGINS" not in vllm_environment({"PATH": "/bin"})
    assert vllm_environment({"VLLM_PLUGINS": "other"})["VLLM_PLUGINS"] == "other,onecat"
    assert vllm_environment({"VLLM_PLUGINS": "onecat"})["VLLM_PLUGINS"] == "onecat"


def test_launcher_refuses_python_without_vllm(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm_version, "installed_vllm_version", lambda: None)
    monkeypatch.setattr(
        "onecat.vllm_plugin.launcher.check_vllm_version", vllm_version.check_vllm_version
    )
    with pytest.raises(OnecatError, match="vLLM is not installed"):
        serve_with_vllm("/models/x")  # this interpreter
    # Another interpreter is probed in a subprocess: one with onecat but no vLLM ...
    wrapper = tmp_path / "python-with-onecat"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(OnecatError, match="vLLM is not installed"):
            check_vllm_in(str(wrapper))
    # ... one without onecat, and one that does not exist.
    bare = tmp_path / "python-bare"
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "$@"\n')
    bare.chmod(0o755)
    with pytest.raises(OnecatError, match="cannot run onecat's vLLM plugin.*No module named"):
        check_vllm_in(str(bare))
    with pytest.raises(OnecatError, match="cannot run /nonexistent/python"):
        check_vllm_in("/nonexistent/python")


def test_serve_cli_engine_vllm_errors(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from onecat.cli import main

    monkeypatch.setattr(vllm_version, "installed_vllm_version", lambda: None)
    monkeypatch.setattr(
        "onecat.vllm_plugin.launcher.check_vllm_version", vllm_version.check_vllm_version
    )
    runner = CliRunner()
    result = runner.invoke(main, ["serve", str(tmp_path), "--engine", "vllm", "-tp", "2"])
    assert result.exit_code == 1 and "vLLM is not installed" in result.output
    result = runner.invoke(main, ["serve", str(tmp_path), "--engine", "vllm", "--device", "cpu"])
    assert result.exit_code == 1 and "--device cpu does not apply to --engine vllm" in result.output
    result = runner.invoke(main, ["serve", str(tmp_path), "--pipeline-parallel-size", "2"])
    assert result.exit_code == 1 and "need --engine vllm" in result.output  # -tp: both engines


def test_moe_checkpoints_are_detected(tmp_path):
    from onecat.vllm_plugin.launcher import is_moe_checkpoint

    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_experts": 256}}))
    assert is_moe_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 5120}}))
    assert not is_moe_checkpoint(str(tmp_path))
    assert not is_moe_checkpoint("Qwen/Qwen3.5-27B")
