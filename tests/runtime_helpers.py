"""Shared helpers of the runtime tests: tiny checkpoints (float, AWQ, packed), transformers
reference models with the same (dequantised) weights, and an engine logit recorder."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from onecat.formats.awq_gemm import pack_awq_gemm
from onecat.pack.volta_layout import dequantize_volta, fits_layout, pack_volta
from onecat.runtime.engine import model_runner

WRAPPER = "model.language_model."
NOT_QUANTIZED = ("embed_tokens", "lm_head", "norm", ".mlp.gate.", "shared_expert_gate", "in_proj_a", "in_proj_b")


def rtn_quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric 4-bit: ``(q [N, K] uint8, zeros [N, K/g] uint8, scales fp16)``."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo).clamp(min=1e-5) / 15).to(torch.float16)
    s = scales.float()
    zeros = torch.round(-lo / s).clamp(0, 15)
    q = (torch.round(g / s[..., None]) + zeros[..., None]).clamp(0, 15)
    return q.reshape(n, k).to(torch.uint8), zeros.to(torch.uint8), scales


def _quantizable(name: str, tensor: torch.Tensor) -> bool:
    return (
        name.startswith(WRAPPER + "layers.")
        and name.endswith(".weight")
        and tensor.dim() == 2
        and not any(tag in name for tag in NOT_QUANTIZED)
        and fits_layout(tensor.shape[0], tensor.shape[1], 32)
    )


def write_awq_checkpoint(src: Path, out: Path, group: int = 32) -> dict[str, torch.Tensor]:
    """Quantize the tiny float checkpoint ``src`` (RTN, group ``group``) into an AutoAWQ GEMM
    checkpoint at ``out`` (experts per expert, as AWQ checkpoints store them). Returns the
    dequantised weights (the kernels' dequant contract) by text-model name, for transformers."""
    out.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(shard))
    for fused in [n for n in tensors if n.endswith("mlp.experts.gate_up_proj")]:
        prefix = fused[: -len(".gate_up_proj")]
        gate_up, down = tensors.pop(fused), tensors.pop(f"{prefix}.down_proj")
        half = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            tensors[f"{prefix}.{e}.gate_proj.weight"] = gate_up[e, :half]
            tensors[f"{prefix}.{e}.up_proj.weight"] = gate_up[e, half:]
            tensors[f"{prefix}.{e}.down_proj.weight"] = down[e]
    written: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if not _quantizable(name, w):
            written[name] = w
            continue
        q, zeros, scales = rtn_quantize(w, group)
        prefix = name[: -len(".weight")]
        for part, t in pack_awq_gemm(q, zeros, scales).items():
            written[f"{prefix}.{part}"] = t
        qweight, scales_zeros = pack_volta(q, zeros, scales)
        dequantized["model." + name[len(WRAPPER) :]] = dequantize_volta(qweight, scales_zeros, group)
    save_file({k: v.contiguous() for k, v in written.items()}, out / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
        "version": "gemm", "modules_to_not_convert": ["lm_head", "mlp.gate", "shared_expert_gate"],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for side in src.iterdir():
        if side.is_file() and not side.name.endswith((".safetensors", ".index.json", "config.json")):
            shutil.copy2(side, out / side.name)
    shutil.copy2(src / "generation_config.json", out / "generation_config.json")
    return dequantized


def reference_model(src: Path, dequantized: dict[str, torch.Tensor] | None = None):
    """transformers' fp32 model of the float checkpoint ``src``, with quantized linears
    replaced by their dequantised weights."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in (dequantized or {}).items():
            expert = name.split(".mlp.experts.")
            if len(expert) == 2 and expert[1].split(".")[0].isdigit():
                e, which = int(expert[1].split(".")[0]), expert[1].split(".")[1]
                base = expert[0] + ".mlp.experts."
                if which == "down_proj":
                    params[base + "down_proj"][e].copy_(w)
                else:
                    half = params[base + "gate_up_proj"].shape[1] // 2
                    rows = slice(0, half) if which == "gate_proj" else slice(half, 2 * half)
                    params[base + "gate_up_proj"][e, rows].copy_(w)
            else:
                params[name].copy_(w)
    return model


@torch.no_grad()
def reference_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Logits ``[T, vocab]`` of transformers' model over ``token_ids`` in one forward pass."""
    return model(torch.tensor([token_ids])).logits[0].float()


def record_logits(engine) -> dict[str, list[torch.Tensor]]:
    """Make ``engine`` record, per request id, the logits row of every token it samples.
    With overlapped decode steps a request that stops on a token (EOS, a stop id or string)
    has one row more than it has tokens, last: the step in flight when it stopped."""
    records: dict[str, list[torch.Tensor]] = defaultdict(list)
    run = engine.runner.run

    def spy(scheduled, *args):
        seqs, logits = run(scheduled, *args)
        for seq, row in zip(seqs, logits, strict=True):
            records[seq.request_id].append(row.float().clone())
        return seqs, logits

    engine.runner.run = spy
    return records


def drain(engine) -> dict[str, list]:
    """Step ``engine`` until idle; returns every output per request id."""
    outputs: dict[str, list] = defaultdict(list)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def write_text_only_checkpoint(src: Path, out: Path) -> None:
    """Rewrite the wrapper checkpoint ``src`` in the text-only layout: keys ``model.layers...``,
    a flat ``qwen3_5*_text`` config, no vision or MTP tensors."""
    out.mkdir(parents=True)
    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        for name, t in load_file(shard).items():
            if name.startswith(WRAPPER):
                tensors["model." + name[len(WRAPPER) :]] = t
            elif name == "lm_head.weight":
                tensors[name] = t
    save_file(tensors, out / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    text = dict(config["text_config"])
    (out / "config.json").write_text(json.dumps(text, indent=2))
    for side in src.iterdir():
        if side.is_file() and not side.name.endswith((".safetensors", ".index.json", "config.json")):
            shutil.copy2(side, out / side.name)
    shutil.copy2(src / "generation_config.json", out / "generation_config.json")


def assert_same_greedy_runs(
    ref: tuple[dict, dict], got: tuple[dict, dict], atol: float, *, relative: bool = False, label: str = ""
) -> float:
    """Two greedy runs of the same requests (``(tokens, logits)`` by request id, as
    :func:`record_logits` and :func:`drain` give them) agree: while their tokens agree (same
    context), every logits row within ``atol`` (times the request's largest |logit| if
    ``relative``). The tokens may part only at a near tie -- the token the reference chose
    leads the other run's token by at most twice the tolerance (random-weight models have
    nearly flat next-token distributions, so such steps occur) -- and the comparison of that
    request stops there, since the contexts differ from then on. Returns the largest
    difference seen (relative if ``relative``)."""
    (ref_tokens, ref_logits), (tokens, logits) = ref, got
    assert ref_tokens.keys() == tokens.keys(), f"{label}: requests differ"
    worst = 0.0
    for rid, expected in ref_tokens.items():
        actual, rows, ref_rows = tokens[rid], logits[rid], ref_logits[rid]
        assert len(actual) == len(expected), f"{label} {rid}: {len(actual)} tokens, expected {len(expected)}"
        scale = ref_rows.abs().max().item() if relative else 1.0
        tol = atol * scale
        for step, (a, b) in enumerate(zip(expected, actual, strict=True)):
            diff = (rows[step] - ref_rows[step]).abs().max().item()
            worst = max(worst, diff / scale)
            assert diff <= tol, f"{label} {rid} step {step}: logits differ by {diff:.3g} (tolerance {tol:.3g})"
            if a != b:
                lead = (ref_rows[step][a] - ref_rows[step][b]).item()
                assert lead <= 2 * tol, (
                    f"{label} {rid} step {step}: token {b} instead of {a}, which leads it by {lead:.3g} "
                    f"(more than twice the tolerance {tol:.3g}): {actual} vs {expected}"
                )
                break
    return worst


class _Replay:
    def __init__(self, fn=None):
        self.replay = fn

    def pool(self) -> None:
        return None


class _FakeStream:
    def wait_stream(self, other) -> None:
        pass


def emulate_graphs(monkeypatch, engine) -> None:
    """Make ``engine``'s runner use CUDA-graph decode on CPU: its real capture (static
    buffers, padding rows, buckets) with a "replay" that runs the forward again on the static
    buffers in the graph's context (and, after a verify graph, the MTP drafting again)."""
    runner = engine.runner
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Replay)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None, stream=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    real_capture = runner._capture

    def capture(batch: int, positions: int, width: int):
        graph = real_capture(batch, positions, width)

        def replay():  # device-side work recomputes per replay: nothing cached from the capture
            model_runner.set_context(graph.context())
            try:
                graph.hidden.copy_(runner.model(graph.input_ids, graph.positions))
                graph.logits.copy_(runner.model.compute_logits(graph.hidden))
            finally:
                model_runner.set_context(None)

        graph.graph = _Replay(replay)
        if graph.draft is not None:
            draft = graph.draft
            draft.graph = _Replay(lambda: draft.drafts.copy_(draft.forward()))
        return graph

    monkeypatch.setattr(runner, "_capture", capture)
    runner.use_graphs = True
