"""``onecat doctor``: is this machine able to run onecat's kernels, and if not, what to fix.

Checks the GPU (name, compute capability), the driver, whether torch was built with kernels
for the GPU's architecture, NVRTC (or prebuilt kernels), and runs every kernel variant once
against the reference.  Each check yields a :class:`Finding`; a problem carries its fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from onecat.errors import OnecatError


@dataclass
class Finding:
    """One line of the report: ``ok`` False means a problem, with ``fix`` saying what to do."""

    check: str
    ok: bool
    detail: str
    fix: str = ""


def _torch_arch_finding(major: int, minor: int) -> Finding:
    arch = f"sm_{major}{minor}"
    archs = torch.cuda.get_arch_list()
    ok = arch in archs or any(
        a.startswith("compute_") and int(a.split("_")[1]) <= major * 10 + minor for a in archs
    )
    cuda = torch.version.cuda or "none"
    fix = ""
    if not ok:
        fix = f"this torch {torch.__version__} (CUDA {cuda}) has no {arch} kernels; " + (
            "install a +cu126 build: pip install torch --index-url "
            "https://download.pytorch.org/whl/cu126"
            if (major, minor) == (7, 0)
            else "install a torch build whose arch list contains it"
        )
    return Finding("torch arch list", ok, f"torch {torch.__version__} CUDA {cuda}: {archs}", fix)


def _nvrtc_finding() -> Finding:
    from onecat.kernels import build

    prebuilt = os.environ.get("ONECAT_KERNEL_DIR")
    try:
        major, minor = build.nvrtc_version()
    except OnecatError as exc:
        if prebuilt:
            return Finding("NVRTC", True, f"not installed; using prebuilt kernels in {prebuilt}")
        return Finding("NVRTC", False, "not installed", str(exc))
    detail = f"{major}.{minor}" + (f"; prebuilt kernels from {prebuilt}" if prebuilt else "")
    if major != 12 and not prebuilt:
        return Finding(
            "NVRTC",
            False,
            detail,
            "onecat compiles with NVRTC 12 (NVRTC 13 cannot target sm_70): "
            "pip install 'nvidia-cuda-nvrtc-cu12<13' 'cuda-bindings<13'",
        )
    return Finding("NVRTC", True, detail)


def self_test(device_index: int = 0) -> list[Finding]:
    """Run every kernel variant once on random data and compare with the fp64 reference."""
    from onecat.kernels.tuning import random_packed_weights
    from onecat.kernels.variants import all_variants, run_variant
    from onecat.pack.volta_layout import dequantize_volta

    findings = []
    n, k, g = 256, 512, 128
    device = torch.device("cuda", device_index)
    gen = torch.Generator(device=device).manual_seed(0)
    qweight, scales_zeros = random_packed_weights(n, k, g, gen)
    w = dequantize_volta(qweight, scales_zeros, g, dtype=torch.float64)
    for variant in all_variants():
        m = variant.rows if variant.kind == "gemv" else 24
        x = torch.randn(m, k, dtype=torch.float16, device=device, generator=gen)
        ref = x.double() @ w.t()
        out = torch.full((m, n), float("nan"), dtype=torch.float16, device=device)
        try:
            with torch.cuda.device(device):
                run_variant(variant, x, qweight, scales_zeros, g, out=out)
                torch.cuda.synchronize()
        except OnecatError as exc:
            findings.append(Finding(f"kernel {variant.name}", False, str(exc), _rebuild_fix()))
            continue
        err = float(((out.double() - ref).norm() / ref.norm()).nan_to_num(float("inf")))
        ok = err < 2e-3
        findings.append(
            Finding(
                f"kernel {variant.name}",
                ok,
                f"M={m} {n}x{k}: relative error {err:.1e}",
                "" if ok else "wrong results: report this GPU/driver at onecat's issue tracker",
            )
        )
    return findings


def _ptx_driver_finding(target: str, driver_cuda: tuple[int, int]) -> Finding:
    """PTX is JIT-compiled by the driver, which must know the PTX version NVRTC wrote."""
    from onecat.kernels import build

    detail = target + (
        " (PTX, JIT-compiled by the driver)" if target.startswith("compute_") else ""
    )
    if not target.startswith("compute_") or os.environ.get("ONECAT_KERNEL_DIR"):
        return Finding("kernel target", True, detail)
    try:
        nvrtc = build.nvrtc_version()
    except OnecatError:
        return Finding("kernel target", True, detail)
    if driver_cuda < nvrtc:
        return Finding(
            "kernel target", False,
            f"{detail}: NVRTC {nvrtc[0]}.{nvrtc[1]} writes PTX newer than this driver "
            f"(CUDA {driver_cuda[0]}.{driver_cuda[1]}) can JIT",
            "update the NVIDIA driver, install an NVRTC no newer than the driver "
            "(pip install 'nvidia-cuda-nvrtc-cu12==<driver CUDA version>.*'), or unset "
            "ONECAT_KERNEL_ARCH to load cubins",
        )  # fmt: skip
    return Finding("kernel target", True, detail)


def _rebuild_fix() -> str:
    if os.environ.get("ONECAT_KERNEL_DIR"):
        return "rebuild the kernels: onecat build-kernels --arch sm_70 --out $ONECAT_KERNEL_DIR"
    return "clear the kernel cache (~/.cache/onecat/kernels) and check the NVRTC finding"


def diagnose() -> list[Finding]:
    """All findings for this machine (no GPU: reported as a problem, the rest still checked)."""
    from onecat.kernels import driver, loader

    findings = [Finding("torch", True, f"{torch.__version__} (CUDA {torch.version.cuda})")]
    findings.append(_nvrtc_finding())
    if not torch.cuda.is_available():
        findings.append(
            Finding(
                "GPU",
                False,
                "no GPU: torch sees no CUDA device",
                "check `nvidia-smi` and CUDA_VISIBLE_DEVICES; on a GPU machine install a CUDA "
                "build of torch (+cu126 for a V100)",
            )
        )
        return findings
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        name = torch.cuda.get_device_name(index)
        findings.append(
            Finding(f"GPU {index}", True, f"{name}, compute capability {major}.{minor}")
        )
    try:
        dmaj, dmin = driver.driver_version()
        findings.append(Finding("driver", True, f"CUDA {dmaj}.{dmin}"))
    except OnecatError as exc:
        findings.append(Finding("driver", False, str(exc), "install or repair the NVIDIA driver"))
        return findings
    major, minor = torch.cuda.get_device_capability(0)
    findings.append(_torch_arch_finding(major, minor))
    try:
        target = loader.choose_target(0)
    except OnecatError as exc:
        findings.append(Finding("kernel target", False, str(exc), "unset ONECAT_KERNEL_ARCH"))
        return findings
    findings.append(_ptx_driver_finding(target, (dmaj, dmin)))

    findings += self_test(0)
    return findings
