"""GPU tests of the one-launch RMSNorm (``rms_norm.cu``) against an fp64 reference of the
runtime's torch math: the residual add rounded to fp16 once (bit-equal to torch's add), then
``r * rsqrt(mean(r^2) + eps) * (1 + w)`` with one rounding. Outputs are poisoned with NaN."""

from __future__ import annotations

import pytest
import torch

from onecat.kernels import rms_norm as norm_kernel
from onecat.runtime.layers import norm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def reference(r: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    r64 = r.double()
    return r64 * torch.rsqrt(r64.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight.double())


@pytest.mark.parametrize("hidden", [64, 256, 2048, 5120, 8192, 16384])
@pytest.mark.parametrize("rows", [1, 3, 32, 513])
def test_add_rms_norm_matches_fp64(rows, hidden):
    gen = torch.Generator(device="cuda").manual_seed(rows * 7 + hidden)
    x = torch.randn(rows, hidden, device="cuda", generator=gen).half()
    residual = (torch.randn(rows, hidden, device="cuda", generator=gen) * 4).half()
    weight = torch.randn(hidden, device="cuda", generator=gen) * 0.1
    eps = 1e-6
    for res in (residual, None):
        out = torch.full_like(x, float("nan"))
        normed, summed = norm_kernel.add_rms_norm(x, res, weight, eps, out=out)
        assert normed is out
        expected_sum = x if res is None else x + res
        assert torch.equal(summed, expected_sum), "the residual add is one fp16 rounding, as torch's"
        ref = reference(expected_sum, weight, eps)
        assert torch.isfinite(normed).all()
        err = (normed.double() - ref).abs()
        assert (err <= 2e-3 * ref.abs() + 1e-3 * ref.pow(2).mean().sqrt()).all(), float(err.max())


def test_runtime_norms_take_the_kernel_and_fall_back():
    """The runtime's norms run the kernel for fp16 CUDA rows from KERNEL_MIN_HIDDEN features and
    torch otherwise, same values."""
    hidden = norm.KERNEL_MIN_HIDDEN + 1024
    x = torch.randn(4, hidden, device="cuda").half()
    residual = torch.randn(4, hidden, device="cuda").half()
    weight = torch.randn(hidden, device="cuda") * 0.1
    assert norm_kernel.supports(x, residual, weight)
    normed, summed = norm.add_rms_norm(x, residual, weight, 1e-6)
    kernel_normed, _ = norm_kernel.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(normed, kernel_normed), "wide rows take the kernel"
    torch_normed, torch_summed = norm._add_rms_norm_compiled(x, residual, weight, 1e-6)
    assert torch.equal(summed, torch_summed)
    assert (normed.float() - torch_normed.float()).abs().max() <= 2e-3 * torch_normed.float().abs().max()
    strided = torch.randn(4, 2 * hidden, device="cuda").half()[:, :hidden]
    assert not norm_kernel.supports(strided, None, weight)
    assert not norm_kernel.supports(x, None, weight.half())
    wide = norm_kernel.MAX_HIDDEN + 8
    assert not norm_kernel.supports(torch.randn(2, wide, device="cuda").half(), None, torch.zeros(wide, device="cuda"))
    assert norm.rms_norm(strided, weight, 1e-6).shape == (4, hidden)
