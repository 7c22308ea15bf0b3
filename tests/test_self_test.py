"""``onecat doctor --self-test`` (``onecat/self_test.py``) on CPU: the paths that exist there
(eager x prefix cache x speculation x async scheduling, batch 1 and a ragged 8) on the
trained tiny models against the fp32 reference; the comparison catches what it must; the
CLI prints the table and exits 1 on any failure. The GPU run is ``test_all_paths_gpu.py``."""

from __future__ import annotations

import time

import pytest
import torch
from click.testing import CliRunner

from onecat import self_test
from onecat.self_test import RTOL, Reference, Row, _Run, compare, engine_paths

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("self-test")


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_every_cpu_path_matches_the_reference(family, cache):
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows = self_test.run_self_test("cpu", families=(family,), cache=cache)
    print()
    for row in rows:
        print(self_test.row_line(row))
    print(f"{self_test.summary(rows)} in {time.perf_counter() - start:.1f} s")
    reference, paths = rows[0], rows[1:]
    assert reference.path.startswith("reference") and reference.ok, reference.detail
    assert len(paths) == 2 * len(engine_paths("cpu")) == 16  # engines x (batch 1, ragged 8)
    failed = [self_test.row_line(row) for row in paths if not row.ok]
    assert not failed, "\n".join(failed)
    assert all(row.tokens_equal and row.max_diff <= RTOL["cpu"] for row in paths)
    cached = [row for row in paths if " cache " in f" {row.path} "]
    assert cached and all("cached tokens" in row.detail and not row.detail.startswith("0 ") for row in cached)


def _reference(tokens: list[int], lead: float = 1.0) -> Reference:
    logits = torch.zeros(len(tokens), 16)
    logits[:, 15] = -10.0  # the largest |logit|: the tolerance's scale
    for step, token in enumerate(tokens):
        logits[step, token] = lead
    return Reference(tokens, logits)


def test_compare_flags_token_flips_logit_drift_and_missing_rows():
    ref = {"a": _reference([1, 2, 3])}
    same = _Run(tokens={"a": [1, 2, 3]}, logits={"a": list(ref["a"].logits.clone())})
    assert compare(ref, same, 1e-3) == (0.0, True, [], [])
    assert ref["a"].smallest_margin() == pytest.approx(0.1)

    drift = _Run(tokens={"a": [1, 2, 3]}, logits={"a": list(ref["a"].logits.clone())})
    drift.logits["a"][1][7] += 0.05  # 5e-3 of the largest |logit|
    worst, equal, problems, _ = compare(ref, drift, 1e-3)
    assert worst == pytest.approx(5e-3) and equal and "step 1" in problems[0]

    flipped = _Run(tokens={"a": [1, 4, 3]}, logits={"a": list(ref["a"].logits.clone())})
    worst, equal, problems, ties = compare(ref, flipped, 1e-3)
    assert not equal and "tokens [1, 4, 3] != reference [1, 2, 3]" in problems[0] and not ties

    tied = {"a": _reference([1, 2, 3])}
    tied["a"].logits[1][4] = tied["a"].logits[1][2] - 1e-4  # token 4 trails the reference's by 1e-4
    near = _Run(tokens={"a": [1, 4, 3]}, logits={"a": list(tied["a"].logits.clone())})
    worst, equal, problems, ties = compare(tied, near, 1e-3)
    assert not equal and not problems and "a step 1: near tie" in ties[0]

    nan = _Run(tokens={"a": [1, 2, 3]}, logits={"a": [row.clone() for row in ref["a"].logits]})
    nan.logits["a"][0][0] = float("nan")
    assert compare(ref, nan, 1e-3)[2], "NaN logits must fail"

    short = _Run(tokens={"a": [1, 2, 3]}, logits={"a": list(ref["a"].logits[:2])})
    assert "2 logits rows recorded for 3 tokens" in compare(ref, short, 1e-3)[2][0]


def test_paths_cover_every_combination():
    assert RTOL["cuda"] > RTOL["cpu"]
    assert len(engine_paths("cuda")) == 2 * len(engine_paths("cpu")) == 16


@pytest.mark.parametrize("ok", [True, False])
def test_cli_prints_the_table_and_exits_1_on_a_failure(ok, monkeypatch):
    from onecat.cli import main
    from onecat.kernels import doctor

    def fake_run(device, progress=None, **_):
        rows = [Row("qwen3_5", "eager cache spec async", "1", 1e-7, True, 0.5, True, "176 cached tokens"),
                Row("qwen3_5", "eager cache spec async", "8 ragged", 3e-2 if not ok else 1e-7, ok, 0.7, ok,
                    "" if ok else "b8-3 step 2: logits differ")]  # fmt: skip
        for row in rows:
            progress(row)
        return rows

    monkeypatch.setattr(self_test, "run_self_test", fake_run)
    monkeypatch.setattr(doctor, "diagnose", lambda: [doctor.Finding("torch", True, "x")])
    result = CliRunner().invoke(main, ["doctor", "--self-test"])
    assert result.exit_code == (0 if ok else 1), result.output
    assert "max logit diff" in result.output and "eager cache spec async" in result.output
    assert ("all passed" in result.output) == ok
    if not ok:
        assert "FAIL" in result.output and "1 failed" in result.output
