"""GPU tests of the one-launch MoE router (``moe_router``, kernel ``w4a16_moe_route_decode``)
on every code path of the kernel: 1..8 tokens, block sizes (rows per block), the shared gate
returned / appended as a folded expert / absent, top-k of 1..32, hidden sizes that take one
or several passes over a weight row or several staged token chunks, expert counts that take
one or several key groups per lane.

Run on a GPU (the H200 runs a V100's code with ``ONECAT_KERNEL_ARCH=70``):

    ONECAT_KERNEL_ARCH=70 .venv/bin/python -m pytest -q tests/test_moe_router_gpu.py

The data are integer-valued (x in {-1, 0, 1}, router weights in {-1, 0, 1} / 64), so every
fp32 sum of products is exact in any order and the kernel's fp16 logits equal the CPU
reference's (``reference_router``) bit for bit: the expert ids must be equal exactly, with
many equal logits (ties: lowest expert index first), and the weights agree within fp32
rounding of the softmax. ``tests/test_moe_kernel_gpu.py`` checks the same op on Gaussian
data against an fp64 projection. Outputs are poisoned (free allocator blocks filled with NaN)
before each call.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

E, H, TOP_K = 256, 2048, 8  # Qwen3.5-35B-A3B's router


def poison_allocator() -> None:
    """Fill free blocks of the caching allocator (small and large pools) with NaN."""
    blocks = [torch.full((n,), float("nan"), dtype=torch.float16, device="cuda") for n in [1 << 14] * 32 + [1 << 18] * 4]
    del blocks


def ternary(shape: tuple[int, ...], density: float, gen: torch.Generator) -> torch.Tensor:
    """Random values in {-1, 0, 1} (non-zero with probability ``density``), fp32 on the GPU."""
    sign = torch.randint(0, 2, shape, device="cuda", generator=gen).float() * 2 - 1
    return sign * (torch.rand(shape, device="cuda", generator=gen) < density).float()


def exact_inputs(tokens: int, h: int, experts: int, density: float, seed: int, gate: bool):
    """``(x [T, h] fp16 strided view, router [E, h], shared gate [1, h] or None)``."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.zeros(tokens, h + 64, device="cuda", dtype=torch.float16)
    x[:, :h] = ternary((tokens, h), density, gen).half()
    router = (ternary((experts, h), density, gen) / 64).half()
    shared = (ternary((1, h), density, gen) / 64).half() if gate else None
    return x[:, :h], router, shared


def check_router(x, router, shared, top_k: int, shared_expert: int = -1) -> None:
    from onecat.kernels.moe import moe_router, reference_router, router_fits

    assert router_fits(x, router, shared)
    ref_w, ref_ids, ref_gate = reference_router(x.cpu(), router.cpu(), None if shared is None else shared.cpu(),
                                                top_k, shared_expert)
    for call in range(2):  # twice: the kernel leaves its ticket counter zeroed for the next launch
        poison_allocator()
        weights, ids, gate = moe_router(x, router, shared, top_k, shared_expert)
        torch.cuda.synchronize()
        assert ids.dtype == torch.int32 and weights.dtype == torch.float32, f"call {call}"
        assert torch.equal(ids.cpu(), ref_ids), (
            f"call {call}: expert ids differ in {int((ids.cpu() != ref_ids).any(-1).sum())} of {x.shape[0]} tokens"
        )
        err = (weights.cpu() - ref_w).abs().max().item()
        assert err <= 2e-6, f"call {call}: routing weights, max error {err:.2e}"
        assert gate.shape == ref_gate.shape and torch.equal(gate.cpu(), ref_gate), f"call {call}: shared gate logits"


@pytest.mark.parametrize("tokens", range(1, 9))
@pytest.mark.parametrize("mode", ["no gate", "gate logit", "folded shared expert"])
@pytest.mark.parametrize("warps", [16, 4])
def test_router_matches_reference_at_35b_shapes(tokens, mode, warps, monkeypatch):
    """Qwen3.5-35B-A3B's router (256 x 2048, top-8) at 1..8 tokens, with the current block
    size (16 rows per block) and a smaller one (4 rows: more blocks, and several tokens per
    warp in the selection)."""
    from onecat.kernels import moe

    monkeypatch.setattr(moe, "_ROUTER_WARPS", warps)
    x, router, shared = exact_inputs(tokens, H, E, 0.25, seed=tokens, gate=mode != "no gate")
    check_router(x, router, shared, TOP_K, E if mode == "folded shared expert" else -1)


@pytest.mark.parametrize("density", [0.25, 0.03])
def test_router_ties_lowest_index_first(density):
    """Sparse ternary data give mostly equal logits (0 and a few multiples of 1/64), equal
    rows give equal logits: the choice among equal logits must be the lowest expert index."""
    x, router, shared = exact_inputs(8, H, E, density, seed=11, gate=True)
    router[[3, 40, 77, 200, 201]] = router[250].clone()  # five equal rows
    check_router(x, router, shared, TOP_K)
    x[:, :] = 0  # every logit 0: experts 0..7, weights 1/8
    check_router(x, router, shared, TOP_K, E)


@pytest.mark.parametrize(
    "experts, h, top_k, tokens",
    [
        (512, 4096, 10, 3),  # two passes over each weight row, two key groups, top-16 lists
        (1000, 1024, 32, 5),  # four key groups (the last partial), top-32 lists
        (64, 16384, 4, 2),  # one token staged at a time: weights reloaded per token and pass
        (100, 200, 1, 8),  # a partial 256-column pass, top-1
        (17, 256, 17, 4),  # top_k = E
    ],
)
@pytest.mark.parametrize("warps", [16, 1])
def test_router_other_shapes(experts, h, top_k, tokens, warps, monkeypatch):
    from onecat.kernels import moe

    monkeypatch.setattr(moe, "_ROUTER_WARPS", warps)
    x, router, shared = exact_inputs(tokens, h, experts, 0.25, seed=experts + h, gate=True)
    check_router(x, router, shared, top_k, experts)
    check_router(x, router, None, top_k)


def check_router_norm(tokens: int, h: int, experts: int, top_k: int, shared_expert: int, gate: bool, seed: int) -> None:
    """``moe_router_norm`` against fp64 for the add and the norm, and against ``moe_router`` on
    its own normed rows for the routing (the same staged values: equal bit for bit)."""
    from onecat.kernels.moe import moe_router, moe_router_norm, router_norm_fits

    gen = torch.Generator(device="cuda").manual_seed(seed)
    x, router, shared = exact_inputs(tokens, h, experts, 0.25, seed=seed, gate=gate)
    x = (x.float() + torch.randn(tokens, h, device="cuda", generator=gen) * 0.5).half()
    residual = (torch.randn(tokens, h, device="cuda", generator=gen) * 3).half()
    norm_weight = torch.randn(h, device="cuda", generator=gen) * 0.1
    assert router_norm_fits(x, residual, norm_weight, router, shared)
    summed_ref = x + residual
    r64 = summed_ref.double()
    normed_ref = r64 * torch.rsqrt(r64.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + norm_weight.double())
    for call in range(2):  # twice: the ticket counter is left zeroed
        poison_allocator()
        weights, ids, gate_logit, normed, summed = moe_router_norm(
            x, residual, norm_weight, 1e-6, router, shared, top_k, shared_expert
        )
        torch.cuda.synchronize()
        assert torch.equal(summed, summed_ref), f"call {call}: the residual add is one fp16 rounding"
        err = (normed.double() - normed_ref).abs()
        assert torch.isfinite(normed).all() and (err <= 2e-3 * normed_ref.abs() + 1e-3).all(), float(err.max())
        ref_w, ref_ids, ref_gate = moe_router(normed, router, shared, top_k, shared_expert)
        assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w), f"call {call}: routing of the normed rows"
        assert torch.equal(gate_logit, ref_gate), f"call {call}: shared gate logits"


@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("mode", ["no gate", "gate logit", "folded shared expert"])
def test_router_with_the_norm_at_35b_shapes(tokens, mode):
    check_router_norm(tokens, H, E, TOP_K, E if mode == "folded shared expert" else -1, mode != "no gate", seed=tokens)


@pytest.mark.parametrize("experts, h, top_k, tokens", [(64, 16384, 4, 2), (100, 200, 1, 8), (512, 4096, 10, 3)])
def test_router_with_the_norm_other_shapes(experts, h, top_k, tokens):
    """One token staged at a time (16384 features), a width that is not a multiple of the
    block's vectors, several passes over a weight row."""
    check_router_norm(tokens, h, experts, top_k, experts, True, seed=experts)


def test_router_with_the_norm_falls_back_beyond_its_batch():
    """More tokens than the kernel stages run the same math in torch."""
    from onecat.kernels.moe import moe_router_norm, reference_router_norm

    x, router, shared = exact_inputs(12, H, E, 0.25, seed=5, gate=True)
    residual = torch.randn(12, H, device="cuda").half()
    norm_weight = torch.randn(H, device="cuda") * 0.1
    got = moe_router_norm(x, residual, norm_weight, 1e-6, router, shared, TOP_K, E)
    ref = reference_router_norm(x, residual, norm_weight, 1e-6, router, shared, TOP_K, E)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)
