"""Bad input to `onecat quantize` (issue 2, section 7): each gives a clear message, exit
status 1, and leaves neither OUT nor its work directory behind."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from onecat.cli import main
from onecat.errors import OnecatError
from onecat.quantize.pipeline import quantize_rtn
from onecat.quantize.recipe import shipped_recipes
from onecat.tiny import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"), num_layers=2,
                            max_shard_size="200KB")


@pytest.fixture
def model(llama: Path, tmp_path: Path) -> Path:
    """A private copy each test may damage."""
    return Path(shutil.copytree(llama, tmp_path / "model"))


def run_quantize(model: Path, out: Path, *extra: str) -> tuple[int, str]:
    args = ["quantize", str(model), "--out", str(out), "--samples", "4", "--seqlen", "32",
            "--group-size", "32", *extra]
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.output


def assert_fails_cleanly(model: Path, out: Path, expected: list[str], *extra: str) -> None:
    code, output = run_quantize(model, out, *extra)
    assert code == 1, output
    for part in expected:
        assert part in output, output
    assert not out.exists()
    assert not out.with_name(out.name + ".partial").exists()


def test_unknown_model_type_lists_recipes(model: Path, tmp_path: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    (model / "config.json").write_text(json.dumps(config))
    assert_fails_cleanly(model, tmp_path / "out",
                         ["'gpt_neox'", "qwen3_5.yaml", "qwen3_5_moe.yaml", "llama.yaml", "--recipe"])


def test_recipe_schema_error(model: Path, tmp_path: Path) -> None:
    data = yaml.safe_load(shipped_recipes()["llama"].read_text())
    data["quantization"]["indivisible"] = "round"
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(yaml.safe_dump(data))
    assert_fails_cleanly(model, tmp_path / "out",
                         [str(recipe), "quantization.indivisible", "keep_fp16, fail"], "--recipe", str(recipe))


def test_indivisible_group_fails_when_the_recipe_says_so(model: Path, tmp_path: Path) -> None:
    data = yaml.safe_load(shipped_recipes()["llama"].read_text())
    data["quantization"]["indivisible"] = "fail"
    recipe = tmp_path / "strict.yaml"
    recipe.write_text(yaml.safe_dump(data))
    # hidden 128 and intermediate 256 do not divide by 96
    assert_fails_cleanly(model, tmp_path / "out",
                         ["model.layers.0.", "in-features", "group size 96", "indivisible: fail"],
                         "--recipe", str(recipe), "--group-size", "96")


def test_indivisible_group_keeps_fp16_with_a_warning(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    # hidden 128 does not divide by 256; the MLP's 256 in-features (down_proj) do
    with pytest.warns(UserWarning, match="in-features 128 do not divide by group size 256; kept in fp16"):
        code, output = run_quantize(model, out, "--group-size", "256")
    assert code == 0, output
    config = json.loads((out / "config.json").read_text())
    kept = config["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.0.mlp.up_proj" in kept and "model.layers.1.self_attn.q_proj" in kept
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.up_proj.weight" in index  # kept fp
    assert "model.layers.0.mlp.down_proj.qweight" in index  # 256 % 256 == 0


@pytest.mark.parametrize("group,expected", [
    ("0", ["--group-size 0", "positive multiple of 32"]),
    ("-32", ["--group-size -32", "positive multiple of 32"]),
    ("48", ["--group-size 48", "positive multiple of 32"]),
    # a valid size that divides none of the in-features (128, 256): the output would be a
    # float model labelled AWQ
    ("96", ["nothing would be quantized with group size 96", "128, 256"]),
    ("512", ["nothing would be quantized with group size 512"]),
])
def test_bad_group_size_is_refused_before_any_work(model: Path, tmp_path: Path, group: str,
                                                   expected: list[str]) -> None:
    assert_fails_cleanly(model, tmp_path / "out", expected, "--group-size", group)
    with pytest.raises(OnecatError, match=re.escape(expected[0])):
        quantize_rtn(model, tmp_path / "rtn", group_size=int(group), show_progress=False)
    assert not (tmp_path / "rtn").exists() and not (tmp_path / "rtn.partial").exists()


def test_nothing_quantized_is_refused_after_the_layers_too(model: Path, tmp_path: Path,
                                                          monkeypatch) -> None:
    """Should the up-front shape check miss a case, the run still refuses to publish a float
    model labelled AWQ."""
    import onecat.quantize.pipeline as pipeline

    monkeypatch.setattr(pipeline, "check_group_divisibility", lambda *args: None)
    with pytest.warns(UserWarning, match="kept in fp16"):
        assert_fails_cleanly(model, tmp_path / "out",
                             ["no linear was quantized with group size 96"], "--group-size", "96")


def test_recipe_group_size_must_be_a_multiple_of_32(model: Path, tmp_path: Path) -> None:
    data = yaml.safe_load(shipped_recipes()["llama"].read_text())
    data["quantization"]["group_size"] = 40
    recipe = tmp_path / "g40.yaml"
    recipe.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(main, ["quantize", str(model), "--out", str(tmp_path / "out"),
                                       "--recipe", str(recipe)])
    assert result.exit_code == 1
    assert "quantization.group_size" in result.output and "multiple of 32" in result.output
    assert not (tmp_path / "out").exists()


def test_missing_shard(model: Path, tmp_path: Path) -> None:
    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    shard = sorted(set(index.values()))[-1]
    (model / shard).unlink()
    assert_fails_cleanly(model, tmp_path / "out", [shard, "missing", "re-download"])


def test_corrupted_shard(model: Path, tmp_path: Path) -> None:
    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    shard = model / sorted(set(index.values()))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # truncated download
    assert_fails_cleanly(model, tmp_path / "out", [shard.name, "corrupted or truncated"])


def test_output_exists_without_resume_or_overwrite(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, output = run_quantize(model, out)
    assert code == 1 and "already exists" in output and "--overwrite" in output
    assert (out / "keep.txt").read_text() == "mine"  # untouched
    assert not out.with_name("out.partial").exists()
    code, output = run_quantize(model, out, "--resume", "--overwrite")
    assert code == 1 and "not both" in output


def test_overwrite_replaces_output(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_quantize(model, out)[0] == 0
    (out / "config.json").write_text("{}")  # a file onecat wrote (listed by its marker)
    code, output = run_quantize(model, out, "--overwrite")
    assert code == 0, output
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"
    assert "artifact:" in output
    (out / "old.txt").write_text("old")  # not onecat's: --overwrite refuses (test_checkpoint_safety)
    code, output = run_quantize(model, out, "--overwrite")
    assert code == 1 and "old.txt was not written by onecat" in output, output
    assert (out / "old.txt").read_text() == "old"


@pytest.mark.parametrize(
    "content,expected",
    [
        (None, ["does not exist"]),
        ("", ["is empty"]),
        ("just a few words", ["too short", "4 were asked"]),
    ],
    ids=["missing", "empty", "short"],
)
def test_calibration_source_problems(model: Path, tmp_path: Path, content, expected) -> None:
    calib = tmp_path / "calib.txt"
    if content is not None:
        calib.write_text(content)
    assert_fails_cleanly(model, tmp_path / "out", expected, "--calib", str(calib))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_device_without_gpu(model: Path, tmp_path: Path) -> None:
    assert_fails_cleanly(model, tmp_path / "out", ["--device cuda", "no CUDA GPU", "--device cpu"],
                         "--device", "cuda")


def test_offline_hub_id_says_to_pass_a_local_path(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, output = run_quantize(Path("nobody-xyz/no-such-model"), tmp_path / "out")
    assert code == 1 and "local directory" in output
    assert not (tmp_path / "out").exists()
