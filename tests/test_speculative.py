"""MTP speculative decoding (``engine/speculative.py``) on the trained tiny Qwen3.5 models.

Their MTP heads were trained (``onecat/tiny_train.py``), so drafts are often right and the
accept / reject / roll-back paths all run. Greedy output must equal decoding without
speculation exactly (trained margins); the MTP head must compute what the training-time
module computes; rejection sampling must emit each token with the target distribution.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runtime_helpers import drain, emulate_graphs

from onecat.errors import OnecatError
from onecat.runtime.config import EngineConfig
from onecat.runtime.engine import LLMEngine
from onecat.runtime.engine.speculative import SpeculativeConfig, accept_random
from onecat.runtime.sampling_params import SamplingParams
from onecat.tiny_train import fixture_dir

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ('The "if" statement is used for', "def main(argv):\n    return", "Lists are mutable sequences")


def _engine(family: str, n: int | None, device: str = "cpu", **config) -> LLMEngine:
    spec = None if n is None else {"method": "mtp", "num_speculative_tokens": n}
    return LLMEngine(EngineConfig(model=str(fixture_dir(family)), device=device, max_num_seqs=4,
                                  speculative_config=spec, **config))


def _run(engine: LLMEngine, params: SamplingParams, plain: SamplingParams | None = None) -> dict[str, list[int]]:
    """Three prompts, two of them arriving while the first decodes; with ``plain`` a fourth
    request that cannot speculate (it asks for logprobs) decodes beside them."""
    ids = [engine.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    engine.add_request("a", ids[0], params)
    outputs = {}
    for _ in range(3):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.add_request("b", ids[1], params)
    engine.add_request("c", ids[2], params)
    if plain is not None:
        engine.add_request("plain", ids[0], plain)
    for rid, outs in drain(engine).items():
        outputs.setdefault(rid, []).extend(t for o in outs for t in o.new_token_ids)
    return outputs


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_greedy_speculation_gives_the_tokens_of_plain_decoding(family):
    params = SamplingParams(max_tokens=32, temperature=0.0)
    plain = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    reference = _run(_engine(family, None), params, plain)
    for n in (1, 3, 4):
        engine = _engine(family, n)
        assert _run(engine, params, plain) == reference, f"{family} with {n} drafts"
        stats = engine.stats()
        assert stats["spec_decode_num_drafts"] > 0
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
        per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
        assert len(per_pos) == n and sum(per_pos) == stats["spec_decode_num_accepted_tokens"]
        assert stats["free_kv_blocks"] == stats["total_kv_blocks"] and stats["running"] == 0


def test_speculation_with_chunked_prompts_and_preemption_keeps_greedy_tokens():
    """A tight token budget (prompts in chunks beside verify chunks) and a KV cache small
    enough that sequences are preempted and recomputed, drafts and all."""
    params = SamplingParams(max_tokens=40, temperature=0.0)
    tight = dict(max_num_batched_tokens=16, kv_block_size=4, num_kv_blocks=40)
    reference = _run(_engine("qwen3_5", None, **tight), params)
    assert _run(_engine("qwen3_5", 3, **tight), params) == reference


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_speculation_with_tensor_parallelism_keeps_greedy_tokens(family):
    """Two CPU ranks: verify passes, roll-backs and drafting run on every rank (the MTP
    head's layer is split like the model's, experts by rank); tokens are plain single-rank
    decoding's."""
    params = SamplingParams(max_tokens=24, temperature=0.0)
    reference = _run(_engine(family, None), params)
    engine = _engine(family, 3, tensor_parallel_size=2)
    try:
        assert _run(engine, params) == reference
        assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_verify_graphs_keep_greedy_tokens(family, monkeypatch):
    """Verify steps replay (CPU-emulated) decode graphs of 1 + N rows per sequence (padding
    rows, the per-position GDN state rows, the state put back after a rejection), and the MTP
    head drafts in the draft graph that follows them."""
    params = SamplingParams(max_tokens=32, temperature=0.0)
    plain = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    reference = _run(_engine(family, None), params, plain)
    engine = _engine(family, 3)
    emulate_graphs(monkeypatch, engine)
    calls = []
    accept_drafts = engine.runner.accept_drafts
    monkeypatch.setattr(engine.runner, "accept_drafts", lambda pairs: (calls.append(pairs), accept_drafts(pairs)))
    drafted = []
    with_graph = engine.runner._propose_with_graph
    monkeypatch.setattr(engine.runner, "_propose_with_graph", lambda *a: drafted.append(with_graph(*a)) or drafted[-1])
    assert _run(engine, params, plain) == reference
    assert 4 in {key[1] for key in engine.runner.graphs}  # verify graphs of 1 + 3 rows ran
    assert any(d is not None for d in drafted), "the draft graph never ran"
    assert any(calls), "no draft was rejected: the roll-back went untested"
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0


def test_draft_head_is_lm_head_rounded_to_4_bits():
    """The drafter's lm_head: every weight within about half a step of the original (round to
    nearest, per group of 128), zero kept exactly; a shape the layout cannot hold gets none."""
    from onecat.pack.volta_layout import dequantize_volta
    from onecat.runtime.layers.draft_head import GROUP_SIZE, quantized_draft_head
    from onecat.runtime.layers.linear import Linear

    torch.manual_seed(0)
    head = Linear(256, 8192 + 96, dtype=torch.float16)  # two passes of rows, the last partial
    head.weight.data.normal_(0, 0.05)
    head.weight.data[5, :GROUP_SIZE] = 0
    draft = quantized_draft_head(head)
    dense = dequantize_volta(draft.qweight, draft.scales_zeros, GROUP_SIZE).float()
    w = head.weight.float()
    groups = w.reshape(w.shape[0], -1, GROUP_SIZE)
    step = ((groups.amax(-1).clamp(min=0) - groups.amin(-1).clamp(max=0)) / 15).clamp(min=1e-5)
    err = (dense - w).abs().reshape_as(groups)
    # half a step, plus the fp16 rounding of the scale and of -zero*scale (measured: 0.507)
    assert (err <= 0.52 * step[..., None]).all()
    assert torch.equal(dense[5, :GROUP_SIZE], torch.zeros(GROUP_SIZE))
    x = torch.randn(3, 256, dtype=torch.float16)
    assert torch.allclose(draft(x).float(), x.float() @ dense.t(), atol=2e-2, rtol=1e-2)
    assert quantized_draft_head(Linear(100, 64, dtype=torch.float16)) is None


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_mtp_head_computes_what_it_was_trained_as(family):
    """The engine's MTP pass over a prompt against ``tiny_train.MtpHead`` (transformers'
    decoder layer, the training-time module) on the same weights: same logits."""
    import transformers
    from safetensors.torch import load_file

    from onecat.tiny_train import MtpHead

    path = fixture_dir(family)
    cls = transformers.Qwen3_5MoeForConditionalGeneration if family.endswith("moe") else transformers.Qwen3_5ForConditionalGeneration
    model = cls.from_pretrained(path, dtype=torch.float32).eval()
    head = MtpHead(model).eval()
    state = {}
    for shard in Path(path).glob("*.safetensors"):
        state.update({k[len("mtp."):]: v.float() for k, v in load_file(shard).items() if k.startswith("mtp.")})
    head.load_state_dict(state, strict=True)

    engine = _engine(family, 2)
    captured = []
    run_mtp = engine.runner._run_mtp
    engine.runner._run_mtp = lambda *args: captured.append(run_mtp(*args)) or captured[-1]
    prompt = engine.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    engine.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=0.0))
    (out,) = engine.step()  # prefill, first token, then the MTP pass over every prompt position
    engine.abort_request("r")
    tokens = prompt + out.new_token_ids
    got = engine.runner.model.compute_logits(captured[0])

    with torch.no_grad():
        ids = torch.tensor([tokens])
        text = model.model.language_model
        hidden = text(input_ids=ids[:, :-1]).last_hidden_state
        positions = torch.arange(len(prompt)).view(1, 1, -1).expand(3, 1, -1)
        rope = text.rotary_emb(hidden, positions)
        want = model.lm_head(head(hidden, text.embed_tokens(ids[:, 1:]), rope))[0]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def test_rejection_sampling_emits_the_target_distribution():
    """Whatever the draft, the first emitted token is distributed as the target row, and
    after a kept draft the next one as the next row."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]])
    trials = 20000
    for draft in (0, 3):
        first = torch.zeros(4)
        second = torch.zeros(4)
        for _ in range(trials):
            kept, token = accept_random(probs, [draft], gen)
            first[draft if kept else token] += 1
            if kept:
                second[token] += 1
        torch.testing.assert_close(first / trials, probs[0], atol=0.015, rtol=0)
        torch.testing.assert_close(second / second.sum(), probs[1], atol=0.03, rtol=0)


def test_seeded_sampling_with_speculation_is_reproducible():
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7)
    runs = [_run(_engine("qwen3_5", 3), params) for _ in range(2)]
    assert runs[0] == runs[1]
    assert all(len(tokens) == 24 for tokens in runs[0].values())


@pytest.mark.parametrize("value, message", [
    ("{", "not valid JSON"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "not supported"),
    ('{"method": "mtp", "num_speculative_tokens": 9}', "from 1 to 4"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "model": "x"}', "unsupported field"),
])
def test_bad_speculative_config_is_refused_by_name(value, message):
    with pytest.raises(OnecatError, match=message):
        SpeculativeConfig.parse(value)


def test_checkpoint_without_mtp_head_is_refused(tmp_path):
    from onecat.tiny import build_tiny_model

    path = build_tiny_model("qwen3_5", tmp_path / "m")
    for shard in path.glob("model-mtp*.safetensors"):
        shard.unlink()
    index = path / "model.safetensors.index.json"
    if index.exists():
        import json

        data = json.loads(index.read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items() if not k.startswith("mtp.")}
        index.write_text(json.dumps(data))
    with pytest.raises(OnecatError, match="mtp"):
        LLMEngine(EngineConfig(model=str(path), device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 2}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_greedy_speculation_on_gpu_with_graphs():
    """On a GPU verify chunks run through the piecewise graphs: still plain decoding's tokens."""
    params = SamplingParams(max_tokens=32, temperature=0.0)
    reference = _run(_engine("qwen3_5", None, device="cuda"), params)
    engine = _engine("qwen3_5", 3, device="cuda")
    assert _run(engine, params) == reference
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0


def test_metrics_report_acceptance_per_position():
    from onecat.runtime.server.metrics import ServerMetrics

    stats = {"spec_decode_num_drafts": 5, "spec_decode_num_draft_tokens": 15, "spec_decode_num_accepted_tokens": 7,
             "spec_decode_num_accepted_tokens_per_pos": [4, 2, 1]}
    text = ServerMetrics(lambda: stats, "m").render().decode()
    assert 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 5.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 15.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 7.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0' in text


def test_server_streams_the_same_answer_with_speculation():
    """Through the HTTP server: several tokens per engine step reach the stream as one chunk
    each, the text equals the plain server's, and /metrics counts the drafts."""
    import json

    import httpx
    from server_helpers import scrape, sse_payloads, stream_lines

    from onecat.runtime.server.launcher import BackgroundServer

    body = {"model": "m", "messages": [{"role": "user", "content": 'Explain: The "if" statement'}],
            "max_tokens": 40, "temperature": 0, "stream": True}
    answers, counters = [], None
    for n in (None, 3):
        engine = _engine("qwen3_5", n)
        engine.model_name = "m"
        with BackgroundServer(engine) as server, httpx.Client(base_url=server.url, timeout=60) as client:
            chunks = [json.loads(p) for p in sse_payloads(stream_lines(client, "/v1/chat/completions", body))]
            answers.append("".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]))
            if n:
                counters = scrape(server.url)
    assert answers[0] and answers[0] == answers[1]
    assert counters["vllm:spec_decode_num_drafts_total"] > 0
    assert counters["vllm:spec_decode_num_accepted_tokens_total"] > 0
