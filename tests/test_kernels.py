"""CPU tests of onecat.kernels: NVRTC builds for sm_70 (no spills), the reference op, the op
registration and fake implementation, prebuilt-kernel handling and the doctor without a GPU."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from onecat.errors import OnecatError
from onecat.kernels import build, loader, ops
from onecat.kernels.variants import Variant, all_variants
from onecat.pack.volta_layout import pack_volta


def random_layer(n: int, k: int, g: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    z = torch.randint(0, 16, (n, k // g), dtype=torch.uint8, generator=gen)
    s = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.001).half()
    return q, z, s


@pytest.fixture(scope="module")
def sm70_builds():
    return {p: build.compile_program(p, "sm_70") for p in build.PROGRAMS}


@pytest.mark.parametrize("program", build.PROGRAMS)
def test_nvrtc_builds_compute_70_ptx(program):
    compiled = build.compile_program(program, "compute_70")
    ptx = compiled.image.rstrip(b"\0").decode()
    assert ".target sm_70" in ptx
    for name in build.kernel_names(program):
        assert f".entry {name}(" in ptx


@pytest.mark.parametrize("program", build.PROGRAMS)
def test_nvrtc_builds_sm_70_cubin_without_spills(program, sm70_builds):
    compiled = sm70_builds[program]
    assert compiled.image[:4] == b"\x7fELF"
    by_name = {r.name: r for r in compiled.resources}
    assert set(by_name) == set(build.kernel_names(program)), compiled.log
    for r in by_name.values():
        assert r.spill_stores == 0 and r.spill_loads == 0, f"{r.name} spills: {r}"
        assert r.stack_bytes == 0, f"{r.name} uses a stack frame: {r}"
        assert r.shared_bytes <= 48 * 1024, f"{r.name} needs opt-in shared memory: {r}"


def test_wmma_kernels_use_tensor_core_instructions():
    ptx = build.compile_program("w4a16_wmma", "compute_70").image.decode(errors="replace")
    assert "wmma.mma.sync.aligned.row.col.m16n16k16.f32.f32" in ptx
    assert "wmma.mma.sync.aligned.row.col.m8n32k16.f32.f32" in ptx
    for forbidden in ("cp.async", "ldmatrix", "mma.sync.aligned.m16n8k16"):
        assert forbidden not in ptx


def test_parse_ptxas_report_reads_registers_and_spills():
    log = (
        "ptxas info    : Compiling entry function 'k1' for 'sm_70'\n"
        "ptxas info    : Function properties for k1\n"
        "    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
        "ptxas info    : Used 80 registers, 516 bytes smem, 400 bytes cmem[0]\n"
        "ptxas info    : Compiling entry function 'k2' for 'sm_70'\n"
        "ptxas info    : Function properties for k2\n"
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Used 32 registers, 400 bytes cmem[0]\n"
    )
    k1, k2 = build.parse_ptxas_report(log)
    assert (k1.name, k1.registers, k1.spill_stores, k1.spill_loads) == ("k1", 80, 4, 12)
    assert (k1.stack_bytes, k1.shared_bytes) == (8, 516)
    assert (k2.name, k2.registers, k2.spill_stores, k2.shared_bytes) == ("k2", 32, 0, 0)


@pytest.mark.parametrize("program", build.PROGRAMS)
def test_every_kernel_name_leads_the_loader_to_its_program(program):
    """The loader finds a kernel's program by its name (build.program_of): a kernel named
    outside its program's prefix could never be launched."""
    for name in build.kernel_names(program):
        assert build.program_of(name) == program, name


def test_every_variant_names_a_built_kernel():
    names = {n for p in build.PROGRAMS for n in build.kernel_names(p)}
    for variant in all_variants():
        assert variant.kernel_name() in names
        assert Variant.parse(variant.name) == variant
    with pytest.raises(OnecatError):
        Variant.parse("gemv-m3-u2-p0")


@pytest.mark.parametrize("shape", [(1, 256), (7, 256), (3, 5, 512)])
def test_cpu_op_matches_fp64_contract(shape):
    n, g = 96, 64
    k = shape[-1]
    q, z, s = random_layer(n, k, g, seed=k)
    qweight, scales_zeros = pack_volta(q, z, s)
    # The dequant contract computed independently: one rounding of q*s + fp16(-z*s).
    nzs = (-(z.double() * s.double())).half().double()
    w = (q.double().view(n, k // g, g) * s.double()[..., None] + nzs[..., None]).half().double()
    w = w.view(n, k)
    x = torch.randn(*shape, dtype=torch.float16)
    bias = torch.randn(n, dtype=torch.float16)
    y = ops.w4a16_linear(x, qweight, scales_zeros, g, bias)
    ref = x.double() @ w.t() + bias.double()
    assert y.shape == (*shape[:-1], n) and y.dtype == torch.float16
    err = (y.double() - ref).abs()
    assert (err <= 2e-3 * ref.abs() + 2e-3 * ref.pow(2).mean().sqrt()).all(), err.max()


def test_op_registration_and_fake_impl():
    n, k, g = 64, 128, 32
    qweight, scales_zeros = pack_volta(*random_layer(n, k, g))
    x = torch.randn(4, k, dtype=torch.float16)
    torch.library.opcheck(torch.ops.onecat.w4a16_linear, (x, qweight, scales_zeros, g, None))
    fake = torch.ops.onecat.w4a16_linear(
        x.to("meta"), qweight.to("meta"), scales_zeros.to("meta"), g
    )
    assert fake.shape == (4, n) and fake.device.type == "meta"


def test_silu_mul_op_is_silu_of_gate_times_up_on_cpu():
    """The SwiGLU op's CPU path is ``silu(gate) * up`` of the plain op's output, for fp16 and
    fp32 activations; its fake impl halves N; odd halves are rejected."""
    n, k, g = 128, 256, 64
    qweight, scales_zeros = pack_volta(*random_layer(n, k, g, seed=2))
    bias = torch.randn(n, dtype=torch.float16)
    for dtype in (torch.float16, torch.float32):
        x = torch.randn(3, 5, k, dtype=dtype)
        b = bias.to(dtype)
        y = ops.packed_linear(x, qweight, scales_zeros, g, b)
        expected = torch.nn.functional.silu(y[..., : n // 2]) * y[..., n // 2 :]
        got = ops.packed_linear_silu_mul(x, qweight, scales_zeros, g, b)
        assert got.shape == (3, 5, n // 2) and got.dtype == dtype
        assert torch.equal(got, expected)
    x = torch.randn(4, k, dtype=torch.float16)
    torch.library.opcheck(torch.ops.onecat.w4a16_linear_silu_mul, (x, qweight, scales_zeros, g, bias))
    fake = torch.ops.onecat.w4a16_linear_silu_mul(x.to("meta"), qweight.to("meta"), scales_zeros.to("meta"), g)
    assert fake.shape == (4, n // 2)
    odd_q, odd_sz = pack_volta(*random_layer(96, k, g, seed=3))
    with pytest.raises(OnecatError, match="multiple of 64"):
        torch.ops.onecat.w4a16_linear_silu_mul(x, odd_q, odd_sz, g)


def test_torch_compile_traces_through_the_fake_impl():
    n, k, g = 64, 128, 32
    qweight, scales_zeros = pack_volta(*random_layer(n, k, g, seed=1))

    def layer(x):
        return torch.relu(ops.w4a16_linear(x, qweight, scales_zeros, g)) * 2

    x = torch.randn(2, 3, k, dtype=torch.float16)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), layer(x))


def test_op_rejects_bad_inputs_with_onecat_error():
    n, k, g = 64, 128, 32
    qweight, scales_zeros = pack_volta(*random_layer(n, k, g))
    x = torch.randn(2, k, dtype=torch.float16)
    with pytest.raises(OnecatError, match="x must be float16"):
        ops.w4a16_linear(x.float(), qweight, scales_zeros, g)
    with pytest.raises(OnecatError, match=r"x must be \[\.\.\., 128\]"):
        ops.w4a16_linear(x[:, :64], qweight, scales_zeros, g)
    with pytest.raises(OnecatError, match="scales_zeros must be float16"):
        ops.w4a16_linear(x, qweight, scales_zeros, 64)
    with pytest.raises(OnecatError, match="qweight must be int32"):
        ops.w4a16_linear(x, qweight.view(n // 32, -1), scales_zeros, g)
    with pytest.raises(OnecatError, match="bias must be float16"):
        ops.w4a16_linear(x, qweight, scales_zeros, g, torch.zeros(n + 1, dtype=torch.float16))


def test_build_kernels_cli_writes_prebuilt_dir_and_loader_checks_it(tmp_path, monkeypatch):
    from onecat.cli import main

    out = tmp_path / "kernels"
    result = CliRunner().invoke(main, ["build-kernels", "--arch", "sm_70", "--out", str(out)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / build.MANIFEST).read_text())
    assert manifest["sources_hash"] == build.sources_hash() and manifest["arch"] == "70"
    for program in build.PROGRAMS:
        assert (out / f"{program}.compute_70.ptx").is_file()
        assert (out / f"{program}.sm_70.cubin").is_file()
    image = loader._prebuilt_image(out, "w4a16_gemv", "compute_70")
    assert image == (out / "w4a16_gemv.compute_70.ptx").read_bytes()
    # A GPU newer than the build falls back to the PTX, and a stale build is refused.
    assert loader._prebuilt_image(out, "w4a16_dequant", "sm_70")[:4] == b"\x7fELF"
    with pytest.raises(OnecatError, match="holds no w4a16_gemv image for compute_80"):
        loader._prebuilt_image(out, "w4a16_gemv", "compute_80")
    manifest["sources_hash"] = "0" * 16
    (out / build.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(OnecatError, match="built from other sources"):
        loader._prebuilt_image(out, "w4a16_gemv", "compute_70")


def test_forced_arch_parsing(monkeypatch):
    monkeypatch.setenv("ONECAT_KERNEL_ARCH", "sm_70")
    assert loader.forced_arch() == "70"
    monkeypatch.setenv("ONECAT_KERNEL_ARCH", "volta")
    with pytest.raises(OnecatError, match="not an architecture"):
        loader.forced_arch()
    monkeypatch.delenv("ONECAT_KERNEL_ARCH")
    assert loader.forced_arch() is None


def test_nvrtc_cache_is_keyed_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("ONECAT_CACHE_DIR", str(tmp_path))
    first = build.cached_image("w4a16_dequant", "compute_70")
    files = list((tmp_path / "kernels").iterdir())
    assert len(files) == 1 and build.sources_hash() in files[0].name
    assert "compute_70" in files[0].name and "nvrtc12." in files[0].name
    assert build.cached_image("w4a16_dequant", "compute_70") == first


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU report")
def test_doctor_reports_no_gpu_and_fails():
    from onecat.cli import main

    result = CliRunner().invoke(main, ["doctor"])
    assert result.exit_code == 1
    assert "no GPU" in result.output and "fix:" in result.output
    assert "NVRTC: 12." in result.output


def test_tuning_buckets():
    from onecat.kernels.tuning import bucket

    assert [bucket(m) for m in (1, 2, 3, 5, 17, 64, 65, 100, 257, 9000)] == [
        1, 2, 4, 8, 32, 64, 128, 128, 512, 8192,
    ]  # fmt: skip


def test_packed_fragment_elements_hold_the_documented_k():
    """The register-dequant kernels' contract with the packed layout (w4a16_common.cuh,
    "Dequantisation on packed wmma fragments"): a lane's two uint4 of k tiles 2c, 2c+1, read
    as 16 16-bit elements kk = 8t + 2v + h, hold in nibble j the q of k = 64c + 32t + 8v + 2j + h
    of the lane's column (stage_a_permuted stages x by the same rule; the GPU tests check the
    products)."""
    from onecat.pack.volta_layout import lane_to_column

    n, k, g = 32, 128, 64
    q, z, s = random_layer(n, k, g, seed=11)
    qweight, _ = pack_volta(q, z, s)  # [N/32, K/32, 32 lanes, 4 words]
    words = qweight[0].to(torch.int64) & 0xFFFFFFFF  # [K/32, 32, 4]
    for lane in range(32):
        column = int(lane_to_column(lane))
        for c in range(k // 64):
            for kk in range(16):
                t, v, h = kk // 8, (kk % 8) // 2, kk % 2
                element = (int(words[2 * c + t, lane, v]) >> (16 * h)) & 0xFFFF
                for j in range(4):
                    assert (element >> (4 * j)) & 0xF == int(q[column, 64 * c + 32 * t + 8 * v + 2 * j + h])
