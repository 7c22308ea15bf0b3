"""GPU tests of the MoE ops (``w4a16_moe_gemv.cu``, ``w4a16_moe_wmma.cu``,
``w4a16_moe_route.cu``) against an fp64 reference with the kernels' dequant contract.

Run on a GPU (the H200 runs a V100's code with ``ONECAT_KERNEL_ARCH=70``):

    ONECAT_KERNEL_ARCH=70 .venv/bin/python -m pytest -q tests/test_moe_kernel_gpu.py

``ref`` is, per (token, expert) pair in fp64, ``down(h)`` with ``h = fp16(silu(gate) * up)``
(the kernels round h to fp16 between the projections) and weights ``fp16(q*s + fp16(-z*s))``,
summed with the routing weights. Tolerance: every output finite, elementwise
``|y - ref| <= 4e-3 * |ref| + c * rms(ref)`` and ``||y - ref|| / ||ref|| <= n`` with
c = 4e-3, n = 2e-3 on the grouped wmma path (fp32 accumulation, as the linear op's tests)
and c = 1e-2, n = 3e-3 on the gather-GEMV and grouped-GEMV paths (same dot products): its two chained projections each form fp16
partial sums of 16 products (about 7e-4 of the rms per projection: sqrt(2) x the 5e-4
estimated for the linear GEMV's sums of 8 from its measured 2e-3 worst case at K = 128), and
the worst of 10^4..10^5 outputs lies about 4.5 sigma out. A wrong expert, column or routing weight is off by O(rms). The caching allocator's free blocks are filled with NaN before
each call, so an output or hidden row the kernels never write fails the finiteness check.
Shapes are Qwen3.5-35B-A3B's (E = 256, H = 2048, I = 512, top-8, g = 128) unless noted;
T < 16 takes the gather-GEMV path, 16..32 the grouped-GEMV path, more tokens the grouped wmma
path.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from onecat.runtime.engine.graph_capture import capture

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

E, H, INTER, TOP_K, G = 256, 2048, 512, 8, 128
RTOL = 4e-3  # elementwise, relative to |ref|
TOLERANCES = {"grouped wmma": (4e-3, 2e-3), "gather-GEMV": (1e-2, 3e-3), "grouped-GEMV": (1e-2, 3e-3)}  # (x rms(ref), norm)


def random_stacked(e: int, n: int, k: int, g: int, gen: torch.Generator):
    """Random stacked packed weights [E, N/32, K/32, 32, 4] + scales_zeros (any nibbles are
    valid q; s in [0.001, 0.021], z in 0..15, nzs = fp16(-z*s))."""
    qweight = torch.randint(-(2**31), 2**31 - 1, (e, n // 32, k // 32, 32, 4), dtype=torch.int32,
                            device="cuda", generator=gen)
    s = (torch.rand(e, n // 32, k // g, 32, 1, device="cuda", generator=gen) * 0.02 + 0.001).half()
    z = torch.randint(0, 16, s.shape, device="cuda", generator=gen)
    nzs = (-(z.double() * s.double())).half()
    return qweight, torch.cat([s, nzs], dim=-1).contiguous()


@pytest.fixture(scope="module")
def experts_35b():
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = random_stacked(E, 2 * INTER, H, G, gen)
    w2 = random_stacked(E, H, INTER, G, gen)
    return (*w13, *w2)


def reference(x, ids, weights, tensors, g):
    """fp64 per expert: contract weights, h rounded to fp16, routing-weighted sum."""
    from onecat.pack.volta_layout import dequantize_volta

    w13_q, w13_sz, w2_q, w2_sz = tensors
    num_experts, inter = w13_q.shape[0], w13_q.shape[1] * 16
    out = torch.zeros(x.shape[0], w2_q.shape[1] * 32, dtype=torch.float64, device=x.device)
    ids = ids.long()
    valid = (ids >= 0) & (ids < num_experts)
    for e in torch.unique(ids[valid]).tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        gate_up = x[tokens].double() @ dequantize_volta(w13_q[e], w13_sz[e], g, torch.float64).t()
        h = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).half().double()
        y = h @ dequantize_volta(w2_q[e], w2_sz[e], g, torch.float64).t()
        out.index_add_(0, tokens, y * weights[tokens, slots].double()[:, None])
    return out


def poison_allocator() -> None:
    """Fill free blocks of the caching allocator (small and large pools) with NaN."""
    blocks = [torch.full((n,), float("nan"), dtype=torch.float16, device="cuda")
              for n in [1 << 14] * 32 + [1 << 18] * 16 + [1 << 24] * 4]
    del blocks


def path_of(tokens: int, top_k: int = TOP_K) -> str:
    from onecat.kernels.moe import GATHER_MAX_PAIRS, GROUPED_GEMV_MIN_TOKENS

    if tokens * top_k > GATHER_MAX_PAIRS:
        return "grouped wmma"
    return "grouped-GEMV" if tokens >= GROUPED_GEMV_MIN_TOKENS else "gather-GEMV"


def check_close(y: torch.Tensor, ref: torch.Tensor, what: str, path: str) -> None:
    rms_rtol, norm_rtol = TOLERANCES[path]
    what = f"{what} [{path}]"
    assert torch.isfinite(y).all(), (
        f"{what}: {int((~torch.isfinite(y)).sum())} non-finite outputs (unwritten rows or "
        f"columns, or a NaN hidden row read back), first at {(~torch.isfinite(y)).nonzero()[:4].tolist()}"
    )
    y64 = y.double()
    rms = ref.pow(2).mean().sqrt()
    err = (y64 - ref).abs()
    bound = RTOL * ref.abs() + rms_rtol * rms
    worst = int((err - bound).argmax())
    rel_norm = float((y64 - ref).norm() / ref.norm())
    assert (err <= bound).all() and rel_norm <= norm_rtol, (
        f"{what}: max error {err.max():.3e} (rms of ref {rms:.3e}); worst element {divmod(worst, y.shape[1])} "
        f"got {y.flatten()[worst].item():.4f} want {ref.flatten()[worst].item():.4f}; "
        f"{int((err > bound).sum())} elements over the bound; rel norm {rel_norm:.2e} (limit {norm_rtol})"
    )


def random_routing(t: int, e: int, top_k: int, seed: int, ids_dtype=torch.int32, weights_dtype=torch.float32):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(t, e, device="cuda", generator=gen).argsort(dim=-1)[:, :top_k].to(ids_dtype)
    weights = torch.softmax(torch.randn(t, top_k, device="cuda", generator=gen), -1).to(weights_dtype)
    x = torch.randn(t, H, device="cuda", generator=gen).half()
    return x, ids.contiguous(), weights


def run_op(x, ids, weights, tensors, g=G):
    from onecat.kernels.moe import w4a16_moe

    poison_allocator()
    y = w4a16_moe(x, ids, weights, *tensors, g)
    torch.cuda.synchronize()
    return y


@pytest.mark.parametrize("tokens", [1, 2, 3, 8, 16, 32, 256, 2048])  # 1 and 2: the down projection split (down_splits)
def test_moe_op_matches_fp64_at_35b_shapes(experts_35b, tokens):
    x, ids, weights = random_routing(tokens, E, TOP_K, seed=tokens)
    y = run_op(x, ids, weights, experts_35b)
    assert y.shape == (tokens, H) and y.dtype == torch.float16
    check_close(y, reference(x, ids, weights, experts_35b, G), f"T={tokens}", path_of(tokens))


@pytest.mark.parametrize("tokens", [5, 200])
@pytest.mark.parametrize("ids_dtype, weights_dtype", [(torch.int64, torch.float16), (torch.int32, torch.float32)])
def test_moe_op_id_and_weight_dtypes(experts_35b, tokens, ids_dtype, weights_dtype):
    x, ids, weights = random_routing(tokens, E, TOP_K, seed=7, ids_dtype=ids_dtype, weights_dtype=weights_dtype)
    y = run_op(x, ids, weights, experts_35b)
    check_close(y, reference(x, ids, weights, experts_35b, G), f"T={tokens} ids {ids_dtype} weights {weights_dtype}",
                path_of(tokens))


@pytest.mark.parametrize("tokens", [2, 8, 24, 300])
def test_all_tokens_on_one_expert_others_empty(experts_35b, tokens):
    """Slot 0 of every token is expert 7 (300 rows: several row tiles of one expert), the
    other slots are spread over experts 200..203; the other 251 experts are empty."""
    x, _, weights = random_routing(tokens, E, TOP_K, seed=3)
    ids = torch.empty(tokens, TOP_K, dtype=torch.int32, device="cuda")
    ids[:, 0] = 7
    ids[:, 1:] = 200 + torch.arange(TOP_K - 1, device="cuda") % 4
    y = run_op(x, ids, weights, experts_35b)
    check_close(y, reference(x, ids, weights, experts_35b, G), f"T={tokens}, one expert for all", path_of(tokens))


@pytest.mark.parametrize("tokens", [2, 4, 20, 100])
def test_ids_outside_the_experts_contribute_nothing(experts_35b, tokens):
    """Other ranks' experts (ids < 0 or >= E, as expert parallelism and vLLM's -1 give) add
    nothing; a token whose every id is outside gets zeros."""
    x, ids, weights = random_routing(tokens, E, TOP_K, seed=11, ids_dtype=torch.int64)
    ids[:, ::2] = -1
    ids[:, 1] += E  # >= E
    ids[0] = torch.tensor([-5, E, E + 3, -1, 10**10, -(10**10), E, -2], device="cuda")
    y = run_op(x, ids, weights, experts_35b)
    ref = reference(x, ids, weights, experts_35b, G)
    assert torch.equal(y[0], torch.zeros_like(y[0])), "a token without a local expert must get zeros"
    check_close(y[1:], ref[1:], f"T={tokens}, ids outside [0, E)", path_of(tokens))


@pytest.mark.parametrize("tokens", [1, 4, 32, 64])
def test_moe_op_under_cuda_graph_capture(experts_35b, tokens):
    """Captured once; replayed after new inputs and routing are copied into the static
    tensors: the results follow the new routing (nothing was read on the host)."""
    from onecat.kernels.moe import w4a16_moe

    x, ids, weights = random_routing(tokens, E, TOP_K, seed=1)
    graph = torch.cuda.CUDAGraph()  # warmed up on the capture stream: kernels and workspace first
    y = capture(graph, None, lambda: w4a16_moe(x, ids, weights, *experts_35b, G))
    for seed in (2, 3):
        x2, ids2, weights2 = random_routing(tokens, E, TOP_K, seed=seed)
        x.copy_(x2)
        ids.copy_(ids2)
        weights.copy_(weights2)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_close(y, reference(x2, ids2, weights2, experts_35b, G), f"graph replay T={tokens} seed {seed}",
                    path_of(tokens))


@pytest.mark.parametrize("h, inter, g", [(96, 96, 32), (192, 128, 64)])
def test_small_shapes_and_odd_tile_counts(h, inter, g):
    """Sizes off the 35B grid, E = 6: H = 96 (3 k tiles), I = 96 (3 column tiles, an odd
    count: the grouped kernel's last column group is half empty), g = 32 (fp16 staging); and
    H = 192 (6 output tiles: the down projection's last group of 4 is half empty), I = 128,
    g = 64 (packed fragments)."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    e = 6
    tensors = (*random_stacked(e, 2 * inter, h, g, gen), *random_stacked(e, h, inter, g, gen))
    for tokens in (1, 2, 3, 150):
        ids = torch.randint(-1, e + 1, (tokens, 2), device="cuda", generator=gen)
        weights = torch.rand(tokens, 2, device="cuda", generator=gen)
        x = torch.randn(tokens, h, device="cuda", generator=gen).half()
        y = run_op(x, ids, weights, tensors, g)
        check_close(y, reference(x, ids, weights, tensors, g), f"E={e} H={h} I={inter} T={tokens}",
                    path_of(tokens, 2))


@pytest.mark.parametrize("tokens", [20, 400])  # grouped GEMV (16-32 tokens), grouped wmma
def test_the_most_experts_the_align_step_takes(tokens):
    """E = 1024 (``MAX_EXPERTS``: one align thread per expert, every warp of its shuffle scan
    holding counts) with every token's first choice on the last expert: the pair and tile
    offsets of all 32 warps' experts must chain correctly."""
    from onecat.kernels.moe import MAX_EXPERTS

    gen = torch.Generator(device="cuda").manual_seed(9)
    e, h, inter, g = MAX_EXPERTS, 64, 64, 32
    tensors = (*random_stacked(e, 2 * inter, h, g, gen), *random_stacked(e, h, inter, g, gen))
    ids = torch.randint(0, e, (tokens, 4), device="cuda", generator=gen, dtype=torch.int32)
    ids[:, 0] = e - 1
    weights = torch.rand(tokens, 4, device="cuda", generator=gen)
    x = torch.randn(tokens, h, device="cuda", generator=gen).half()
    y = run_op(x, ids, weights, tensors, g)
    check_close(y, reference(x, ids, weights, tensors, g), f"E={e} T={tokens}", path_of(tokens, 4))


def test_rows_wider_than_the_staging_take_global_loads():
    """H = 4608 (wider than the 4096 halfs gate_up stages in shared memory) and I = 2304
    (wider than the grouped down's 2048), E = 4: the unstaged instantiations, on the gather
    path (3 tokens) and the grouped-GEMV path (20 tokens)."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    e, h, inter = 4, 4608, 2304
    tensors = (*random_stacked(e, 2 * inter, h, G, gen), *random_stacked(e, h, inter, G, gen))
    for tokens in (3, 20):
        ids = torch.stack([torch.randperm(e, device="cuda", generator=gen)[:2] for _ in range(tokens)]).int()
        weights = torch.rand(tokens, 2, device="cuda", generator=gen)
        x = torch.randn(tokens, h, device="cuda", generator=gen).half()
        y = run_op(x, ids, weights, tensors, G)
        check_close(y, reference(x, ids, weights, tensors, G), f"E={e} H={h} I={inter} T={tokens}",
                    path_of(tokens, 2))


# --- router ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 7, 2048])
def test_route_kernel_matches_reference(dtype, tokens):
    from onecat.kernels.moe import moe_route, reference_route

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    wide = (torch.randn(tokens, E + 16, device="cuda", generator=gen) * 2).to(dtype)
    logits = wide[:, :E]  # strided rows, as a view of a wider projection
    weights, ids = moe_route(logits, TOP_K)
    ref_w, ref_ids = reference_route(logits.cpu(), TOP_K)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu(), ref_ids), f"expert ids differ in {int((ids.cpu() != ref_ids).any(-1).sum())} rows"
    err = (weights.cpu() - ref_w).abs().max()
    assert err <= 2e-6, f"routing weights: max error {err:.2e}"
    probs = torch.softmax(logits.float(), -1)
    top, top_ids = torch.topk(probs, TOP_K, -1)
    assert torch.allclose(weights, top / top.sum(-1, keepdim=True), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 32, 300])
def test_route_kernel_appends_the_shared_expert(dtype, tokens):
    """Logits [T, E+1] whose last column is the shared expert's gate (a view of a wider
    projection): the routed choices as without it, then (shared id, sigmoid(gate))."""
    from onecat.kernels.moe import moe_route, reference_route

    gen = torch.Generator(device="cuda").manual_seed(50 + tokens)
    wide = (torch.randn(tokens, E + 9, device="cuda", generator=gen) * 2).to(dtype)
    logits = wide[:, : E + 1]
    weights, ids = moe_route(logits, TOP_K, E)
    assert weights.shape == ids.shape == (tokens, TOP_K + 1)
    routed_w, routed_ids = moe_route(logits[:, :E], TOP_K)
    assert torch.equal(ids[:, :TOP_K], routed_ids) and torch.equal(weights[:, :TOP_K], routed_w)
    assert (ids[:, TOP_K] == E).all()
    shared = torch.sigmoid(logits[:, E].double()).float()
    assert (weights[:, TOP_K] - shared).abs().max() <= 1e-6
    ref_w, ref_ids = reference_route(logits.cpu(), TOP_K, E)
    assert torch.equal(ids.cpu(), ref_ids) and (weights.cpu() - ref_w).abs().max() <= 2e-6


def test_route_kernel_breaks_ties_lowest_index_first():
    from onecat.kernels.moe import moe_route

    logits = torch.zeros(3, E, device="cuda", dtype=torch.float16)
    logits[0, [3, 40, 77, 200]] = 2.0
    logits[1] = 1.0
    logits[2, [255, 31, 32, 1]] = 5.0
    _, ids = moe_route(logits, TOP_K)
    expected = [[3, 40, 77, 200, 0, 1, 2, 4], list(range(8)), [1, 31, 32, 255, 0, 2, 3, 4]]
    assert ids.tolist() == expected


@pytest.mark.parametrize("tokens", [1, 5, 8])
@pytest.mark.parametrize("shared", [True, False])
def test_router_kernel_matches_fp64_projection_and_route(tokens, shared):
    """The one-launch router (projection + route + shared gate) against the fp64 projection:
    logits within fp16 rounding, the same experts wherever the fp64 logits leave a margin
    beyond that rounding, weights within the logits' rounding; outputs poisoned first."""
    from onecat.kernels.moe import moe_router, reference_route, router_fits

    gen = torch.Generator(device="cuda").manual_seed(100 + tokens)
    h = 2048
    wide = torch.randn(tokens, h + 64, device="cuda", generator=gen).half()
    x = wide[:, :h]  # strided rows, as the normed hidden states may be
    router = (torch.randn(E, h, device="cuda", generator=gen) / 4).half()  # logits ~ N(0, 11^2): clear gaps
    gate_w = (torch.randn(1, h, device="cuda", generator=gen) / 16).half() if shared else None
    assert router_fits(x, router, gate_w)
    poison_allocator()
    for _ in range(2):  # twice: the kernel leaves its ticket counter zeroed for the next launch
        weights, ids, gate = moe_router(x, router, gate_w, TOP_K)
    logits64 = x.double() @ router.double().T
    rounded = logits64.half()
    ref_w, ref_ids = reference_route(rounded.cpu(), TOP_K)
    top = torch.sort(logits64, dim=-1, descending=True).values
    clear = ((top[:, : TOP_K] - top[:, 1 : TOP_K + 1]).abs().min(-1).values > 0.05).cpu()
    assert clear.sum() >= (tokens + 1) // 2, f"test data: most tokens must have clear top-k margins ({clear.tolist()})"
    assert torch.equal(ids.cpu()[clear], ref_ids[clear]), "expert ids differ where the fp64 margins are clear"
    assert (weights.cpu()[clear] - ref_w[clear]).abs().max() <= 1e-2  # a logit may round to the next fp16
    assert torch.allclose(weights.sum(-1), torch.ones(tokens, device="cuda"), atol=1e-5)
    if shared:
        assert gate.shape == (tokens, 1)
        assert (gate.double() - x.double() @ gate_w.double().T).abs().max() <= 2e-3 + 1e-3 * top.abs().max()
    else:
        assert gate.shape == (tokens, 0)


def test_router_kernel_ties_and_graph_capture():
    """Equal rows give equal logits (the same sums in the same order): ties go to the lowest
    expert index; the launch replays inside a CUDA graph with new inputs."""
    from onecat.kernels.moe import moe_router

    gen = torch.Generator(device="cuda").manual_seed(7)
    h = 512
    router = (torch.randn(E, h, device="cuda", generator=gen) / 16).half()
    router[[3, 40, 77, 200, 201]] = router[250] * 0 + 0.05  # five equal, clearly largest rows
    x = torch.rand(4, h, device="cuda", generator=gen).half() + 0.5
    weights, ids, _ = moe_router(x, router, None, TOP_K)
    assert ids[:, :5].tolist() == [[3, 40, 77, 200, 201]] * 4
    assert torch.allclose(weights[:, :5], weights[:, :1].expand(4, 5))
    static = torch.randn(8, h, device="cuda", generator=gen).half()
    shared = (torch.randn(1, h, device="cuda", generator=gen) / 16).half()
    graph = torch.cuda.CUDAGraph()  # warmed up on the capture stream
    out = capture(graph, None, lambda: moe_router(static, router, shared, TOP_K))
    for seed in (1, 2):
        static.copy_(torch.randn(8, h, device="cuda", generator=gen.manual_seed(seed)).half())
        graph.replay()
        expected = moe_router(static.clone(), router, shared, TOP_K)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(out, expected, strict=True))


# --- the runtime's MoE layer -------------------------------------------------------------


@pytest.mark.parametrize("tokens", [2, 100])
def test_runtime_experts_on_cuda_match_their_cpu_reference(tokens):
    """FusedExperts (and an expert-parallel LocalExperts share) on CUDA vs the same module on
    the CPU (the op's reference), with routing from the runtime's router kernel."""
    from onecat.kernels.moe import moe_route
    from onecat.runtime.layers.expert_parallel import LocalExperts
    from onecat.runtime.layers.moe import FusedExperts

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    e, h, inter, g = 64, 256, 128, 64
    full = FusedExperts(e, h, inter, group_size=g, dtype=torch.float16)
    share = LocalExperts(e, 16, 32, h, inter, group_size=g, dtype=torch.float16)
    w13 = random_stacked(e, 2 * inter, h, g, gen)
    w2 = random_stacked(e, h, inter, g, gen)
    for module, first, count in ((full, 0, e), (share, 16, 32)):
        for name, value in zip(("w13_qweight", "w13_scales_zeros", "w2_qweight", "w2_scales_zeros"), (*w13, *w2), strict=True):
            getattr(module, name).data = value[first : first + count].clone()
    x = torch.randn(tokens, h, device="cuda", generator=gen).half()
    weights, ids = moe_route(torch.randn(tokens, e, device="cuda", generator=gen), 4)
    for module in (full, share):
        y = module.cuda()(x, ids, weights)
        ref = module.cpu()(x.cpu(), ids.cpu(), weights.cpu())
        check_close(y, ref.double().cuda(), f"{type(module).__name__} T={tokens}", path_of(tokens, 4))


@pytest.mark.parametrize("small_tiles, packed", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("tokens", [40, 300])
def test_grouped_row_tile_sizes_match_fp64(experts_35b, tokens, small_tiles, packed, monkeypatch):
    """Both row-tile sizes of the grouped path (16 rows for few pairs per expert, 64 rows),
    16-row tiles dequantising on packed fragments and through fp16 in shared memory, on the
    same routings, whichever the op would pick."""
    from onecat.kernels import moe

    monkeypatch.setattr(moe, "SMALL_TILE_PAIRS_PER_EXPERT", 1 << 30 if small_tiles else 0)
    monkeypatch.setattr(moe, "PACKED_FRAGMENTS", packed)
    x, ids, weights = random_routing(tokens, E, TOP_K, seed=100 + tokens)
    y = moe.w4a16_moe(x, ids, weights, *experts_35b, G)
    label = f"T={tokens} {'16' if small_tiles else '64'}-row tiles{' packed' if packed else ''}"
    check_close(y, reference(x, ids, weights, experts_35b, G), label, "grouped wmma")


@pytest.mark.parametrize("tokens", [1, 2, 8, 32])
def test_every_gather_kernel_shape_matches_fp64(experts_35b, tokens, monkeypatch):
    """Every (warps, batch) shape ``w4a16_moe_gemv.cu`` builds for the gather path's two
    kernels, one at a time beside the default of the other."""
    from onecat.kernels import build, moe

    x, ids, weights = random_routing(tokens, E, TOP_K, seed=200 + tokens)
    ref = reference(x, ids, weights, experts_35b, G)
    monkeypatch.setattr(moe, "GROUPED_GEMV_MIN_TOKENS", 1 << 30)
    for name in build.kernel_names("w4a16_moe_gemv"):
        if not re.fullmatch(r"w4a16_moe_gemv_(gate_up|down)_w\d+_b\d+", name):
            continue  # the grouped decode kernels and the pair sum: tested below
        kind, shape = name.removeprefix("w4a16_moe_gemv_").rsplit("_w", 1)
        warps, batch = (int(v) for v in shape.split("_b"))
        gate, down = moe.gather_shapes(tokens)
        pinned = {"gate_up": gate, "down": down, kind: (warps, batch)}
        monkeypatch.setattr(moe, "GATHER_SHAPES", ((1 << 30, pinned["gate_up"], pinned["down"]),))
        check_close(run_op(x, ids, weights, experts_35b), ref, f"T={tokens} {name}", "gather-GEMV")


@pytest.mark.parametrize("tokens", [1, 3, 8, 32])
def test_every_grouped_gemv_shape_matches_fp64(experts_35b, tokens, monkeypatch):
    """The grouped decode kernels at every built (warps, batch, rows per block), forced on
    from one token: one pair per expert (1 token), partial row tiles, and experts with more
    pairs than a block holds (every token's slot 0 on expert 5: several row tiles of one
    expert)."""
    from onecat.kernels import moe

    built = moe.built_grouped_gemv_shapes()
    assert built, "no grouped decode kernels are built"
    x, ids, weights = random_routing(tokens, E, TOP_K, seed=300 + tokens)
    ids[:, 0] = 5
    ref = reference(x, ids, weights, experts_35b, G)
    monkeypatch.setattr(moe, "GROUPED_GEMV_MIN_TOKENS", 1)
    for shape in built:
        monkeypatch.setattr(moe, "GROUPED_GEMV_SHAPE", shape)
        check_close(run_op(x, ids, weights, experts_35b), ref, f"T={tokens} grouped shape {shape}", "grouped-GEMV")
