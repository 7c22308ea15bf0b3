"""bench/ab_summary.py (the A/B tool's summary) on run files written as bench/e2e.py does."""

from __future__ import annotations

import json
from pathlib import Path

from bench_helpers import load_bench


def load_summary_module():
    return load_bench("ab_summary", "ab_summary")


def write_run(path: Path, b1: float, b32: float) -> None:
    result = {"model": "35b-a3b", "decode_b1_tok_s": b1, "decode_b32_tok_s": b32, "prefill_tok_s": 1000.0}
    path.write_text(json.dumps({"gpu": "test", "runs": [{"onecat": result}]}))


def test_summary_pairs_sides_and_takes_the_ratio_of_medians(tmp_path):
    ab = load_summary_module()
    write_run(tmp_path / "e2e_new_1.json", 110.0, 300.0)
    write_run(tmp_path / "e2e_new_2.json", 130.0, 300.0)
    write_run(tmp_path / "e2e_base_1.json", 100.0, 300.0)
    write_run(tmp_path / "e2e_base_2.json", 100.0, 200.0)
    lines = ab.summary(ab.collect(tmp_path))
    by_figure = {line.split()[1]: line for line in lines}
    assert set(by_figure) == {"decode_b1_tok_s", "decode_b32_tok_s", "prefill_tok_s"}
    assert by_figure["decode_b1_tok_s"].endswith("new/base 1.200")  # median 120 over 100
    assert by_figure["decode_b32_tok_s"].endswith("new/base 1.200")  # 300 over 250
    assert "new 110.0 130.0" in by_figure["decode_b1_tok_s"]


def test_summary_skips_figures_one_side_lacks(tmp_path):
    ab = load_summary_module()
    write_run(tmp_path / "e2e_new_1.json", 110.0, 300.0)
    assert ab.summary(ab.collect(tmp_path)) == []


def test_summary_compares_every_patch_side_with_base(tmp_path):
    ab = load_summary_module()
    write_run(tmp_path / "e2e_new_1.json", 110.0, 300.0)
    write_run(tmp_path / "e2e_wmmar-three-stages_1.json", 150.0, 300.0)
    write_run(tmp_path / "e2e_base_1.json", 100.0, 300.0)
    lines = [line for line in ab.summary(ab.collect(tmp_path)) if line.split()[1] == "decode_b1_tok_s"]
    assert len(lines) == 2
    assert lines[0].split()[2] == "new" and lines[0].endswith("new/base 1.100")
    assert lines[1].split()[2] == "wmmar-three-stages" and lines[1].endswith("wmmar-three-stages/base 1.500")
