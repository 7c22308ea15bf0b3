"""Compile onecat's CUDA C++ kernels with NVRTC 12 (no CUDA toolkit, no torch headers).

Every ``*.cu`` file in this package is one NVRTC program; ``w4a16_common.cuh`` is handed to
NVRTC as an in-memory header, and ``cuda_fp16.h`` comes from the ``nvidia-cuda-runtime-cu12``
wheel (or ``$CUDA_HOME/include``).  A target is ``compute_XY`` (PTX, which the driver
JIT-compiles for any GPU of that capability or newer) or ``sm_XY`` (a cubin for exactly that
GPU; NVRTC then also runs ptxas, whose ``-v`` report lists registers and spills).

Compiled images are cached on disk under ``cache_dir() / "kernels"``, keyed by the sources'
hash, the target and the NVRTC version, so a GPU compiles each program once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from onecat.errors import OnecatError

KERNEL_DIR = Path(__file__).resolve().parent
COMMON_HEADER = "w4a16_common.cuh"
PROGRAMS = (
    "w4a16_gemv", "w4a16_wmma", "w4a16_dequant", "gdn_decode",
    "w4a16_moe_gemv", "w4a16_moe_wmma", "w4a16_moe_route",
    "paged_attention", "gdn_prefill", "attention_prep", "all_reduce", "rms_norm", "flash_prefill",
)
"""The NVRTC programs (``<name>.cu`` in this package)."""

MANIFEST = "onecat_kernels.json"
"""Name of the manifest written by :func:`build_all` next to the prebuilt images."""


@dataclass(frozen=True)
class KernelResource:
    """ptxas's report for one kernel of a cubin build."""

    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    shared_bytes: int


@dataclass(frozen=True)
class CompiledProgram:
    """One program compiled for one target."""

    program: str
    target: str  # "compute_70" or "sm_70"
    image: bytes  # PTX text (NUL-terminated) or cubin
    log: str
    resources: tuple[KernelResource, ...]


def cache_dir() -> Path:
    """onecat's cache directory: ``$ONECAT_CACHE_DIR``, else ``$XDG_CACHE_HOME/onecat``, else
    ``~/.cache/onecat``."""
    if os.environ.get("ONECAT_CACHE_DIR"):
        return Path(os.environ["ONECAT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "onecat"


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        try:  # cuda-python < 12.6 exposed the same module as cuda.nvrtc
            from cuda import nvrtc
        except ImportError as exc:
            raise _missing_nvrtc() from exc
    return nvrtc


def _missing_nvrtc() -> OnecatError:
    return OnecatError(
        "onecat.kernels needs NVRTC 12 to compile its kernels: install it with "
        "`pip install 'onecat[cuda]'` (nvidia-cuda-nvrtc-cu12, nvidia-cuda-runtime-cu12, "
        "cuda-bindings 12), or point ONECAT_KERNEL_DIR at kernels prebuilt by "
        "`onecat build-kernels`"
    )


def nvrtc_version() -> tuple[int, int]:
    """The NVRTC version ``(major, minor)``; raises OnecatError when NVRTC is missing."""
    nvrtc = _nvrtc()
    err, major, minor = nvrtc.nvrtcVersion()
    _check(nvrtc, err, "nvrtcVersion")
    return int(major), int(minor)


def _check(nvrtc, err, what: str) -> None:
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise OnecatError(f"NVRTC {what} failed: {err}")


def cuda_include_dirs() -> list[Path]:
    """Directories holding ``cuda_fp16.h``: the nvidia-cuda-runtime-cu12 wheel, CUDA_HOME."""
    found = []
    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            found.append(Path(location) / "include")
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            found.append(Path(os.environ[env]) / "include")
    found.append(Path("/usr/local/cuda/include"))
    usable = [d for d in found if (d / "cuda_fp16.h").is_file()]
    if not usable:
        raise OnecatError(
            "cuda_fp16.h not found: install `nvidia-cuda-runtime-cu12` (pip install "
            "'onecat[cuda]') or set CUDA_HOME to a CUDA 12 toolkit"
        )
    return usable[:1]


def source_text(program: str) -> str:
    """The CUDA C++ source of ``program``."""
    return (KERNEL_DIR / f"{program}.cu").read_text()


def sources_hash() -> str:
    """sha256 over every kernel source and the shared header (first 16 hex digits)."""
    h = hashlib.sha256()
    for name in sorted([COMMON_HEADER] + [f"{p}.cu" for p in PROGRAMS]):
        h.update(name.encode())
        h.update((KERNEL_DIR / name).read_bytes())
    return h.hexdigest()[:16]


def program_of(kernel: str) -> str | None:
    """The program that defines ``kernel``: kernels are named with their program's name first."""
    return next((p for p in PROGRAMS if kernel.startswith(p)), None)


def kernel_names(program: str) -> list[str]:
    """The ``extern "C"`` kernel names a program defines (read from its source)."""
    text = source_text(program)
    if program == "w4a16_gemv":
        found = re.findall(r"^ONECAT_GEMV\((\d+), (\d+), (\d+), \d+\)$", text, flags=re.M)
        return [f"w4a16_gemv_m{m}_w{w}_u{u}" for m, w, u in found]
    if program == "w4a16_wmma":
        found = re.findall(r"^ONECAT_(WMMAR?)\((\d+), (\d+), (\d+)(?:, \d+)?\)", text, flags=re.M)
        return [f"w4a16_{kind.lower()}_mt{t}_w{w}_c{c}" for kind, t, w, c in found]
    if program.startswith(("w4a16_moe", "paged_attention", "gdn_prefill", "gdn_decode", "attention_prep", "all_reduce",
                           "rms_norm", "flash_prefill")):
        # plain extern "C" kernels, then the MoE programs' macro-built ones
        names = re.findall(r'^extern "C" __global__ void __launch_bounds__\([^)]*\)\n\s*(\w+)\(', text, flags=re.M)
        for w, b in re.findall(r"^ONECAT_MOE_GATE_UP\((\d+), (\d+)\)$", text, flags=re.M):
            names.append(f"w4a16_moe_gemv_gate_up_w{w}_b{b}")
        for w, b in re.findall(r"^ONECAT_MOE_DOWN\((\d+), (\d+), \d+\)$", text, flags=re.M):
            names.append(f"w4a16_moe_gemv_down_w{w}_b{b}")
        for w, b, r in re.findall(r"^ONECAT_MOE_GROUPED\((\d+), (\d+), (\d+)\)$", text, flags=re.M):
            names += [f"w4a16_moe_gemv_grouped_{part}_w{w}_b{b}_r{r}" for part in ("gate_up", "down")]
        names += re.findall(r"^FAP_KERNEL\((\w+), \d+, \d+(?:, [\w:]+)?\)$", text, flags=re.M)
        names += re.findall(r"^ONECAT_PA_SPLIT\((\w+), \d+, \d+, \w+, [\w:]+\)$", text, flags=re.M)
        for suffix in re.findall(r"^ONECAT_MOE_WMMA\((\w*), \d+, \w+\)$", text, flags=re.M):
            names += [f"w4a16_moe_wmma_gate_up{suffix}", f"w4a16_moe_wmma_down{suffix}"]
        return names
    return [program]


def _options(target: str, verbose_ptxas: bool) -> list[bytes]:
    opts = [
        f"--gpu-architecture={target}",
        "-std=c++17",
        "--device-as-default-execution-space",
    ]
    opts += [f"--include-path={d}" for d in cuda_include_dirs()]
    if verbose_ptxas and target.startswith("sm_"):
        opts.append("--ptxas-options=-v")
    return [o.encode() for o in opts]


_PTXAS_FUNCTION = re.compile(r"Compiling entry function '(\w+)'")
_PTXAS_STACK = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_PTXAS_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas_report(log: str) -> tuple[KernelResource, ...]:
    """Registers, spills, stack and static shared memory per kernel from ptxas ``-v`` output."""
    resources = []
    current = None
    stack = (0, 0, 0)
    for line in log.splitlines():
        if m := _PTXAS_FUNCTION.search(line):
            current, stack = m.group(1), (0, 0, 0)
        elif (m := _PTXAS_STACK.search(line)) and current:
            stack = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        elif (m := _PTXAS_USED.search(line)) and current:
            resources.append(
                KernelResource(
                    name=current,
                    registers=int(m.group(1)),
                    spill_stores=stack[1],
                    spill_loads=stack[2],
                    stack_bytes=stack[0],
                    shared_bytes=int(m.group(2) or 0),
                )
            )
            current = None
    return tuple(resources)


def compile_program(program: str, target: str, verbose_ptxas: bool = True) -> CompiledProgram:
    """Compile ``program`` for ``target`` (``compute_XY`` -> PTX, ``sm_XY`` -> cubin) with NVRTC.

    Raises OnecatError with NVRTC's log on a compile error.
    """
    if program not in PROGRAMS:
        raise OnecatError(f"unknown kernel program {program!r}; known: {', '.join(PROGRAMS)}")
    if not re.fullmatch(r"(compute|sm)_\d+a?", target):
        raise OnecatError(f"bad target {target!r}: use compute_70 (PTX) or sm_70 (cubin)")
    nvrtc = _nvrtc()
    header = (KERNEL_DIR / COMMON_HEADER).read_bytes()
    err, prog = nvrtc.nvrtcCreateProgram(
        source_text(program).encode(),
        f"{program}.cu".encode(),
        1,
        [header],
        [COMMON_HEADER.encode()],
    )
    _check(nvrtc, err, "nvrtcCreateProgram")
    try:
        options = _options(target, verbose_ptxas)
        (compile_err,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        _check(nvrtc, err, "nvrtcGetProgramLogSize")
        buf = b" " * size
        (err,) = nvrtc.nvrtcGetProgramLog(prog, buf)
        log = buf.rstrip(b"\0").decode(errors="replace")
        if compile_err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise OnecatError(f"NVRTC could not compile {program}.cu for {target}:\n{log}")
        if target.startswith("sm_"):
            err, size = nvrtc.nvrtcGetCUBINSize(prog)
            _check(nvrtc, err, "nvrtcGetCUBINSize")
            image = b" " * size
            (err,) = nvrtc.nvrtcGetCUBIN(prog, image)
            _check(nvrtc, err, "nvrtcGetCUBIN")
        else:
            err, size = nvrtc.nvrtcGetPTXSize(prog)
            _check(nvrtc, err, "nvrtcGetPTXSize")
            image = b" " * size
            (err,) = nvrtc.nvrtcGetPTX(prog, image)
            _check(nvrtc, err, "nvrtcGetPTX")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return CompiledProgram(program, target, image, log, parse_ptxas_report(log))


def image_suffix(target: str) -> str:
    """File suffix of a compiled image: ``.ptx`` for compute_XY, ``.cubin`` for sm_XY."""
    return ".ptx" if target.startswith("compute_") else ".cubin"


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def cached_image(program: str, target: str) -> bytes:
    """The compiled image of ``program`` for ``target`` from the disk cache, compiling on a miss."""
    major, minor = nvrtc_version()
    key = f"{program}-{target}-nvrtc{major}.{minor}-{sources_hash()}{image_suffix(target)}"
    path = cache_dir() / "kernels" / key
    if path.is_file():
        return path.read_bytes()
    image = compile_program(program, target, verbose_ptxas=False).image
    _atomic_write(path, image)
    return image


def check_kernel_dir(out_dir: Path) -> None:
    """OnecatError unless replacing ``out_dir`` deletes only what :func:`build_all` writes: it
    must be absent, empty, or a directory of the manifest and ``<program>.<target>`` images
    of known programs (their names are fixed, so no output marker is needed). Names the first
    other file, which would be lost."""
    out_dir = Path(out_dir)
    how = f"Nothing was changed. Choose another --out, or move what you need out of {out_dir}"
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if out_dir.is_symlink() or not out_dir.is_dir():
        raise OnecatError(f"{out_dir} is not a kernel directory onecat wrote; replacing it "
                          f"would delete it. {how}")
    image = re.compile(rf"({'|'.join(PROGRAMS)})\.(compute|sm)_\d+\.(ptx|cubin)")
    entries = sorted(out_dir.iterdir())
    if entries and not (out_dir / MANIFEST).is_file():
        raise OnecatError(f"{out_dir} has no {MANIFEST}: it is not a kernel directory onecat "
                          f"wrote, and replacing it would delete {entries[0]}. {how}")
    for entry in entries:
        if entry.is_symlink() or not entry.is_file() or not (
            entry.name == MANIFEST or image.fullmatch(entry.name)
        ):
            raise OnecatError(f"{entry} was not written by onecat build-kernels: replacing "
                              f"{out_dir} would delete it. {how}")


def build_all(arch: str, out_dir: Path) -> list[CompiledProgram]:
    """Pre-build every program as ``compute_<arch>`` PTX and ``sm_<arch>`` cubin into ``out_dir``.

    ``arch`` is ``sm_70``, ``70`` or ``compute_70``.  Writes ``<program>.<target>.{ptx,cubin}``
    and a manifest (sources hash, NVRTC version) read by the loader (``ONECAT_KERNEL_DIR``).
    The directory is written to a temporary sibling and renamed into place; an existing
    ``out_dir`` is replaced only when it holds nothing else (:func:`check_kernel_dir`, checked
    before compiling and again before the rename).
    """
    digits = re.sub(r"^(sm_|compute_)", "", str(arch))
    if not digits.isdigit():
        raise OnecatError(f"bad --arch {arch!r}: use e.g. sm_70")
    out_dir = Path(out_dir)
    check_kernel_dir(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    results = []
    for program in PROGRAMS:
        for target in (f"compute_{digits}", f"sm_{digits}"):
            compiled = compile_program(program, target)
            (tmp / f"{program}.{target}{image_suffix(target)}").write_bytes(compiled.image)
            results.append(compiled)
    major, minor = nvrtc_version()
    manifest = {
        "sources_hash": sources_hash(),
        "nvrtc": f"{major}.{minor}",
        "arch": digits,
        "programs": list(PROGRAMS),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    try:
        check_kernel_dir(out_dir)
    except OnecatError:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
        raise
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old")
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    else:
        os.replace(tmp, out_dir)
    return results
