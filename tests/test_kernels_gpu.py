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
from onecat.runtime.engine.graph_capture import capture

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


def check_close(y: torch.Tensor, ref: torch.Tensor, what: str, scale: float = 1.0) -> None:
    """``scale`` widens both tolerances (a product of two such outputs carries both errors)."""
    assert torch.isfinite(y).all(), f"{what}: non-finite outputs (unwritten or overflow)"
    y64 = y.double()
    rms = ref.pow(2).mean().sqrt()
    err = (y64 - ref).abs()
    bound = scale * RTOL * (ref.abs() + rms)
    worst = (err - bound).max()
    rel_norm = float((y64 - ref).norm() / ref.norm())
    assert worst <= 0 and rel_norm <= scale * NORM_RTOL, (
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


@pytest.mark.parametrize(
    "variant_name", ["gemv-m1-u2-p5", "gemv-m4-u2-p5", "wmma-mt8-w4-c2-s3", "wmmar-mt8-w4-c2-s3", "wmmar-mt32-w4-c2-s3"]
)
def test_split_sums_keep_a_nan_visible(variant_name):
    """A NaN activation must not come out finite from a split-K sum: the GEMV's 64-bit split
    words count a NaN partial as their largest value, so its row overflows to inf; the
    tensor-core kernels' fp32 slices propagate NaN. Other rows stay correct, and the next call
    is clean (words re-zeroed, slices rewritten)."""
    from onecat.kernels.variants import Variant, run_variant

    n, k, g = 1024, 5120, 128
    qweight, scales_zeros, w = make_weight(n, k, g, seed=21)
    variant = Variant.parse(variant_name)
    m = min(variant.rows, 4)
    x = torch.randn(m, k, dtype=torch.float16, device="cuda")
    bad = x.clone()
    bad[0, 7] = float("nan")
    out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    run_variant(variant, bad, qweight, scales_zeros, g, out=out)
    assert not torch.isfinite(out[0]).any(), f"{variant_name}: a NaN input gave finite outputs"
    if m > 1:
        check_close(out[1:], bad[1:].double() @ w.t(), f"{variant_name} rows without NaN")
    out.fill_(float("nan"))
    run_variant(variant, x, qweight, scales_zeros, g, out=out)  # words re-zeroed, slices rewritten
    check_close(out, x.double() @ w.t(), f"{variant_name} after the NaN call")


def replays(op, static_x: torch.Tensor, *args, rounds: int = 2):
    """Capture ``op(static_x, *args)`` in a CUDA graph, then per round: new random ``static_x``,
    the output poisoned with NaN, one replay; yields the output after each."""
    graph = torch.cuda.CUDAGraph()
    static_y = capture(graph, None, lambda: op(static_x, *args))
    for _ in range(rounds):
        static_x.copy_(torch.randn(static_x.shape, dtype=static_x.dtype, device=static_x.device))
        static_y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        yield static_y


def silu_mul_reference(y64: torch.Tensor) -> torch.Tensor:
    """fp64 ``silu(gate) * up`` of an fp64 gate/up output (gate columns first)."""
    gate, up = y64.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("n,k,g", [(1024, 5120, 128), (4352, 2048, 64), (192, 512, 32), (2176, 640, 128)])
def test_silu_mul_epilogue_every_gemv_variant_and_split(n, k, g):
    """The GEMV's SwiGLU launches (gate column c paired with up column c + N/2 through a
    64-bit pair word) against fp64: ranges that cut tiles or span two, half widths of 3 and 34 pairs;
    the tensor-core variants have no such epilogue and refuse the plan."""
    from onecat.kernels.variants import Variant, all_variants, run_variant

    qweight, scales_zeros, w = make_weight(n, k, g, seed=11)
    ktiles = k // 32
    for base in all_variants():
        if base.kind != "gemv":
            if base.supports_group(g) and base.supports(8):
                x = torch.randn(8, k, dtype=torch.float16, device="cuda")
                with pytest.raises(OnecatError, match="GEMV variant"):
                    run_variant(base, x, qweight, scales_zeros, g, silu_mul=True)
            continue
        for split in [0, 5, ktiles, 2 * ktiles]:
            variant = Variant(base.kind, base.rows, base.width, split, base.chunk)
            for m in [1, 2, 3, 4]:
                if not variant.supports(m):
                    continue
                x = torch.randn(m, k, dtype=torch.float16, device="cuda")
                bias = torch.randn(n, dtype=torch.float16, device="cuda") if m % 2 else None
                y64 = x.double() @ w.t() + (0 if bias is None else bias.double())
                out = torch.full((m, n // 2), float("nan"), dtype=torch.float16, device="cuda")
                for _ in range(2):  # twice: the pair words must be left zeroed
                    run_variant(variant, x, qweight, scales_zeros, g, bias, out=out, silu_mul=True)
                check_close(out, silu_mul_reference(y64), f"silu_mul {n}x{k} g{g} M={m} {variant.name}", scale=2)


def test_silu_mul_op_graph_capture_and_rejects_odd_halves():
    """The op at 1, 8 and 100 rows (one fused GEMV launch, or the projection then the
    activation), eager and replayed from a CUDA graph, against fp64."""
    from onecat.kernels.ops import packed_linear_silu_mul

    n, k, g = 2 * 1728, 1024, 128
    qweight, scales_zeros, w = make_weight(n, k, g, seed=12)
    for m in (1, 8, 100):
        static_x = torch.randn(m, k, dtype=torch.float16, device="cuda")
        eager = packed_linear_silu_mul(static_x, qweight, scales_zeros, g)
        check_close(eager, silu_mul_reference(static_x.double() @ w.t()), f"op M={m}", scale=2)
        for static_y in replays(torch.ops.onecat.w4a16_linear_silu_mul, static_x, qweight, scales_zeros, g):
            check_close(static_y, silu_mul_reference(static_x.double() @ w.t()), f"graph M={m}", scale=2)
    odd_q, odd_sz, _ = make_weight(96, k, g, seed=13)
    with pytest.raises(OnecatError, match="multiple of 64"):
        packed_linear_silu_mul(static_x, odd_q, odd_sz, g)


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
        for static_y in replays(w4a16_linear, static_x, qweight, scales_zeros, g):
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
