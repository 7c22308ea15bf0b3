"""CPU tests of the MoE ops (onecat.kernels.moe): the reference of ``w4a16_moe`` against a
plain per-(token, expert) loop over weights dequantised independently from the integers
(the dequant contract ``fp16(q*s + fp16(-z*s))``), the router's reference against torch's
softmax / top-k / renormalise, the fake implementations and the input checks. The kernels'
sm_70 builds (no spills) are checked by test_kernels.py over build.PROGRAMS."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onecat.errors import OnecatError
from onecat.kernels import moe
from onecat.pack.volta_layout import pack_volta

pytestmark = pytest.mark.usefixtures("one_thread")


def contract_weight(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g: int) -> torch.Tensor:
    """fp64 weights ``fp16(q*s + fp16(-z*s))`` computed from the integers."""
    n, k = q.shape
    nzs = (-(z.double() * s.double())).half().double()
    w = q.double().view(n, k // g, g) * s.double()[..., None] + nzs[..., None]
    return w.half().double().view(n, k)


def random_experts(e: int, h: int, i: int, g: int, seed: int = 0):
    """Stacked packed experts (w13 = gate rows then up rows) and their fp64 contract weights."""
    gen = torch.Generator().manual_seed(seed)
    packed = {"w13": ([], []), "w2": ([], [])}
    dense = {"w13": [], "w2": []}
    for _ in range(e):
        for name, (n, k) in (("w13", (2 * i, h)), ("w2", (h, i))):
            q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
            z = torch.randint(0, 16, (n, k // g), dtype=torch.uint8, generator=gen)
            s = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.001).half()
            qweight, scales_zeros = pack_volta(q, z, s)
            packed[name][0].append(qweight)
            packed[name][1].append(scales_zeros)
            dense[name].append(contract_weight(q, z, s, g))
    tensors = [torch.stack(packed[name][part]) for name in ("w13", "w2") for part in (0, 1)]
    return tensors, torch.stack(dense["w13"]), torch.stack(dense["w2"])


def loop_reference(x, ids, weights, w13, w2, round_hidden=torch.float16):
    """fp64, one (token, expert) pair at a time; the hidden activation rounded like the op's."""
    t_count, top_k = ids.shape
    inter = w13.shape[1] // 2
    out = torch.zeros(t_count, w2.shape[1], dtype=torch.float64)
    for t in range(t_count):
        for j in range(top_k):
            e = int(ids[t, j])
            if not 0 <= e < w13.shape[0]:
                continue
            gate_up = w13[e] @ x[t].double()
            hidden = (F.silu(gate_up[:inter]) * gate_up[inter:]).to(round_hidden).double()
            out[t] += float(weights[t, j]) * (w2[e] @ hidden)
    return out


H, INTER, G, E = 96, 64, 32, 6


@pytest.fixture(scope="module")
def experts():
    return random_experts(E, H, INTER, G, seed=3)


def routing(t: int, top_k: int, seed: int, experts: int = E):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, top_k, generator=gen), dim=-1)
    return ids, weights


def check_close(y: torch.Tensor, ref: torch.Tensor, what: str, rtol: float = 4e-3) -> None:
    err = (y.double() - ref).abs()
    bound = rtol * ref.abs() + rtol * ref.pow(2).mean().sqrt()
    assert torch.isfinite(y).all(), f"{what}: non-finite outputs"
    assert (err <= bound).all(), f"{what}: max error {err.max():.3e}, bound {bound.min():.3e}..{bound.max():.3e}"


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.float16])
def test_cpu_op_matches_the_per_pair_loop(experts, ids_dtype, weights_dtype):
    tensors, w13, w2 = experts
    x = torch.randn(7, H, dtype=torch.float16)
    ids, weights = routing(7, 3, seed=1)
    ids, weights = ids.to(ids_dtype), weights.to(weights_dtype)
    y = moe.w4a16_moe(x, ids, weights, *tensors, G)
    assert y.shape == (7, H) and y.dtype == torch.float16
    check_close(y, loop_reference(x, ids, weights, w13, w2), "cpu op vs loop")
    assert torch.equal(torch.ops.onecat.w4a16_moe(x, ids, weights, *tensors, G), y)


def test_empty_experts_one_expert_for_all_and_ids_out_of_range(experts):
    tensors, w13, w2 = experts
    x = torch.randn(9, H, dtype=torch.float16)
    # every token on expert 4 (others empty), plus pairs of other ranks' experts
    ids = torch.tensor([[4, -1, E], [4, 7, -3]] * 4 + [[4, 4, 100]])
    weights = torch.rand(9, 3)
    y = moe.w4a16_moe(x, ids, weights, *tensors, G)
    ref = loop_reference(x, ids, weights, w13, w2)
    check_close(y, ref, "one expert, out-of-range ids")
    only_valid = loop_reference(x, ids[:, :1], weights[:, :1], w13, w2)
    only_valid[8] += loop_reference(x[8:], ids[8:, 1:2], weights[8:, 1:2], w13, w2)[0]
    assert torch.allclose(ref, only_valid), "out-of-range ids must add nothing"
    # no valid pair at all: zeros
    nothing = moe.w4a16_moe(x, torch.full((9, 2), -1), torch.rand(9, 2), *tensors, G)
    assert torch.equal(nothing, torch.zeros_like(nothing))
    # no tokens
    assert moe.w4a16_moe(x[:0], ids[:0], weights[:0], *tensors, G).shape == (0, H)


def test_cpu_op_keeps_fp32_activations_unrounded(experts):
    tensors, w13, w2 = experts
    x = torch.randn(4, H)
    ids, weights = routing(4, 2, seed=5)
    y = moe.w4a16_moe(x, ids, weights, *tensors, G)
    assert y.dtype == torch.float32
    ref = loop_reference(x, ids, weights, w13, w2, round_hidden=torch.float64)
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_fake_implementation_gives_the_output_shape(experts):
    from torch._subclasses.fake_tensor import FakeTensorMode

    tensors, _, _ = experts
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in tensors]
        x = torch.empty(5, H, dtype=torch.float16)
        ids = torch.empty(5, 8, dtype=torch.int32)
        y = torch.ops.onecat.w4a16_moe(x, ids, torch.empty(5, 8), *fake, G)
        w, i = torch.ops.onecat.moe_route(torch.empty(5, 256, dtype=torch.float16), 8)
        ws, is_ = torch.ops.onecat.moe_route(torch.empty(5, 257, dtype=torch.float16), 8, 256)
    assert y.shape == (5, H) and y.dtype == torch.float16
    assert (w.shape, w.dtype, i.shape, i.dtype) == ((5, 8), torch.float32, (5, 8), torch.int32)
    assert ws.shape == is_.shape == (5, 9), "the shared expert is one more choice"


def test_bad_inputs_name_the_argument(experts):
    tensors, _, _ = experts
    x = torch.randn(2, H, dtype=torch.float16)
    ids, weights = routing(2, 2, seed=0)
    with pytest.raises(OnecatError, match="group_size 64"):
        moe.w4a16_moe(x, ids, weights, *tensors, 64)
    with pytest.raises(OnecatError, match="w2_qweight"):
        moe.w4a16_moe(x, ids, weights, tensors[0], tensors[1], tensors[2][:, :1], tensors[3], G)
    with pytest.raises(OnecatError, match="x must be"):
        moe.w4a16_moe(x[:, :32], ids, weights, *tensors, G)
    with pytest.raises(OnecatError, match="expert_ids must be int32 or int64"):
        moe.w4a16_moe(x, ids.float(), weights, *tensors, G)
    with pytest.raises(OnecatError, match="weights must be"):
        moe.w4a16_moe(x, ids, weights[:, :1], *tensors, G)


# --- router ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_route_reference_matches_softmax_topk_renormalise(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(33, 256, generator=gen) * 3).to(dtype)
    weights, ids = moe.moe_route(logits, 8)
    probs = torch.softmax(logits.float(), dim=-1)
    top, top_ids = torch.topk(probs, 8, dim=-1)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), top_ids), "random logits have no ties: same experts, same order"
    assert torch.allclose(weights, top / top.sum(-1, keepdim=True), rtol=1e-5, atol=1e-7)
    assert torch.allclose(weights.sum(-1), torch.ones(33))


def test_route_with_the_shared_expert_appends_it_to_every_token():
    """``moe_route(logits [T, E+1], k, shared)``: the routed choices over the first E columns as
    without it, then ``(shared, sigmoid(last column))`` as choice k (CPU reference)."""
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(6, 33, generator=gen) * 2).half()
    weights, ids = moe.moe_route(logits, 4, 32)
    routed_w, routed_ids = moe.moe_route(logits[:, :32], 4)
    assert weights.shape == ids.shape == (6, 5)
    assert torch.equal(ids[:, :4], routed_ids) and torch.equal(weights[:, :4], routed_w)
    assert (ids[:, 4] == 32).all()
    assert torch.allclose(weights[:, 4], torch.sigmoid(logits[:, 32].float()))
    with pytest.raises(OnecatError, match="top_k 33"):
        moe.moe_route(logits, 33, 32)  # 32 routed experts: the gate column is not one of them


def test_router_reference_is_the_linears_then_the_route():
    """``moe_router``'s CPU reference: fp16-rounded projection logits, the route, and the shared
    gate's logit; without a shared gate its third output is ``[T, 0]``."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=gen).half()
    router, shared = (torch.randn(32, 64, generator=gen) / 8).half(), (torch.randn(1, 64, generator=gen) / 8).half()
    weights, ids, gate = moe.moe_router(x, router, shared, 4)
    ref_w, ref_ids = moe.reference_route(F.linear(x.float(), router.float()).half(), 4)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w)
    assert gate.shape == (5, 1) and gate.dtype == torch.float16
    assert torch.allclose(gate.float(), x.float() @ shared.float().T, atol=2e-3, rtol=1e-3)
    assert moe.moe_router(x, router, None, 4)[2].shape == (5, 0)
    with pytest.raises(OnecatError, match="router_weight"):
        moe.moe_router(x, router[:, :32], shared, 4)
    with pytest.raises(OnecatError, match="shared_gate_weight"):
        moe.moe_router(x, router, shared[:, :8], 4)
    assert not moe.router_fits(x, router, shared), "CPU tensors never take the GPU kernel"


def test_router_norm_reference_is_the_add_the_norm_then_the_router():
    """``moe_router_norm``'s CPU reference: the runtime's add_rms_norm, then ``moe_router`` on
    the normed rows; the fake implementation's shapes; mismatched inputs name the argument."""
    from onecat.runtime.layers.norm import add_rms_norm

    gen = torch.Generator().manual_seed(2)
    x, residual = torch.randn(3, 64, generator=gen).half(), torch.randn(3, 64, generator=gen).half()
    norm_weight = torch.randn(64, generator=gen) * 0.1
    router, shared = (torch.randn(32, 64, generator=gen) / 8).half(), (torch.randn(1, 64, generator=gen) / 8).half()
    weights, ids, gate, normed, summed = moe.moe_router_norm(x, residual, norm_weight, 1e-6, router, shared, 4, 32)
    ref_normed, ref_summed = add_rms_norm(x, residual, norm_weight, 1e-6)
    assert torch.equal(summed, ref_summed) and torch.equal(normed, ref_normed)
    ref = moe.moe_router(ref_normed, router, shared, 4, 32)
    assert torch.equal(weights, ref[0]) and torch.equal(ids, ref[1]) and gate.shape == (3, 0)
    meta = [t.to("meta") for t in (x, residual, norm_weight, router, shared)]
    fake = torch.ops.onecat.moe_router_norm(*meta[:3], 1e-6, *meta[3:], 4, 32)
    assert [tuple(t.shape) for t in fake] == [(3, 5), (3, 5), (3, 0), (3, 64), (3, 64)]
    with pytest.raises(OnecatError, match="residual must be"):
        moe.moe_router_norm(x, residual[:2], norm_weight, 1e-6, router, shared, 4)
    with pytest.raises(OnecatError, match="norm_weight must be"):
        moe.moe_router_norm(x, residual, norm_weight[:8], 1e-6, router, shared, 4)
    assert not moe.router_norm_fits(x, residual, norm_weight, router, shared), "CPU tensors never take the kernel"


def test_route_breaks_ties_lowest_index_first():
    logits = torch.zeros(3, 16)
    logits[0, [3, 9, 12]] = 2.0  # three-way tie for the top, then a 13-way tie at 0
    logits[1] = 1.0  # all equal
    logits[2, 15], logits[2, 2] = 5.0, 5.0
    weights, ids = moe.moe_route(logits, 4)
    assert ids.tolist() == [[3, 9, 12, 0], [0, 1, 2, 3], [2, 15, 0, 1]]
    assert torch.allclose(weights[1], torch.full((4,), 0.25))
    with pytest.raises(OnecatError, match="top_k 17"):
        moe.moe_route(logits, 17)
