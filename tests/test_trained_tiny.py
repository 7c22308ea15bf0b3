"""The trained tiny Qwen3.5 fixtures (``onecat/tiny_train.py``, ``onecat/fixtures/``).

Trained weights have real next-token margins, so engines are compared on greedy tokens
exactly, with no near-tie allowance: onecat's embedded engine (eager, CPU fp32) against
transformers (fp32, a full forward pass per step) on chat and plain-text prompts. The
smallest top-1 margin of every compared step is printed and must be far above the engines'
fp32 difference (about 1e-5 in logits, checked), so agreement is not luck.
"""

from __future__ import annotations

import json

import pytest
import torch
from runtime_helpers import drain, record_logits

from onecat.tiny_train import fixture_dir

FAMILIES = ("qwen3_5", "qwen3_5_moe")
MAX_TOKENS = 24
MIN_MARGIN = 1e-3
"""Smallest allowed top-1 logit lead over the runner-up at a compared step: ten times ATOL
(observed smallest: 0.0028 dense, 0.0028 MoE)."""
ATOL = 1e-4
"""Largest allowed logit difference between the engines (observed about 1e-5): the margins
are checked against it, so identical tokens are not luck."""
CHAT_QUESTIONS = ('Explain: The "while" statement', 'Explain: The "if" statement')
TEXT_PROMPTS = (
    'The "if" statement is used for',
    'Assert statements are a convenient way',
    'The "for" statement is used to',
    'Lists are mutable sequences',
    'The "with" statement is used to wrap',
    "Assignment statements are used to",
    "def main(argv):\n    return",
)

pytestmark = pytest.mark.usefixtures("one_thread")


def prompts(tokenizer) -> list[list[int]]:
    """Token ids of the chat questions (with the generation prompt) and the text prompts."""
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in CHAT_QUESTIONS
    ]
    return [tokenizer.encode(text, add_special_tokens=False) for text in chats + list(TEXT_PROMPTS)]


@pytest.mark.parametrize("family", FAMILIES)
def test_fixture_has_the_real_layout_and_its_recipe(family):
    path = fixture_dir(family)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == family
    assert config["text_config"]["layer_types"].count("full_attention") == 1
    weights = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" in weights
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in weights
    assert "model.language_model.layers.3.self_attn.q_proj.weight" in weights
    mtp = {name for name in weights if name.startswith("mtp.")}
    for name in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                 "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight",
                 "mtp.layers.0.input_layernorm.weight"):
        assert name in mtp
    if family == "qwen3_5_moe":
        assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in weights
        assert "mtp.layers.0.mlp.experts.gate_up_proj" in weights
        assert "mtp.layers.0.mlp.shared_expert.down_proj.weight" in weights
    record = json.loads((path / "training.json").read_text())
    assert record["command"].startswith("python -m onecat.tiny_train")
    assert record["torch"] and record["heldout_ppl"] < 100
    size = sum(p.stat().st_size for p in path.iterdir())
    assert size < 8 * 2**20, f"{path} holds {size} bytes: fixtures must stay small"


@torch.no_grad()
def transformers_greedy(model, prompt: list[int], eos: int) -> tuple[list[int], float, torch.Tensor]:
    """Greedy tokens of transformers' model (a full forward pass per step, stopping after the
    end-of-sequence token), the smallest top-1 margin of its steps and their logits."""
    ids, margin, rows = list(prompt), float("inf"), []
    for _ in range(MAX_TOKENS):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        rows.append(logits)
        top = logits.topk(2).values
        margin = min(margin, (top[0] - top[1]).item())
        ids.append(int(logits.argmax()))
        if ids[-1] == eos:
            break
    return ids[len(prompt) :], margin, torch.stack(rows)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_equals_transformers_exactly(family):
    import transformers

    from onecat.runtime.config import EngineConfig
    from onecat.runtime.engine import LLMEngine
    from onecat.runtime.sampling_params import SamplingParams

    path = fixture_dir(family)
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", max_model_len=256, enforce_eager=True))
    engine_logits = record_logits(engine)
    tokenizer = engine.tokenizer
    eos = tokenizer.eos_token_id
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    all_prompts = prompts(tokenizer)
    for i, ids in enumerate(all_prompts):
        engine.add_request(f"p{i}", ids, params)
    outputs = drain(engine)
    smallest, worst = float("inf"), 0.0
    for i, ids in enumerate(all_prompts):
        ours = [t for out in outputs[f"p{i}"] for t in out.new_token_ids]
        theirs, margin, rows = transformers_greedy(reference, ids, eos)
        smallest = min(smallest, margin)
        print(f"{family} {tokenizer.decode(ids)!r} -> {tokenizer.decode(theirs)!r} (margin {margin:.4f})")
        assert ours == theirs, (
            f"{family} prompt {tokenizer.decode(ids)!r}: onecat {tokenizer.decode(ours)!r} vs "
            f"transformers {tokenizer.decode(theirs)!r}"
        )
        worst = max(worst, (torch.stack(engine_logits[f"p{i}"][: len(ours)]) - rows).abs().max().item())
    print(f"\n{family}: {len(all_prompts)} prompts identical; smallest top-1 margin {smallest:.4f}, "
          f"largest logit difference {worst:.2e}")
    assert worst <= ATOL, f"{family}: engine and transformers logits differ by {worst:.3g}"
    assert smallest >= MIN_MARGIN, f"{family}: a greedy step has top-1 margin {smallest:.4f}"
