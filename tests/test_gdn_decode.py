"""CPU tests of the GDN decode kernels' host-side choice: which decode passes run the
wide-batch kernels (``gdn_decode_wide_d*`` + the gated norm) and which the fused one, and that
the layer lets the kernel project b and a only where the fused kernel runs. The kernels
themselves: tests/test_gdn_kernel_gpu.py; sm_70 builds (no spills): test_kernels.py."""

from __future__ import annotations

import pytest
import torch

from onecat.kernels import gdn

pytestmark = pytest.mark.usefixtures("one_thread")


def test_wide_kernels_run_above_the_row_threshold(monkeypatch):
    assert gdn.uses_wide_kernel(1), "measured faster at every decode size (gdn.WIDE_ABOVE_ROWS)"
    assert gdn.uses_wide_kernel(32)
    monkeypatch.setattr(gdn, "WIDE_ABOVE_ROWS", 16)  # read at call time: tunable, and tests force paths
    assert not gdn.uses_wide_kernel(16)
    assert gdn.uses_wide_kernel(17)


def fp16_layer():
    """A GDN layer of the tiny config (fp16, unpacked in_proj_ba) on the CPU, told that it runs
    on the decode kernels (their checks need CUDA tensors)."""
    from onecat.runtime.models.config import ModelConfig
    from onecat.runtime.models.qwen3_5 import GatedDeltaNet
    from onecat.runtime.quant_plan import QuantPlan
    from onecat.tiny import _text_kwargs

    raw = _text_kwargs("qwen3_5", 512, 4)
    raw.update(model_type="qwen3_5_text")
    layer = GatedDeltaNet(ModelConfig.from_dict(raw), "layer", QuantPlan(), torch.float16)
    layer._uses_decode_kernel = lambda mixed: True
    return layer


def projects(layer, rows, prefills=()):
    from onecat.runtime.context import ForwardContext, set_context

    x = torch.zeros(rows, layer.in_proj_qkvz.in_features, dtype=torch.float16)
    set_context(ForwardContext(slot_mapping=torch.zeros(rows, dtype=torch.int64), num_decodes=rows,
                               prefills=list(prefills)))
    try:
        return layer._kernel_projects_ba(x)
    finally:
        set_context(None)


@pytest.mark.parametrize("wide_above", [8, 4, 0])
def test_every_decode_only_pass_projects_ba_in_its_kernels(monkeypatch, wide_above):
    """Passes of decode rows only hand the layer input to the decode kernels whatever their
    size: the fused kernel projects b and a itself, the conv launch does for the wide one."""
    monkeypatch.setattr(gdn, "WIDE_ABOVE_ROWS", wide_above)
    layer = fp16_layer()
    for rows in range(1, 13):
        assert projects(layer, rows), rows


def test_a_pass_with_prompt_rows_runs_in_proj_ba():
    from onecat.runtime.context import PrefillChunk

    layer = fp16_layer()
    chunk = PrefillChunk(start=2, length=3, num_past=0, block_table=torch.zeros(1, dtype=torch.int64), state_slot=0)
    assert projects(layer, 2)
    assert not projects(layer, 2, [chunk])


def test_conv_projects_ba_only_from_rows_its_128_bit_loads_read():
    """The decode conv launch projects b and a from fp16 rows of a multiple-of-8 width and
    stride, 16-byte aligned; other rows go through in_proj_ba (see GatedDeltaNet._decode_in_place)."""
    rows = torch.zeros(4, 520, dtype=torch.float16)
    assert gdn.conv_can_project_ba(rows)
    assert gdn.conv_can_project_ba(rows[:, :512])
    assert not gdn.conv_can_project_ba(rows[:, 1:513]), "a view 2 bytes into each row"
    assert not gdn.conv_can_project_ba(torch.zeros(4, 12, dtype=torch.float16))
    assert not gdn.conv_can_project_ba(rows.float())
    assert not gdn.conv_can_project_ba(rows.t())
