"""`make demo` end to end: build, quantize, pack, serve and query a tiny Qwen3.5 (CPU)."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from onecat.demo import run_demo  # noqa: E402


@pytest.mark.slow
def test_demo_end_to_end(tmp_path):
    console = Console(record=True, width=240, force_terminal=False)
    result = run_demo(tmp_path / "demo-out", console)
    config = json.loads((result.packed_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "onecat"
    assert (result.packed_dir / "onecat_manifest.json").is_file()
    assert json.loads((result.awq_dir / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"
    assert result.finish_reason in ("stop", "length")
    assert result.usage["completion_tokens"] >= 1
    text = console.export_text()
    assert '"if" statement' in result.answer, f"the trained model's answer is not recognisable: {result.answer!r}"
    assert "trained for minutes on the pydoc topics" in text
    assert repr(result.answer) in text
    for path in (result.model_dir, result.awq_dir, result.packed_dir):
        assert str(path) in text
