"""GPU tests of the W4A16 kernels against an fp64 reference with the kernels' dequant contract.

Run on a GPU (the H200 runs a V100's code with ``ONECAT_KERNEL_ARCH=70``, PTX from
``ONECAT_KERNEL_DIR``).  ``ref`` is the fp64 product of x with the contract weights
``fp16(q*s + fp16(-z*s))``.  Tolerance: every output finite, ``||y - ref|| / ||ref|| <= 1e-3``
and elementwise ``|y - ref| <= 4e-3 * |ref| + 4e-3 * rms(ref)``.  The budget: fp16 output
rounding (<= 2^-11 relative) plus the GEMV's fp16 partial sums of 8 products (each hfma2
rounds to fp16; on a K = 128 row they add up to about 2e-3 of the row's rms, measured on the
H200); tensor-core and cuBLAS paths accumulate in fp32 and stay near 2e-4.
Outputs are poisoned with NaN before each run, so an unwritten element fails.
"""

from __future__ import annotations

import pytest
import torch

from onecat.errors import OnecatError
from onecat.pack.volta_layout import dequantize_volta, pack_volta

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

M_VALUES = list(range(1, 18)) + [31, 64, 100, 257, 2048]
RTOL = 4e-3  # elementwise, relative to |ref| and to rms(ref)
NORM_RTOL = 1e-3  # whole output, relative norm


@pytest.fixture(autouse=True)
def _no_autotune(monkeypatch):
    monkeypatch.setenv("ONECAT_AUTOTUNE", "0")


def make_weight(n: int, k: int, g: int, seed: int):
    """Random packed weight on the GPU and its contract dequantisation in fp64."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda", generator=gen)
    z = torch.randint(0, 16, (n, k // g), dtype=torch.uint8, device="cuda", generator=gen)
    s = (torch.rand(n, k // g, device="cuda", generator=gen) * 0.02 + 0.001).half()
    qweight, scales_zeros = pack_volta(q, z, s)
    w = dequantize_volta(qweight, scales_zeros, g, dtype=torch.float64)
    return qweight, scales_zeros, w


def check_close(y: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert torch.isfinite(y).all(), f"{what}: non-finite outputs (unwritten or overflow)"
    y64 = y.double()
    rms = ref.pow(2).mean().sqrt()
    err = (y64 - ref).abs()
    bound = RTOL * ref.abs() + RTOL * rms
    worst = (err - bound).max()
    rel_norm = float((y64 - ref).norm() / ref.norm())
    assert worst <= 0 and rel_norm <= NORM_RTOL, (
        f"{what}: max error {err.max():.3e} (bound exceeded by {float(worst):.1e}); "
        f"rel norm {rel_norm:.2e}"
    )


def _shapes():
    from onecat.kernels.shapes import sliced_shapes

    return sliced_shapes()


@pytest.mark.parametrize("label,n,k", _shapes(), ids=[f"{n}x{k}" for _, n, k in _shapes()])
def test_default_dispatch_all_model_shapes(label, n, k):
    from onecat.kernels.variants import default_variant, run_variant

    g = 128 if k % 128 == 0 else 32
    qweight, scales_zeros, w = make_weight(n, k, g, seed=n + k)
    for m in M_VALUES:
        x = torch.randn(m, k, dtype=torch.float16, device="cuda")
        bias = torch.randn(n, dtype=torch.float16, device="cuda") if m % 3 == 0 else None
        ref = x.double() @ w.t()
        if bias is not None:
            ref += bias.double()
        variant = default_variant(m)
        out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
        run_variant(variant, x, qweight, scales_zeros, g, bias, out=out)
        check_close(out, ref, f"{label} {n}x{k} M={m} {variant.name}")


@pytest.mark.parametrize(
    "n,k,g", [(1024, 5120, 128), (4352, 2048, 64), (512, 512, 32), (2048, 4352, 128)]
)
def test_every_variant_and_split(n, k, g):
    from onecat.kernels.variants import Variant, all_variants, run_variant

    qweight, scales_zeros, w = make_weight(n, k, g, seed=7)
    ktiles = k // 32
    for base in all_variants():
        if not base.supports_group(g):
            continue
        if base.kind == "gemv":  # automatic, odd (ranges cut tiles), whole tiles, two tiles
            split_options = [0, 5, ktiles, 2 * ktiles]
        else:
            split_options = [0] if base.kind == "dequant" else [0, 1, 3]
        for split in split_options:
            variant = Variant(base.kind, base.rows, base.width, split, base.chunk)
            ms = [1, 2, 3, 4] if base.kind == "gemv" else [1, 5, 8, 9, 16, 33, 64, 70]
            for m in ms:
                if not variant.supports(m):
                    continue
                x = torch.randn(m, k, dtype=torch.float16, device="cuda")
                bias = torch.randn(n, dtype=torch.float16, device="cuda")
                ref = x.double() @ w.t() + bias.double()
                out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
                run_variant(variant, x, qweight, scales_zeros, g, bias, out=out)
                check_close(out, ref, f"{n}x{k} g{g} M={m} {variant.name}")


def test_op_reshapes_and_handles_strided_and_misaligned_x():
    from onecat.kernels.ops import w4a16_linear

    n, k, g = 2048, 1024, 128
    qweight, scales_zeros, w = make_weight(n, k, g, seed=3)
    wide = torch.randn(2, 3, k + 64, dtype=torch.float16, device="cuda")
    x = wide[..., 8 : 8 + k]  # not contiguous
    check_close(w4a16_linear(x, qweight, scales_zeros, g), x.double() @ w.t(), "strided x")
    flat = torch.randn(5 * k + 1, dtype=torch.float16, device="cuda")
    x = flat[1:].view(5, k)  # contiguous but 2 bytes off 16-byte alignment
    assert x.data_ptr() % 16
    check_close(w4a16_linear(x, qweight, scales_zeros, g), x.double() @ w.t(), "misaligned x")
    assert w4a16_linear(x[:0], qweight, scales_zeros, g).shape == (0, n)


def test_op_rejects_bad_inputs():
    from onecat.kernels.ops import w4a16_linear

    n, k, g = 512, 512, 128
    qweight, scales_zeros, _ = make_weight(n, k, g, seed=4)
    x = torch.randn(2, k, dtype=torch.float16, device="cuda")
    with pytest.raises(OnecatError, match="float16"):
        w4a16_linear(x.bfloat16(), qweight, scales_zeros, g)
    with pytest.raises(OnecatError, match="contiguous"):
        w4a16_linear(x, qweight.transpose(0, 1), scales_zeros, g)
    with pytest.raises(OnecatError, match="group_size"):
        w4a16_linear(x, qweight, scales_zeros, 48)
    with pytest.raises(OnecatError, match="x must be"):
        w4a16_linear(x[:, :256], qweight, scales_zeros, g)
    with pytest.raises(OnecatError, match="is on"):
        w4a16_linear(x.cpu(), qweight, scales_zeros, g)


def test_cuda_graph_capture_and_replay():
    from onecat.kernels.ops import w4a16_linear

    n, k, g = 5120, 2048, 128
    qweight, scales_zeros, w = make_weight(n, k, g, seed=5)
    for m in (1, 8, 100):
        static_x = torch.randn(m, k, dtype=torch.float16, device="cuda")
        w4a16_linear(static_x, qweight, scales_zeros, g)  # load the kernels before capture
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph):
                static_y = w4a16_linear(static_x, qweight, scales_zeros, g)
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(2):
            static_x.copy_(torch.randn(m, k, dtype=torch.float16, device="cuda"))
            static_y.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            check_close(static_y, static_x.double() @ w.t(), f"graph replay M={m}")


def test_tuner_picks_a_correct_variant(tmp_path, monkeypatch):
    from onecat.kernels import tuning
    from onecat.kernels.ops import w4a16_linear

    monkeypatch.setenv("ONECAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_tables", {})
    n, k, g = 4096, 2048, 128
    qweight, scales_zeros, w = make_weight(n, k, g, seed=6)
    best, timings = tuning.tune_shape(3, qweight, scales_zeros, g)
    assert best.name in timings and all(t > 0 for t in timings.values())
    assert tuning.table_path(0).is_file()
    x = torch.randn(3, k, dtype=torch.float16, device="cuda")
    check_close(w4a16_linear(x, qweight, scales_zeros, g), x.double() @ w.t(), "tuned op")
