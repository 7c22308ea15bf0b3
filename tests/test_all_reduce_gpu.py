"""GPU tests of the one-shot all-reduce (``onecat/kernels/all_reduce.cu`` through
``CustomAllReduce`` and ``parallel_state.all_reduce``) on 2, 4 and 8 GPUs (each world size
skips without enough GPUs, and all skip without peer access between them).

    ONECAT_KERNEL_ARCH=70 .venv/bin/python -m pytest -q tests/test_all_reduce_gpu.py

Each test spawns one process per GPU. Every rank draws all ranks' inputs from per-rank seeds,
so it knows the fp64 sum; the kernel sums in fp32 and rounds once, so every element must be
within one fp16 rounding of it (``2^-11`` relative, plus ``2^-16`` for sums near zero: a
missing or doubled rank is off by ~1), and the result bit-identical on every rank. Outputs
are poisoned (NaN) before each call. The calls cover: one 16-byte vector, partial blocks,
several grid-stride passes (more vectors than 36 blocks x 512 threads), the size limit;
out-of-place (input untouched) and in place; back-to-back calls of changing sizes (the grid,
hence the set of blocks that synchronise, changes from call to call) with the ranks skewed
by sleeps on the GPU, checked only at the end; CUDA-graph replays with new inputs copied in
before each, eager calls in between (the epoch continues across both); and tensors the
kernel does not take mixed in (NCCL through ``parallel_state.all_reduce``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from onecat.kernels import all_reduce as kernel
from onecat.runtime.distributed import parallel_state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

HIDDEN = 5120


def rank_input(call: int, rank: int, numel: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Rank ``rank``'s input of call ``call`` (CPU), the same in every process."""
    gen = torch.Generator().manual_seed(7919 * call + rank)
    return torch.randn(numel, generator=gen).to(dtype)


def reference(call: int, world: int, numel: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The fp64 sum of every rank's input of call ``call``."""
    return sum(rank_input(call, r, numel, dtype).double() for r in range(world))


def assert_one_rounding(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = (out.double().cpu() - ref).abs()
    bad = ~(err <= ref.abs() * 2.0**-11 + 2.0**-16)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {ref.numel()} elements off, max error {float(err.max())}"


def assert_identical_on_ranks(out: torch.Tensor, world: int, what: str) -> None:
    gathered = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(gathered, out)
    assert all(torch.equal(g, gathered[0]) for g in gathered), f"{what}: ranks differ"


def poisoned(numel: int, device: torch.device) -> torch.Tensor:
    return torch.full((numel,), float("nan"), dtype=torch.float16, device=device)


def fused_inputs(call: int, rank: int, world: int, rows: int, hidden: int):
    """This rank's x, the residual and the norm weight of a fused call, plus the fp64 sum of
    every rank's x (CPU)."""
    numel = rows * hidden
    x = rank_input(call, rank, numel).view(rows, hidden)
    gen = torch.Generator().manual_seed(104729 + call)
    residual = (4 * torch.randn(numel, generator=gen)).to(torch.float16).view(rows, hidden)
    weight = 0.5 * torch.randn(hidden, generator=gen)
    total = reference(call, world, numel).view(rows, hidden)
    return x, residual, weight, total


def assert_fused(normed: torch.Tensor, summed: torch.Tensor, inputs, what: str) -> None:
    """The kernel's (normed, new residual) against fp64: the residual within two fp16
    roundings of sum + residual, the norm of that fp16 residual within one more."""
    _, residual, weight, total = inputs
    exact = total + residual.double()
    got_sum = summed.double().cpu()
    err = (got_sum - exact).abs()
    assert (err <= (total.abs() + exact.abs()) * 2.0**-10 + 2.0**-14).all(), f"{what}: residual off by {float(err.max())}"
    ref = got_sum * torch.rsqrt(got_sum.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + weight.double())
    err = (normed.double().cpu() - ref).abs()
    assert (err <= ref.abs() * 2.0**-10 + 2.0**-14).all(), f"{what}: norm off by {float(err.max())}"


def check_fused(custom, call: int, rank: int, world: int, rows: int, hidden: int, device: torch.device) -> None:
    """One eager fused call of ``rows x hidden`` checked against fp64, inputs untouched, the
    results identical on every rank."""
    inputs = fused_inputs(call, rank, world, rows, hidden)
    x, residual, weight = (t.to(device) for t in inputs[:3])
    assert custom.norm_fits(x, residual, weight)
    normed, summed = parallel_state.all_reduce_add_rms_norm(x, residual, weight, 1e-6)
    assert_fused(normed, summed, inputs, f"fused {rows} x {hidden}")
    assert torch.equal(x.cpu(), inputs[0]) and torch.equal(residual.cpu(), inputs[1]), "an input changed"
    assert_identical_on_ranks(normed, world, f"fused {rows} x {hidden}")


def rank_checks(rank: int, world: int, init_method: str) -> None:
    """One rank of :func:`test_one_shot_all_reduce` (every rank runs the same calls)."""
    device = torch.device("cuda", rank)
    parallel_state.init_tensor_parallel(rank, world, init_method, device)
    custom = parallel_state._custom
    assert custom is not None, "the custom all-reduce did not set up (see the log)"
    limit = custom.max_bytes // 2  # elements
    passes = kernel.GRID_LIMIT * kernel.THREADS * 8  # elements one grid-stride pass covers
    sizes = [n for n in (8, HIDDEN - 8, HIDDEN, 3 * HIDDEN, 64 * HIDDEN, 2 * passes + 8) if n < limit] + [limit]
    call = 0

    # one call at a time: out of place (input untouched) and in place, poisoned outputs
    for numel in sizes:
        x_cpu = rank_input(call, rank, numel)
        x = x_cpu.to(device)
        out = poisoned(numel, device)
        assert custom.fits(x)
        custom.all_reduce(x, out)
        assert_one_rounding(out, reference(call, world, numel), f"out of place, {numel} elements")
        assert torch.equal(x.cpu(), x_cpu), "the input changed"
        assert_identical_on_ranks(out, world, f"out of place, {numel} elements")
        call += 1
        x = rank_input(call, rank, numel).to(device)
        parallel_state.all_reduce(x)
        assert_one_rounding(x, reference(call, world, numel), f"in place, {numel} elements")
        call += 1

    # back-to-back calls of changing sizes, one rank late each time, checked at the end
    order = [sizes[i % len(sizes)] for i in range(3 * len(sizes))] + [HIDDEN] * 20
    outs = []
    for i, numel in enumerate(order):
        x = rank_input(call + i, rank, numel).to(device)
        out = poisoned(numel, device)
        if rank == i % world:
            torch.cuda._sleep(50_000)  # ~25 us: the other ranks run ahead into this call
        custom.all_reduce(x, out)
        outs.append(out)
    for i, (numel, out) in enumerate(zip(order, outs, strict=True)):
        assert_one_rounding(out, reference(call + i, world, numel), f"back-to-back call {i}, {numel} elements")
    call += len(order)

    # tensors the kernel does not take go to NCCL, in between
    others = [
        rank_input(call, rank, custom.max_bytes // 2 + 8),  # above the limit
        rank_input(call + 1, rank, 2 * HIDDEN, torch.float32),  # fp32
        rank_input(call + 2, rank, 12),  # 24 bytes: not whole vectors
    ]
    for k, x_cpu in enumerate(others):
        x = x_cpu.to(device)
        assert not custom.fits(x)
        parallel_state.all_reduce(x)
        ref = reference(call + k, world, x.numel(), x.dtype)
        magnitude = sum(rank_input(call + k, r, x.numel(), x.dtype).double().abs() for r in range(world))
        err = (x.double().cpu() - ref).abs()  # NCCL may round each partial sum: N - 1 roundings
        assert (err <= (world - 1) * 2.0**-11 * magnitude + 2.0**-16).all(), f"NCCL path, input {k}"
    call += len(others)

    # CUDA graph: three calls of different sizes on static buffers, replayed with new inputs
    graph_sizes = [HIDDEN, 16 * HIDDEN, 64 * HIDDEN]
    static_in = [torch.zeros(n, dtype=torch.float16, device=device) for n in graph_sizes]
    static_out = [torch.zeros(n, dtype=torch.float16, device=device) for n in graph_sizes]
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        custom.all_reduce(static_in[0], static_out[0])
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for a, b in zip(static_in, static_out, strict=True):
            custom.all_reduce(a, b)
        parallel_state.all_reduce(static_in[0])  # in place, after its out-of-place call
    for replay in range(60):
        for k, (a, b) in enumerate(zip(static_in, static_out, strict=True)):
            a.copy_(rank_input(call + k, rank, a.numel()).to(device))
            b.fill_(float("nan"))
        graph.replay()
        for k, b in enumerate(static_out):
            assert_one_rounding(b, reference(call + k, world, b.numel()), f"graph replay {replay}, output {k}")
        assert_one_rounding(static_in[0], reference(call, world, HIDDEN), f"graph replay {replay}, in place")
        call += len(graph_sizes)
        if replay % 7 == 3:  # eager calls between replays
            x = rank_input(call, rank, 2 * HIDDEN).to(device)
            custom.all_reduce(x)
            assert_one_rounding(x, reference(call, world, 2 * HIDDEN), f"eager call after replay {replay}")
            call += 1
    assert_identical_on_ranks(static_out[2], world, "graph replay")
    torch.cuda.synchronize(device)
    del graph

    # fused all-reduce + residual add + RMSNorm (1 + w): eager at several shapes, then replayed
    # in a graph between plain calls (one epoch sequence for both kernels)
    for rows, hidden in [(1, HIDDEN), (3, 2048), (8, HIDDEN), (kernel.MAX_BLOCKS, HIDDEN), (2, 8192)]:
        check_fused(custom, call, rank, world, rows, hidden, device)
        call += 1
    x = torch.zeros(8, HIDDEN, dtype=torch.float16, device=device)
    res = torch.zeros_like(x)
    weight = torch.zeros(HIDDEN, dtype=torch.float32, device=device)
    plain = torch.zeros(2 * HIDDEN, dtype=torch.float16, device=device)
    with torch.cuda.stream(side):
        custom.add_rms_norm(x, res, weight, 1e-6)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        custom.all_reduce(plain)
        normed, summed = custom.add_rms_norm(x, res, weight, 1e-6)
    for replay in range(20):
        inputs = fused_inputs(call, rank, world, 8, HIDDEN)
        x.copy_(inputs[0].to(device))
        res.copy_(inputs[1].to(device))
        weight.copy_(inputs[2].to(device))
        plain.copy_(rank_input(call + 1, rank, 2 * HIDDEN).to(device))
        normed.fill_(float("nan"))
        graph.replay()
        assert_fused(normed, summed, inputs, f"fused graph replay {replay}")
        assert_one_rounding(plain, reference(call + 1, world, 2 * HIDDEN), f"plain call in the fused graph {replay}")
        call += 2
    torch.cuda.synchronize(device)
    del graph
    parallel_state.destroy_tensor_parallel()
    assert parallel_state._custom is None


@pytest.mark.parametrize("world", [2, 4, 8])
def test_one_shot_all_reduce(world, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    if not all(torch.cuda.can_device_access_peer(i, j) for i in range(world) for j in range(world) if i != j):
        pytest.skip("no peer access between the GPUs: the custom all-reduce stays off")
    mp.spawn(rank_checks, args=(world, f"file://{tmp_path / 'store'}"), nprocs=world, join=True)
