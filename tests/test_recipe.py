"""Recipes: the shipped ones load and are chosen by model_type; schema errors name file and field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from onecat.errors import OnecatError
from onecat.quantize.recipe import load_recipe, recipe_for_model_type, shipped_recipes

MODEL_TYPES = {
    "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe", "qwen3": "qwen3", "llama": "llama",
}


@pytest.mark.parametrize("model_type,name", sorted(MODEL_TYPES.items()))
def test_recipe_chosen_by_model_type(model_type: str, name: str) -> None:
    recipe = recipe_for_model_type(model_type)
    assert recipe.name == name
    assert model_type in recipe.model_types


def test_shipped_recipes_encode_the_qwen3_5_rules() -> None:
    assert set(shipped_recipes()) == {"qwen3_5", "qwen3_5_moe", "qwen3", "llama"}
    moe = recipe_for_model_type("qwen3_5_moe")
    post = next(m for m in moe.mappings if m.smooth == "post_attention_layernorm")
    # every consumer of the norm is balanced, quantized or not
    for name in ("mlp.gate", "mlp.shared_expert_gate", "mlp.experts.*.gate_proj"):
        assert name in post.balance
    assert not moe.is_quantized("mlp.gate") and not moe.is_quantized("mlp.shared_expert_gate")
    assert moe.is_quantized("mlp.experts.17.down_proj")
    dense = recipe_for_model_type("qwen3_5")
    assert dense.norm_style == "one_plus" and recipe_for_model_type("llama").norm_style == "plain"
    assert not dense.is_quantized("linear_attn.in_proj_a")
    gdn = next(m for m in dense.mappings if "linear_attn.in_proj_qkv" in m.balance)
    assert {"linear_attn.in_proj_a", "linear_attn.in_proj_b"} <= set(gdn.balance)
    # no v_proj -> o_proj and nothing smoothed into the GDN out_proj
    assert all(m.smooth != "self_attn.v_proj" for m in dense.mappings)
    assert all("linear_attn.out_proj" not in m.balance for m in dense.mappings)
    attn = next(m for m in dense.mappings if "self_attn.q_proj" in m.balance)
    assert attn.gated_query == "self_attn.q_proj"


def test_unknown_model_type_lists_recipes() -> None:
    with pytest.raises(OnecatError) as err:
        recipe_for_model_type("gpt2", Path("/m/config.json"))
    msg = str(err.value)
    assert "/m/config.json" in msg and "'gpt2'" in msg
    for name in ("qwen3_5.yaml", "qwen3_5_moe.yaml", "qwen3.yaml", "llama.yaml"):
        assert name in msg
    assert "--recipe" in msg


def _broken(tmp_path: Path, edit) -> Path:
    data = yaml.safe_load(shipped_recipes()["llama"].read_text())
    edit(data)
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    "edit,expected",
    [
        (lambda d: d["architecture"].update(norm_style="layernorm"),
         ["architecture.norm_style", "'layernorm'", "one_plus, plain"]),
        (lambda d: d["quantization"].pop("group_size"), ["quantization.group_size", "missing"]),
        (lambda d: d["quantization"].update(group_size="128"), ["quantization.group_size", "must be int"]),
        (lambda d: d["quantization"].update(bits=3), ["quantization.bits", "allowed values: 4"]),
        (lambda d: d["quantization"].update(indivisible="pad"),
         ["quantization.indivisible", "keep_fp16, fail"]),
        (lambda d: d["search"].update(clip_max_shrink=1.5), ["search.clip_max_shrink", "[0, 1)"]),
        (lambda d: d["quantization"].update(quantize=["mlp\\.(gate"]), ["quantization.quantize", "invalid regex"]),
        (lambda d: d.update(smoothing=[{"smooth": "x", "balance": ["a"], "scored": "a", "gated_query": "q"}]),
         ["smoothing[0].gated_query", "not in balance"]),
        (lambda d: d["search"].update(gird=20), ["search.gird", "not a known field"]),
        (lambda d: d.update(recipe_version=2), ["recipe_version", "allowed values: 1"]),
    ],
)
def test_schema_errors_name_file_field_and_allowed_values(tmp_path: Path, edit, expected) -> None:
    path = _broken(tmp_path, edit)
    with pytest.raises(OnecatError) as err:
        load_recipe(path)
    msg = str(err.value)
    assert str(path) in msg
    for part in expected:
        assert part in msg, msg


def test_recipe_that_is_not_yaml(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: [unclosed\n")
    with pytest.raises(OnecatError, match="not valid YAML"):
        load_recipe(path)
