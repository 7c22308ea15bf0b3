"""The plugin inside vLLM's real layer classes, under simulated tensor parallelism.

Runs in the vLLM environment (``make test`` calls ``.venv-vllm/bin/python -m pytest`` on this
file; elsewhere it is skipped). For TP 1, 2, 4 and 8 and every rank, vLLM's own
``QKVParallelLinear`` / ``MergedColumnParallelLinear`` (gate/up and Qwen3.5's GDN
``in_proj_qkvz``, loaded from ``in_proj_qkv`` with a tuple shard id) / ``RowParallelLinear``
load full checkpoint tensors through their weight loaders with the plugin's methods; the
result must be exactly the Volta packing of that rank's slice of the integers, for packed
artifacts (sliced as packed tiles) and for plain AWQ (sliced as AWQ words, repacked after
loading). The MoE method's loader and per-expert compute are checked the same way.
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("vllm", reason="needs the vLLM environment (make vllm-env)")

import vllm.model_executor.layers.linear as vllm_linear  # noqa: E402
import vllm.model_executor.parameter as vllm_parameter  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402

from onecat.errors import OnecatError  # noqa: E402
from onecat.formats.awq_gemm import pack_awq_gemm  # noqa: E402
from onecat.pack.volta_layout import dequantize_volta, pack_volta  # noqa: E402
from onecat.vllm_plugin import register  # noqa: E402
from onecat.vllm_plugin.config import OnecatAwqConfig, OnecatConfig  # noqa: E402
from onecat.vllm_plugin.moe_method import OnecatMoEMethod  # noqa: E402

G = 64
PACKED = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
    "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
}


def random_ints(n: int, k: int, g: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    z = torch.randint(0, 16, (n, k // g), dtype=torch.uint8, generator=gen)
    s = (torch.rand(n, k // g, generator=gen) * 0.01 + 1e-4).half()
    return q, z, s


def checkpoint_tensors(fmt: str, ints) -> dict[str, torch.Tensor]:
    if fmt == "onecat":
        qweight, scales_zeros = pack_volta(*ints)
        return {"qweight": qweight, "scales_zeros": scales_zeros}
    return pack_awq_gemm(*ints)


@pytest.fixture
def tensor_parallel(monkeypatch):
    """Pretend to be rank ``rank`` of ``world`` tensor-parallel ranks."""
    register()

    def set_rank(rank: int, world: int) -> None:
        for module in (vllm_linear, vllm_parameter):
            monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: rank)
            monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: world)

    return set_rank


def make_config(fmt: str, modules: list[str]):
    config = OnecatConfig(G) if fmt == "onecat" else OnecatAwqConfig(G)
    config.quantized = {f"layers.0.{m}" for m in modules}
    config.packed_modules_mapping = PACKED
    return config


def load(layer, name: str, tensors: dict[str, torch.Tensor], shard_id=None) -> None:
    params = dict(layer.named_parameters())
    for part, tensor in tensors.items():
        param = params[part]
        if shard_id is None:
            param.weight_loader(param, tensor)
        else:
            param.weight_loader(param, tensor, shard_id)


def rank_rows(ints, rank: int, world: int, replicas: int = 1):
    """Rank's slice of the output rows (KV heads shared by ``replicas`` ranks)."""
    q, z, s = ints
    shards = world // replicas
    n = q.shape[0] // shards
    rows = slice((rank // replicas) * n, (rank // replicas + 1) * n)
    return q[rows], z[rows], s[rows]


def assert_holds(layer, fmt: str, expected_ints) -> None:
    layer.quant_method.process_weights_after_loading(layer)
    qweight, scales_zeros = pack_volta(*expected_ints)
    assert torch.equal(layer.qweight, qweight)
    assert torch.equal(layer.scales_zeros, scales_zeros)
    x = torch.randn(3, expected_ints[0].shape[1]).half()
    y = layer.quant_method.apply(layer, x)
    w = dequantize_volta(qweight, scales_zeros, G, dtype=torch.float32)
    assert torch.allclose(y.float(), x.float() @ w.t(), rtol=2e-3, atol=2e-3)


def cat_ints(parts):
    return tuple(torch.cat(t).contiguous() for t in zip(*parts, strict=True))


@pytest.mark.parametrize("fmt", ["onecat", "awq"])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_qkv_parallel_linear_shards_like_the_integers(tensor_parallel, fmt, world):
    hidden, head, heads, kv_heads = 256, 64, 8, 4  # TP 8: each KV head on two ranks
    full = {"q": random_ints(heads * head, hidden, G, 1), "k": random_ints(kv_heads * head, hidden, G, 2),
            "v": random_ints(kv_heads * head, hidden, G, 3)}
    config = make_config(fmt, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])
    replicas = max(1, world // kv_heads)
    for rank in range(world):
        tensor_parallel(rank, world)
        with set_current_vllm_config(VllmConfig()):
            layer = vllm_linear.QKVParallelLinear(
                hidden, head, heads, kv_heads, bias=False, quant_config=config,
                prefix="model.layers.0.self_attn.qkv_proj",
            )
        for shard, ints in full.items():
            load(layer, shard, checkpoint_tensors(fmt, ints), shard)
        expected = [rank_rows(full["q"], rank, world)]
        expected += [rank_rows(full[s], rank, world, replicas) for s in ("k", "v")]
        assert_holds(layer, fmt, cat_ints(expected))


@pytest.mark.parametrize("fmt", ["onecat", "awq"])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_gdn_in_proj_qkvz_shards_like_the_integers(tensor_parallel, fmt, world):
    """Qwen3.5 stores in_proj_qkv (q, k, v stacked) and in_proj_z; vLLM fuses them into four
    column-parallel parts and loads in_proj_qkv with the tuple shard id (0, 1, 2)."""
    hidden, key_dim, value_dim = 256, 256, 512
    qkv = random_ints(2 * key_dim + value_dim, hidden, G, 4)
    z_proj = random_ints(value_dim, hidden, G, 5)
    config = make_config(fmt, ["linear_attn.in_proj_qkv", "linear_attn.in_proj_z"])
    bounds = [(0, key_dim), (key_dim, 2 * key_dim), (2 * key_dim, 2 * key_dim + value_dim)]
    for rank in range(world):
        tensor_parallel(rank, world)
        with set_current_vllm_config(VllmConfig()):
            layer = vllm_linear.MergedColumnParallelLinear(
                hidden, [key_dim, key_dim, value_dim, value_dim], bias=False, quant_config=config,
                prefix="model.layers.0.linear_attn.in_proj_qkvz",
            )
        load(layer, "in_proj_qkv", checkpoint_tensors(fmt, qkv), (0, 1, 2))
        load(layer, "in_proj_z", checkpoint_tensors(fmt, z_proj), 3)
        parts = [rank_rows(tuple(t[a:b] for t in qkv), rank, world) for a, b in bounds]
        parts.append(rank_rows(z_proj, rank, world))
        assert_holds(layer, fmt, cat_ints(parts))


@pytest.mark.parametrize("fmt", ["onecat", "awq"])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_gate_up_and_down_shard_like_the_integers(tensor_parallel, fmt, world):
    hidden, inter = 256, 1024
    gate, up = random_ints(inter, hidden, G, 6), random_ints(inter, hidden, G, 7)
    down = random_ints(hidden, inter, G, 8)
    config = make_config(fmt, ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"])
    for rank in range(world):
        tensor_parallel(rank, world)
        with set_current_vllm_config(VllmConfig()):
            gate_up = vllm_linear.MergedColumnParallelLinear(
                hidden, [inter, inter], bias=False, quant_config=config,
                prefix="model.layers.0.mlp.gate_up_proj",
            )
            down_layer = vllm_linear.RowParallelLinear(
                inter, hidden, bias=False, quant_config=config, prefix="model.layers.0.mlp.down_proj",
            )
        load(gate_up, "gate_proj", checkpoint_tensors(fmt, gate), 0)
        load(gate_up, "up_proj", checkpoint_tensors(fmt, up), 1)
        assert_holds(gate_up, fmt, cat_ints([rank_rows(gate, rank, world), rank_rows(up, rank, world)]))
        load(down_layer, "down_proj", checkpoint_tensors(fmt, down))
        k, g = inter // world, inter // G // world
        q, z, s = down
        cols = (q[:, rank * k:(rank + 1) * k], z[:, rank * g:(rank + 1) * g], s[:, rank * g:(rank + 1) * g])
        assert_holds(down_layer, fmt, tuple(t.contiguous() for t in cols))


def test_split_that_cuts_a_group_is_refused(tensor_parallel):
    """A 35B-A3B-like down_proj (K = 512) at g128 cannot be split 8 ways."""
    tensor_parallel(0, 8)
    config = OnecatConfig(128)
    config.quantized = {"layers.0.mlp.down_proj"}
    with set_current_vllm_config(VllmConfig()), pytest.raises(OnecatError, match="tensor-parallel"):
        vllm_linear.RowParallelLinear(512, 2048, bias=False, quant_config=config,
                                      prefix="model.layers.0.mlp.down_proj")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_moe_loader_and_experts(world):
    """Per-expert Volta tensors sliced for each rank; apply() equals dense routed experts."""
    hidden, inter, experts, top_k = 128, 256, 4, 2
    weights = {
        e: {name: random_ints(*shape, G, 100 * e + i)
            for i, (name, shape) in enumerate((("gate_proj", (inter, hidden)),
                                               ("up_proj", (inter, hidden)),
                                               ("down_proj", (hidden, inter))))}
        for e in range(experts)
    }
    x = torch.randn(5, hidden).half()
    gen = torch.Generator().manual_seed(0)
    topk_ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(5)])
    topk_weights = torch.rand(5, top_k, generator=gen)
    total = torch.zeros(5, hidden)
    for rank in range(world):
        layer = torch.nn.Module()
        layer.moe_config = types.SimpleNamespace(tp_rank=rank, tp_size=world)
        layer._map_global_expert_id_to_local_expert_id = lambda e: e
        layer.activation, layer.apply_router_weight_on_input, layer.expert_map = "silu", False, None
        method = OnecatMoEMethod(None, G, "model.layers.0.mlp.experts")
        method.create_weights(layer, experts, hidden, inter // world, torch.float16)
        params = dict(layer.named_parameters())
        for e, parts in weights.items():
            for name, ints in parts.items():
                stem = "w2" if name == "down_proj" else "w13"
                shard = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[name]
                for part, tensor in checkpoint_tensors("onecat", ints).items():
                    param = params[f"{stem}_{part}"]
                    assert param.weight_loader(param, tensor, f"experts.{stem}_{part}", shard, e, True)
        method.process_weights_after_loading(layer)
        for e, parts in weights.items():
            i0, i1 = rank * inter // world, (rank + 1) * inter // world
            g0, g1 = i0 // G, i1 // G
            gate_up = cat_ints([tuple(t[i0:i1] for t in parts["gate_proj"]),
                                tuple(t[i0:i1] for t in parts["up_proj"])])
            q, z, s = parts["down_proj"]
            down = (q[:, i0:i1].contiguous(), z[:, g0:g1].contiguous(), s[:, g0:g1].contiguous())
            assert torch.equal(layer.w13_qweight[e], pack_volta(*gate_up)[0])
            assert torch.equal(layer.w2_scales_zeros[e], pack_volta(*down)[1])
        routed = method.apply(layer, x, topk_weights, topk_ids, None, None)
        # expert parallelism: experts the expert map sends to -1 (other ranks') add nothing
        layer.expert_map = torch.tensor([0, -1, 2, -1], dtype=torch.int32)
        partial = method.apply(layer, x, topk_weights, topk_ids, None, None)
        layer.expert_map = None
        kept = topk_weights * (topk_ids % 2 == 0)
        assert torch.allclose(partial.float(), method.apply(layer, x, kept, topk_ids, None, None).float(),
                              rtol=1e-3, atol=1e-3)
        total += routed.float()
    expected = torch.zeros(5, hidden)
    for t in range(5):
        for j in range(top_k):
            parts = {n: dequantize_volta(*pack_volta(*ints), G, dtype=torch.float32)
                     for n, ints in weights[int(topk_ids[t, j])].items()}
            h = torch.nn.functional.silu(x[t].float() @ parts["gate_proj"].t()) * (x[t].float() @ parts["up_proj"].t())
            expected[t] += topk_weights[t, j] * (h @ parts["down_proj"].t())
    assert torch.allclose(total, expected, rtol=2e-2, atol=2e-2)


def test_awq_slice_outside_the_layout_runs_dequantised(tensor_parallel):
    """An AWQ linear whose N is not a multiple of 32 (e.g. a 48-head in_proj_b) stays usable."""
    from onecat.formats.awq_gemm import dequantize_awq_gemm

    tensor_parallel(0, 1)
    ints = random_ints(48, 256, G, 9)
    config = make_config("awq", ["linear_attn.in_proj_b"])
    with set_current_vllm_config(VllmConfig()):
        layer = vllm_linear.ColumnParallelLinear(256, 48, bias=False, quant_config=config,
                                                 prefix="model.layers.0.linear_attn.in_proj_b")
    awq = checkpoint_tensors("awq", ints)
    load(layer, "in_proj_b", awq)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.onecat_dense and not hasattr(layer, "qweight")
    x = torch.randn(2, 256)
    expected = x @ dequantize_awq_gemm(awq["qweight"], awq["qzeros"], awq["scales"], torch.float32).t()
    assert torch.allclose(layer.quant_method.apply(layer, x), expected, rtol=1e-5, atol=1e-5)


def test_config_validation_and_awq_override(monkeypatch):
    from onecat.vllm_plugin import config as plugin_config

    good = {"quant_method": "onecat", "format": "volta-w4", "format_version": 1, "bits": 4,
            "group_size": 128}
    assert OnecatConfig.from_config(good).group_size == 128
    for change, message in ((("format_version", 2), "re-pack"), (("bits", 8), "4-bit"),
                            (("group_size", 100), "multiple of 32")):
        with pytest.raises(OnecatError, match=message):
            OnecatConfig.from_config({**good, change[0]: change[1]})
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    assert OnecatAwqConfig.from_config(awq).group_size == 128
    with pytest.raises(OnecatError, match="GEMM checkpoints with zero points"):
        OnecatAwqConfig.from_config({**awq, "version": "gemv"})
    # claimed on sm_70 (or by name), left to vLLM elsewhere
    override = OnecatAwqConfig.override_quantization_method
    assert override(awq, None) is None  # this CPU
    assert override(awq, "onecat_awq") == "onecat_awq"
    monkeypatch.setattr(plugin_config, "_is_sm70", lambda: True)
    assert override(awq, None) == "onecat_awq" and override(awq, "awq") == "onecat_awq"
    assert override(awq, "gptq") is None and override({"quant_method": "gptq"}, None) is None
    assert OnecatConfig.get_min_capability() == 70
