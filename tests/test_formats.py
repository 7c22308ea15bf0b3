"""The formats layer's small pieces: the quantization_config detector (null-safe), file
reference containment rules, the packed-artifact config check and the one dequantiser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from onecat.errors import OnecatError
from onecat.formats.files import contained_file
from onecat.formats.integers import dequantize
from onecat.formats.quant_config import (
    AWQ_GEMM,
    COMPRESSED_TENSORS,
    FLOAT,
    ONECAT,
    detect_format,
    detect_source_format,
    find_quantization_config,
    text_config,
    without_quantization_config,
)
from onecat.pack.artifact import check_onecat_config
from onecat.vllm_plugin.launcher import is_moe_checkpoint

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
CT = {"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g0": {"weights": {"num_bits": 4, "type": "int"}}}, "ignore": ["lm_head"]}
ONECAT_QC = {"quant_method": "onecat", "format": "volta-w4", "format_version": 1, "bits": 4,
             "group_size": 128}


@pytest.mark.parametrize("config,kind", [
    ({"model_type": "qwen3_5", "text_config": None}, FLOAT),
    ({"text_config": None, "quantization_config": None}, FLOAT),
    ({"text_config": {"quantization_config": AWQ}}, AWQ_GEMM),
    ({"text_config": None, "quantization_config": AWQ}, AWQ_GEMM),
    ({"compression_config": CT}, COMPRESSED_TENSORS),
    ({"quantization_config": ONECAT_QC}, ONECAT),
])
def test_detector_reads_every_place_and_survives_null_text_config(config, kind):
    fmt = detect_format(config)
    assert fmt.kind == kind
    assert (find_quantization_config(config) is None) == (kind == FLOAT)
    stripped = without_quantization_config(config)
    assert find_quantization_config(stripped) is None and detect_format(stripped).kind == FLOAT


def test_detector_details_and_refusals():
    assert detect_format({"quantization_config": AWQ}).group_size == 128
    assert detect_format({"quantization_config": CT}).modules_to_not_convert == ["lm_head"]
    assert text_config({"text_config": None, "a": 1}) == {"text_config": None, "a": 1}
    with pytest.raises(OnecatError, match=r"cfg: AWQ version 'gemv' is not supported"):
        detect_format({"quantization_config": {**AWQ, "version": "gemv"}}, "cfg")
    with pytest.raises(OnecatError, match="zero_point=False is not supported"):
        detect_format({"quantization_config": {**AWQ, "zero_point": False}})
    with pytest.raises(OnecatError, match="quant_method 'gptq' is not supported"):
        detect_format({"quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(OnecatError, match="no quantization_config"):
        detect_source_format({"text_config": None})
    with pytest.raises(OnecatError, match="already a onecat packed artifact"):
        detect_source_format({"quantization_config": ONECAT_QC})


def test_plugin_moe_probe_survives_null_text_config(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": None, "num_experts": 8}))
    assert is_moe_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"text_config": None}))
    assert not is_moe_checkpoint(str(tmp_path))
    assert not is_moe_checkpoint(str(tmp_path / "missing"))


@pytest.mark.parametrize("ref,message", [
    ("", "not a file name"),
    (None, "not a file name"),
    (7, "not a file name"),
    ("sub/../model.safetensors", "climbs out with '..'"),
    ("..\\model.safetensors", "climbs out with '..'"),
    ("/etc/passwd", "absolute path"),
    ("C:\\weights.safetensors", "absolute path"),
])
def test_contained_file_refuses_references_that_may_leave(tmp_path: Path, ref, message):
    with pytest.raises(OnecatError, match=message) as err:
        contained_file(tmp_path, ref, where="index.json", entry="weight_map['x']")
    assert "index.json: weight_map['x']" in str(err.value)


def test_contained_file_accepts_plain_and_nested_names(tmp_path: Path):
    assert contained_file(tmp_path, "model.safetensors", where="w", entry="e") == tmp_path / "model.safetensors"
    assert contained_file(tmp_path, "sub/a.safetensors", where="w", entry="e") == tmp_path / "sub/a.safetensors"


def test_onecat_config_check_names_the_field():
    assert check_onecat_config(ONECAT_QC, "q") == 128
    for change, message in ((("format_version", 2), "re-pack"), (("bits", 8), "4-bit"),
                            (("group_size", 0), "multiple of 32"), (("group_size", 96.0), "multiple")):
        with pytest.raises(OnecatError, match=message):
            check_onecat_config({**ONECAT_QC, change[0]: change[1]}, "q")


def test_dequantize_is_q_minus_z_times_s():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64, 128), dtype=torch.uint8, generator=gen)
    z = torch.randint(0, 16, (64, 4), dtype=torch.uint8, generator=gen)
    s = (torch.rand(64, 4, generator=gen) * 0.01).half()
    expected = torch.empty(64, 128, dtype=torch.float64)
    for n in range(64):
        for k in range(128):
            expected[n, k] = (int(q[n, k]) - int(z[n, k // 32])) * float(s[n, k // 32])
    assert torch.allclose(dequantize(q, z, s).double(), expected, rtol=1e-6, atol=0)
    assert dequantize(q, z, s, torch.float16).dtype == torch.float16
