"""Capacity planning (issue #42 item 3): ``onecat.runtime.capacity`` (the arithmetic the
engine's planner and ``onecat plan`` share), ``onecat.runtime.plan`` (from the artifact alone)
and ``--kv-cache-memory-bytes`` / ``--kv-cache-dtype`` (CPU, tiny models; real 27B / 35B-A3B
shapes on the meta device, no weights allocated)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from bench_helpers import load_bench
from click.testing import CliRunner
from runtime_helpers import write_awq_checkpoint

from onecat.cli import main
from onecat.errors import OnecatError
from onecat.pack.writer import pack_checkpoint
from onecat.runtime import capacity
from onecat.runtime.config import EngineConfig
from onecat.runtime.engine import LLMEngine
from onecat.runtime.models.config import ModelConfig
from onecat.runtime.plan import plan_artifact, plan_capacity
from onecat.runtime.quant_plan import QuantPlan
from onecat.tiny import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A float dense model and a packed MoE artifact (packed experts, folded shared expert)."""
    root = tmp_path_factory.mktemp("capacity")
    dense = build_tiny_model("qwen3_5", root / "dense")
    moe = build_tiny_model("qwen3_5_moe", root / "moe")
    write_awq_checkpoint(moe, root / "moe-awq")
    pack_checkpoint(root / "moe-awq", root / "moe-packed", show_progress=False)
    return {"dense": dense, "moe-packed": root / "moe-packed"}


# --- sizes and dtypes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value",
    [
        ("8589934592", 8 << 30),
        ("8G", 8 << 30),
        ("8GiB", 8 << 30),
        ("8g", 8 * 10**9),
        ("8GB", 8 * 10**9),
        ("25.6k", 25600),
        ("512M", 512 << 20),
        ("1.5GB", 1_500_000_000),
        (" 4 KiB ", 4096),
    ],
)
def test_sizes_read_as_vllm_reads_them(text, value):
    assert capacity.parse_bytes(text, "--kv-cache-memory-bytes") == value


@pytest.mark.parametrize("text", ["8XB", "lots", "-1", "0", "8.5G", "1.5", "8 G B", ""])
def test_bad_sizes_name_the_flag(text):
    with pytest.raises(OnecatError, match="--gpu-memory"):
        capacity.parse_bytes(text, "--gpu-memory")


def test_kv_cache_dtypes_come_from_one_registry():
    assert capacity.kv_cache_dtype_choices() == list(capacity.KV_CACHE_DTYPES) == ["auto", "fp8_e5m2", "int8"]
    assert capacity.kv_element_bytes("auto", 2) == 2 and capacity.kv_element_bytes("auto", 4) == 4
    assert capacity.kv_element_bytes("fp8_e5m2", 2) == capacity.kv_element_bytes("int8", 4) == 1
    assert capacity.kv_scale_bytes("auto") == capacity.kv_scale_bytes("fp8_e5m2") == 0
    assert capacity.kv_scale_bytes("int8") == 4  # one fp32 scale per token and KV head
    with pytest.raises(OnecatError, match="--kv-cache-dtype fp8_e4m3 is not supported.*auto"):
        capacity.kv_element_bytes("fp8_e4m3", 2)
    # 27B attention: 16 layers x 4 KV heads x 256, 16-token blocks
    fp16 = capacity.kv_block_bytes(16, 4, 256, 16, 2)
    assert fp16 == 16 * 16 * 2 * 4 * 256 * 2
    assert capacity.kv_block_bytes(16, 4, 256, 16, 1) * 2 == fp16
    assert capacity.kv_block_bytes(16, 4, 256, 16, 1, 4) == 16 * 16 * 2 * 4 * (256 + 4)
    assert "--kv-cache-dtype fp8_e5m2" in capacity.fit_hints(1) and "--kv-cache-dtype int8" in capacity.fit_hints(1)
    assert "--kv-cache-dtype" not in capacity.fit_hints(1, "int8")


# --- the arithmetic ------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [10_000, 123_457, 1 << 20, 50 << 20])
@pytest.mark.parametrize("drafts", [0, 2])
def test_plan_never_allocates_more_than_the_budget(budget, drafts):
    shape = capacity.CacheShape(
        block_size=16, block_bytes=4096, slot_bytes=20_000, num_drafts=drafts
    )
    plan = capacity.plan_caches(budget, shape, max_num_seqs=64, max_len=4096, prefix_caching=True)
    if plan.allocated_bytes > budget:  # not even one slot beside a block: refused
        assert plan.num_blocks == 0
        with pytest.raises(OnecatError, match="does not fit: one sequence needs 1 KV blocks"):
            capacity.check_fits(plan, None)
        return
    # slots take at most half the budget, checkpoints at most an eighth
    assert plan.num_slots * shape.per_slot_bytes <= max(budget // 2, shape.per_slot_bytes)
    assert plan.num_checkpoints * shape.slot_bytes <= budget // 8
    if plan.num_blocks:  # the rest is blocks: not one more fits
        assert plan.allocated_bytes + shape.block_bytes > budget


def test_concurrency_counts_blocks_and_slots():
    shape = capacity.CacheShape(block_size=16, block_bytes=1000, slot_bytes=10)
    plan = capacity.CachePlan(
        10**6, num_blocks=1000, num_slots=5, num_checkpoints=0, wanted_slots=8, shape=shape
    )
    assert plan.capacity_tokens == 16000
    assert plan.concurrency(4096) == 3  # 256 blocks each
    assert plan.concurrency(16) == 5  # the slots bind
    capacity.check_fits(plan, 16000)
    with pytest.raises(
        OnecatError, match=r"does not fit: one --max-model-len 16001 sequence.*at most 16000 fits"
    ):
        capacity.check_fits(plan, 16001)


# --- the plan agrees with the engine -------------------------------------------------------


def _storage_bytes(model: torch.nn.Module) -> int:
    storages = {}
    for t in [*model.parameters(), *model.buffers()]:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("name", ["dense", "moe-packed"])
@pytest.mark.parametrize(
    "budget, seqs, caching, kv_dtype",
    [
        (1 << 20, 8, True, "auto"),
        (300_000, 64, True, "auto"),
        (2 << 20, 4, False, "auto"),
        (1 << 20, 8, True, "fp8_e5m2"),
        (1 << 20, 8, True, "int8"),
    ],
)
def test_plan_matches_what_the_engine_allocates(models, name, budget, seqs, caching, kv_dtype):
    path = models[name]
    engine = LLMEngine(
        EngineConfig(
            model=str(path),
            device="cpu",
            kv_cache_memory_bytes=budget,
            max_num_seqs=seqs,
            enable_prefix_caching=caching,
            kv_cache_dtype=kv_dtype,
        )
    )
    runner = engine.runner
    report = plan_artifact(
        path,
        gpu_memory=None,
        kv_cache_memory_bytes=budget,
        max_num_seqs=seqs,
        enable_prefix_caching=caching,
        dtype=torch.float32,  # the CPU engine's activations
        kv_cache_dtype=kv_dtype,
    )
    cache = report.cache
    assert (cache.num_blocks, cache.num_slots, cache.num_checkpoints) == (
        runner.num_blocks,
        runner.num_slots,
        runner.num_checkpoints,
    )
    assert report.cache.shape == runner.cache_shape()
    allocated = _cache_bytes(runner)
    assert allocated == cache.allocated_bytes <= budget
    assert report.weight_bytes == _storage_bytes(runner.model)  # exact, from headers only
    assert report.serving_len == engine.max_model_len


def _cache_bytes(runner) -> int:
    """Bytes of the engine's KV cache (one tensor, every layer a view; an int8 cache's scales in
    a second one) and GDN state tensors."""
    kv = runner.attention[0].k_cache.untyped_storage().nbytes() if runner.attention else 0
    if runner.attention and runner.attention[0].k_scale is not None:
        kv += runner.attention[0].k_scale.untyped_storage().nbytes()
    return kv + sum(t.untyped_storage().nbytes() for group in runner.state_groups for t in group)


def test_8_bit_caches_hold_about_twice_the_tokens(models):
    """The same exact budget: fp8_e5m2 and int8 blocks are about half as big (int8 pays 4
    bytes per token and KV head for its scales), so the plan and the engine count ~2x the
    blocks; the cache tensors are uint8 / int8."""
    path = models["dense"]
    tokens = {}
    for kv_dtype in ("auto", "fp8_e5m2", "int8"):
        report = plan_artifact(path, gpu_memory=None, kv_cache_memory_bytes=4 << 20, max_num_seqs=2,
                               dtype=torch.float16, kv_cache_dtype=kv_dtype)  # fmt: skip
        tokens[kv_dtype] = report.cache.capacity_tokens
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", kv_cache_memory_bytes=4 << 20, max_num_seqs=2,
                                    kv_cache_dtype="int8"))  # fmt: skip
    head_dim = engine.runner.model_config.head_dim  # small here: the scales weigh 4 / head_dim
    assert tokens["fp8_e5m2"] >= 1.99 * tokens["auto"]
    assert tokens["int8"] >= 0.99 * 2 * head_dim / (head_dim + 4) * tokens["auto"]
    assert tokens["int8"] < tokens["fp8_e5m2"]
    layer = engine.runner.attention[0]
    assert layer.k_cache.dtype == torch.int8 and layer.k_scale.dtype == torch.float32
    assert layer.k_scale.shape == layer.k_cache.shape[:3]


def test_the_engine_refuses_what_the_plan_refuses(models):
    path = models["dense"]
    flags = dict(kv_cache_memory_bytes=200_000, max_num_seqs=4, max_model_len=2048)
    report = plan_artifact(path, gpu_memory=None, dtype=torch.float32, **flags)
    assert not report.fits and report.problem.startswith(
        "does not fit: one --max-model-len 2048 sequence"
    )
    with pytest.raises(OnecatError) as refused:
        LLMEngine(EngineConfig(model=str(path), device="cpu", **flags))
    assert str(refused.value) == report.problem


# --- the command line ----------------------------------------------------------------------


def test_plan_command_table_and_json(models):
    path = str(models["moe-packed"])
    runner = CliRunner()
    table = runner.invoke(main, ["plan", path, "--gpu-memory", "2GiB", "--max-model-len", "2048"])
    assert table.exit_code == 0, table.output
    for row in (
        "weights",
        "KV cache + GDN states",
        "longest context",
        "sequences of 4k",
        "sequences of 32k",
    ):
        assert row in table.output
    as_json = runner.invoke(
        main, ["plan", path, "--gpu-memory", "2GiB", "--max-model-len", "2048", "--json"]
    )
    assert as_json.exit_code == 0, as_json.output
    report = json.loads(as_json.stdout)
    assert report["fits"] and report["max_model_len"] == 2048
    assert report["num_kv_blocks"] * report["kv_block_size"] == report["kv_capacity_tokens"] >= 2048
    assert (
        set(report["concurrency"]) == {"4096", "32768"} and report["concurrency"]["4096"] == 0
    )  # > 2048
    exact = runner.invoke(main, ["plan", path, "--kv-cache-memory-bytes", "1M", "--json"])
    assert exact.exit_code == 0, exact.output
    assert json.loads(exact.stdout)["kv_cache_memory_bytes"] == 1 << 20


def test_plan_command_does_not_fit(models):
    result = CliRunner().invoke(main, ["plan", str(models["dense"]), "--gpu-memory", "1GiB"])
    assert result.exit_code == 1
    assert "error: does not fit" in result.output and "-tp 2" in result.output
    result = CliRunner().invoke(
        main,
        [
            "plan",
            str(models["dense"]),
            "--kv-cache-memory-bytes",
            "100K",
            "--max-model-len",
            "2048",
            "--json",
        ],
    )
    assert result.exit_code == 1 and json.loads(result.stdout)["fits"] is False
    assert "does not fit: one --max-model-len 2048 sequence" in result.stderr


def test_plan_command_bad_inputs(models, tmp_path):
    runner = CliRunner()
    path = str(models["dense"])
    bad = runner.invoke(main, ["plan", path, "--gpu-memory", "32XB"])
    assert bad.exit_code == 2 and "--gpu-memory '32XB' is not a size" in bad.output
    bad = runner.invoke(main, ["plan", path, "--gpu-memory", "32GiB", "--kv-cache-dtype", "fp8"])
    assert bad.exit_code == 2 and "--kv-cache-dtype fp8 is not supported" in bad.output
    for kv_dtype in ("fp8_e5m2", "int8"):
        ok = runner.invoke(main, ["plan", path, "--gpu-memory", "32GiB", "--kv-cache-dtype", kv_dtype, "--json"])
        assert ok.exit_code == 0 and json.loads(ok.stdout)["kv_cache_dtype"] == kv_dtype, ok.output
    missing = runner.invoke(main, ["plan", path])
    assert missing.exit_code == 1 and "--gpu-memory" in missing.output
    empty = tmp_path / "empty"
    empty.mkdir()
    unreadable = runner.invoke(main, ["plan", str(empty), "--gpu-memory", "32GiB"])
    assert unreadable.exit_code == 1 and str(empty / "config.json") in unreadable.output
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    (broken / "config.json").write_text("{oops")
    unreadable = runner.invoke(main, ["plan", str(broken), "--gpu-memory", "32GiB"])
    assert unreadable.exit_code == 1 and str(broken / "config.json") in unreadable.output
    tp = runner.invoke(main, ["plan", path, "--gpu-memory", "32GiB", "-tp", "3"])
    assert tp.exit_code == 1 and "--tensor-parallel-size 3" in tp.output


def test_serve_refuses_before_loading_weights(models, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the engine was built")

    monkeypatch.setattr("onecat.runtime.engine.LLMEngine.__init__", never)
    args = ["--device", "cpu", "--kv-cache-memory-bytes", "100K", "--max-model-len", "2048"]
    result = CliRunner().invoke(main, ["serve", str(models["dense"]), *args])
    assert result.exit_code == 1, result.output
    plan = plan_artifact(
        models["dense"],
        gpu_memory=None,
        kv_cache_memory_bytes=100 << 10,
        max_model_len=2048,
        dtype=torch.float32,
    )
    assert f"error: {plan.problem}" in result.output
    bad = CliRunner().invoke(
        main, ["serve", str(models["dense"]), "--kv-cache-memory-bytes", "lots"]
    )
    assert bad.exit_code == 2 and "--kv-cache-memory-bytes 'lots' is not a size" in bad.output


def test_generate_takes_the_budget(models):
    args = [
        "--device",
        "cpu",
        "--kv-cache-memory-bytes",
        "1M",
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
    ]
    result = CliRunner().invoke(main, ["generate", str(models["dense"]), *args])
    assert result.exit_code == 0, result.output


def test_vllm_gets_the_budget_in_bytes(tmp_path, monkeypatch):
    calls = []

    def fake_serve(artifact, **kwargs):
        calls.append(kwargs)

    monkeypatch.setattr("onecat.vllm_plugin.launcher.serve_from_onecat_flags", fake_serve)
    CliRunner().invoke(
        main, ["serve", str(tmp_path), "--engine", "vllm", "--kv-cache-memory-bytes", "8G"]
    )
    assert calls and calls[0]["vllm_args"] == ("--kv-cache-memory-bytes", str(8 << 30))
    assert "kv_cache_memory_bytes" not in calls[0] and "kv_cache_dtype" not in calls[0]
    CliRunner().invoke(main, ["serve", str(tmp_path), "--engine", "vllm", "--kv-cache-dtype", "fp8_e5m2"])
    assert calls[1]["vllm_args"] == ("--kv-cache-dtype", "fp8_e5m2")
    refused = CliRunner().invoke(main, ["serve", str(tmp_path), "--engine", "vllm", "--kv-cache-dtype", "int8"])
    assert refused.exit_code == 2 and "vLLM has no int8 KV cache" in refused.output and len(calls) == 2


# --- real shapes (meta device: nothing allocated) ------------------------------------------


def _bench_shape(name: str) -> ModelConfig:
    raw = load_bench("e2e").text_config(name)
    raw["max_position_embeddings"] = 262144  # the released models'
    return ModelConfig.from_dict(raw)


def test_27b_at_4_bits_needs_a_32gib_card_for_32k():
    cfg = _bench_shape("27b")
    packed = QuantPlan(default=128)  # every linear that fits, as bench/e2e.py packs it
    small = plan_capacity(cfg, packed, gpu_memory=16 << 30, max_model_len=32768)
    assert not small.fits and small.problem.startswith("does not fit") and "-tp 2" in small.problem
    # weights per GPU: BENCHMARKS.md measured 16.8 GiB for this model on the GPU
    assert abs(small.weight_bytes / 2**30 - 16.8) < 0.1
    big = plan_capacity(cfg, packed, gpu_memory=32 << 30, max_model_len=32768)
    assert big.fits and big.concurrency[32768] >= 1 and big.concurrency[4096] >= 8
    assert big.cache.capacity_tokens >= 32768 and big.cache.allocated_bytes <= big.cache.budget
    # a state slot is ~150 MB (48 GDN layers of fp32 [48, 128, 128] plus the conv taps)
    assert 140 << 20 < big.cache.shape.slot_bytes < 160 << 20
    tp2 = plan_capacity(
        cfg, packed, gpu_memory=32 << 30, tensor_parallel_size=2, max_model_len=32768
    )
    assert (
        tp2.weight_bytes < 0.65 * big.weight_bytes
        and tp2.concurrency[32768] > big.concurrency[32768]
    )


def test_35b_a3b_shapes():
    cfg = _bench_shape("35b-a3b")
    packed = QuantPlan(default=128)
    one = plan_capacity(cfg, packed, gpu_memory=32 << 30, max_model_len=32768)
    assert one.fits and abs(one.weight_bytes / 2**30 - 18.6) < 0.1  # BENCHMARKS.md: 18.6 GiB
    assert not plan_capacity(cfg, packed, gpu_memory=16 << 30, max_model_len=32768).fits
    two = plan_capacity(
        cfg, packed, gpu_memory=16 << 30, tensor_parallel_size=2, max_model_len=32768
    )
    assert two.weight_bytes < 0.6 * one.weight_bytes  # the experts split over the ranks
    assert two.fits and two.concurrency[32768] >= 1
    # a 256k context: 10 attention layers x 2 KV heads x 256 x 2 (K, V) x fp16 = 20 KiB a token
    flags = dict(gpu_memory=None, max_model_len=262144, max_num_seqs=4)
    exact = plan_capacity(cfg, packed, kv_cache_memory_bytes=8 << 30, **flags)
    assert exact.fits and exact.cache.budget == 8 << 30 and exact.cache.capacity_tokens >= 262144
    assert exact.cache.shape.block_bytes == 16 * 20 << 10
    short = plan_capacity(cfg, packed, kv_cache_memory_bytes=4 << 30, **flags)
    assert not short.fits and "--max-model-len 262144" in short.problem
    assert "--kv-cache-dtype int8" in short.problem
    # an 8-bit cache: the same budget holds the 256k context (int8: 10 x 2 x 2 x (256 + 4) bytes a token)
    for kv_dtype in ("fp8_e5m2", "int8"):
        small = plan_capacity(cfg, packed, kv_cache_memory_bytes=4 << 30, kv_cache_dtype=kv_dtype, **flags)
        assert small.fits and small.cache.capacity_tokens >= 1.9 * short.cache.capacity_tokens
    int8 = plan_capacity(cfg, packed, kv_cache_memory_bytes=4 << 30, kv_cache_dtype="int8", **flags)
    assert int8.cache.shape.block_bytes == 16 * 10 * 2 * 2 * (256 + 4)
