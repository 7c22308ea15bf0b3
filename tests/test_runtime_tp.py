"""Tensor parallelism of the embedded runtime (CPU, gloo): TP 2 and 4 against TP 1.

Tiny Qwen3.5 dense and MoE checkpoints with more heads than ``onecat.tiny``'s defaults
(8 attention heads, 2 KV heads -- replicated at TP 4 --, 4 GDN key and 8 value heads, a
shared expert wide enough to split 4 ways in 32-row tiles), as float checkpoints and as
packed artifacts (AWQ RTN g32, then ``onecat pack``). The engine runs in fp32 on CPU, so
tensor parallelism only changes the summation order of the row-parallel matmuls and the
all-reduce: logits must match TP 1 within 1e-4 absolute (logits are O(1); observed ~1e-6),
and greedy tokens must be identical, through chunked prefill and batched decode. TP 4
(three worker processes on CI's two cores) runs the packed models only, to stay fast.
"""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import drain, record_logits, write_awq_checkpoint

from onecat import tiny
from onecat.errors import OnecatError
from onecat.pack.writer import pack_checkpoint
from onecat.runtime.config import EngineConfig
from onecat.runtime.engine import LLMEngine
from onecat.runtime.sampling_params import SamplingParams

ATOL = 1e-4
WIDER = dict(
    num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=4, linear_num_value_heads=8
)
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> path of the wide tiny dense / MoE checkpoints, float and packed."""
    root = tmp_path_factory.mktemp("tp")
    base_kwargs = tiny._text_kwargs

    def wider(family: str, vocab_size: int, num_layers: int) -> dict:
        kwargs = base_kwargs(family, vocab_size, num_layers)
        kwargs.update(WIDER)
        if family == "qwen3_5_moe":
            kwargs["shared_expert_intermediate_size"] = 128
        return kwargs

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    paths = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tiny, "_text_kwargs", wider)
        for name, family in (("dense", "qwen3_5"), ("moe", "qwen3_5_moe")):
            paths[name] = tiny.build_tiny_model(family, root / name, max_shard_size="2MB")
            write_awq_checkpoint(paths[name], root / f"{name}-awq")
            pack_checkpoint(root / f"{name}-awq", root / f"{name}-packed", show_progress=False)
            paths[f"{name}-packed"] = root / f"{name}-packed"
    torch.set_num_threads(threads)
    return paths


def run(path, tp: int) -> tuple[dict, dict]:
    """Greedy outputs and per-token logits of three requests (chunked prefill, batched
    decode) on an engine with ``tp`` ranks."""
    engine = LLMEngine(EngineConfig(
        model=str(path), device="cpu", max_num_batched_tokens=16, kv_block_size=8, num_kv_blocks=64,
        tensor_parallel_size=tp,
    ))
    try:
        logits = record_logits(engine)
        for i, length in enumerate((23, 9, 5)):
            ids = torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(i)).tolist()
            engine.add_request(f"r{i}", ids, GREEDY)
        outputs = drain(engine)
        tokens = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in outputs.items()}
        assert engine.stats()["free_kv_blocks"] == engine.stats()["total_kv_blocks"]
        return tokens, {rid: torch.stack(rows) for rid, rows in logits.items()}
    finally:
        engine.close()


@pytest.fixture(scope="module")
def tp1(checkpoints):
    """TP 1 outputs of every checkpoint (computed once)."""
    torch.set_num_threads(1)
    return {name: run(path, 1) for name, path in checkpoints.items()}


@pytest.mark.parametrize(
    "tp, names", [(2, ["dense", "moe", "dense-packed", "moe-packed"]), (4, ["dense-packed", "moe-packed"])]
)
def test_tensor_parallel_matches_tp1(checkpoints, tp1, tp, names):
    torch.set_num_threads(1)
    for name in names:
        ref_tokens, ref_logits = tp1[name]
        tokens, logits = run(checkpoints[name], tp)
        assert tokens == ref_tokens, f"{name} TP{tp}: greedy tokens differ"
        for rid, ref in ref_logits.items():
            diff = (logits[rid] - ref).abs().max().item()
            assert diff < ATOL, f"{name} TP{tp} {rid}: logits differ by {diff}"


def test_indivisible_head_count_is_a_clear_error(checkpoints):
    with pytest.raises(OnecatError) as err:
        LLMEngine(EngineConfig(model=str(checkpoints["dense"]), device="cpu", tensor_parallel_size=3))
    message = str(err.value)
    assert "--tensor-parallel-size 3" in message and "num_attention_heads 8" in message
    assert "Sizes that work for this model: 1, 2, 4" in message
