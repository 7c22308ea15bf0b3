"""Every engine path on a GPU (issue #40): eager / CUDA graphs x prefix cache off / on x MTP
speculation off / on x async scheduling on / off, each with three prompts one at a time and a
ragged batch of eight, on the trained tiny Qwen3.5 dense and MoE models quantized and packed
for onecat's W4A16 kernels; plus tensor parallelism 2 with two GPUs. Greedy tokens must equal
the CPU fp32 reference's and every step's logits lie within 2e-2 of its largest |logit|
(``onecat/self_test.py`` argues both). The same suite is ``onecat doctor --self-test``.

    pytest -q -s tests/test_all_paths_gpu.py        (ONECAT_KERNEL_ARCH=70 on a newer GPU)
"""

from __future__ import annotations

import time

import pytest
import torch

from onecat import self_test

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_every_gpu_path_matches_the_cpu_reference(tmp_path):
    start = time.perf_counter()
    rows = self_test.run_self_test(
        "cuda", cache=tmp_path, progress=lambda row: print(self_test.row_line(row), flush=True)
    )
    elapsed = time.perf_counter() - start
    print(f"\n{self_test.summary(rows)} in {elapsed:.0f} s")
    paths = [row for row in rows if not row.path.startswith("reference")]
    expected = 2 * len(self_test.engine_paths("cuda")) * len(self_test.FAMILIES)
    expected += 2 if torch.cuda.device_count() >= 2 else 0  # TP 2: batch 1 and the ragged 8
    assert len(paths) == expected
    failed = [self_test.row_line(row) for row in rows if not row.ok]
    assert not failed, f"{len(failed)} of {len(rows)} rows failed:\n" + "\n".join(failed)
