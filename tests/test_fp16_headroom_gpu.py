"""GPU tests of the fp16 headroom plan: the overflowing trained tiny Qwen3.5
(``fp16_headroom_helpers.overflow_checkpoint``) through the real fp16 CUDA paths, plain
(the start-up audit, on the GPU in fp32) and packed (the plan ``onecat quantize`` wrote,
carried by ``onecat pack``), against the CPU fp32 runtime."""

from __future__ import annotations

import pytest
import torch
from fp16_headroom_helpers import forward_logits, overflow_checkpoint
from runtime_helpers import drain, record_logits
from transformers import AutoTokenizer

from onecat.formats.fp16_headroom import HeadroomPlan
from onecat.runtime.config import EngineConfig
from onecat.runtime.engine.llm_engine import LLMEngine
from onecat.runtime.fp16_audit import audit_token_ids, startup_plan
from onecat.runtime.loader import load_model
from onecat.runtime.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
LOGIT_ATOL = 0.15
"""fp16 GPU against fp32 CPU logits (peak ~13; the CPU fp16 run differs by 0.017)."""


@pytest.fixture(scope="module")
def overflow(tmp_path_factory):
    """(checkpoint, a prompt of 96 tokens of the audit text)."""
    path = overflow_checkpoint(tmp_path_factory.mktemp("fp16gpu") / "overflow")
    prompt = audit_token_ids(AutoTokenizer.from_pretrained(path), sequences=1, seqlen=96)[0]
    return path, prompt


def test_plain_checkpoint_on_gpu_with_the_startup_audit(overflow):
    path, prompt = overflow
    fp32 = forward_logits(load_model(path, CPU, torch.float32), prompt, CPU)
    plain = forward_logits(load_model(path, CUDA, torch.float16), prompt, CUDA)
    assert not bool(torch.isfinite(plain).all())
    plan = startup_plan(path, AutoTokenizer.from_pretrained(path), CUDA)
    assert plan is not None and plan.residual_shift >= 5
    handled = forward_logits(load_model(path, CUDA, torch.float16, headroom=plan), prompt, CUDA).cpu()
    assert bool(torch.isfinite(handled).all())
    torch.testing.assert_close(handled, fp32, atol=LOGIT_ATOL, rtol=0)


def test_packed_artifact_on_gpu_with_the_quantize_plan(overflow, tmp_path):
    from onecat.pack.writer import pack_checkpoint
    from onecat.quantize.pipeline import quantize_model

    path, prompt = overflow
    with pytest.warns(UserWarning):
        awq = quantize_model(path, tmp_path / "awq", samples=4, seqlen=64, group_size=32, show_progress=False)
    packed = pack_checkpoint(awq, tmp_path / "packed", show_progress=False)
    fp32 = forward_logits(load_model(packed, CPU, torch.float32, headroom=HeadroomPlan()), prompt, CPU)
    plain = forward_logits(load_model(packed, CUDA, torch.float16, headroom=HeadroomPlan()), prompt, CUDA)
    assert not bool(torch.isfinite(plain).all())
    handled = forward_logits(load_model(packed, CUDA, torch.float16), prompt, CUDA).cpu()
    assert bool(torch.isfinite(handled).all())
    torch.testing.assert_close(handled, fp32, atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_engine_serves_the_overflowing_checkpoint(overflow, eager):
    """LLMEngine on CUDA audits the plain checkpoint at start-up: prefill and decode (kernels,
    CUDA graphs) give finite logits, the prompt's last row matching CPU fp32."""
    path, prompt = overflow
    config = EngineConfig(model=str(path), device="cuda", max_num_batched_tokens=128, kv_block_size=16,
                          num_kv_blocks=64, max_num_seqs=4, max_model_len=256, enforce_eager=eager)
    engine = LLMEngine(config)
    logits = record_logits(engine)
    engine.add_request("a", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    drain(engine)
    rows = torch.stack(logits["a"])
    assert rows.shape[0] == 8 and bool(torch.isfinite(rows).all())
    fp32 = forward_logits(load_model(path, CPU, torch.float32), prompt, CPU)
    torch.testing.assert_close(rows[0].cpu(), fp32[-1], atol=LOGIT_ATOL, rtol=0)
