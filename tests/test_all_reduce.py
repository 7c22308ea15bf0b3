"""CPU tests of the one-shot all-reduce's pieces that need no GPU: the buffer layout shared by
``all_reduce.cu`` and ``kernels/all_reduce.py``, the grid and the per-tensor choice (every
rank must choose alike), when the custom all-reduce stays off, how ``parallel_state`` picks
between it and NCCL, sets it up and frees it, the gloo path, and the switch from
``onecat serve --disable-custom-all-reduce`` to the engine and to vLLM. The kernel itself:
``tests/test_all_reduce_gpu.py``; its sm_70 build (no spills, no stack): ``test_kernels.py``
over ``build.PROGRAMS``."""

from __future__ import annotations

import re

import pytest
import torch
import torch.multiprocessing as mp
from click.testing import CliRunner
from server_helpers import capture_launches

from onecat.kernels import all_reduce as kernel
from onecat.kernels import build
from onecat.runtime.config import EngineConfig
from onecat.runtime.distributed import custom_all_reduce, parallel_state


def test_layout_constants_match_the_kernel_source():
    source = build.source_text("all_reduce")
    constants = {name: int(value) for name, value in re.findall(r"constexpr \w+(?: \w+)* (k\w+) = (\d+);", source)}
    assert constants == {
        "kMaxRanks": kernel.MAX_RANKS, "kMaxBlocks": kernel.MAX_BLOCKS, "kThreads": kernel.THREADS,
        "kTicketOffset": kernel.TICKET_OFFSET, "kFlagsOffset": kernel.FLAGS_OFFSET,
        "kStagingOffset": kernel.STAGING_OFFSET, "kNormThreads": kernel.NORM_THREADS,
        "kNormVectors": kernel.NORM_VECTORS,
    }  # fmt: skip
    assert kernel.TICKET_OFFSET + 4 <= kernel.FLAGS_OFFSET
    assert kernel.FLAGS_OFFSET + kernel.MAX_BLOCKS * kernel.MAX_RANKS * 4 <= kernel.STAGING_OFFSET
    assert kernel.GRID_LIMIT <= kernel.MAX_BLOCKS and kernel.GRID_LIMIT <= 80  # resident at once on a V100
    assert build.kernel_names("all_reduce") == (
        [f"all_reduce_w{n}" for n in kernel.WORLD_SIZES] + [f"all_reduce_add_rms_norm_w{n}" for n in kernel.WORLD_SIZES]
    )
    assert "all_reduce" in build.PROGRAMS


def test_buffer_holds_two_staging_buffers_of_the_limit():
    for max_bytes in (16, 1000, 1 << 20):
        stage = kernel.stage_bytes(max_bytes)
        assert stage >= max_bytes and stage % kernel.VECTOR_BYTES == 0 and stage - max_bytes < kernel.VECTOR_BYTES
        assert kernel.buffer_bytes(max_bytes) == kernel.STAGING_OFFSET + 2 * stage


@pytest.mark.parametrize("vectors", [1, 511, 512, 513, 36 * 512, 36 * 512 + 1, 65536])
def test_grid_covers_every_vector_within_the_limit(vectors):
    grid = kernel.grid_size(vectors)
    assert 1 <= grid <= kernel.GRID_LIMIT
    covered = {(b + k * grid) * kernel.THREADS + t for b in range(grid) for t in range(kernel.THREADS)
               for k in range(-(-vectors // (grid * kernel.THREADS)))}  # fmt: skip
    assert set(range(vectors)) <= covered
    assert grid == kernel.GRID_LIMIT or grid * kernel.THREADS >= vectors  # no block left idle below the limit


def test_eligible_tensors():
    limit = 1 << 20
    x = torch.zeros(64, 5120, dtype=torch.float16)
    assert kernel.eligible(x, limit) and kernel.eligible(x[:1], limit)
    assert kernel.eligible(torch.zeros(8, dtype=torch.float16), limit)  # one vector
    assert kernel.eligible(torch.zeros(limit // 2, dtype=torch.float16), limit)  # at the limit
    assert not kernel.eligible(torch.zeros(limit // 2 + 8, dtype=torch.float16), limit)
    assert not kernel.eligible(torch.zeros(0, dtype=torch.float16), limit)
    assert not kernel.eligible(torch.zeros(12, dtype=torch.float16), limit)  # 24 bytes
    assert not kernel.eligible(x.float()[:1], limit)
    assert not kernel.eligible(x.to(torch.bfloat16), limit)
    assert not kernel.eligible(x[:, :16], limit)  # not contiguous
    assert not kernel.eligible(torch.zeros(9, dtype=torch.float16)[1:], limit)  # 2-byte aligned
    assert not kernel.fits(x, limit)  # not on CUDA


def test_unavailable_reasons():
    cuda = torch.device("cuda", 0)
    assert "cpu" in custom_all_reduce.unavailable_reason(2, torch.device("cpu"))
    assert "not 3" in custom_all_reduce.unavailable_reason(3, cuda)
    assert custom_all_reduce.unavailable_reason(4, cuda) is None
    assert custom_all_reduce.unavailable_reason(2, cuda, [0, 1], lambda i, j: True) is None
    asked = []
    reason = custom_all_reduce.unavailable_reason(4, cuda, [0, 1, 2, 3], lambda i, j: asked.append((i, j)) or (i, j) != (2, 1))
    assert "GPU 2 cannot access GPU 1" in reason
    assert (0, 0) not in asked
    assert sorted(custom_all_reduce.MAX_MESSAGE_BYTES) == list(kernel.WORLD_SIZES)
    assert custom_all_reduce.max_message_bytes(2) >= 64 * 5120 * 2  # the 27B's decode at batch 64


class FakeCustom:
    """Stands for CustomAllReduce: takes tensors of at most ``limit`` elements."""

    def __init__(self, limit: int) -> None:
        self.limit, self.calls, self.closed = limit, [], False

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() <= self.limit

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.numel())
        return x.mul_(2)

    def close(self) -> None:
        self.closed = True


def test_all_reduce_picks_custom_when_it_fits_else_nccl(monkeypatch):
    nccl = []
    monkeypatch.setattr(parallel_state.dist, "all_reduce", lambda x: nccl.append(x.numel()))
    monkeypatch.setattr(parallel_state, "_world_size", 2)
    fake = FakeCustom(limit=100)
    monkeypatch.setattr(parallel_state, "_custom", fake)
    small, large = torch.ones(100), torch.ones(101)
    assert parallel_state.all_reduce(small) is small and torch.equal(small, torch.full((100,), 2.0))
    assert parallel_state.all_reduce(large) is large
    assert fake.calls == [100] and nccl == [101]
    monkeypatch.setattr(parallel_state, "_custom", None)  # off (disabled, unavailable, gloo)
    parallel_state.all_reduce(small)
    assert fake.calls == [100] and nccl == [101, 100]
    monkeypatch.setattr(parallel_state, "_world_size", 1)  # no tensor parallelism: nothing
    parallel_state.all_reduce(small)
    assert nccl == [101, 100]


@pytest.mark.parametrize(("device", "enabled", "created"), [("cuda", True, True), ("cuda", False, False), ("cpu", True, False)])
def test_init_sets_up_the_custom_all_reduce_on_cuda_unless_disabled(monkeypatch, device, enabled, created):
    groups, made = [], []
    monkeypatch.setattr(parallel_state.dist, "init_process_group", lambda backend, **kw: groups.append(backend))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(custom_all_reduce.CustomAllReduce, "create",
                        classmethod(lambda cls, rank, world, dev: made.append((rank, world, dev)) or "custom"))
    for name in ("_rank", "_world_size", "_device", "_custom"):
        monkeypatch.setattr(parallel_state, name, getattr(parallel_state, name))
    parallel_state.init_tensor_parallel(1, 2, "file:///nowhere", torch.device(device, 1), custom_all_reduce=enabled)
    assert groups == ["nccl" if device == "cuda" else "gloo"]
    assert made == ([(1, 2, torch.device("cuda", 1))] if created else [])
    assert parallel_state._custom == ("custom" if created else None)


def test_destroy_closes_the_custom_all_reduce(monkeypatch):
    fake = FakeCustom(limit=1)
    monkeypatch.setattr(parallel_state, "_custom", fake)
    monkeypatch.setattr(parallel_state, "_world_size", 2)
    monkeypatch.setattr(parallel_state.dist, "is_initialized", lambda: False)
    parallel_state.destroy_tensor_parallel()
    assert fake.closed and parallel_state._custom is None and parallel_state.tp_size() == 1


def gloo_rank(rank: int, world: int, init_method: str) -> None:
    """One rank of the gloo test: the sum through parallel_state, no custom all-reduce."""
    torch.set_num_threads(1)
    parallel_state.init_tensor_parallel(rank, world, init_method, torch.device("cpu"))
    try:
        assert parallel_state._custom is None
        x = torch.full((4, 8), float(rank + 1), dtype=torch.float16)
        assert parallel_state.all_reduce(x) is x
        assert torch.equal(x, torch.full((4, 8), float(world * (world + 1) // 2), dtype=torch.float16))
    finally:
        parallel_state.destroy_tensor_parallel()


def test_gloo_all_reduce_is_unchanged(tmp_path):
    mp.spawn(gloo_rank, args=(2, f"file://{tmp_path / 'store'}"), nprocs=2, join=True)


def test_engine_config_and_cli_switch(tmp_path, monkeypatch):
    from onecat.cli import main

    assert EngineConfig(model="m").disable_custom_all_reduce is False

    configs, vllm_calls = capture_launches(monkeypatch)
    runner = CliRunner()
    runner.invoke(main, ["serve", str(tmp_path)])
    runner.invoke(main, ["serve", str(tmp_path), "--disable-custom-all-reduce"])
    assert [c.disable_custom_all_reduce for c in configs] == [False, True]
    runner.invoke(main, ["serve", str(tmp_path), "--engine", "vllm", "--disable-custom-all-reduce"])
    runner.invoke(main, ["serve", str(tmp_path), "--engine", "vllm"])
    assert [k["vllm_args"] for k in vllm_calls] == [("--disable-custom-all-reduce",), ()]
    assert all("disable_custom_all_reduce" not in k for k in vllm_calls)
    # the escape hatch for overlapped steps (vLLM's flag), on by default
    runner.invoke(main, ["serve", str(tmp_path), "--no-async-scheduling"])
    runner.invoke(main, ["serve", str(tmp_path), "--engine", "vllm", "--no-async-scheduling"])
    assert [c.async_scheduling for c in configs] == [True, True, False]
    assert vllm_calls[-1]["vllm_args"] == ("--no-async-scheduling",)


def test_executor_passes_the_switch_to_every_rank(monkeypatch):
    from onecat.runtime.engine import executor

    seen = []

    class Stop(Exception):
        pass

    def fake_init(rank, world_size, init_method, device, custom_all_reduce=True):
        seen.append(custom_all_reduce)
        raise Stop

    monkeypatch.setattr(executor, "init_tensor_parallel", fake_init)
    replies = []

    class Pipe:
        def send(self, message):
            replies.append(message[0])

    monkeypatch.setattr(executor.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    config = EngineConfig(model="m", tensor_parallel_size=2, disable_custom_all_reduce=True)
    with pytest.raises(SystemExit):
        executor._worker_main(1, 2, "file:///nowhere", config, None, "cuda", torch.float16, None, Pipe())
    assert seen == [False] and replies == ["started", "error"]


def test_fused_norm_takes_decode_rows_only(monkeypatch):
    """What the fused all-reduce + add + norm accepts is decided by shape, dtype and layout
    (so every rank agrees): decode-sized rows, a hidden size the block holds, the fp32 weight
    of the norm; anything else takes the all-reduce and the compiled norm."""
    def ok(rows=8, hidden=5120, weight_dtype=torch.float32, residual_rows=None):
        x = torch.zeros(rows, hidden, dtype=torch.float16)
        residual = torch.zeros(residual_rows or rows, hidden, dtype=torch.float16)
        return kernel.norm_fits(x, residual, torch.zeros(hidden, dtype=weight_dtype), 1 << 20)

    assert not ok()  # CPU tensors: never
    monkeypatch.setattr(kernel, "fits", kernel.eligible)  # the device check aside
    assert ok() and ok(rows=1) and ok(rows=kernel.MAX_BLOCKS) and ok(hidden=kernel.NORM_MAX_HIDDEN)
    assert not ok(rows=kernel.MAX_BLOCKS + 1)  # one block per row, one flag row per block
    assert not ok(rows=1, hidden=kernel.NORM_MAX_HIDDEN + 8)
    assert not ok(hidden=5124)  # not whole 16-byte vectors
    assert not ok(weight_dtype=torch.float16)
    assert not ok(residual_rows=4)


def test_fused_norm_at_one_rank_is_the_compiled_norm():
    """Without tensor parallelism ``all_reduce_add_rms_norm`` is ``add_rms_norm``."""
    from onecat.runtime.layers.norm import add_rms_norm

    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(3, 64, generator=gen).half() for _ in range(2))
    weight = torch.randn(64, generator=gen)
    got = parallel_state.all_reduce_add_rms_norm(x, residual, weight, 1e-6)
    want = add_rms_norm(x, residual, weight, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
