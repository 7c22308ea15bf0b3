"""CPU tests of the GDN prefill kernels' host side: the varlen chunk tables, input errors, and
the kernels' algorithm with its fp16 rounding points (``reference_prefill``) against an fp64
recurrence (this measures what the fp16 cuts cost; tests/test_gdn_prefill_gpu.py bounds the
CUDA kernels with it). sm_70 builds (no spills) are checked by test_kernels.py over
build.PROGRAMS."""

from __future__ import annotations

import pytest
import torch
from gdn_prefill_reference import error_report, random_prefill, recurrence_fp64

from onecat.errors import OnecatError
from onecat.kernels.gdn_prefill import chunk_tables, reference_prefill, supports

pytestmark = pytest.mark.usefixtures("one_thread")


def test_chunk_tables_split_sequences_into_64_token_chunks():
    seqs, chunks = chunk_tables([0, 1, 70], [1, 65, 64], [3, 0, 9])
    assert seqs == [0, 1, 0, 3, 1, 1, 65, 1, 0, 2, 70, 64, 3, 9, 1]
    assert chunks == [0, 1, 0, -1, 1, 64, 1, -1, 65, 1, 1, -1, 70, 64, 2, -1]


def test_chunk_tables_end_a_chunk_at_each_checkpoint():
    """Checkpoints at offsets 16 and 144 of a 200-token sequence: chunks 16, 64, 64, 56
    (the first and third end at a checkpoint and name its row); the second sequence has none."""
    seqs, chunks = chunk_tables([0, 200], [200, 3], [1, 2], [[(16, 7), (144, 5)], []])
    assert seqs == [0, 200, 0, 1, 4, 200, 3, 4, 2, 1]
    assert chunks == [0, 16, 0, 7, 16, 64, 0, -1, 80, 64, 0, 5, 144, 56, 0, -1, 200, 3, 1, -1]


@pytest.mark.parametrize(
    "starts, lengths, slots, message",
    [
        ([0, 10], [10, 5], [1, 1], "distinct"),
        ([0, 5], [10, 5], [1, 2], "overlap"),
        ([0], [0], [1], "length 0"),
        ([], [], [], "at least one"),
    ],
)
def test_chunk_tables_refuse_bad_batches(starts, lengths, slots, message):
    with pytest.raises(OnecatError, match=message):
        chunk_tables(starts, lengths, slots)


@pytest.mark.parametrize(
    "checkpoints, message",
    [([[(10, 1)]], "distinct"), ([[(0, 3)]], "inside"), ([[(10, 3)]], "inside"), ([[(5, 3), (4, 4)]], "rise")],
)
def test_chunk_tables_refuse_bad_checkpoints(checkpoints, message):
    with pytest.raises(OnecatError, match=message):
        chunk_tables([0], [10], [1], checkpoints)


def test_supports_only_what_the_kernels_are_built_for():
    assert supports(128, 128, 4, torch.float16)
    assert supports(128, 32, 4, torch.float16)
    assert not supports(128, 128, 4, torch.float32)
    assert not supports(64, 128, 4, torch.float16)
    assert not supports(128, 256, 4, torch.float16)
    assert not supports(128, 128, 3, torch.float16)


def test_kernel_algorithm_with_fp16_cuts_matches_fp64_recurrence():
    """Measured: rms error 5.6e-4 (outputs) / 4.3e-4 (states) of rms, worst element 6e-3 of
    rms; the GPU test allows 2e-3 / 2.5e-2."""
    lengths = [1, 63, 65, 150]
    mixed, ba, A_log, dt_bias, state, starts, slots = random_prefill(lengths, 1, 2, 64, 6, seed=1, device="cpu")
    ref_o, ref_s = recurrence_fp64(mixed, ba, A_log, dt_bias, state[slots], starts, lengths, 1)
    before = state.clone()
    out = reference_prefill(mixed, ba, A_log, dt_bias, state, starts, lengths, slots, 1)
    others = [s for s in range(6) if s not in slots]
    assert torch.equal(state[others], before[others])
    for i, (start, length) in enumerate(zip(starts, lengths, strict=True)):
        worst, rms, message = error_report(f"sequence {i} output", out[start : start + length], ref_o[start : start + length])
        assert rms <= 1e-3 and worst <= 1.5e-2, message
        worst, rms, message = error_report(f"sequence {i} state", state[slots[i]], ref_s[i])
        assert rms <= 1e-3 and worst <= 1.5e-2, message
